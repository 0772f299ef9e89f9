"""Lose a host, keep training (docs/reliability.md, "elastic membership" rows): NNODES=MIN:MAX runs torchrun's
c10d rendezvous; a lost host's peers go on at the smaller world size from the newest checkpoint, a host that
returns joins at an agreed step, and across both changes every sample of the epoch is trained on exactly once.

Real launchers, real torchrun elastic agents, real gloo ranks: two hosts in network namespaces joined by a veth
pair (tests/netns.py), sharing a checkpoint directory (as hosts share a network file system), a trainer.api
script that logs what it trains.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections import defaultdict
from pathlib import Path

import pytest
from fault_helpers import Launch, error_lines, running, wait_until
from helpers import REPO, free_port, read_summary
from netns import MASTER_ADDR, Host

USER_CODE = REPO / "tests" / "user_code"
RUN_BOUND_S = 300  # a bound on a hang on a loaded 2-core machine, not a speed goal
SAMPLES, GLOBAL_BATCH = 6400, 32


def elastic_env(port: int, where: Host) -> dict[str, str]:
    # The same settings on every host (but the interface's name): no NODE_RANK, the rendezvous assigns them.
    return {"PREFLIGHT": "0", "NNODES": "1:2", "NPROC_PER_NODE": "1", "MASTER_ADDR": MASTER_ADDR,
            "MASTER_PORT": str(port), "GLOO_SOCKET_IFNAME": where.veth, "TRAIN_BATCH_SIZE": str(GLOBAL_BATCH // 2)}


def host(out: Path, port: int, name: str, where: Host, samples: int = SAMPLES, **env: str) -> Launch:
    """The elastic loop on host `where` (host 0 holds MASTER_ADDR: the rendezvous store is its launcher's)."""
    return Launch([str(USER_CODE / "elastic_loop.py"), "--out", str(out), "--samples", str(samples),
                   "--step-seconds", "0.15"], out, {**elastic_env(port, where), **env}, name=name, prefix=where.prefix)


def committed_lines(out: Path) -> dict[int, list[tuple[int, list[int]]]]:
    """{step: [(world size, indices) per rank]} of the attempt whose work each step kept: the attempt that
    resumed from the latest checkpoint at or before the step (a later attempt replaced what an earlier one
    trained after that checkpoint)."""
    by_step: dict[int, dict[int, list[tuple[int, list[int]]]]] = defaultdict(lambda: defaultdict(list))
    for log in out.glob("seen-*.txt"):
        for line in log.read_text().splitlines():
            start, world, step, *indices = map(int, line.split())
            by_step[step][start].append((world, indices))
    return {step: attempts[max(attempts)] for step, attempts in by_step.items()}


def world_sizes_in(output: str) -> list[int]:
    return [int(line.split("world size ")[1].split()[0]) for line in output.splitlines()
            if "INFO training " in line and "world size " in line]


@pytest.mark.slow
def test_a_lost_host_shrinks_the_job_a_returning_one_grows_it_a_stopped_one_leaves_and_every_sample_is_trained_once(hosts, tmp_path, launches):
    port = free_port()
    first = host(tmp_path, port, "hostA", hosts[0])  # at MASTER_ADDR: it hosts the rendezvous store
    launches.append(first)
    time.sleep(2)
    second = host(tmp_path, port, "hostB", hosts[1])
    launches.append(second)
    checkpoints = tmp_path / "checkpoints"
    # Global rank 0, whose lines say the world size, is on whichever host the rendezvous made node 0 in a round.
    wait_until(lambda: 2 in world_sizes_in(first.output() + second.output()) and any(checkpoints.glob("step-*.pt")),
               RUN_BOUND_S, f"a checkpoint at world size 2\n{first.output()[-3000:]}\n{second.output()[-3000:]}")

    lost_workers = list(second.workers().values())
    os.kill(second.pid, signal.SIGKILL)  # the host is gone: its launcher, and with it its workers
    lost_at = time.monotonic()
    wait_until(lambda: not any(running(p) for p in lost_workers), 10, "the lost host's workers to die with it")
    assert second.wait(10) == -signal.SIGKILL
    wait_until(lambda: world_sizes_in(first.output())[-1:] == [1] and "first step done" in
               first.output().rsplit("INFO training ", 1)[-1], RUN_BOUND_S,
               f"the job to go on at world size 1\n{first.output()[-3000:]}")
    regrouped_s = time.monotonic() - lost_at
    output = first.output()
    # The restart names what happened, the host that went away (by its address: both namespaces share a hostname),
    # not only its own rank, which died of it; and the rank's line for the lost peer is a warning, since the job
    # goes on: no error line for what is not the run's end.
    assert re.search(rf"^restart 1 of 10: host .+ \({hosts[1].address}\) went away \(its launcher stopped answering "
                     r"the rendezvous store for 3 s: .*\); rank 0 \(host .+\) exited with code 1 when it lost its "
                     r"peers; the hosts still here meet again \(NNODES=1:2\)", output, re.M), output[-3000:]
    assert re.search(r"^warning: collective: .+; a peer was lost: the launcher restarts the workers \(restart 1 of "
                     r"10\)$", output, re.M), output[-3000:]
    assert not error_lines(output), output[-3000:]
    assert "Traceback" not in output and "AssertionError" not in output, output[-4000:]

    back = host(tmp_path, port, "hostB-back", hosts[1])  # the host returns, with the same settings
    launches.append(back)

    def trains_at(world: int, output: str) -> bool:  # its newest world, and a step done in it
        return world_sizes_in(output)[-1:] == [world] and "first step done" in output.rsplit("INFO training ", 1)[-1]
    wait_until(lambda: any(trains_at(2, h.output()) for h in (first, back)), RUN_BOUND_S,
               f"the job to grow back to world size 2\n{first.output()[-3000:]}\n{back.output()[-3000:]}")
    # The running host's workers stop for the one that joined: its launcher says so in one line (not torch's
    # warning for each worker it stops).
    assert "\na host joined the job: this host's workers stop, and every worker starts again at world size 2 (2 " \
        "hosts, NNODES=1:2) from the newest checkpoint\n" in first.output(), first.output()[-3000:]

    # The host leaves as `docker compose stop` makes it: SIGTERM to its launcher. Every rank stops at an agreed
    # step with a checkpoint; that host exits 0, the other goes on alone from that very checkpoint.
    os.kill(back.pid, signal.SIGTERM)
    assert back.wait(60) == 0, back.output()[-4000:]
    assert first.wait(RUN_BOUND_S) == 0, first.output()[-4000:]
    output, everything = first.output(), first.output() + second.output() + back.output()
    assert "closing signal" not in output and not error_lines(output), output[-4000:]
    sizes = world_sizes_in(everything)
    assert 2 in sizes and 1 in sizes and world_sizes_in(output)[-1] == 1, (sizes, output[-4000:])
    stops = [int(line.split("stopped at step ")[1].split(":")[0]) for line in everything.splitlines()
             if "INFO stopped at step " in line]
    assert len(stops) == 2, everything[-4000:]  # the running host's stop for the return, and the stop at the leave
    after_leave = output.split("another host left the job", 1)
    assert len(after_leave) == 2, output[-4000:]
    assert f"(step {max(stops)}, " in after_leave[1].split("INFO training ")[0], output[-3000:]  # nothing recomputed
    # Every step of the epoch kept once, each of GLOBAL_BATCH samples over the ranks of its world, and every
    # sample of the epoch in exactly one of them: the global order held across 2 -> 1 -> 2.
    steps = committed_lines(tmp_path)
    assert sorted(steps) == list(range(1, SAMPLES // GLOBAL_BATCH + 1))
    seen: list[int] = []
    for step, ranks in steps.items():
        world = ranks[0][0]
        assert len(ranks) == world and all(w == world for w, _ in ranks), (step, ranks)
        assert sum(len(indices) for _, indices in ranks) == GLOBAL_BATCH, (step, ranks)
        seen += [i for _, indices in ranks for i in indices]
    assert sorted(seen) == list(range(SAMPLES))
    summary = read_summary(tmp_path / "runs")
    assert summary["status"] == "completed" and summary["world_size"] == 1
    assert summary["global_step"] == SAMPLES // GLOBAL_BATCH
    print(f"lost host to the first step at world size 1: {regrouped_s:.1f} s")


@pytest.mark.slow
def test_losing_the_rendezvous_host_ends_the_others_naming_it_and_a_restart_resumes(hosts, tmp_path, launches):
    """The c10d store lives on the MASTER_ADDR host: the job cannot outlive it. The other host stops at once with
    a line naming it (not torchrun's store errors), exit 1; started again, the job resumes from the newest
    checkpoint."""
    port, samples = free_port(), SAMPLES // 2  # the restart trains the rest alone: a shorter epoch
    store_host = host(tmp_path, port, "hostA", hosts[0], samples)
    launches.append(store_host)
    time.sleep(2)
    other = host(tmp_path, port, "hostB", hosts[1], samples)
    launches.append(other)
    checkpoints = tmp_path / "checkpoints"
    wait_until(lambda: any(checkpoints.glob("step-*.pt")), RUN_BOUND_S,
               f"a first checkpoint\n{store_host.output()[-3000:]}\n{other.output()[-3000:]}")
    os.kill(store_host.pid, signal.SIGKILL)
    assert other.wait(60) == 1, other.output()[-3000:]
    last = [line for line in other.output().splitlines() if line.startswith("error: ")][-1]
    assert last.startswith(f"error: training failed: the rendezvous host {MASTER_ADDR} went away (its c10d store at "
                           f"{MASTER_ADDR}:{port} stopped answering)"), other.output()[-3000:]
    assert "Traceback" not in other.output()
    newest = max(int(p.stem.split("-")[1]) for p in checkpoints.glob("step-*.pt"))

    again = host(tmp_path, port, "hostA-again", hosts[0], samples)  # MIN is 1: one host is a job
    launches.append(again)
    assert again.wait(RUN_BOUND_S) == 0, again.output()[-4000:]
    summary = read_summary(tmp_path / "runs")
    assert summary["resumed_from_step"] == newest and summary["status"] == "completed"


@pytest.mark.slow
def test_a_checkpoint_directory_that_is_not_shared_stops_every_host_with_one_line_and_no_restarts(hosts, tmp_path,
                                                                                                  launches):
    """Bad input: each host's own directory (a local disk of the same path, here two folders). Rank 0 leaves a
    marker; the other host does not see it: every host stops with exit 2 and the one line naming it, before a
    step is trained at world size 2, and a usage error is not restarted (MAX_RESTARTS is 10 under a range)."""
    port = free_port()
    launchers = []
    for name, where in zip(("hostA", "hostB"), hosts):
        out = tmp_path / name  # its own checkpoint directory: out/checkpoints
        out.mkdir()
        launchers.append(host(out, port, name, where))
        launches.append(launchers[-1])
        time.sleep(2)
    for one in launchers:
        assert one.wait(RUN_BOUND_S) == 2, one.output()[-4000:]
    for one in launchers:
        output = one.output()
        errors = [line for line in output.splitlines() if line.startswith("error: ")]
        assert errors[0].startswith("error: checkpoint_dir: ") and "is not one directory that every host of this " \
            "elastic job shares: rank 1 on " in errors[0] and "(use a directory every host mounts" in errors[0], output
        assert errors[-1].endswith("(a mistake in the settings is not restarted)"), output
        assert "restart 1 of" not in output and "Traceback" not in output, output[-4000:]
    assert not list(tmp_path.glob("host*/checkpoints/.shared-check-*"))  # rank 0 removed its marker


@pytest.mark.slow
def test_below_the_fewest_hosts_the_job_ends_with_one_line_once_none_joins_in_time(hosts, tmp_path, launches):
    """NNODES=2:2 (MIN 2): one host is lost, so the other is below the floor. Its agent restarts and waits for a
    host to join; none does within RDZV_TIMEOUT: it stops with one line saying so (not that the rendezvous host
    went away: it is that very host), exit 1."""
    port = free_port()
    launchers = []
    for name, where in zip(("hostA", "hostB"), hosts):
        launchers.append(host(tmp_path, port, name, where, NNODES="2:2", RDZV_TIMEOUT="10"))
        launches.append(launchers[-1])
        time.sleep(2)
    wait_until(lambda: any((tmp_path / "checkpoints").glob("step-*.pt")), RUN_BOUND_S,
               f"a first checkpoint\n{launchers[0].output()[-3000:]}\n{launchers[1].output()[-3000:]}")
    os.kill(launchers[1].pid, signal.SIGKILL)
    assert launchers[0].wait(120) == 1, launchers[0].output()[-3000:]
    output = launchers[0].output()
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert errors[-1] == ("error: training failed: fewer than the 2 hosts an elastic job needs (NNODES=2:2) were left, "
                          "and no other host joined within RDZV_TIMEOUT (10 s) (start the lost hosts again, or lower "
                          "MIN: the job resumes from the newest checkpoint)"), output[-3000:]
    assert "Traceback" not in output, output[-3000:]


@pytest.mark.slow
def test_the_one_machine_example_of_the_elastic_page_runs_as_written(tmp_path):
    """docs/elastic.md's "Try it on one machine": two launchers on loopback, the second stopped once both train;
    the first goes on alone, in place (RECOVERY's default), at world size 1 and completes. Its lines as written, on
    a free port."""
    import re
    import subprocess
    import sys

    page = (REPO / "docs" / "elastic.md").read_text()
    block = re.search(r"\*\*Try it on one machine\.\*\*.*?```bash\n(.*?)\n```", page, re.S).group(1)
    port = str(free_port())
    script = block.replace("MASTER_PORT=29400", f"MASTER_PORT={port}").replace("127.0.0.1/29400", f"127.0.0.1/{port}")
    assert script.count(port) == 2, "the example's port is no longer where this test replaces it"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAIN_")}
    env.update(PATH=f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])))
    done = subprocess.run(["bash", "-e", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=RUN_BOUND_S)
    logs = {name: (tmp_path / name).read_text() for name in ("host-a.log", "host-b.log")}
    assert done.returncode == 0, done.stdout + done.stderr + logs["host-a.log"][-3000:] + logs["host-b.log"][-2000:]
    assert "recovery: in place: " in done.stdout and "restart 1 of" not in done.stdout, done.stdout
    assert re.search(r"in place: generation \d+, world size 1 of at most 2", done.stdout) and \
        "completed at step 64" in done.stdout, done.stdout
    assert "stopped by SIGTERM: every worker on this host exited 0" in logs["host-b.log"], logs["host-b.log"][-2000:]
