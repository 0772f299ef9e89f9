"""In-place recovery (docs/elastic.md; docs/reliability.md's in-place rows): a lost host's peers go on in their own
processes within seconds, a returning host gets the state from a live peer, and a host that comes back after the job
went on without it is fenced.

Real launchers (trainer-launch with NNODES=MIN:MAX, whose RECOVERY is in-place by default), torchft's real lighthouse
and Managers, real gloo groups: hosts in network namespaces joined by a veth pair (tests/netns.py), sharing a
checkpoint directory (as hosts share a network file system); tests/user_code/inplace_loop.py, a trainer.api script on
run.steps(), logs what each step trained. The order every step must train is computed here from torch's
DistributedSampler: the shares of the largest world, whoever trains them.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Callable

import pytest
import torch
from fault_helpers import Launch, children, descendants, error_lines, running, wait_until
from helpers import REPO, assert_identical, free_port, read_summary
from netns import MASTER_ADDR, Host

from trainer.checkpoint.store import HOLD_ENV, load_for_resume

USER_CODE = REPO / "tests" / "user_code"
RUN_BOUND_S = 300  # a bound on a hang on a loaded 2-core machine, not a speed goal
SAMPLES, SHARE_BATCH, SEED = 6400, 16, 0
GENERATION = re.compile(r"in place: generation (\d+), world size (\d+) of at most (\d+)")

pytestmark = pytest.mark.skipif(__import__("importlib").util.find_spec("torchft") is None,
                                reason="torchft (a dependency) is not installed")


def inplace_env(port: int, where: Host, hosts: str = "1:2", **extra: str) -> dict[str, str]:
    # The same settings on every host (but the interface's name): in-place is RECOVERY's default.
    return {"PREFLIGHT": "0", "NNODES": hosts, "NPROC_PER_NODE": "1", "MASTER_ADDR": MASTER_ADDR,
            "MASTER_PORT": str(port), "GLOO_SOCKET_IFNAME": where.veth, "TRAIN_BATCH_SIZE": str(SHARE_BATCH),
            "TRAIN_COLLECTIVE_TIMEOUT": "10", **extra}


def host(out: Path, port: int, name: str, where: Host, *args: str, samples: int = SAMPLES, hosts: str = "1:2",
         **env: str) -> Launch:
    return Launch([str(USER_CODE / "inplace_loop.py"), "--out", str(out), "--samples", str(samples),
                   "--step-seconds", "0.1", *args], out, inplace_env(port, where, hosts, **env), name=name,
                  prefix=where.prefix)


def generations(output: str) -> list[tuple[int, int]]:
    """(generation, world size) of every membership this host trained in, in order."""
    return [(int(m.group(1)), int(m.group(2))) for m in GENERATION.finditer(output)]


def shares_order(samples: int, largest: int, epoch: int = 0) -> list[list[int]]:
    """Each share's (a rank of the largest world's) samples of an epoch, in training order: torch's own sampler."""
    out = []
    for share in range(largest):
        sampler = torch.utils.data.DistributedSampler(range(samples), num_replicas=largest, rank=share, shuffle=True,
                                                      seed=SEED, drop_last=True)
        sampler.set_epoch(epoch)
        out.append(list(sampler))
    return out


def seen(out: Path) -> dict[int, dict[int, list[tuple[int, list[int]]]]]:
    """{pid: {step: [(world size, indices)]}} from every worker's seen-<pid>.txt (committed steps only)."""
    found: dict[int, dict] = {}
    for log in out.glob("seen-*.txt"):
        steps = defaultdict(list)
        for line in log.read_text().splitlines():
            world, step, *indices = map(int, line.split())
            steps[step].append((world, indices))
        found[int(log.stem.split("-")[1])] = steps
    return found


def check_the_order(out: Path, survivor: int, steps: int, largest: int = 2, samples: int = SAMPLES,
                    epochs: int = 1, losses: int = 1, lost_after: dict[int, int] | None = None) -> None:
    """Every step of the run was trained, once: each line of each host is one or more share micro-batches of that
    step (the shares of the largest world, in torch's sampler order), no sample twice in a step, and a step's lines
    from as many ranks as its world size hold all of its samples. The survivor trained every step from the one it
    joined at to the end. A host lost just after a commit may have had no time to write its line: at most `losses`
    steps lack one (test 1's equal weights show that nothing was missing from the training). lost_after: {pid: step}
    of hosts lost with no live peer, whose steps after their last checkpoint were trained again from it: those
    lines of theirs are not the job's."""
    per_epoch = samples // largest // SHARE_BATCH
    orders = {e: shares_order(samples, largest, e) for e in range(epochs)}
    records = seen(out)
    for pid, last in (lost_after or {}).items():
        records[pid] = {step: lines for step, lines in records.get(pid, {}).items() if step <= last}
    mine = sorted(records[survivor])
    assert mine == list(range(mine[0], steps + 1)), (mine[:5], len(mine))
    lines: dict[int, list[tuple[int, list[int]]]] = defaultdict(list)
    for pid, steps_of in records.items():
        for step, attempts in steps_of.items():
            assert len(attempts) == 1, (pid, step, attempts)  # a step is written once: when it committed
            lines[step] += attempts
    # A line is written once its step committed, at the next step's start (after the next quorum): a host lost just
    # after its commit, training alone, left no line of that step at all (the checkpoint it committed has it).
    missing = sorted(set(range(1, steps + 1)) - set(lines))
    assert set(missing) <= set((lost_after or {}).values()), missing
    incomplete = []
    for step, found in lines.items():
        epoch, index = divmod(step - 1, per_epoch)
        batches = [order[index * SHARE_BATCH:(index + 1) * SHARE_BATCH] for order in orders[epoch]]
        trained = []
        for world, indices in found:
            chunks = [indices[i:i + SHARE_BATCH] for i in range(0, len(indices), SHARE_BATCH)]
            assert chunks and all(chunk in batches for chunk in chunks), (step, world)
            trained += indices
        assert len(trained) == len(set(trained)), (step, "a sample trained twice")
        world = found[0][0]
        if len(found) == world:
            assert sorted(trained) == sorted(i for b in batches for i in b), step
        else:
            incomplete.append(step)
    assert len(incomplete) + len(missing) <= losses, (incomplete, missing)


def the_writer(*hosts: Launch) -> tuple[Launch, Launch] | None:
    """Once both hosts train together: (the one that writes the checkpoints, the other): the first replica of the
    generation (each host's newest generation line says which replica it is)."""
    newest = [GENERATION.findall(h.output())[-1:] for h in hosts]
    if not all(n and n[0][1] == "2" for n in newest):
        return None
    lines = [h.output().rsplit("in place: generation", 1)[1] for h in hosts]
    first = next((h for h, line in zip(hosts, lines) if "this host is replica 0 " in line.split("\n")[0]), None)
    return None if first is None else (first, next(h for h in hosts if h is not first))


def newest_step(directory: Path) -> int:
    """The step of the newest checkpoint in `directory` (0: none yet)."""
    return max((int(p.stem.split("-")[1]) for p in directory.glob("step-*.pt")), default=0)


def newest_checkpoint(directory: Path) -> dict:
    return torch.load(directory / f"step-{newest_step(directory):08d}.pt", map_location="cpu", weights_only=True)


def workers(launch: Launch) -> list[int]:
    """The launcher's worker processes running the script now (the agent's children)."""
    found = []
    for pid in children(launch.pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"inplace_loop.py" in argv and running(pid):
            found.append(pid)
    return found


def worker_pid(launch: Launch) -> int:
    (pid,) = wait_until(lambda: workers(launch), 60, f"the worker of {launch.log_path.name}")
    return pid


def loader_pids(out: Path, worker: int) -> set[int]:
    return {int(p.name.split("-")[2]) for p in out.glob(f"loader-{worker}-*")}


@pytest.mark.slow
def test_a_lost_host_costs_its_peers_no_restart_and_a_returning_one_joins_in_place(hosts, tmp_path, launches):
    # A BatchNorm in the model: its running statistics are the job's as rank 0 keeps them under DDP, the chain of
    # share 0's forwards, whoever trains that share (inplace.BufferChain).
    port = free_port()
    first = host(tmp_path, port, "hostA", hosts[0], "--batchnorm", "--pause-file", str(tmp_path / "pause"))
    launches.append(first)  # at MASTER_ADDR: the lighthouse runs beside it
    time.sleep(2)
    second = host(tmp_path, port, "hostB", hosts[1], "--batchnorm")
    launches.append(second)
    checkpoints = tmp_path / "checkpoints"
    wait_until(lambda: (2 in [w for _, w in generations(first.output())]) and any(checkpoints.glob("step-*.pt")),
               RUN_BOUND_S, f"both hosts training, a checkpoint\n{first.output()[-3000:]}\n{second.output()[-3000:]}")
    assert "recovery: in place: " in first.output()
    survivor = worker_pid(first)
    loaders = wait_until(lambda: loader_pids(tmp_path, survivor), 30, "the survivor's DataLoader worker")
    back = lose_and_bring_back(first, second, lambda: host(tmp_path, port, "hostB-back", hosts[1], "--batchnorm"),
                               launches, nproc=1)
    # The survivor's worker and its DataLoader worker are the ones it started with.
    assert workers(first) == [survivor] and all(running(p) for p in loaders)
    assert loader_pids(tmp_path, survivor) == loaders
    assert first.wait(RUN_BOUND_S) == 0, first.output()[-4000:]
    assert back.wait(RUN_BOUND_S) == 0, back.output()[-4000:]
    output = first.output()
    sizes = [w for _, w in generations(output)]  # it may have trained alone until the other host came in
    assert sizes[sizes.index(2):][:3] == [2, 1, 2], generations(output)
    assert "restart 1 of" not in output and "Traceback" not in output, output[-4000:]
    steps = SAMPLES // 2 // SHARE_BATCH
    check_the_order(tmp_path, survivor, steps)
    assert read_summary(tmp_path / "runs")["status"] == "completed"
    trained = newest_checkpoint(checkpoints)
    assert trained["global_step"] == steps and not list(checkpoints.rglob(".tmp-*"))
    # The returning host resumed from the newest checkpoint it found, while the survivor committed newer ones: those
    # are the job's, not a rollback's abandoned future (nothing set aside).
    assert not [p.name for p in checkpoints.iterdir() if p.name.startswith("abandoned")], list(checkpoints.iterdir())

    # The same job without faults on the restart path, two processes under DistributedDataParallel, trains the very
    # same micro-batches (in place, the shares of the lost host were trained by the survivor): the same weights and
    # optimizer state, and the BatchNorm's running statistics and num_batches_tracked, to the bit.
    assert "running_mean" in "".join(trained["model"])
    assert_trained_as_without_faults(trained, tmp_path, launches, "--batchnorm")


@pytest.mark.slow
def test_hosts_of_two_processes_each_go_on_in_place_through_a_loss_and_a_return_to_the_weights_of_ddp(hosts, tmp_path,
                                                                                                      launches):
    """Two hosts of two processes each (NPROC_PER_NODE=2, the compose and Kubernetes pairs' shape, which the tests
    above do not have): the second is lost and comes back. The first's two processes train on in place, neither
    restarted nor fenced: they agree on each quorum's generation, though torchft gives each of them another member's
    store (they once counted one quorum twice, and the one with the smaller number was fenced at its next step, half
    the time). Every step is trained once, in the order of the largest world (4), and the job ends on the weights,
    BatchNorm statistics and momentum of four processes under DistributedDataParallel without a fault (within the
    last bits: four ranks sum in another order than DDP's ring, docs/elastic.md)."""
    port, two = free_port(), {"NPROC_PER_NODE": "2"}
    first = host(tmp_path, port, "hostA", hosts[0], "--batchnorm", "--pause-file", str(tmp_path / "pause"),
                 **two)  # at MASTER_ADDR: the lighthouse beside it
    launches.append(first)
    # At once (the second's launcher waits for the lighthouse): their first quorum has them both at step 0, where
    # torchft gives a host's two processes the stores of two members.
    second = host(tmp_path, port, "hostB", hosts[1], "--batchnorm", **two)
    launches.append(second)
    checkpoints = tmp_path / "checkpoints"
    wait_until(lambda: 4 in [w for _, w in generations(first.output())] and any(checkpoints.glob("step-*.pt")),
               RUN_BOUND_S, f"both hosts training, a checkpoint\n{first.output()[-3000:]}\n{second.output()[-3000:]}")
    survivors = sorted(wait_until(lambda: len(workers(first)) == 2 and workers(first), 60, "the first's workers"))
    back = lose_and_bring_back(first, second, lambda: host(tmp_path, port, "hostB-back", hosts[1], "--batchnorm",
                                                           **two), launches, nproc=2)
    assert sorted(workers(first)) == survivors  # the same two processes
    assert first.wait(RUN_BOUND_S) == 0, first.output()[-4000:]
    assert back.wait(RUN_BOUND_S) == 0, back.output()[-4000:]
    output = first.output()
    sizes = [w for _, w in generations(output)]
    assert sizes[sizes.index(4):][:3] == [4, 2, 4], generations(output)
    assert "restart 1 of" not in output and "Traceback" not in output and "error: " not in output, output[-4000:]
    steps = SAMPLES // 4 // SHARE_BATCH
    check_the_order(tmp_path, survivors[0], steps, largest=4)
    check_the_order(tmp_path, survivors[1], steps, largest=4)
    assert read_summary(tmp_path / "runs")["status"] == "completed"
    trained = newest_checkpoint(checkpoints)
    assert trained["global_step"] == steps and not list(checkpoints.rglob(".tmp-*"))
    assert_trained_as_without_faults(trained, tmp_path, launches, "--batchnorm", nproc=4)


def lose_and_bring_back(first: Launch, second: Launch, start_again: Callable[[], Launch], launches: list,
                        nproc: int) -> Launch:
    """SIGKILL the second host (its launcher, and with it its workers) once both train; once the first goes on alone
    (a step committed at its own world size after the abandoned one), the second started again: it, once the job
    trains at both hosts' world size again, in a third membership at least. The first (started with --pause-file
    <its out>/pause) pauses 20 steps after it went on alone until the second has begun training: however slowly the
    second starts on a loaded machine, the first has not finished the job meanwhile (in CI, with 100 steps, it once
    had: the test waited for a host back in a job that had ended). A step ahead, named in the file, so that every
    process of the first host pauses at the same one (one that paused while the other was in the step's collective
    failed it, and the host restarted)."""
    pause = first.log_path.parent / "pause"
    lost = workers(second)
    os.kill(second.pid, signal.SIGKILL)
    wait_until(lambda: not any(running(p) for p in lost), 10, "the lost host's workers to die with it")
    alone = wait_until(lambda: re.search(r"in place: step (\d+) committed [\d.]+ s after the first abandoned one, at "
                                         rf"world size {nproc}\b", first.output()), RUN_BOUND_S,
                       f"the survivor to go on alone\n{first.output()[-3000:]}")
    (pause.parent / "pause.new").write_text(str(int(alone.group(1)) + 20))
    os.replace(pause.parent / "pause.new", pause)  # whole: no process reads it half-written
    back = start_again()
    launches.append(back)
    wait_until(lambda: "INFO training " in back.output(), RUN_BOUND_S, "the host back to begin training")
    pause.unlink()
    wait_until(lambda: generations(first.output())[-1][1] == 2 * nproc and len(generations(first.output())) >= 3,
               RUN_BOUND_S, "the host back in")
    return back


def assert_trained_as_without_faults(trained: dict, tmp_path: Path, launches: list, *args: str,
                                     nproc: int = 2) -> None:
    """The final model (buffers included) and optimizer state of an in-place job equal those of the same job (the
    script's `args`) trained by `nproc` processes under DistributedDataParallel on the restart path, without a
    fault: to the bit at two ranks; at more, within the last bits a sum in another order than gloo's ring gives
    (docs/elastic.md, "To the bit at two hosts only"), and the counts to the bit."""
    alone = tmp_path / "alone"
    alone.mkdir()
    reference = Launch([str(USER_CODE / "inplace_loop.py"), "--out", str(alone), "--samples", str(SAMPLES), *args],
                       alone, {"PREFLIGHT": "0", "NPROC_PER_NODE": str(nproc), "TRAIN_BATCH_SIZE": str(SHARE_BATCH)},
                       name="ddp")
    launches.append(reference)
    assert reference.wait(RUN_BOUND_S) == 0, reference.output()[-3000:]
    expected = newest_checkpoint(alone / "checkpoints")

    def same(mine: torch.Tensor, theirs: torch.Tensor) -> bool:
        if nproc == 2 or not theirs.is_floating_point():
            return torch.equal(mine, theirs)
        return torch.allclose(mine, theirs, rtol=1e-5, atol=1e-6)  # 6e-8 after 100 steps at four ranks

    for name, tensor in expected["model"].items():
        assert same(trained["model"][name], tensor), (name, (trained["model"][name] - tensor).abs().max())
    for key, state in expected["optimizer"]["state"].items():
        assert same(trained["optimizer"]["state"][key]["momentum_buffer"], state["momentum_buffer"])


@pytest.mark.slow
def test_a_host_lost_in_the_middle_of_the_sum_over_the_hosts_applies_nothing_of_that_step(hosts, tmp_path, launches):
    """The sum over the hosts overlaps the backward, bucket by bucket (inplace.GradientSum): a host killed after its
    first bucket's sum was launched and before the next one's leaves its peer with a step of which some buckets were
    summed: that step is abandoned whole, nothing of it applied, and the job ends with the weights of a fault-free
    run. A hidden width of 90000 makes two buckets: the second layer's gradients (the backward's first, 1 MiB and more:
    the first bucket's cap) and the first layer's."""
    port = free_port()
    args = ("--hidden", "90000")
    first = host(tmp_path, port, "hostA", hosts[0], *args, "--die-in-the-sum-at", "80")
    launches.append(first)
    time.sleep(2)
    second = host(tmp_path, port, "hostB", hosts[1], *args, "--die-in-the-sum-at", "80")
    launches.append(second)
    wait_until(lambda: the_writer(first, second), RUN_BOUND_S,
               f"both hosts training\n{first.output()[-3000:]}\n{second.output()[-3000:]}")
    pids = {worker_pid(first): first, worker_pid(second): second}
    assert first.wait(RUN_BOUND_S) == 0, first.output()[-4000:]
    assert second.wait(RUN_BOUND_S) == 0, second.output()[-4000:]
    pid, step, launched, buckets = map(int, (tmp_path / "died").read_text().split())
    assert (launched, buckets) == (1, 2)  # the first bucket's sum was under way when the host died, not the second's
    assert pid in pids, "the host died before both were seen training"
    dead = pids[pid]
    alive = second if dead is first else first
    assert re.search(r"^restart 1 of 10: .* was killed by SIGKILL", dead.output(), re.M), dead.output()[-3000:]
    output = alive.output()
    assert re.search(rf"in place: step {step} abandoned after ", output), output[-4000:]
    assert "restart 1 of" not in output and "Traceback" not in output, output[-4000:]
    steps = SAMPLES // 2 // SHARE_BATCH
    survivor = next(p for p, launch in pids.items() if launch is alive)
    check_the_order(tmp_path, survivor, steps)
    trained = newest_checkpoint(tmp_path / "checkpoints")
    assert trained["global_step"] == steps
    assert_trained_as_without_faults(trained, tmp_path, launches, *args)


@pytest.mark.slow
def test_a_second_backward_on_one_host_alone_abandons_the_step_on_every_host(hosts, tmp_path, launches):
    """A second backward pass in a step's last micro-batch on one host only (an auxiliary loss that its data asked
    for): a gradient changed after its sum over the hosts had been launched, so the sum is wrong on every host.
    torchft's should_commit() is each host's own: the other host, which saw nothing, once committed that sum while
    the first abandoned the step and was healed from it. Now a flag summed over the hosts after the gradients has
    every host abandon it, the step is taken again with one backward pass, and the job ends with the weights of a
    fault-free run, each host's steps in the order of the largest world."""
    port, hold, at = free_port(), tmp_path / "hold", 40
    first = host(tmp_path, port, "hostA", hosts[0], "--hold-at", "10", "--hold-until", str(hold),
                 "--second-backward-at", str(at))
    launches.append(first)
    time.sleep(2)
    second = host(tmp_path, port, "hostB", hosts[1])
    launches.append(second)
    wait_until(lambda: "INFO training " in second.output(), RUN_BOUND_S, "the second host started")
    hold.touch()  # both train together long before step 40, however slowly the second started
    pids = [worker_pid(first), worker_pid(second)]
    assert first.wait(RUN_BOUND_S) == 0, first.output()[-4000:]
    assert second.wait(RUN_BOUND_S) == 0, second.output()[-4000:]
    mine, theirs = first.output(), second.output()
    assert "in place: a gradient changed after its sum over the hosts had been launched" in mine, mine[-4000:]
    assert re.search(rf"in place: step {at + 1} abandoned after [\d.]+ s \(a gradient changed after its sum", mine), \
        mine[-4000:]
    assert re.search(rf"in place: step {at + 1} abandoned after [\d.]+ s \(a gradient on another host changed ",
                     theirs), theirs[-4000:]
    for output in (mine, theirs):
        assert "restart 1 of" not in output and "Traceback" not in output, output[-4000:]
        assert len(re.findall(r"in place: step \d+ abandoned", output)) == 1, output[-4000:]
        # The script's own answer: run.optimizer_step() returned False for that step alone, on both hosts.
        assert re.findall(r"optimizer_step: step (\d+) not counted", output) == [str(at + 1)], output[-4000:]
    steps = SAMPLES // 2 // SHARE_BATCH
    for pid in pids:
        check_the_order(tmp_path, pid, steps)
    trained = newest_checkpoint(tmp_path / "checkpoints")
    assert trained["global_step"] == steps
    assert_trained_as_without_faults(trained, tmp_path, launches)


# The reference recipe's techniques that reach across the hosts under in place (docs/recipes.md): the clip after the
# sum over the hosts, mixup/cutmix keyed by the share's rank in the largest world, the EMA's decay for that world,
# and the per-sample augmentations keyed by the sample. The built-in loop, BatchNorm-free ("cnn"), so that every
# tensor of the state must come out equal.
RECIPE = ("--model", "cnn", "--synthetic-image-size", "48", "--epochs", "1", "--log-every", "1", "--checkpoint-every",
          "10", "--clip-grad-norm", "0.5", "--label-smoothing", "0.1", "--mixup-alpha", "0.2", "--cutmix-alpha", "1.0",
          "--model-ema", "--model-ema-steps", "1", "--auto-augment", "ta_wide", "--random-erase", "0.1")
RECIPE_STEPS = 240


@pytest.mark.slow
def test_the_reference_recipe_recovers_in_place_to_the_weights_of_a_fault_free_run(hosts, tmp_path, launches):
    """The built-in loop with the recipe on: a host lost and back in place, and the final model, EMA and optimizer
    state equal those of the same job trained by two processes under DistributedDataParallel without a fault."""
    port = free_port()
    args = (*RECIPE, "--synthetic-size", str(RECIPE_STEPS * 2 * SHARE_BATCH), "--checkpoint-dir",
            str(tmp_path / "checkpoints"), "--log-dir", str(tmp_path / "runs"))
    first = Launch(args, tmp_path, inplace_env(port, hosts[0]), name="hostA", prefix=hosts[0].prefix)
    launches.append(first)
    time.sleep(2)
    second = Launch(args, tmp_path, inplace_env(port, hosts[1]), name="hostB", prefix=hosts[1].prefix)
    launches.append(second)
    wait_until(lambda: 2 in [w for _, w in generations(first.output())] and
               any((tmp_path / "checkpoints").glob("step-*.pt")), RUN_BOUND_S,
               f"both hosts training, a checkpoint\n{first.output()[-3000:]}\n{second.output()[-3000:]}")
    survivor = wait_until(lambda: first.workers(), 30, "the first host's worker")
    os.kill(second.pid, signal.SIGKILL)
    wait_until(lambda: re.search(r"in place: step \d+ committed [\d.]+ s after the first abandoned one, at world "
                                 r"size 1", first.output()), RUN_BOUND_S,
               f"the survivor to go on alone\n{first.output()[-3000:]}")
    back = Launch(args, tmp_path, inplace_env(port, hosts[1]), name="hostB-back", prefix=hosts[1].prefix)
    launches.append(back)
    wait_until(lambda: generations(first.output())[-1][1] == 2 and len(generations(first.output())) >= 3,
               RUN_BOUND_S, f"the host back in\n{first.output()[-3000:]}\n{back.output()[-3000:]}")
    assert first.workers() == survivor  # the same process trained on through the loss and the return
    assert first.wait(RUN_BOUND_S) == 0, first.output()[-4000:]
    assert back.wait(RUN_BOUND_S) == 0, back.output()[-4000:]
    output = first.output()
    sizes = [w for _, w in generations(output)]
    assert sizes[sizes.index(2):][:3] == [2, 1, 2], (generations(output), output[-3000:])
    assert "restart 1 of" not in output and "Traceback" not in output, output[-4000:]
    assert read_summary(tmp_path / "runs")["status"] == "completed"
    trained = newest_checkpoint(tmp_path / "checkpoints")
    assert trained["global_step"] == RECIPE_STEPS

    alone = tmp_path / "alone"
    alone.mkdir()
    reference = Launch((*RECIPE, "--synthetic-size", str(RECIPE_STEPS * 2 * SHARE_BATCH), "--checkpoint-dir",
                        str(alone / "checkpoints"), "--log-dir", str(alone / "runs")), alone,
                       {"PREFLIGHT": "0", "NPROC_PER_NODE": "2", "TRAIN_BATCH_SIZE": str(SHARE_BATCH)}, name="ddp")
    launches.append(reference)
    assert reference.wait(RUN_BOUND_S) == 0, reference.output()[-3000:]
    expected = newest_checkpoint(alone / "checkpoints")
    for part in ("model", "model_ema"):
        assert expected[part].keys() == trained[part].keys(), part
        for name, tensor in expected[part].items():
            assert torch.equal(trained[part][name], tensor), (part, name)
    for key, state in expected["optimizer"]["state"].items():
        assert torch.equal(trained["optimizer"]["state"][key]["momentum_buffer"], state["momentum_buffer"])


def caught_writing(hosts, tmp_path: Path, port: int, launches: list) -> tuple:
    """Two hosts whose checkpoints take long to write, caught while the writer writes one: (the writer, the other
    host, the writer's worker's temp files)."""
    ballast = ("--ballast-mb", "60")  # a write that takes long enough to be caught in it
    first = host(tmp_path, port, "hostA", hosts[0], *ballast)
    launches.append(first)
    time.sleep(2)
    second = host(tmp_path, port, "hostB", hosts[1], *ballast)
    launches.append(second)
    writer, other = wait_until(lambda: the_writer(first, second), RUN_BOUND_S,
                               f"both hosts training\n{first.output()[-3000:]}\n{second.output()[-3000:]}")
    pid = worker_pid(writer)
    # In its generation's folder (trainer.checkpoint.store.open_generation), which the next generation retires.
    writing = wait_until(lambda: list((tmp_path / "checkpoints").glob(f".generation-*/.tmp-step-*.{pid}.*")),
                         RUN_BOUND_S, "a checkpoint being written")
    return writer, other, writing


@pytest.mark.slow
def test_a_host_lost_while_it_writes_a_checkpoint_leaves_the_older_ones_and_the_others_go_on(hosts, tmp_path,
                                                                                                 launches):
    """The first host writes the job's checkpoints. Killed mid-write (its temp file there), it commits nothing; the
    other host goes on alone, writes from then on, and its new generation retires the lost host's generation's
    folder, temp file and all."""
    port = free_port()
    lighthouse = standalone_lighthouse(hosts[0], port, tmp_path)  # as compose's service: not the writer's
    checkpoints = tmp_path / "checkpoints"
    writer, other, writing = caught_writing(hosts, tmp_path, port, launches)
    survivor = worker_pid(other)
    os.kill(writer.pid, signal.SIGKILL)  # its workers die with it, mid-write
    assert other.wait(RUN_BOUND_S) == 0, other.output()[-4000:]
    lighthouse.kill()
    lighthouse.wait()
    assert [w for _, w in generations(other.output())][-1] == 1, generations(other.output())
    assert not writing[0].exists() and not writing[0].parent.exists()  # retired with its generation
    assert not list(checkpoints.rglob(".tmp-*")), list(checkpoints.rglob("*"))
    check_the_order(tmp_path, survivor, SAMPLES // 2 // SHARE_BATCH)
    assert newest_checkpoint(checkpoints)["global_step"] == SAMPLES // 2 // SHARE_BATCH


@pytest.mark.slow
def test_a_host_lost_during_validation_costs_the_other_nothing_there(hosts, tmp_path, launches):
    """Each host validates the whole set on its own (no collective across the hosts): the survivor finishes its
    validation, then regroups at its next step. The first holds at step 20 of epoch 0's 40 until the second asks
    for its first quorum: however slowly the second starts on a loaded machine, it joins in epoch 0 and validates
    it (without the hold, a second host that took 6 s to start joined after epoch 0's validation, and never had
    one to be lost in)."""
    port, samples, hold = free_port(), 1280, tmp_path / "hold"
    args = ("--epochs", "2", "--validate", "4")
    first = host(tmp_path, port, "hostA", hosts[0], *args, "--hold-at", "20", "--hold-until", str(hold),
                 samples=samples)
    launches.append(first)
    time.sleep(2)
    second = host(tmp_path, port, "hostB", hosts[1], *args, samples=samples)
    launches.append(second)
    survivor = worker_pid(first)
    wait_until(lambda: "INFO training " in second.output(), RUN_BOUND_S,
               f"the second host started\n{first.output()[-3000:]}\n{second.output()[-3000:]}")
    hold.touch()
    wait_until(lambda: "validating after epoch 0" in second.output(), RUN_BOUND_S,
               f"the first validation\n{first.output()[-3000:]}\n{second.output()[-3000:]}")
    os.kill(second.pid, signal.SIGKILL)
    assert first.wait(RUN_BOUND_S) == 0, first.output()[-4000:]
    output = first.output()
    assert output.count("validated: {'Loss/val'") == 2, output[-4000:]
    assert [w for _, w in generations(output)][-1] == 1, generations(output)
    check_the_order(tmp_path, survivor, 2 * samples // 2 // SHARE_BATCH, samples=samples, epochs=2)


@pytest.mark.slow
def test_a_second_host_lost_while_the_others_regroup_for_the_first(hosts, tmp_path, launches):
    """Three hosts (two in the second namespace); one is lost, and another while the rest agree on the new
    membership: the last one goes on alone."""
    # Three shares of 16: 200 steps. Long enough that the first host, alone until the others have started (15-20 s
    # under CI's load), is still training when they join and when they are lost: at 60 steps it had finished, or
    # had 10 steps left, in two CI runs of two (the test waited for three hosts, or for a loss, that never came).
    port, samples = free_port(), 9600
    first = host(tmp_path, port, "hostA", hosts[0], samples=samples, hosts="1:3")
    launches.append(first)
    time.sleep(2)
    others = [host(tmp_path, port, f"host{n}", hosts[1], samples=samples, hosts="1:3") for n in "BC"]
    launches.extend(others)
    wait_until(lambda: 3 in [w for _, w in generations(first.output())], RUN_BOUND_S,
               f"three hosts training\n{first.output()[-3000:]}")
    survivor = worker_pid(first)
    os.kill(others[1].pid, signal.SIGKILL)
    # Within the lighthouse's heartbeat timeout (2 s): the others are still agreeing on the membership without it,
    # whether the loss failed a step's sum (that step abandoned) or came while every host was in the quorum (the
    # lighthouse waits out the lost one's heartbeat; no step abandoned: waiting here for an "abandoned" line, the test
    # waited in vain once).
    time.sleep(0.5)
    os.kill(others[0].pid, signal.SIGKILL)
    assert first.wait(RUN_BOUND_S) == 0, first.output()[-4000:]
    output = first.output()
    assert [w for _, w in generations(output)][-1] == 1, generations(output)
    # Each line names its quorum's generation, a group that did not form too (it said the one before it again).
    numbers = [g for g, _ in generations(output)]
    assert numbers == sorted(set(numbers)), generations(output)
    check_the_order(tmp_path, survivor, samples // 3 // SHARE_BATCH, largest=3, samples=samples, losses=2)


@pytest.mark.slow
def test_a_host_whose_worker_is_killed_is_named_by_its_rank_in_the_job_and_rejoins(hosts, tmp_path, launches):
    """Each host's agent runs a group of its own, whose rank 0 may be the job's rank 1: the restart line names the
    rank in the job (and the host's replica), not the host's own. The workers' start says none of the two C++
    warnings known harmless here (no DNS server answers in the namespaces: c10d's look-up of a name fails)."""
    port = free_port()
    first = host(tmp_path, port, "hostA", hosts[0])
    launches.append(first)
    time.sleep(2)
    second = host(tmp_path, port, "hostB", hosts[1])
    launches.append(second)
    wait_until(lambda: the_writer(first, second), RUN_BOUND_S,
               f"both hosts training\n{first.output()[-3000:]}\n{second.output()[-3000:]}")
    replica = int(re.findall(r"this host is replica (\d+) ", second.output())[-1])
    generation = generations(second.output())[-1][0]
    os.kill(worker_pid(second), signal.SIGKILL)
    restart = wait_until(lambda: re.search(r"^restart 1 of 10: .*$", second.output(), re.M), 60,
                         f"the restart line\n{second.output()[-3000:]}")
    assert restart.group(0) == (
        f"restart 1 of 10: rank {replica} (host {socket.gethostname()}, replica {replica} of generation {generation}; "
        "this host's rank 0) was killed by SIGKILL; this host's ranks start again (from the newest checkpoint, then a "
        "live peer's state) and rejoin in place; the other hosts go on without them meanwhile"), restart.group(0)
    wait_until(lambda: [w for _, w in generations(second.output().split(restart.group(0))[1])][-1:] == [2],
               RUN_BOUND_S, f"the host back in\n{second.output()[-3000:]}")
    for launch in (first, second):
        output = launch.output()
        assert "hostname of the client socket cannot be retrieved" not in output, output[-3000:]
        assert "setSequenceNumberForGroup() is deprecated" not in output, output[-3000:]


@pytest.mark.slow
def test_a_frozen_host_that_comes_back_after_the_job_went_on_is_fenced(hosts, tmp_path, launches):
    """SIGSTOP the host that writes the checkpoints, in the middle of a write; the other goes on alone after the
    collective timeout. SIGCONT: the frozen host finds a newer generation before committing, leaves with one line,
    having written nothing; its launcher starts it again and it rejoins in place."""
    checkpoints = tmp_path / "checkpoints"
    writer, other, writing = caught_writing(hosts, tmp_path, free_port(), launches)
    frozen = worker_pid(writer)
    step = int(writing[0].name.split("-")[2].split(".")[0])
    stopped = [frozen, *descendants(frozen)]
    for pid in stopped:
        os.kill(pid, signal.SIGSTOP)
    try:
        wait_until(lambda: generations(other.output())[-1][1] == 1, RUN_BOUND_S,
                   f"the other host alone\n{other.output()[-3000:]}")
        wait_until(lambda: (checkpoints / ".generation").is_file(), 30, "the newer generation written")
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
    assert other.wait(RUN_BOUND_S) == 0, other.output()[-4000:]
    assert writer.wait(RUN_BOUND_S) == 0, writer.output()[-4000:]
    lines = [line for line in writer.output().splitlines() if line.startswith("error: in place: this host came back")]
    # Where it notices depends on which of its threads runs first after SIGCONT: the writer before committing the
    # frozen checkpoint, the training loop at its next step's start, or (that loop already in the quorum) torchft's
    # quorum thread handing it a live peer's state. Either way that checkpoint is never committed; the line is the one
    # line, naming both generations, wherever it was noticed (CI once saw the third place, worded apart).
    noticed = ("noticed before committing a checkpoint", "noticed at a step's start",
               "noticed when handed a live peer's state")
    assert len(lines) == 1 and any(where in lines[0] for where in noticed), writer.output()[-4000:]
    assert re.search(r"\(generation \d+, the job's is \d+: it was frozen, paused or cut off; noticed ", lines[0]), lines
    assert not (checkpoints / f"step-{step:08d}.pt").exists()  # the frozen write was never committed
    assert not list(checkpoints.rglob(".tmp-*"))
    assert read_summary(tmp_path / "runs")["status"] == "completed"


def held_writer(hosts, tmp_path: Path, port: int, launches: list, *args: str, samples: int = SAMPLES,
                **env: str) -> tuple[Launch, Launch, int, int]:
    """Two hosts training together, every checkpoint kept, the writing host's next checkpoint held right before the
    rename that commits it (trainer.checkpoint.store's test hook, HOLD_ENV): (the writer, the other host, the step
    of the held checkpoint, the process holding it). The test removes tmp_path/"hold" to let it go on."""
    hold = tmp_path / "hold"
    env = {HOLD_ENV: str(hold), "TRAIN_KEEP_CHECKPOINTS": "1000", **env}
    first = host(tmp_path, port, "hostA", hosts[0], *args, samples=samples, **env)
    launches.append(first)
    time.sleep(2)
    second = host(tmp_path, port, "hostB", hosts[1], *args, samples=samples, **env)
    launches.append(second)
    writer, other = wait_until(lambda: the_writer(first, second), RUN_BOUND_S,
                               f"both hosts training\n{first.output()[-3000:]}\n{second.output()[-3000:]}")
    hold.touch()
    reached = Path(f"{hold}.reached")
    step, pid = map(int, wait_until(lambda: reached.is_file() and reached.read_text().split(), RUN_BOUND_S,
                                    f"the writer at its commit\n{writer.output()[-3000:]}"))
    assert pid == worker_pid(writer), (pid, writer.log_path.name)
    return writer, other, step, pid


def cadence_checkpoints(directory: Path, steps: int, but: int) -> tuple[list[str], list[str]]:
    """(the step-* names in `directory`, those of every 10th step of the run but `but`)."""
    return (sorted(p.name for p in directory.glob("step-*")),
            [f"step-{s:08d}.pt" for s in range(10, steps + 1, 10) if s != but])


@pytest.mark.slow
def test_a_writer_frozen_between_its_last_check_and_its_rename_commits_nothing_when_thawed(hosts, tmp_path, launches):
    """The writing host is frozen (SIGSTOP) at the very end of a checkpoint's write, right before the rename that
    commits it. The other goes on alone in a newer generation and commits newer checkpoints. Thawed, the frozen host
    goes straight on to its rename, which finds nothing (the newer generation retired its generation's folder): it
    commits nothing and leaves with the fence's one line; its launcher starts it again and it rejoins; the job
    completes, and a resume picks the job's newest checkpoint. Before, its fence check had been passed before the
    freeze, and the rename failed only because the other host's clean-up had deleted its temp file, the line blaming
    the directory's permissions (or, had that host written no checkpoint yet, it committed its stale one)."""
    checkpoints, samples = tmp_path / "checkpoints", 9600  # 300 steps: time to rejoin before the end
    writer, other, step, frozen = held_writer(hosts, tmp_path, free_port(), launches, samples=samples)
    own = generations(writer.output())[-1][0]
    stopped = [frozen, *descendants(frozen)]
    for pid in stopped:
        os.kill(pid, signal.SIGSTOP)
    try:
        (tmp_path / "hold").unlink()  # thawed, it goes straight on to its rename
        wait_until(lambda: generations(other.output())[-1][1] == 1 and newest_step(checkpoints) > step,
                   RUN_BOUND_S, f"the other host alone, committing newer checkpoints\n{other.output()[-3000:]}")
        newest = generations(other.output())[-1][0]
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
    assert other.wait(RUN_BOUND_S) == 0, other.output()[-4000:]
    assert writer.wait(RUN_BOUND_S) == 0, writer.output()[-4000:]
    output = writer.output()
    assert error_lines(output) == [
        f"error: in place: this host came back after the job went on without it (generation {own}, the job's is "
        f"{newest}: it was frozen, paused or cut off; noticed before committing a checkpoint): it leaves, having "
        "written nothing of the newer generation (started again, it rejoins as a returning host)"], output[-4000:]
    assert "restart 1 of" in output, output[-4000:]
    rejoined = output.split("this host came back after", 1)[1]
    assert 2 in [w for _, w in generations(rejoined)], rejoined[-3000:]
    steps = samples // 2 // SHARE_BATCH
    found, expected = cadence_checkpoints(checkpoints, steps, but=step)
    assert found == expected, (step, found)  # every checkpoint of the job, and nothing of the frozen host's
    state, path = load_for_resume(checkpoints, "auto")
    assert path == checkpoints / f"step-{steps:08d}.pt" and state["global_step"] == steps
    assert not list(checkpoints.rglob(".tmp-*")) and not list(checkpoints.glob(".retired-*"))
    assert len(list(checkpoints.glob(".generation-*"))) == 1, list(checkpoints.glob(".generation*"))
    assert read_summary(tmp_path / "runs")["status"] == "completed"


@pytest.mark.slow
def test_a_background_write_that_spans_a_change_of_membership_is_not_committed_and_the_host_trains_on(
        hosts, tmp_path, launches):
    """--checkpoint-async: the writing host's background write is held right before its rename while the other
    host is lost; the writing host goes on alone in a newer generation, which retires the held write's generation's
    folder. That checkpoint is not committed, with one warning, and not counted as committed; the host, still in
    the job, is not fenced: its next checkpoint commits, and it trains to the end and writes the last one."""
    checkpoints, samples, port = tmp_path / "checkpoints", 3200, free_port()  # 100 steps
    lighthouse = standalone_lighthouse(hosts[0], port, tmp_path)  # either host may be the one lost
    try:
        # Slower steps: the host must regroup alone before its next checkpoint, which waits for the held write.
        writer, other, step, _ = held_writer(hosts, tmp_path, port, launches, "--step-seconds", "0.4",
                                             samples=samples, TRAIN_CHECKPOINT_ASYNC="1")
        os.kill(other.pid, signal.SIGKILL)
        wait_until(lambda: generations(writer.output())[-1][1] == 1, RUN_BOUND_S,
                   f"the writing host alone\n{writer.output()[-3000:]}")
        (tmp_path / "hold").unlink()
        assert writer.wait(RUN_BOUND_S) == 0, writer.output()[-4000:]
    finally:
        lighthouse.kill()
        lighthouse.wait()
    output = writer.output()
    warned = [line for line in output.splitlines() if "was not committed" in line]
    assert len(warned) == 1 and warned[0].endswith(
        f"in place: the checkpoint of step {step} was not committed: the membership changed while it was written "
        "(the next one commits)"), output[-4000:]
    assert not error_lines(output) and "restart 1 of" not in output, output[-4000:]
    steps = samples // 2 // SHARE_BATCH
    found, expected = cadence_checkpoints(checkpoints, steps, but=step)
    assert found == expected, (step, found)
    assert newest_checkpoint(checkpoints)["global_step"] == steps
    assert read_summary(tmp_path / "runs")["status"] == "completed"


def slow_starters(hosts, tmp_path: Path, port: int, launches: list, samples: int, late: str = "B",
                  most: str = "1:2", apart: bool = True, **env: str) -> tuple[Launch, Path, list[tuple[Launch, int, int]]]:
    """The first host trains alone (the lighthouse apart, as compose's service runs it, unless not `apart`: then
    beside the first's launcher); the hosts named in `late` start once there is a checkpoint, resume from it and wait
    before their first step until the test creates the returned file: (the first, that file, [(a late host, its
    worker, the step it resumed from)]). The first holds at step 20 until the late hosts have resumed: however slowly
    they start on a loaded machine, they resume from a checkpoint before the job's end."""
    if apart:
        standalone_lighthouse(hosts[0], port, tmp_path)
    hold = tmp_path / "hold"
    first = host(tmp_path, port, "hostA", hosts[0], "--hold-at", "20", "--hold-until", str(hold), samples=samples,
                 hosts=most, **env)
    launches.append(first)
    wait_until(lambda: newest_step(tmp_path / "checkpoints"), RUN_BOUND_S, f"a checkpoint\n{first.output()[-3000:]}")
    go = tmp_path / "go"
    others = [host(tmp_path, port, f"host{n}", hosts[1], "--start-when", str(go), samples=samples, hosts=most, **env)
              for n in late]
    launches.extend(others)
    started = []
    for other in others:
        found = wait_until(lambda o=other: re.search(r"starting at step (\d+)", o.output()), RUN_BOUND_S,
                           f"{other.log_path.name} resumed\n{other.output()[-3000:]}")
        started.append((other, worker_pid(other), int(found.group(1))))
    hold.touch()
    return first, go, started


def lose_the_first(first: Launch, checkpoints: Path, past: int) -> tuple[list[int], int]:
    """SIGKILL the first host once it has checkpointed 20 steps past `past`: (its workers, the newest checkpoint's
    step once they are gone)."""
    wait_until(lambda: newest_step(checkpoints) >= past + 20, RUN_BOUND_S,
               f"the first host further\n{first.output()[-3000:]}")
    lost = workers(first)  # the script's workers (Launch.workers() finds `python -m trainer` ones only)
    os.kill(first.pid, signal.SIGKILL)
    wait_until(lambda: not any(running(p) for p in lost), 10, "the lost host's workers to die with it")
    return lost, newest_step(checkpoints)


def committed(directory: Path) -> dict[str, int]:
    """The committed checkpoints and summary.json: {name: mtime_ns}."""
    return {p.name: p.stat().st_mtime_ns for p in [*directory.glob("checkpoints/step-*.pt"),
                                                    *directory.glob("runs/summary.json")]}


@pytest.mark.slow
def test_a_host_started_again_as_the_job_finishes_trains_nothing_and_writes_nothing(hosts, tmp_path, launches):
    """The second host resumes from a checkpoint and, before its first step, the first trains to the end, writes
    the last checkpoint and summary.json, and leaves. The second's first quorum has it alone, behind the job's newest
    checkpoint: it goes on from there, the job's end, and leaves with "nothing to do", the finished run's files as
    they were."""
    samples = 3200  # 100 steps
    first, go, [(second, worker, resumed)] = slow_starters(hosts, tmp_path, free_port(), launches, samples)
    assert first.wait(RUN_BOUND_S) == 0, first.output()[-4000:]
    finished = committed(tmp_path)
    steps = samples // 2 // SHARE_BATCH
    assert resumed < steps and f"step-{steps:08d}.pt" in finished and "summary.json" in finished, finished
    go.touch()
    assert second.wait(RUN_BOUND_S) == 0, second.output()[-4000:]
    output = second.output()
    assert (f"in place: the hosts here were at step {resumed}, and the job committed step {steps} without them "
            f"(the hosts that trained it have left): going on from {tmp_path / 'checkpoints'}/step-{steps:08d}.pt"
            ) in output, output[-4000:]
    assert f"nothing to do: {tmp_path / 'checkpoints'}/step-{steps:08d}.pt is at step {steps}" in output, output
    assert not seen(tmp_path).get(worker), "the second host trained steps again"
    assert committed(tmp_path) == finished and not list((tmp_path / "checkpoints").rglob(".tmp-*"))
    assert read_summary(tmp_path / "runs")["status"] == "completed"


@pytest.mark.slow
def test_a_host_started_again_as_the_job_ends_with_its_lighthouse_finds_nothing_to_do(hosts, tmp_path, launches):
    """As above, with the lighthouse beside the first host's launcher: it goes away with the first host, and the
    second's first quorum finds nobody. The checkpoint directory says the job trained to its end: nothing to do,
    exit 0, in seconds, nothing trained or written (it used to end with a "no quorum" error). At the default
    --collective-timeout, as users have it: the host waiting for the lighthouse reads the directory while it waits
    (with the other tests' 10 s it left when its quorum timed out; at 300 s it waited 5 minutes: a host started again
    as the job ended, in CI's run of bench.goodput)."""
    samples = 3200  # 100 steps
    first, go, [(second, worker, _)] = slow_starters(hosts, tmp_path, free_port(), launches, samples, apart=False,
                                                     TRAIN_COLLECTIVE_TIMEOUT="300")
    assert first.wait(RUN_BOUND_S) == 0, first.output()[-4000:]
    finished = committed(tmp_path)
    go.touch()
    began = time.monotonic()
    assert second.wait(RUN_BOUND_S) == 0, second.output()[-4000:]
    assert time.monotonic() - began < 30, second.output()[-4000:]  # a bound on a hang, not a speed goal
    output = second.output()
    steps = samples // 2 // SHARE_BATCH
    assert (f"nothing to do: the in-place job of the lighthouse at http://{MASTER_ADDR}:{first_port(first)} ended at "
            f"step {steps} ({tmp_path / 'checkpoints' / '.job-ended.json'}); this host, started as it ended, has "
            "nothing to train") in output, output[-4000:]
    assert "error: " not in output, output[-4000:]
    assert not seen(tmp_path).get(worker) and committed(tmp_path) == finished


@pytest.mark.slow
def test_a_host_started_after_the_job_ended_and_its_lighthouse_left_finds_nothing_to_do(hosts, tmp_path, launches):
    """The built-in loop's host started after the job (and the lighthouse beside its first host) ended: it does not
    wait RDZV_TIMEOUT for a lighthouse that will not come back; nothing to do, exit 0, nothing written. The same
    job with more epochs is not over: it waits for its lighthouse, and when none comes, exits 1 (its lighthouse
    answered this directory's job before: its host is to be started again, not a mistake in the settings)."""
    port = free_port()
    first = builtin_host(tmp_path, port, "hostA", hosts[0], "--synthetic-size", "1024")
    launches.append(first)
    assert first.wait(RUN_BOUND_S) == 0, first.output()[-4000:]
    finished = committed(tmp_path)
    late = builtin_host(tmp_path, port, "hostB", hosts[1], "--synthetic-size", "1024")
    launches.append(late)
    assert late.wait(60) == 0, late.output()[-4000:]  # RDZV_TIMEOUT is 900 s
    assert (f"nothing to do: the in-place job of the lighthouse at http://{MASTER_ADDR}:{port} ended at step 32 "
            f"({tmp_path / 'checkpoints' / '.job-ended.json'})") in late.output(), late.output()[-4000:]
    assert "+ torchrun" not in late.output() and committed(tmp_path) == finished
    longer = builtin_host(tmp_path, port, "hostB-longer", hosts[1], "--synthetic-size", "1024", "--epochs", "2",
                          RDZV_TIMEOUT="3")
    launches.append(longer)
    # Its lighthouse answered this directory's job before: a host to start again, not a mistake in the settings.
    assert longer.wait(60) == 1 and "cannot be reached" in longer.output(), longer.output()[-4000:]


def first_port(launch: Launch) -> str:
    return re.search(r"lighthouse at http://[\d.]+:(\d+)", launch.output()).group(1)


@pytest.mark.slow
def test_a_host_whose_peers_trained_on_and_were_lost_while_it_started_goes_on_from_their_newest_checkpoint(
        hosts, tmp_path, launches):
    """As above, but the first host is killed mid-run, well past the step the second resumed from: the second,
    alone, goes on from the newest checkpoint (not the one it loaded), and the job ends with the weights of the
    same job trained without a fault (the steps after that checkpoint, whose state was lost with the host, are
    trained again from it)."""
    first, go, [(second, worker, resumed)] = slow_starters(hosts, tmp_path, free_port(), launches, SAMPLES)
    checkpoints = tmp_path / "checkpoints"
    lost, last = lose_the_first(first, checkpoints, resumed)
    go.touch()
    assert second.wait(RUN_BOUND_S) == 0, second.output()[-4000:]
    output = second.output()
    assert (f"in place: the hosts here were at step {resumed}, and the job committed step {last} without them"
            ) in output, output[-4000:]
    steps = SAMPLES // 2 // SHARE_BATCH
    assert sorted(seen(tmp_path)[worker]) == list(range(last + 1, steps + 1))
    # Every step once, but those the lost host trained after its last checkpoint: their state was lost with it.
    check_the_order(tmp_path, worker, steps, lost_after={pid: last for pid in lost})
    assert read_summary(tmp_path / "runs")["status"] == "completed"
    assert_trained_as_without_faults(newest_checkpoint(checkpoints), tmp_path, launches)


@pytest.mark.slow
def test_hosts_that_each_go_on_from_the_newest_checkpoint_abandon_that_step_and_go_on_together(hosts, tmp_path,
                                                                                                launches):
    """Three hosts at most: the first trains alone; two more start and resume, and wait before their first step
    while the first trains on and is killed. Their first quorum has both behind the newest checkpoint: each goes on
    from it (each read it on its own), they abandon that step (so that none trains from another's state), and
    train on together to the end, every step once but the lost host's after its last checkpoint."""
    samples = 9600  # 200 steps of three shares
    first, go, started = slow_starters(hosts, tmp_path, free_port(), launches, samples, late="BC", most="1:3")
    others, pids, resumed = (list(column) for column in zip(*started))
    lost, last = lose_the_first(first, tmp_path / "checkpoints", max(resumed))
    go.touch()
    for other in others:
        assert other.wait(RUN_BOUND_S) == 0, other.output()[-4000:]
        output = other.output()
        # Where the two resumed from different checkpoints, torchft healed the one behind from the other first.
        assert (f"in place: the hosts here were at step {max(resumed)}, and the job committed step {last} without them"
                ) in output, output[-4000:]
        assert re.search(rf"in place: step {last + 1} abandoned after [\d.]+ s \(a host here began it from the newest "
                         r"checkpoint: the hosts heal to the furthest of them first\)", output), output[-4000:]
        assert generations(output)[-1][1] == 2, generations(output)
    steps = samples // 3 // SHARE_BATCH
    for pid in pids:
        assert sorted(seen(tmp_path)[pid]) == list(range(last + 1, steps + 1))
    check_the_order(tmp_path, pids[0], steps, largest=3, samples=samples, lost_after={pid: last for pid in lost})
    assert read_summary(tmp_path / "runs")["status"] == "completed"


def builtin_host(out: Path, port: int, name: str, where: Host, *args: str, **env: str) -> Launch:
    """The built-in loop on one host of an in-place job, slow enough for others to try to join it."""
    return Launch(["--model", "cnn", "--synthetic-size", "20000", "--epochs", "1",
                   "--checkpoint-every", "20", "--log-every", "20", "--checkpoint-dir", str(out / "checkpoints"),
                   "--log-dir", str(out / "runs"), *args], out, inplace_env(port, where, **env), name=name,
                  prefix=where.prefix)


def first_checkpoint(launch: Launch, checkpoints: Path) -> None:
    wait_until(lambda: newest_step(checkpoints) or launch.proc.poll() is not None, RUN_BOUND_S,
               f"a checkpoint\n{launch.output()[-3000:]}")
    assert launch.proc.poll() is None, launch.output()[-3000:]


def refused(launch: Launch) -> list[str]:
    """The one error line of a launcher that must exit 2 (a worker's usage error adds the agent's own after it)."""
    assert launch.wait(120) == 2, launch.output()[-3000:]
    return [line for line in launch.output().splitlines() if line.startswith("error: ")
            and not line.startswith("error: training failed: ")]


@pytest.mark.slow
def test_a_second_in_place_job_on_the_same_checkpoint_directory_is_refused(hosts, tmp_path, launches):
    """Two jobs (two lighthouses) on one --checkpoint-dir would resume each other's checkpoints. The built-in loop's
    directory is known to the launcher: refused before any worker starts; a script's, by its first worker, before its
    first quorum. Either way one line naming the directory and the job that holds it, exit 2; the first job goes on
    alone and its checkpoints are its own."""
    first_port, other_port = free_port(), free_port()
    first = builtin_host(tmp_path, first_port, "jobA", hosts[0])
    launches.append(first)
    checkpoints = tmp_path / "checkpoints"
    first_checkpoint(first, checkpoints)
    holder = f"the in-place job of the lighthouse at http://{MASTER_ADDR}:{first_port}, first taken by pid {first.pid}"
    other = builtin_host(tmp_path, other_port, "jobB", hosts[0], "--lr", "0.05")
    launches.append(other)
    (line,) = refused(other)
    assert line.startswith(f"error: --checkpoint-dir: {checkpoints} is in use by another run ({holder} on "), line
    assert "+ torchrun" not in other.output()  # refused before any worker started
    script = host(tmp_path, other_port, "jobB-script", hosts[0])
    launches.append(script)
    (line,) = refused(script)
    assert line.startswith(f"error: checkpoint_dir: {checkpoints} is in use by another run ({holder} on "), line
    assert not list(tmp_path.glob("seen-*"))  # the script's worker trained nothing
    first.proc.send_signal(signal.SIGTERM)
    assert first.wait(RUN_BOUND_S) == 0, first.output()[-3000:]
    assert all(size == 1 for _, size in generations(first.output()))
    assert newest_checkpoint(checkpoints)["config"]["lr"] == 0.1  # job A's, not job B's


@pytest.mark.slow
def test_a_host_with_other_settings_is_refused_naming_them_and_the_job_goes_on_without_it(hosts, tmp_path, launches):
    """A host healed from a peer trains the peer's state: with another schedule, seed, learning rate or recipe it would
    train something else than it says (another model is refused as another checkpoint's: check_resume, or below for a
    script's own). Each is refused before its first quorum,
    in one line naming what differs and both values, exit 2; the job trains on alone, undisturbed."""
    port = free_port()
    first = builtin_host(tmp_path, port, "hostA", hosts[0])
    launches.append(first)
    checkpoints = tmp_path / "checkpoints"
    first_checkpoint(first, checkpoints)
    job = f"the in-place job it joins (its lighthouse at http://{MASTER_ADDR}:{port}) has"
    for args, differs in [(["--epochs", "2"], "--epochs: this host has --epochs 2; {job} --epochs 1"),
                          (["--seed", "1", "--lr", "0.05", "--label-smoothing", "0.1"],
                           "--lr, --label-smoothing, --seed: this host has --lr 0.05, --label-smoothing 0.1, --seed 1; "
                           "{job} --lr 0.1, --label-smoothing 0.0, --seed 0")]:
        joining = builtin_host(tmp_path, port, f"host{args[0]}", hosts[1], *args)
        launches.append(joining)
        assert refused(joining) == [f"error: {differs.format(job=job)} (every host of an in-place job trains with "
                                    "the same settings: start this host with the job's settings, or stop every host "
                                    "and start the job again with the new ones, which a resume applies)"]
    first.proc.send_signal(signal.SIGTERM)
    assert first.wait(RUN_BOUND_S) == 0, first.output()[-3000:]
    assert [size for _, size in generations(first.output())] == [1], generations(first.output())


@pytest.mark.slow
def test_a_script_whose_model_does_not_fit_the_jobs_is_refused_naming_it(hosts, tmp_path, launches):
    """A script's model is its own code: its tensors' layout is compared, not a flag. Before the job's first checkpoint
    (after it, a resume would not fit either): such a host used to join the quorum and fail its heal."""
    port = free_port()
    first = host(tmp_path, port, "hostA", hosts[0], "--checkpoint-every", "100000")
    launches.append(first)
    wait_until(lambda: generations(first.output()), RUN_BOUND_S, f"training\n{first.output()[-3000:]}")
    joining = host(tmp_path, port, "hostB", hosts[1], "--hidden", "32", "--checkpoint-every", "100000")
    launches.append(joining)
    (line,) = refused(joining)
    assert re.fullmatch(r"error: model \(its state_dict\): this host has model \(its state_dict\) 4 tensors, 387 "
                        r"values, layout \w+; the in-place job it joins \(.*\) has model \(its state_dict\) 4 tensors, "
                        r"195 values, layout \w+ \(.*\)", line), line
    assert not newest_step(tmp_path / "checkpoints")  # the check did not rest on a checkpoint
    first.proc.send_signal(signal.SIGTERM)
    assert first.wait(RUN_BOUND_S) == 0, first.output()[-3000:]


def test_the_state_a_returning_host_gets_arrives_whole_over_a_real_gloo_group():
    """The transport of a heal (trainer.engine.inplace._StateOverGroup): the structure through torch.save, each tensor
    as its bytes. Every kind of value a checkpoint holds arrives equal, in the same containers: dtypes of every size,
    0-dim, empty and non-contiguous tensors, RNG states, numbers and strings, twice in a row on the same group."""
    import threading
    from collections import OrderedDict
    from datetime import timedelta

    import torch.distributed as dist

    from trainer.engine.inplace import _StateOverGroup

    def state() -> dict:
        g = torch.Generator().manual_seed(3)
        return {"model": OrderedDict(w=torch.randn(64, 33, generator=g), empty=torch.zeros(0, 4),
                                     scale=torch.tensor(2.5), half=torch.randn(7, generator=g).half()),
                "optimizer": {"state": {0: {"momentum_buffer": torch.randn(33, 64, generator=g).t(),
                                            "step": torch.tensor(12.0)}},
                              "param_groups": [{"lr": 0.1, "params": [0], "nesterov": False}]},
                "rng": torch.Generator().manual_seed(9).get_state(), "mask": torch.tensor([True, False, True]),
                "complex": torch.randn(5, dtype=torch.complex64, generator=g), "ints": torch.arange(10)[::3],
                "step": 41, "names": ("a", "b"), "nothing": None}

    store, groups = dist.HashStore(), [None, None]

    def make(rank: int) -> None:
        groups[rank] = dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=30))

    makers = [threading.Thread(target=make, args=(rank,)) for rank in (0, 1)]
    for maker in makers:
        maker.start()
    for maker in makers:
        maker.join()
    sender, receiver = _StateOverGroup(groups[0]), _StateOverGroup(groups[1])

    for step in (41, 42):
        send = threading.Thread(target=sender.send_checkpoint, args=([1], step, state(), timedelta(seconds=30)))
        send.start()
        got = receiver.recv_checkpoint(0, "process-group", step, timedelta(seconds=30))
        send.join()
        assert_identical(got, state(), "state", same_types=True)
        assert receiver.moved_bytes == sender.moved_bytes > 64 * 33 * 4 * 2



PEER_OF_TWO = """
import os
import sys
from datetime import timedelta

import torch
from torch.distributed import AllreduceOptions, ReduceOp

from trainer.engine.replica_group import GlooReplicaGroup

group = GlooReplicaGroup(timeout=timedelta(seconds=60))
group.configure(sys.argv[1], "peer", 1, 2, 1)
options = AllreduceOptions()
options.reduceOp = ReduceOp.SUM
group.allreduce([torch.full((1000,), 2.0)], options).wait()
print("summed once", flush=True)
os._exit(0)  # lost before the second sum: its socket closed, no goodbye
"""


class _Manager:
    """What HostSums reads of torchft's Manager: whether this step already failed, and where a failure is reported
    (should_commit() then says False). Its allreduce must not be called on the direct path."""

    def __init__(self):
        self.errors: list[BaseException] = []

    def errored(self):
        return self.errors[0] if self.errors else None

    def report_error(self, err: BaseException) -> None:
        self.errors.append(err)

    def is_participating(self) -> bool:
        return True

    def allreduce(self, tensor, reduce_op=None):
        raise AssertionError("the Manager's allreduce was called on gloo")


def test_a_sum_on_the_replica_group_called_directly_reports_a_lost_peer_to_the_manager_and_never_raises():
    """HostSums on gloo (every sum of in place: the buckets, the reload flag, the buffers, the end's flag) calls
    torchft's replica group directly, without the Manager's managed work, and keeps its contract: a sum with its
    peer adds; a sum whose peer was lost is reported to the Manager (the step abandoned) and its wait() returns
    False instead of raising, within gloo's own detection of the lost peer rather than the collective timeout; once
    the step failed nothing more is launched, so the tensor is left as it was."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    from trainer.engine.inplace import HostSums
    from trainer.engine.replica_group import GlooReplicaGroup

    port = free_port()
    store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    address = f"127.0.0.1:{port}/sums"
    peer = subprocess.Popen([sys.executable, "-c", PEER_OF_TWO, address], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        group = GlooReplicaGroup(timeout=timedelta(seconds=60))
        group.configure(address, "here", 0, 2, 1)
        manager = _Manager()
        sums = HostSums(manager, group)
        first = torch.ones(1000)
        assert sums.launch(first).wait() is True
        assert torch.equal(first, torch.full((1000,), 3.0)) and not manager.errors
        assert peer.wait(RUN_BOUND_S) == 0 and "summed once" in peer.stdout.read()
        began = time.monotonic()
        second = torch.ones(1000)
        assert sums.launch(second).wait() is False
        assert time.monotonic() - began < 30, "waited for the collective timeout, not for the lost peer's socket"
        assert len(manager.errors) == 1, manager.errors
        third = torch.ones(1000)
        assert sums.launch(third).wait() is False  # not launched: the step already failed
        assert torch.equal(third, torch.ones(1000)) and len(manager.errors) == 1
    finally:
        peer.kill()
        del store


def test_on_cuda_the_replica_group_is_torchfts_nccl_group_in_a_child_process_and_on_cpus_its_gloo_group():
    """trainer.engine.replica_group: workers on CUDA sum over torchft's baby NCCL group (NCCL in a child process of
    each worker: a lost peer cannot take the worker's CUDA context with it), workers on CPUs over its gloo group; the
    tensors sent over it are on the worker's GPU, or on the CPU. Both keep inplace.InPlace's generation bookkeeping.
    The NCCL group's child is started for real (torchft spawns it, pickling the group's class by its import path):
    on a host without a GPU its configure fails in NCCL's own words, the generation asked recorded, none formed."""
    from datetime import timedelta

    from torchft import ProcessGroupBabyNCCL, ProcessGroupGloo

    from trainer.engine.replica_group import replica_group, tensors_device

    timeout = timedelta(seconds=60)
    nccl, gloo = replica_group(torch.device("cuda", 0), timeout), replica_group(torch.device("cpu"), timeout)
    assert isinstance(nccl, ProcessGroupBabyNCCL) and nccl.getBackendName() == "torchft-baby-nccl"
    assert isinstance(gloo, ProcessGroupGloo) and gloo.getBackendName() == "torchft-gloo"
    from trainer.engine.inplace import _replica_group  # what InPlace makes from its DistContext's device

    assert isinstance(_replica_group(timeout, torch.device("cuda", 0)), ProcessGroupBabyNCCL)
    assert isinstance(_replica_group(timeout, torch.device("cpu")), ProcessGroupGloo)
    assert not isinstance(_replica_group(timeout), ProcessGroupBabyNCCL)
    assert tensors_device(torch.device("cuda", 1)) == torch.device("cuda", 1)
    assert tensors_device(torch.device("cpu")) == tensors_device(torch.device("mps")) == torch.device("cpu")
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    for group in (nccl, gloo):
        assert (group.asked, group.generation) == (0, 0)
        try:
            group.configure(f"127.0.0.1:{store.port}/{group.getBackendName()}", "replica-0", 0, 1, quorum_id=7)
        except ValueError as err:
            assert group is nccl and not torch.cuda.is_available() and "no GPUs found" in str(err), err
            assert (group.asked, group.generation) == (7, 0) and group.configured_s > 0
        else:
            assert (group.asked, group.generation) == (7, 7) and group.configured_s > 0
        finally:
            group.shutdown()


def test_the_state_sent_over_the_nccl_group_says_which_tensors_lived_on_the_gpu_and_the_rest_land_on_the_cpu():
    """_StateOverGroup's placement, on this CPU: with the group's tensors on a GPU (NCCL), the sender marks each
    tensor on that device type as the device's (it arrives on the receiver's own GPU) and the others (RNG states, a
    CPU-side counter) as the CPU's; with gloo every tensor is the group's own, on the CPU. What was received on the
    CPU stays that same tensor."""
    from trainer.engine.inplace import _filled, _landed, _placed, _skeleton

    state = {"model": {"w": torch.randn(3, 2)}, "rng": torch.Generator().manual_seed(1).get_state(), "step": 4}
    tensors: list = []
    skeleton = _skeleton(state, tensors)
    assert [t.shape for t in tensors] == [(3, 2), state["rng"].shape]
    assert _placed(tensors, torch.device("cuda", 0)) == [False, False]
    assert _placed(tensors, torch.device("cpu")) == [True, True]
    for on_device in ([True, True], [False, False], [True, False]):
        landed = _landed(tensors, on_device)
        assert all(a is b for a, b in zip(landed, tensors))
        rebuilt = iter(landed).__next__
        assert_identical(_filled(skeleton, lambda meta, take=rebuilt: take()), state, "state", same_types=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the NCCL replica group needs a CUDA GPU")
def test_over_the_nccl_replica_group_the_state_arrives_on_the_gpu_and_the_float64_sums_add():
    """Not run without a GPU (none had run it when it was written). Two NCCL replica groups on one GPU, as two
    hosts (NCCL_HOSTID tells NCCL they are, which refuses two ranks of one GPU otherwise): the state of a returning
    host arrives whole, the tensors the sender had on its GPU on the receiver's, its RNG states on the CPU; the
    gradient sum and BufferChain's float64 sum add up over NCCL, and so does the end's flag."""
    import threading
    from collections import OrderedDict
    from datetime import timedelta

    from torch.distributed import AllreduceOptions, ReduceOp
    from torch.utils._pytree import tree_map

    from trainer.engine.inplace import _StateOverGroup
    from trainer.engine.replica_group import replica_group

    device, timeout = torch.device("cuda", 0), timedelta(seconds=60)
    torch.cuda.set_device(device)
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    groups = [replica_group(device, timeout) for _ in range(2)]
    saved = os.environ.get("NCCL_HOSTID")
    try:
        for rank, group in enumerate(groups):  # each group's child takes the environment as it is started
            os.environ["NCCL_HOSTID"] = f"test-replica-{rank}"
            group.configure(f"127.0.0.1:{store.port}/nccl", f"replica-{rank}", rank, 2, quorum_id=1)
    finally:
        os.environ.pop("NCCL_HOSTID") if saved is None else os.environ.update(NCCL_HOSTID=saved)

    def state() -> dict:
        g = torch.Generator().manual_seed(3)
        return {"model": OrderedDict(w=torch.randn(64, 33, generator=g).to(device), empty=torch.zeros(0, 4).to(device),
                                     half=torch.randn(7, generator=g).half().to(device)),
                "optimizer": {"state": {0: {"momentum_buffer": torch.randn(33, 64, generator=g).to(device).t(),
                                            "step": torch.tensor(12.0)}},
                              "param_groups": [{"lr": 0.1, "params": [0]}]},
                "rng": {"cpu": torch.Generator().manual_seed(9).get_state(), "cuda": torch.cuda.get_rng_state()},
                "step": 41}

    try:
        sender, receiver = _StateOverGroup(groups[0], device), _StateOverGroup(groups[1], device)
        send = threading.Thread(target=sender.send_checkpoint, args=([1], 41, state(), timeout))
        send.start()
        got = receiver.recv_checkpoint(0, "process-group", 41, timeout)
        send.join()
        assert got["model"]["w"].device == device and got["optimizer"]["state"][0]["momentum_buffer"].device == device
        assert got["rng"]["cpu"].device.type == got["rng"]["cuda"].device.type == "cpu"
        assert got["optimizer"]["state"][0]["step"].device.type == "cpu"
        on_cpu = lambda tree: tree_map(lambda t: t.cpu() if isinstance(t, torch.Tensor) else t, tree)  # noqa: E731
        assert_identical(on_cpu(got), on_cpu(state()), "state", same_types=True)
        assert receiver.moved_bytes == sender.moved_bytes > 64 * 33 * 4 * 2

        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp.SUM
        for dtype in (torch.float64, torch.float32):  # BufferChain's sum; the gradients' and the end's flag
            flats = [torch.full((5,), rank + 1.0, dtype=dtype, device=device) for rank in range(2)]
            works = [group.allreduce([flat], opts) for group, flat in zip(groups, flats)]
            for work in works:
                work.wait(timeout)
            assert all(flat.cpu().tolist() == [3.0] * 5 for flat in flats), (dtype, flats)
    finally:
        for group in groups:
            group.shutdown()


# ------------------------------------------------------------------------------------------------ bad input

def dry_run(env: dict[str, str], *args: str, pythonpath: str | None = None,
            cwd: Path | None = None) -> subprocess.CompletedProcess:
    from helpers import clean_env

    full = clean_env({"NNODES": "1:2", "MASTER_ADDR": "127.0.0.1", "NPROC_PER_NODE": "1", **env})
    if pythonpath is not None:
        full["PYTHONPATH"] = f"{pythonpath}:{full.get('PYTHONPATH', '')}"
    return subprocess.run([sys.executable, "-m", "trainer.cli.launch", "--dry-run", *args], env=full, cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def recovery_of(done: subprocess.CompletedProcess) -> tuple[str, str]:
    import json

    facts = json.loads(done.stdout)
    return facts["recovery"], facts["recovery_line"]


def test_in_place_asked_for_a_plain_script_or_fsdp_takes_the_restart_path_and_says_why(tmp_path):
    path, line = recovery_of(dry_run({}, str(USER_CODE / "elastic_loop.py"), "--out", str(tmp_path)))
    assert path == "restart" and "elastic_loop.py does not train through trainer.api's run.steps() and " \
        "run.optimizer_step()" in line, line
    path, line = recovery_of(dry_run({}, "--model", "resnet18", "--strategy", "fsdp"))
    assert path == "restart" and "--strategy fsdp shards the model" in line, line
    path, line = recovery_of(dry_run({}, str(USER_CODE / "inplace_loop.py"), "--out", str(tmp_path)))
    assert path == "in-place" and line.startswith("recovery: in place: "), line
    # The job is the hosts together; each host's agent runs a one-host group of its own on a local port (the
    # lighthouse, at MASTER_ADDR:MASTER_PORT, joins the groups).
    import json

    facts = json.loads(dry_run({"MASTER_PORT": "29511"}, str(USER_CODE / "inplace_loop.py"), "--out",
                               str(tmp_path)).stdout)
    command = facts["command"]
    assert (facts["nnodes"], facts["master_port"]) == ("1:2", 29511), facts
    assert command[:3] == ["torchrun", "--nnodes=1", "--node-rank=0"] and "--rdzv-backend=c10d" not in command
    assert not {"--master-addr=127.0.0.1", "--master-port=29511"} & set(command), command
    path, line = recovery_of(dry_run({"RECOVERY": "restart"}, "--model", "cnn"))
    assert path == "restart" and line.endswith("(RECOVERY=restart)"), line


def test_a_thin_wrapper_around_a_loop_of_its_own_modules_recovers_in_place(tmp_path):
    """The launcher reads the script's source for the loop pieces, and those of the modules it imports from its own
    folder: a wrapper (`from my_train import main; main()`), a package beside it reached by a relative import, and
    `-m` of a module in the working directory recover in place; a wrapper whose own module steps by hand does not,
    and an installed package's loop (trainer's own) is not the script's."""
    loop = ("from trainer import api\n\ndef main():\n    with api.Run() as run:\n        for micro in run.steps(loader):\n"
            "            run.optimizer_step(optimizer)\n")
    (tmp_path / "my_train.py").write_text(loop)
    (tmp_path / "thin.py").write_text("from my_train import main\n\nmain()\n")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "entry.py").write_text("from . import loop\n\nloop.main()\n")
    (tmp_path / "pkg" / "loop.py").write_text(loop)
    (tmp_path / "thin_pkg.py").write_text("import pkg.entry\n")
    (tmp_path / "by_hand.py").write_text("from trainer import api\n\ndef main():\n    run.step(loss=1.0)\n")
    (tmp_path / "thin_by_hand.py").write_text("from by_hand import main\n\nmain()\n")
    (tmp_path / "thin_installed.py").write_text("from trainer.engine import loop\n\nloop.main()\n")
    for script in ("thin.py", "thin_pkg.py"):
        path, line = recovery_of(dry_run({}, str(tmp_path / script)))
        assert path == "in-place", (script, line)
    path, line = recovery_of(dry_run({}, "-m", "pkg.entry", cwd=tmp_path))
    assert path == "in-place", line
    for script in ("thin_by_hand.py", "thin_installed.py"):
        path, line = recovery_of(dry_run({}, str(tmp_path / script)))
        assert path == "restart" and f"{script} does not train through trainer.api's run.steps()" in line, line


def test_on_gpus_an_elastic_job_recovers_in_place_only_when_asked():
    """A GPU path no GPU has run is not a default: with GPUs on the host, RECOVERY unset takes the restart path and
    says why; RECOVERY=in-place asks for it."""
    from trainer.cluster.launch import build_command

    env = {"NNODES": "1:2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29512"}
    unset = build_command(env, ["--model", "cnn"], gpu_count=lambda: 2).recovery
    assert not unset.in_place and "in-place recovery has not run on a GPU yet" in unset.line(), unset.line()
    assert build_command({**env, "RECOVERY": "in-place"}, ["--model", "cnn"], gpu_count=lambda: 2).recovery.in_place
    assert build_command(env, ["--model", "cnn"], gpu_count=lambda: 0).recovery.in_place  # CPUs: the default


def test_without_torchft_an_elastic_job_takes_the_restart_path_and_says_so(tmp_path):
    """A host without torchft (a dependency, removed by hand): torchft hidden from the launcher's Python."""
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['torchft'] = None\n")
    path, line = recovery_of(dry_run({}, "--model", "cnn", pythonpath=str(tmp_path)))
    assert path == "restart" and "torchft is not installed (pip install 'torchft>=0.2,<0.3', a dependency of the trainer)" in line, line


def test_a_torchft_release_the_code_does_not_know_is_refused_in_one_line_naming_it(tmp_path):
    """torchft's API moved between releases (its Manager's arguments, the group's configure that inplace.py
    overrides): a release outside the tested range is one line and exit 2 before any worker starts, not a crash or a
    silently wrong step mid-run; RECOVERY=restart does not need it."""
    info = tmp_path / "torchft-0.9.1.dist-info"  # what pip leaves for an installed torchft 0.9.1, ahead on the path
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torchft\nVersion: 0.9.1\n")
    done = dry_run({}, "--model", "cnn", pythonpath=str(tmp_path))
    assert done.returncode == 2 and error_lines(done.stderr) == [
        "error: RECOVERY: in-place recovery runs on torchft 0.2.x, and this host has torchft 0.9.1 (pip install "
        "'torchft>=0.2,<0.3', or RECOVERY=restart for the restart path)"], done.stderr
    path, _ = recovery_of(dry_run({"RECOVERY": "restart"}, "--model", "cnn", pythonpath=str(tmp_path)))
    assert path == "restart"


@pytest.mark.slow
def test_the_torchft_ddp_wrapper_probe_says_in_one_line_whether_the_survivor_of_a_peers_loss_went_on(tmp_path):
    """bench/torchft_ddp_crash.py, why inplace.py sums by hand: torchft's own DDP wrapper, two real replica groups and
    a real lighthouse, one replica SIGKILLed while the other waits in the wrapper's comm hook. Either verdict passes
    (torchft 0.2.0's survivor crashes; a later torchft's may go on); the probe must reach one, quickly, and exit 0."""
    from importlib import metadata

    from helpers import clean_env

    began = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "bench.torchft_ddp_crash", "--start-s", "40", "--after-s", "15",
                           "--keep", str(tmp_path)], cwd=REPO, env=clean_env(), capture_output=True, text=True,
                          timeout=90)
    took = time.monotonic() - began
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert len(lines) == 1, done.stdout
    version = re.escape(metadata.version("torchft"))
    crashed = re.fullmatch(rf"torchft {version}: the survivor crashed at the peer's loss \((exit \d+|killed by SIG\w+), "
                           r"\d+ steps? after it; its last before it: \d+\): (?P<error>\w+.*)", lines[0])
    went_on = re.fullmatch(rf"torchft {version}: the survivor went on, (?P<steps>\d+) steps after the peer's loss "
                           r"\(.*\): the wrapper may replace the hand-made sum", lines[0])
    assert crashed or went_on, lines[0]
    if crashed:  # the survivor's own error, from its stderr, and its peer's kill came while both trained
        assert "(nothing on stderr)" not in crashed["error"], lines[0]
        assert (tmp_path / "replica1.out").read_text().splitlines()[-1].endswith("held after the forward pass")
    else:
        assert int(went_on["steps"]) >= 5, lines[0]
    assert took < 60, f"the probe took {took:.0f} s"


def test_the_torchft_ddp_wrapper_probe_that_cannot_run_exits_1_with_why_and_no_verdict(tmp_path):
    """The probe's only failure is not running at all (its verdicts exit 0): torchft hidden from its processes."""
    from helpers import clean_env

    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['torchft'] = None\n")
    done = subprocess.run([sys.executable, "-m", "bench.torchft_ddp_crash", "--start-s", "20"], cwd=REPO,
                          env=clean_env({"PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and done.stdout == "", (done.stdout, done.stderr)
    assert re.fullmatch(r"error: the lighthouse did not answer at 127\.0\.0\.1:\d+ \(ModuleNotFoundError: .*torchft.*\)\n",
                        done.stderr), done.stderr


def test_an_unknown_recovery_is_one_line_and_exit_2():
    done = dry_run({"RECOVERY": "sometimes"}, "--model", "cnn")
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        "error: RECOVERY: 'sometimes' is not one of in-place, restart (in-place keeps the processes when a host goes "
        "or comes (seconds per change); restart starts every host's workers again from the newest checkpoint)"]


@pytest.mark.parametrize("value", ["10.0.0.1,,10.0.0.2", "10.0.0.1,10.0.0.1", "10.0.0.1 10.0.0.2"])
def test_lighthouse_hosts_that_is_not_a_list_of_hosts_is_one_line_and_exit_2(value):
    done = dry_run({"LIGHTHOUSE_HOSTS": value}, "--model", "cnn")
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        f"error: LIGHTHOUSE_HOSTS: '{value}' is not a list of hosts (name the hosts that run a lighthouse, in order, "
        "comma-separated and each once (e.g. 10.0.0.1,10.0.0.2), the same on every host; each listens at "
        "MASTER_PORT)"], done.stderr


def test_an_in_place_job_says_it_runs_no_c10d_rendezvous(tmp_path):
    """In place no c10d rendezvous runs across the hosts (each host's group is its own; the lighthouse's quorum says
    who trains each step): --dry-run's facts and the topology line a start prints say so (the restart path's stay
    as they were). The start is stopped at once by an HTTP server at MASTER_PORT, after its first two lines."""
    import json

    facts = json.loads(dry_run({"MASTER_PORT": "29513"}, "--model", "cnn").stdout)
    assert (facts["node_rank"], facts["rendezvous"]) == ("none (in place: each host is a group of its own)",
                                                         "none (in place: torchft's lighthouse decides who trains "
                                                         "each step)"), facts
    facts = json.loads(dry_run({"MASTER_PORT": "29513", "RECOVERY": "restart"}, "--model", "cnn").stdout)
    assert (facts["node_rank"], facts["rendezvous"]) == ("assigned by the rendezvous", "c10d"), facts
    from helpers import clean_env

    port = free_port()
    other = subprocess.Popen([sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: subprocess.run(["curl", "-s", "-o", "/dev/null", f"http://127.0.0.1:{port}/"]
                                          ).returncode == 0, 30, "the HTTP server")
        env = clean_env({"NNODES": "1:2", "NPROC_PER_NODE": "1", "MASTER_ADDR": "127.0.0.1",
                         "MASTER_PORT": str(port), "PREFLIGHT": "0"})
        done = subprocess.run([sys.executable, "-m", "trainer.cli.launch", "--model", "cnn"], env=env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=120)
    finally:
        other.kill()
        other.wait()
    assert done.returncode == 2 and done.stderr.splitlines()[0] == (
        f"topology: nnodes=1:2 (elastic, in place: torchft's lighthouse at 127.0.0.1:{port} decides who trains each "
        "step; no c10d rendezvous, each host a group of its own) nproc_per_node=1 world_size=1..2 (source: explicit)"
    ), done.stderr


def test_recovery_in_place_asked_of_a_job_of_a_fixed_size_is_one_line_not_an_error():
    """RECOVERY has no effect on a job of a fixed NNODES: said in one line, and the job runs as asked."""
    line = ("warning: RECOVERY: in-place has no effect with a fixed number of hosts ({}): a job of a fixed size "
            "restarts its workers after a failure (MAX_RESTARTS); in place needs NNODES=MIN:MAX (e.g. 1:2), where the "
            "hosts left go on without a lost one")
    done = dry_run({"NNODES": "2", "NODE_RANK": "0", "MASTER_ADDR": "10.0.0.1", "RECOVERY": "in-place"},
                   "--model", "cnn")
    assert done.returncode == 0 and done.stderr.splitlines() == [line.format("NNODES=2")], done.stderr
    done = dry_run({"NNODES": "", "MASTER_ADDR": "", "RECOVERY": "in-place"}, "--model", "cnn")
    assert done.returncode == 0 and done.stderr.splitlines() == [line.format("NNODES unset: one host")], done.stderr
    for quiet in ({"NNODES": "2", "NODE_RANK": "0", "MASTER_ADDR": "10.0.0.1"},  # RECOVERY unset: nothing asked
                  {"NNODES": "2", "NODE_RANK": "0", "MASTER_ADDR": "10.0.0.1", "RECOVERY": "restart"},
                  {"RECOVERY": "in-place"}):  # NNODES=1:2: in place
        done = dry_run(quiet, "--model", "cnn")
        assert done.returncode == 0 and not done.stderr.strip(), (quiet, done.stderr)


def test_no_quorum_is_said_in_plain_words_not_grpcs_status_text():
    """torchft's real error when a quorum never comes (a lighthouse that needs two hosts, asked by one), as the
    worker's Manager gets it from its Rust client: gRPC's status text becomes its message."""
    from datetime import timedelta

    from torchft._torchft import LighthouseServer, ManagerClient, ManagerServer

    from trainer.engine.inplace import said

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=100)
    manager = ManagerServer(replica_id="a", lighthouse_addr=lighthouse.address(), hostname="127.0.0.1",
                            bind="[::]:0", store_addr="127.0.0.1:1", world_size=1,
                            heartbeat_interval=timedelta(milliseconds=100), connect_timeout=timedelta(seconds=5),
                            quorum_retries=0)
    try:
        with pytest.raises(Exception) as caught:
            ManagerClient(manager.address(), connect_timeout=timedelta(seconds=5))._quorum(
                group_rank=0, step=0, checkpoint_metadata="", shrink_only=False, timeout=timedelta(seconds=1),
                commit_failures=0, init_sync=True)
    finally:
        manager.shutdown()
        lighthouse.shutdown()
    assert str(caught.value).startswith("status: Cancelled, message: \"Timeout expired\", details: [], metadata: "
                                        "MetadataMap {"), str(caught.value)  # what the line said before
    assert said(caught.value) == "Timeout expired"
    unavailable = RuntimeError('status: Unavailable, message: "error trying to connect: tcp connect error: Connection '
                               'refused (os error 111)", details: [], metadata: MetadataMap { headers: {"content-type"'
                               ': "application/grpc"} }')
    assert said(unavailable) == "error trying to connect: tcp connect error: Connection refused (os error 111)"
    assert said(RuntimeError('status: DeadlineExceeded, message: "", details: [], metadata: MetadataMap { headers: {} '
                             '}')) == "deadline exceeded"


def test_only_the_two_known_cxx_warnings_are_dropped():
    """fd 2 caught around a worker's start (C++ writes there directly): the two known lines go, any other stays."""
    code = ("import os\nfrom trainer.parallel.known_warnings import fd2_without\nwith fd2_without():\n"
            "    os.write(2, b'[W1128 14:46:50.084983427 socket.cpp:207] [c10d] The hostname of the client socket "
            "cannot be retrieved. err=-3\\n')\n"
            "    os.write(2, b'[W1128 14:59:39.023591077 Backend.hpp:556] Warning: another C++ warning\\n')\n"
            "    os.write(2, b'[rank0]:[W1128 14:52:31.839622740 Backend.hpp:556] Warning: setSequenceNumberForGroup() "
            "is deprecated and is now a no-op; sequence numbers always start at 0 on every rank. (function "
            "operator())\\n')\n")
    from helpers import clean_env

    done = subprocess.run([sys.executable, "-c", code], env=clean_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stderr.splitlines() == [
        "[W1128 14:59:39.023591077 Backend.hpp:556] Warning: another C++ warning"], done.stderr


@pytest.mark.slow
def test_a_lighthouse_that_cannot_be_reached_is_one_line_naming_it_and_exit_2_before_training(hosts, tmp_path,
                                                                                               launches):
    """The second host alone: nothing listens at MASTER_ADDR:MASTER_PORT on the first."""
    port = free_port()
    alone = host(tmp_path, port, "hostB", hosts[1], RDZV_TIMEOUT="4")
    launches.append(alone)
    assert alone.wait(60) == 2, alone.output()
    errors = [line for line in alone.output().splitlines() if line.startswith("error: ")]
    assert errors == [f"error: MASTER_ADDR: the lighthouse at http://{MASTER_ADDR}:{port} cannot be reached (Connection "
                      "refused; waited RDZV_TIMEOUT, 4 s) (start trainer-launch on the MASTER_ADDR host first (it runs "
                      "the lighthouse), or check MASTER_ADDR, MASTER_PORT and the firewall between the hosts; "
                      "RECOVERY=restart takes the restart path instead)"], alone.output()
    assert not (tmp_path / "checkpoints").exists() and not list(tmp_path.glob("seen-*"))


@pytest.mark.slow
def test_a_lighthouse_that_answered_this_job_before_and_cannot_be_reached_now_is_exit_1_not_a_settings_mistake(
        hosts, tmp_path, launches):
    """A host started again (a worker pod rescheduled) while the job's lighthouse is down: its checkpoint directory
    holds this job's claim and generations (as the job's first run left them, made here with the store's own
    functions), so what is missing is the infrastructure, and a restart policy may retry: exit 1, one line."""
    from trainer.checkpoint.store import claim, next_generation
    from trainer.cluster.lighthouse import identity

    port = free_port()
    directory = tmp_path / "checkpoints"
    directory.mkdir()
    claim(directory, job=identity(MASTER_ADDR, port)).close()
    next_generation(directory)
    args = ("--model", "cnn", "--synthetic-size", "64", "--checkpoint-dir", str(directory), "--log-dir",
            str(tmp_path / "runs"))
    alone = Launch(args, tmp_path, inplace_env(port, hosts[1], RDZV_TIMEOUT="4"), name="hostB", prefix=hosts[1].prefix)
    launches.append(alone)
    assert alone.wait(60) == 1, alone.output()
    errors = [line for line in alone.output().splitlines() if line.startswith("error: ")]
    assert errors == [f"error: in place: the lighthouse at http://{MASTER_ADDR}:{port} cannot be reached (Connection "
                      f"refused; waited RDZV_TIMEOUT, 4 s), and this job trained in {directory} before: its host is "
                      "down or cut off, not a mistake in the settings (start it again, or mend the network between "
                      "the hosts; this launcher exits 1, which a restart policy retries)"], alone.output()
    assert not list(directory.glob("step-*")) and not (tmp_path / "runs").exists()


# Accepts every connection and never says a word (holds them open): a service that waits for its client to speak.
SILENT_LISTENER = ("import socket, sys\nserver = socket.create_server((sys.argv[1], int(sys.argv[2])))\nheld = []\n"
                   "while True:\n    held.append(server.accept())\n")


@pytest.mark.slow
def test_something_else_at_the_lighthouses_port_is_one_line_and_exit_2_at_once(hosts, tmp_path, launches):
    """A plain HTTP server, or a listener that says nothing, at MASTER_ADDR:MASTER_PORT is not torchft's lighthouse:
    refused at once in one line (it was taken for the lighthouse, and the workers sat silent in their quorum), from
    another host and from the MASTER_ADDR host; there also a server that holds the port on another address of the
    host (the launcher's own lighthouse cannot have it, and nothing answers at MASTER_ADDR)."""
    port = free_port()
    http_server = [sys.executable, "-m", "http.server", "--bind"]
    cases = [("http", [*http_server, MASTER_ADDR, str(port)], r"HTTP 200 OK from SimpleHTTP/[\d.]+ Python/[\d.]+",
              hosts),
             ("silent", [sys.executable, "-c", SILENT_LISTENER, MASTER_ADDR, str(port)],
              r"it accepted the connection but gave no answer in \d+ s", hosts),
             ("elsewhere", [*http_server, "127.0.0.1", str(port)],
              re.escape(f"nothing does (Connection refused), and another process on this host holds port {port}"),
              hosts[:1])]
    for what, command, words, wheres in cases:
        other = subprocess.Popen([*hosts[0].prefix, *command], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_until(lambda at=command[-2]: lighthouse_answers(hosts[0], port, at), 30, what)
            for where in reversed(wheres):  # another host; the MASTER_ADDR host
                launch = host(tmp_path, port, f"{what}-{where.node_rank}", where, RDZV_TIMEOUT="120")
                launches.append(launch)
                assert launch.wait(60) == 2, launch.output()
                assert time.monotonic() - launch.started < 30, what  # not RDZV_TIMEOUT's 120 s
                errors = [line for line in launch.output().splitlines() if line.startswith("error: ")]
                assert len(errors) == 1 and re.fullmatch(
                    re.escape(f"error: MASTER_ADDR: what answers at http://{MASTER_ADDR}:{port} is not torchft's "
                              "lighthouse (") + words + re.escape(") (another service holds MASTER_PORT on the "
                                                                  "MASTER_ADDR host; choose another MASTER_PORT, the "
                                                                  "same on every host, or stop it)"), errors[0]), \
                    launch.output()
                assert not [line for line in launch.output().splitlines() if line.startswith("+ ")]  # no worker
                assert "Traceback" not in launch.output(), launch.output()
        finally:
            other.kill()
            other.wait()
    assert not (tmp_path / "checkpoints").exists() and not list(tmp_path.glob("seen-*"))


def test_a_lighthouse_whose_port_is_taken_is_one_line_and_exit_2():
    """Run on its own (compose's service, by hand) on a port something else holds: one line, not torchft's
    RuntimeError traceback. (The launcher's own lighthouse exits quietly there: the launcher's line says what.)"""

    from helpers import clean_env

    with socket.create_server(("127.0.0.1", 0)) as held:
        port = held.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "trainer.cluster.lighthouse", "--port", str(port)],
                              env=clean_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stderr.splitlines() == [
        f"error: --port: {port} is taken on this host (Address already in use) (stop what holds it, or choose another "
        "port, the job's MASTER_PORT on every host)"], done.stderr


def test_a_lighthouse_lost_for_good_ends_each_host_with_exit_1_naming_it_not_as_a_mistake_in_the_settings(
        hosts, tmp_path, launches):
    """The lighthouse on its own (compose's service) SIGKILLed while two hosts train, and not started again: each
    host's quorum fails, its restart finds no lighthouse either, and each launcher ends with exit 1, restartable
    (Compose's on-failure, Kubeflow's retry policy), its lines naming the lighthouse's address. It was exit 2 and
    "a mistake in the settings is not restarted" (issue 43)."""
    port = free_port()
    lighthouse = standalone_lighthouse(hosts[0], port, tmp_path)
    try:
        nodes = [host(tmp_path, port, f"host{name}", where, samples=SAMPLES * 8, MAX_RESTARTS="1")
                 for name, where in zip("AB", hosts)]
        launches.extend(nodes)
        wait_until(lambda: all(generations(node.output())[-1:] and generations(node.output())[-1][1] == 2
                               for node in nodes), RUN_BOUND_S, "both hosts training together")
    finally:
        lighthouse.kill()
        lighthouse.wait()
    for node in nodes:
        assert node.wait(RUN_BOUND_S) == 1, node.output()[-4000:]
        output = node.output()
        assert "mistake in the settings" not in output and "Traceback" not in output, output[-4000:]
        assert f"the lighthouse at http://{MASTER_ADDR}:{port}" in error_lines(output)[-1] or any(
            f"the lighthouse at http://{MASTER_ADDR}:{port} answers no more" in line
            for line in error_lines(output)), output[-4000:]


def committed_lines(out: Path) -> int:
    """The committed steps' lines the workers wrote so far (one per rank and step)."""
    return sum(p.read_bytes().count(b"\n") for p in out.glob("seen-*.txt"))


class Commits:
    """When the committed steps' lines grew, sampled every 50 ms on a thread of the test's until stop()."""

    def __init__(self, out: Path):
        import threading

        self.out, self.times, self.running = out, [], True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()

    def _sample(self) -> None:
        count = committed_lines(self.out)
        while self.running:
            now = committed_lines(self.out)
            if now > count:
                self.times.append(time.monotonic())
                count = now
            time.sleep(0.05)

    def stop(self) -> None:
        self.running = False
        self.thread.join()

    def longest_gap(self, since: float) -> float:
        """The longest time without a new committed line from `since` to the last one (a gap open at `since` included)."""
        times = [since, *(t for t in self.times if t > since)]
        return max(b - a for a, b in zip(times, times[1:]))


@pytest.mark.slow
def test_a_lighthouse_killed_and_started_again_is_rejoined_in_place_with_no_worker_restarted(hosts, tmp_path,
                                                                                            launches):
    """The lighthouse on its own (compose's service) SIGKILLed while two hosts train, started again 3 s later: each
    host keeps its processes, says once that it waits for the lighthouse, and rejoins it (torchft's quorum retries);
    the longest gap between committed steps is seconds, the job's generations only grow, and every step trains in
    its exact order. It was 305 s without a step (each host waited out its quorum's timeout), then every worker
    restarted; or, restarted sooner, the generations went back (2 -> 1) and every host fenced itself (issue 43)."""
    port = free_port()
    samples = SAMPLES * 2
    lighthouse = standalone_lighthouse(hosts[0], port, tmp_path)
    commits = None
    try:
        nodes = [host(tmp_path, port, f"host{name}", where, samples=samples) for name, where in zip("AB", hosts)]
        launches.extend(nodes)
        wait_until(lambda: all(generations(node.output())[-1:] and generations(node.output())[-1][1] == 2
                               for node in nodes) and committed_lines(tmp_path) >= 40, RUN_BOUND_S,
                   "both hosts training together")
        pids = [worker_pid(node) for node in nodes]
        commits = Commits(tmp_path)
        lighthouse.kill()
        lighthouse.wait()
        killed = time.monotonic()
        time.sleep(3)
        lighthouse = standalone_lighthouse(hosts[0], port, tmp_path)
        back = committed_lines(tmp_path)
        wait_until(lambda: committed_lines(tmp_path) >= back + 20, RUN_BOUND_S,
                   f"the hosts training again\n{nodes[0].output()[-3000:]}\n{nodes[1].output()[-3000:]}")
        assert [workers(node) for node in nodes] == [[pid] for pid in pids]  # the same processes, none restarted
        commits.stop()
        gap = commits.longest_gap(killed)
        print(f"the longest gap between committed steps from the lighthouse's kill: {gap:.1f} s (3 s of it without "
              "a lighthouse)")
        # The goal is <= 5 s (issue 43); this bound leaves room for a loaded 2-core machine. Before: 305 s.
        assert gap < 25, gap
        for node in nodes:
            assert node.wait(RUN_BOUND_S) == 0, node.output()[-4000:]
    finally:
        if commits is not None:
            commits.stop()
        lighthouse.kill()
        lighthouse.wait()
    for node in nodes:
        output = node.output()
        assert "restart 1 of" not in output and "Traceback" not in output and "error:" not in output, output[-4000:]
        numbers = [g for g, _ in generations(output)]
        assert numbers == sorted(set(numbers)), generations(output)  # only growing
        assert output.count(f"waiting for the lighthouse at http://{MASTER_ADDR}:{port}") == 1, output[-4000:]
    assert sorted(seen(tmp_path)) == sorted(pids)  # no other worker trained a step
    steps = samples // 2 // SHARE_BATCH
    check_the_order(tmp_path, pids[0], steps, samples=samples)
    assert newest_step(tmp_path / "checkpoints") == steps
    assert read_summary(tmp_path / "runs")["status"] == "completed"


@pytest.mark.slow
def test_a_host_frozen_across_a_restart_of_the_lighthouse_is_fenced_when_thawed(hosts, tmp_path, launches):
    """SIGSTOP a host's worker, then kill the lighthouse and start it again 3 s later: the other host rejoins it alone
    (once the frozen one's heartbeats are missed) in a newer generation than any before, though the new lighthouse
    numbers its quorums from 1 again. SIGCONT: the frozen host finds that newer generation, leaves with one line,
    and its launcher starts it again; no step is committed twice, from two generations."""
    port = free_port()
    samples = SAMPLES * 2
    lighthouse = standalone_lighthouse(hosts[0], port, tmp_path)
    try:
        nodes = [host(tmp_path, port, f"host{name}", where, samples=samples) for name, where in zip("AB", hosts)]
        launches.extend(nodes)
        other, frozen_host = nodes
        wait_until(lambda: all(generations(node.output())[-1:] and generations(node.output())[-1][1] == 2
                               for node in nodes) and committed_lines(tmp_path) >= 20, RUN_BOUND_S,
                   "both hosts training together")
        survivor, frozen = worker_pid(other), worker_pid(frozen_host)
        together = generations(other.output())[-1][0]
        stopped = [frozen, *descendants(frozen)]
        for pid in stopped:
            os.kill(pid, signal.SIGSTOP)
        try:
            lighthouse.kill()
            lighthouse.wait()
            time.sleep(3)
            lighthouse = standalone_lighthouse(hosts[0], port, tmp_path)
            wait_until(lambda: generations(other.output())[-1][1] == 1, RUN_BOUND_S,
                       f"the other host alone\n{other.output()[-3000:]}")
            alone = committed_lines(tmp_path)
            wait_until(lambda: committed_lines(tmp_path) >= alone + 5, RUN_BOUND_S, "steps trained alone")
        finally:
            for pid in stopped:
                os.kill(pid, signal.SIGCONT)
        assert generations(other.output())[-1][0] > together, generations(other.output())
        assert other.wait(RUN_BOUND_S) == 0, other.output()[-4000:]
        assert frozen_host.wait(RUN_BOUND_S) == 0, frozen_host.output()[-4000:]
    finally:
        lighthouse.kill()
        lighthouse.wait()
    lines = [line for line in frozen_host.output().splitlines()
             if line.startswith("error: in place: this host came back")]
    assert len(lines) == 1, frozen_host.output()[-4000:]
    output = other.output()
    assert "restart 1 of" not in output and "Traceback" not in output, output[-4000:]
    numbers = [g for g, _ in generations(output)]
    assert numbers == sorted(set(numbers)), generations(output)  # only growing
    steps = samples // 2 // SHARE_BATCH
    check_the_order(tmp_path, survivor, steps, samples=samples)  # each step trained once, in its exact order
    assert newest_step(tmp_path / "checkpoints") == steps
    assert read_summary(tmp_path / "runs")["status"] == "completed"


def lighthouse_beside(launch: Launch) -> list[int]:
    """The lighthouse processes the launcher runs beside itself now."""
    found = []
    for pid in children(launch.pid):
        try:
            if b"trainer.cluster.lighthouse" in Path(f"/proc/{pid}/cmdline").read_bytes() and running(pid):
                found.append(pid)
        except OSError:
            continue
    return found


@pytest.mark.slow
def test_the_lighthouse_beside_a_launcher_is_started_again_when_it_dies_and_the_hosts_rejoin_it(hosts, tmp_path,
                                                                                               launches):
    """The launcher on the MASTER_ADDR host runs the lighthouse beside itself: SIGKILLed, it is started again on the
    same port, and both hosts rejoin it with the workers they had, and finish."""
    port = free_port()
    first = host(tmp_path, port, "hostA", hosts[0])  # at MASTER_ADDR: the lighthouse runs beside it
    launches.append(first)
    time.sleep(2)
    second = host(tmp_path, port, "hostB", hosts[1])
    launches.append(second)
    nodes = [first, second]
    wait_until(lambda: all(generations(node.output())[-1:] and generations(node.output())[-1][1] == 2
                           for node in nodes) and committed_lines(tmp_path) >= 20, RUN_BOUND_S,
               "both hosts training together")
    pids = [worker_pid(node) for node in nodes]
    (killed,) = lighthouse_beside(first)
    os.kill(killed, signal.SIGKILL)
    wait_until(lambda: [pid for pid in lighthouse_beside(first) if pid != killed], 30, "the lighthouse started again")
    back = committed_lines(tmp_path)
    wait_until(lambda: committed_lines(tmp_path) >= back + 20, RUN_BOUND_S,
               f"the hosts training again\n{first.output()[-3000:]}\n{second.output()[-3000:]}")
    assert [workers(node) for node in nodes] == [[pid] for pid in pids]
    for node in nodes:
        assert node.wait(RUN_BOUND_S) == 0, node.output()[-4000:]
        assert "restart 1 of" not in node.output() and "Traceback" not in node.output(), node.output()[-4000:]
    assert "the lighthouse beside this launcher ended (signal SIGKILL): starting it again on port " \
        f"{port}" in first.output(), first.output()[-4000:]
    assert sorted(seen(tmp_path)) == sorted(pids)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_lighthouse_on_its_own_stops_at_once_with_exit_0(sig):
    """docker stop (SIGTERM) and Ctrl-C (SIGINT) end the service's lighthouse at once, exit 0, as any service's stop:
    its server's threads held the interpreter (Ctrl-C went unheard), and a stop was reported as a death by SIGTERM."""
    from helpers import clean_env

    from trainer.cluster import lighthouse

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "trainer.cluster.lighthouse", "--port", str(port)], env=clean_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: lighthouse.answers("127.0.0.1", port) is None, 60, "the lighthouse to answer")
        began = time.monotonic()
        proc.send_signal(sig)
        assert proc.wait(timeout=20) == 0, proc.stdout.read().decode(errors="replace")
        assert time.monotonic() - began < 5
    finally:
        proc.kill()
        proc.wait()


# ------------------------------------------------------------------------------------------------ helpers

def standalone_lighthouse(where: Host, port: int, out: Path) -> subprocess.Popen:
    """The lighthouse on its own, as compose.multinode.yaml's service runs it: the launchers use the one that
    answers at MASTER_ADDR:MASTER_PORT."""
    log = open(out / "lighthouse.log", "wb")  # noqa: SIM115 (the lighthouse writes it until the test ends)
    proc = subprocess.Popen([*where.prefix, sys.executable, "-m", "trainer.cluster.lighthouse", "--port", str(port),
                             "--join-timeout", "10"], stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONPATH": str(REPO), "RUST_LOG": "info"})
    STANDALONE.append(proc)
    wait_until(lambda: lighthouse_answers(where, port), 30, "the lighthouse to answer")
    return proc


STANDALONE: list[subprocess.Popen] = []  # the standalone lighthouses a test started: stopped when it ends


@pytest.fixture(autouse=True)
def _no_lighthouse_left():
    """A standalone lighthouse left running outlives its test's network namespace (its parent is init then): each
    one a test started is killed when the test ends, passed or failed (slow_starters' were left running for
    good, three per run of this file, ticking on the machine's cores through the runs after it)."""
    yield
    while STANDALONE:
        proc = STANDALONE.pop()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def lighthouse_answers(where: Host, port: int, address: str = MASTER_ADDR) -> bool:
    probe = f"import socket; socket.create_connection(('{address}', {port}), timeout=1)"
    return subprocess.run([*where.prefix, sys.executable, "-c", probe], capture_output=True).returncode == 0


def test_the_sum_over_the_hosts_is_ddps_to_the_bit_at_two_hosts_and_rounds_otherwise_at_three():
    """The limit docs/elastic.md states, measured in real gloo processes (tests/user_code/sum_arithmetic.py): the
    in-place sum (GradientSum's: each host's gradients scaled by its share of the largest world as they are copied
    in, then summed over the hosts) against DDP's (each rank's scaled by 1/world, then summed in gloo's ring order,
    which follows the element's place in DDP's bucket). At two hosts they are one rounding either way, after a loss
    too: equal, and so are the weights after 30 steps. At three the order of three terms matters, and after a loss
    the survivor's two shares are scaled as their sum (four: the scaling is exact, the order is not; the script
    measures it too, docs/elastic.md has its numbers). If this ever comes out equal at three, docs/elastic.md's
    limit is wrong: say so there."""
    import json

    found = {}
    for world in (2, 3):
        done = subprocess.run([sys.executable, str(USER_CODE / "sum_arithmetic.py"), str(world), "30",
                               str(free_port())], capture_output=True, text=True, timeout=RUN_BOUND_S)
        assert done.returncode == 0, done.stderr[-3000:]
        found[world] = json.loads(done.stdout.splitlines()[-1])
    assert found[2]["first_sum"] == found[2]["after_a_loss"] == found[2]["weights"] == [0, 0.0], found[2]
    differing, most = found[3]["first_sum"]
    assert differing > 0 and most < 1e-7, found[3]  # a last bit of about half the elements
    assert found[3]["after_a_loss"][0] > 0 and found[3]["weights"][0] > 0, found[3]


# ------------------------------------------------------------------------------------------------ no single host

def two_lighthouses(hosts) -> str:
    """LIGHTHOUSE_HOSTS naming both hosts, MASTER_ADDR's first: each launcher runs a lighthouse beside it."""
    return ",".join(where.address for where in hosts)


def training_at_two_lighthouses(hosts, tmp_path: Path, launches: list, samples: int, committed: int
                                ) -> tuple[Launch, Launch, int]:
    """Two hosts of LIGHTHOUSE_HOSTS naming both, MASTER_ADDR's first, once both train together and `committed` steps
    were written; and their MASTER_PORT."""
    port = free_port()
    both = two_lighthouses(hosts)
    first = host(tmp_path, port, "hostA", hosts[0], samples=samples, LIGHTHOUSE_HOSTS=both)
    launches.append(first)
    time.sleep(2)
    second = host(tmp_path, port, "hostB", hosts[1], samples=samples, LIGHTHOUSE_HOSTS=both)
    launches.append(second)
    wait_until(lambda: all(generations(node.output())[-1:] and generations(node.output())[-1][1] == 2
                           for node in (first, second)) and committed_lines(tmp_path) >= committed, RUN_BOUND_S,
               "both hosts training together")
    return first, second, port


@pytest.mark.slow
def test_the_master_addr_host_lost_for_good_leaves_the_other_training_within_seconds_on_its_own_lighthouse(
        hosts, tmp_path, launches):
    """LIGHTHOUSE_HOSTS names both hosts: the MASTER_ADDR host (its launcher, its worker and the lighthouse beside
    it) SIGKILLed for good while both train; the other host moves to the lighthouse beside its own launcher once the
    job's lease in the checkpoint directory has stopped changing, goes on in its own processes within seconds, and
    finishes, exit 0, every step trained once in its order. It exited (no quorum without the MASTER_ADDR host's
    lighthouse; issue 43)."""
    samples = SAMPLES * 2
    first, second, port = training_at_two_lighthouses(hosts, tmp_path, launches, samples, committed=40)
    survivor = worker_pid(second)
    commits = Commits(tmp_path)
    try:
        first.stop_everything()  # SIGKILL: the launcher, its worker and the lighthouse beside it, for good
        killed = time.monotonic()
        back = committed_lines(tmp_path)
        wait_until(lambda: committed_lines(tmp_path) >= back + 10, RUN_BOUND_S,
                   f"the other host training on\n{second.output()[-3000:]}")
        assert workers(second) == [survivor]  # its own processes, not restarted
    finally:
        commits.stop()
    gap = commits.longest_gap(killed)
    print(f"the longest gap between committed steps from the MASTER_ADDR host's kill: {gap:.1f} s")
    # The goal is <= 10 s (issue 43); this bound leaves room for a loaded 2-core machine.
    assert gap < 20, gap
    assert second.wait(RUN_BOUND_S) == 0, second.output()[-4000:]
    output = second.output()
    assert "restart 1 of" not in output and "Traceback" not in output and "error:" not in output, output[-4000:]
    numbers = [g for g, _ in generations(output)]
    assert numbers == sorted(set(numbers)), generations(output)  # only growing
    assert generations(output)[-1][1] == 1
    urls = [f"http://{where.address}:{port}" for where in hosts]
    assert f"torchft's lighthouses at {urls[0]} or {urls[1]} (LIGHTHOUSE_HOSTS: one in use, the others standing by)" \
        in output, output[:3000]
    assert f"in place: the lighthouse at {urls[0]} does not answer: this host moves to the one at {urls[1]} (the " \
        "job's lease unchanged for " in output, output[-4000:]
    steps = samples // 2 // SHARE_BATCH
    check_the_order(tmp_path, survivor, steps, samples=samples)
    assert newest_step(tmp_path / "checkpoints") == steps
    assert read_summary(tmp_path / "runs")["status"] == "completed"


def committed_by(out: Path, pid: int) -> list[tuple[int, int]]:
    """(world size, step) of each step the worker `pid` committed so far."""
    try:
        return [tuple(map(int, line.split()[:2])) for line in (out / f"seen-{pid}.txt").read_text().splitlines()]
    except OSError:
        return []


@pytest.mark.slow
def test_hosts_cut_apart_with_a_lighthouse_on_each_side_never_train_apart(hosts, tmp_path, launches):
    """LIGHTHOUSE_HOSTS names both hosts, each runs a lighthouse: the network between them cut while both train (a
    split brain: each side reaches a lighthouse of its own). The side with the job's lighthouse (the MASTER_ADDR
    host, whose lease in the shared checkpoint directory keeps changing) trains on alone; the other side does not
    move to its own lighthouse and commits not one step apart. The link back, the cut-off host is fenced (the job
    went on without it), starts again and rejoins; both finish, each step trained once in its order."""
    samples = SAMPLES * 2
    first, second, _ = training_at_two_lighthouses(hosts, tmp_path, launches, samples, committed=20)
    kept, cut_off = worker_pid(first), worker_pid(second)
    cut_side = {cut_off}  # the cut-off host's workers (started again, when fenced)
    hosts[0].link("down")
    try:
        before = len(committed_by(tmp_path, cut_off))

        def apart() -> list[tuple[int, int]]:
            """The steps the cut-off side committed since the cut, but the one in flight at the cut (committed by
            both before it: its line is written after)."""
            cut_side.update(workers(second))
            return committed_by(tmp_path, cut_off)[before + 1:] + \
                [line for pid in cut_side - {cut_off} for line in committed_by(tmp_path, pid)]

        wait_until(lambda: apart() or sum(1 for world, _ in committed_by(tmp_path, kept) if world == 1) >= 30,
                   RUN_BOUND_S, f"the MASTER_ADDR host training alone\n{first.output()[-3000:]}\n"
                   f"{second.output()[-3000:]}")
        time.sleep(5)  # the cut-off side's quorums fail meanwhile (its lighthouse answers it)
        assert apart() == [], (apart(), second.output()[-4000:])
    finally:
        hosts[0].link("up")
    for node in (first, second):
        assert node.wait(RUN_BOUND_S) == 0, node.output()[-4000:]
    assert "moves to the one at" not in second.output(), second.output()[-4000:]
    assert "the job's lease" in second.output(), second.output()[-4000:]
    steps = samples // 2 // SHARE_BATCH
    check_the_order(tmp_path, kept, steps, samples=samples)  # each step trained once, in its exact order
    assert newest_step(tmp_path / "checkpoints") == steps
    assert read_summary(tmp_path / "runs")["status"] == "completed"


def test_each_steps_first_batch_is_read_while_its_quorum_is_asked(hosts, tmp_path, launches):
    """The quorum (a round trip to the lighthouse that waits for every host) off the step's critical path (issue 46,
    item 2): while it is asked, in a thread of its own, the training thread reads the step's first batch at the
    shares it trains now; a quorum that changed them has the batch read again. With --workers 0 the script's reads
    are in the training process, where it sees the quorum's thread (tests/user_code/inplace_loop.py). The order
    of the samples stays exact (check_the_order); the bit-identical tests above run the same path."""
    samples = 1280
    port = free_port()
    first = host(tmp_path, port, "hostA", hosts[0], "--workers", "0", samples=samples)
    launches.append(first)
    second = host(tmp_path, port, "hostB", hosts[1], "--workers", "0", samples=samples)
    launches.append(second)
    for launch in (first, second):
        assert launch.wait(RUN_BOUND_S) == 0, launch.output()[-4000:]
    steps = samples // 2 // SHARE_BATCH
    memberships = max(len(generations(launch.output())) for launch in (first, second))
    files = sorted(tmp_path.glob("reads-*.txt"))
    assert len(files) == 2, files
    for file in files:
        lines = [tuple(map(int, line.split())) for line in file.read_text().splitlines()]
        reads, running = [asked for asked, _ in lines], [alive for _, alive in lines]
        # Each membership's first read is taken after its quorum (its batches start there); every other step's
        # first batch is read while its quorum is asked. A changed membership's batch read beside it is read again.
        assert sum(reads) >= steps - 2 * memberships and reads.count(0) <= memberships + 1, (reads, memberships)
        # And the quorum's thread was seen running during reads (not every one: a quorum every host asked at once may
        # be answered first under load; 27 of 40 on a loaded 2-core machine, nearly all on a quiet one).
        assert sum(running) >= 1, running
    earliest = min(seen(tmp_path).items(), key=lambda item: min(item[1]))[0]  # the host that trained every step
    check_the_order(tmp_path, earliest, steps, samples=samples)
    assert read_summary(tmp_path / "runs")["status"] == "completed"


def test_a_host_of_two_processes_hands_its_ddp_averaged_buckets_to_the_sum_over_the_hosts_during_the_backward():
    """A host of several processes: its own DDP averages each bucket over them (DDP's default all-reduce, or
    shm_allreduce's, chained in GradientSum's comm hook) and hands it over as it is done, so that the sum over the
    hosts overlaps the backward (tests/user_code/host_buckets.py, real gloo processes, a host alone: its sum is its
    own). Every bucket of the sum is launched during the backward, and the gradients come out DDP's to the bit."""
    import json

    port = free_port()
    done = subprocess.run([sys.executable, str(USER_CODE / "host_buckets.py"), str(port)], capture_output=True,
                          text=True, timeout=RUN_BOUND_S, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr[-3000:]
    found = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [f["chained"] for f in found] == ["default", "shm_allreduce"], done.stdout
    for f in found:
        assert f["steps"] == [[2, 2, 0]] * 3, f


def test_without_a_ddp_of_its_own_the_sum_takes_each_gradient_as_the_last_micro_batch_accumulates_it():
    """A model not wrapped in DDP (a strategy that does not replicate): GradientSum's post-accumulate-grad hooks send
    nothing during the micro-batches that accumulate (not armed), and every bucket during the last one's backward;
    the gradients it puts back are the accumulated ones (a host alone: its sum is its own)."""
    from trainer.engine.inplace import GradientSum

    class OneHost:  # torchft's managed allreduce over a group of one host: the bucket as it is, done at once
        launched = 0

        def allreduce(self, tensor, reduce_op=None):
            OneHost.launched += 1
            return type("Summed", (), {"wait": lambda self: True})()

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 90000), torch.nn.ReLU(), torch.nn.Linear(90000, 3))
    summed = GradientSum(list(net.parameters()), OneHost())
    summed.hook_parameters()
    assert len(summed.buckets) == 2
    for accum in (1, 3):
        net.zero_grad()
        for index in range(accum):
            summed.armed = index == accum - 1
            before = OneHost.launched
            torch.nn.functional.cross_entropy(net(torch.randn(16, 8)), torch.randint(0, 3, (16,))).backward()
            assert OneHost.launched - before == (2 if summed.armed else 0)
        accumulated = [p.grad.clone() for p in net.parameters()]
        summed.finish()
        summed.apply()
        summed.new_step()
        assert all(torch.equal(a, p.grad) for a, p in zip(accumulated, net.parameters()))


def test_what_is_summed_stays_the_bucket_when_a_script_re_points_a_gradients_data():
    """After a commit each .grad is its place in the sum's bucket (DDP's gradient_as_bucket_view), but a view of its
    own: a script that re-points a gradient's .data (as old optimizers and gradient surgery do) leaves the sum's
    places where they were, and the next step still sends its gradients, not the last step's."""
    from trainer.engine.inplace import GradientSum

    class OneHost:  # torchft's managed allreduce over a group of one host: the bucket as it is, done at once
        def allreduce(self, tensor, reduce_op=None):
            return type("Summed", (), {"wait": lambda self: True})()

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    params = list(net.parameters())
    summed = GradientSum(params, OneHost())
    summed.hook_parameters()
    for step in range(3):
        net.zero_grad(set_to_none=False)  # the gradients kept, zeroed where they are: in the buckets after a commit
        summed.armed = True
        torch.nn.functional.cross_entropy(net(torch.randn(4, 8)), torch.randint(0, 3, (4,))).backward()
        accumulated = [p.grad.clone() for p in params]
        summed.finish()
        sent = torch.cat([flat for flat, _ in summed.buckets])  # the buckets hold the parameters in reverse order
        assert torch.equal(sent, torch.cat([g.flatten() for g in reversed(accumulated)])), step
        summed.apply()
        summed.new_step()
        assert all(torch.equal(g, p.grad) for g, p in zip(accumulated, params))
        for p in params:
            p.grad.data = p.grad.data.clone()  # a script's own tensor under the same .grad


class _HostAlone:
    """torchft's Manager over a group of one host: a managed allreduce leaves the bucket as it is, done at once; the
    errors reported (a step should_commit() would abandon) kept."""

    def __init__(self):
        self.errors: list[str] = []

    def allreduce(self, tensor, reduce_op=None):
        return type("Summed", (), {"wait": lambda self: True})()

    def report_error(self, err: Exception) -> None:
        self.errors.append(str(err))


class _TwoBuckets(torch.nn.Module):
    """Two buckets in launch order: the last layers' parameters (a first bucket of 1 MiB), then the first layer's.
    spare: a layer registered last and used by no loss here (its gradient never comes: its bucket, the first, is
    launched by finish(), after the backward)."""

    def __init__(self, spare: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.first, self.last = torch.nn.Linear(8, 90000), torch.nn.Linear(90000, 3)
        self.spare = torch.nn.Linear(3, 3) if spare else None

    def forward(self, x):
        return self.last(torch.relu(self.first(x)))

    def loss(self, x, y, part: str):
        # "the whole model": its loss; "the first layer": a loss of the first layer's output alone (an auxiliary one)
        if part == "the whole model":
            return torch.nn.functional.cross_entropy(self(x), y)
        return self.first(x).square().mean()


def test_each_gradient_is_its_place_in_the_bucket_as_soon_as_the_backward_makes_it():
    """DDP's gradient_as_bucket_view, as the gradients arrive: the post-accumulate-grad hook copies each gradient into
    its bucket, scaled by the host's share, and the parameter's .grad is that place from then on (a view of its own),
    so the tensor autograd made is freed in the backward instead of held to the commit (where every gradient was in
    memory twice at the backward's end)."""
    from trainer.engine.inplace import GradientSum

    net = _TwoBuckets()
    params = list(net.parameters())
    summed = GradientSum(params, _HostAlone(), 0.5)
    summed.hook_parameters()
    assert len(summed.buckets) == 2
    places = {id(p): part for _, members in summed.buckets for p, part in members}
    for step in range(2):
        x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
        expected = torch.autograd.grad(torch.nn.functional.cross_entropy(net(x), y), params)
        net.zero_grad(set_to_none=True)  # the optimizer's default: autograd makes new gradients every step
        summed.armed = True
        torch.nn.functional.cross_entropy(net(x), y).backward()
        for p, g in zip(params, expected):
            assert p.grad.is_set_to(places[id(p)]) and p.grad is not places[id(p)], step  # its place, its own view
            assert torch.equal(p.grad, g * 0.5), step  # the host's share, as it went into the bucket
        summed.finish()
        summed.apply()
        summed.new_step()
        assert not summed.stale and summed.views
        assert all(torch.equal(p.grad, g * 0.5) for p, g in zip(params, expected))  # a host alone: its own sum


@pytest.mark.parametrize("set_to_none", [True, False], ids=["gradients made anew", "gradients kept"])
@pytest.mark.parametrize("first, what", [("the whole model", "a bucket launched"),
                                         ("the first layer", "a bucket not launched")])
def test_a_second_backward_in_the_last_micro_batch_abandons_the_step_and_the_next_ones_sum_it_whole(first, what,
                                                                                                    set_to_none):
    """Two backward passes in a step's last micro-batch (a loss of `first`, then the model's): a gradient reported
    twice. Into a bucket already launched, the sum on its way is wrong; into one not launched yet (a layer no loss
    uses holds it back) but already the gradient's place (adopted in the first backward, or kept there since the
    last commit by zero_grad(set_to_none=False)), autograd added the second part to the first one, scaled, and they
    cannot be told apart (scaled again, the sum was silently wrong before). Either way the sum is `stale`: the step
    is abandoned (on every host: InPlace.commit sums the flag over the hosts, as
    test_a_second_backward_on_one_host_alone_abandons_the_step_on_every_host shows), and the steps after it sum each
    gradient whole: after the backward, or copied in as often as it changes; the sums are the two backward passes'
    together."""
    from trainer.engine.inplace import GradientSum

    net = _TwoBuckets(spare=what == "a bucket not launched")
    params = list(net.parameters())
    manager = _HostAlone()
    summed = GradientSum(params, manager, 0.5)
    summed.hook_parameters()
    assert len(summed.buckets) == 2
    for step in range(4):
        losses = [first, "the whole model"] if step > 0 else ["the whole model"]  # step 0: one backward, committed
        x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
        parts = [torch.autograd.grad(net.loss(x, y, part), params, allow_unused=True) for part in losses]
        expected = [sum((g for g in gs if g is not None), torch.zeros_like(p)) * 0.5
                    for p, gs in zip(params, zip(*parts))]
        net.zero_grad(set_to_none=set_to_none)
        summed.armed = True
        for part in losses:
            net.loss(x, y, part).backward()
        summed.finish()
        assert manager.errors == []  # a stale sum is InPlace.commit's to sum over the hosts (InPlace._after_gradients)
        if step == 1:  # abandoned: what InPlace.commit() does when should_commit() says False
            assert summed.stale == ("launched" if what == "a bucket launched" else "added to")
            summed.new_step()
            net.zero_grad(set_to_none=True)
            assert (summed.overlap, summed.views) == ((False, True) if what == "a bucket launched" else (True, False))
            continue
        assert summed.stale is None  # the steps before and after it commit
        summed.apply()
        summed.new_step()
        for p, g in zip(params, expected):  # the spare layer: no gradient here nor at a peer, None as it was
            got = torch.zeros_like(p) if p.grad is None else p.grad
            assert torch.allclose(got, g, rtol=1e-6, atol=1e-7), (step, first)
