"""Faults injected into real runs: killed and stalled workers, lost rendezvous, crashes and a full
disk while checkpointing, SIGTERM. docs/reliability.md maps each fault to its test here."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Iterator

import pytest
import torch
from fault_helpers import Launch, checkpoint_files, error_lines, launcher_env, running, tiny_run, wait_until
from helpers import (
    REPO,
    assert_same_params,
    assert_usage_error,
    checkpoint_steps,
    clean_env,
    dirs_args,
    final_params,
    free_port,
    load_checkpoint,
    read_scalars,
    read_summary,
    run_trainer_forked,
    skip_or_fail_in_ci,
)

from trainer.checkpoint import store as checkpoint
from trainer.core.errors import UsageError

COLLECTIVE_TIMEOUT_S = 5
USER_CODE = REPO / "tests" / "user_code"
# Slack on top of a configured timeout: process start-up and teardown on a loaded 2-core runner.
# What these bounds catch is the 30-minute default wait, not slowness.
SLACK_S = 40  # three launchers importing torch at once took more than 25 s under a load of 8
RUN_BOUND_S = 180


def first_checkpoint(directory: Path, launch: Launch) -> None:
    """Wait until the run has committed a checkpoint and is still training."""
    wait_until(lambda: checkpoint_files(directory) or launch.proc.poll() is not None, RUN_BOUND_S,
               f"a checkpoint in {directory}")
    assert launch.proc.poll() is None, f"the run ended before the fault:\n{launch.output()[-3000:]}"


def assert_no_traceback(text: str) -> None:
    assert "Traceback" not in text, text[-4000:]


# ------------------------------------------------------------------------------------ elastic restart

def test_sigkilled_worker_restarts_the_group_and_ends_as_if_uninterrupted(tmp_path, launches):
    """MAX_RESTARTS=2: torchrun restarts both ranks from the newest checkpoint; nothing is lost."""
    reference, faulty = tmp_path / "reference", tmp_path / "faulty"
    for root in (reference, faulty):
        root.mkdir()
    uninterrupted = Launch(tiny_run(reference, samples=3200), reference, launcher_env(free_port()))
    run = Launch(tiny_run(faulty, samples=3200), faulty, launcher_env(free_port(), MAX_RESTARTS="2"))
    launches += [uninterrupted, run]

    first_checkpoint(faulty / "checkpoints", run)
    first_group = run.workers()
    os.kill(first_group[1], signal.SIGKILL)
    wait_until(lambda: len(group := run.workers()) == 2 and set(group.values()).isdisjoint(first_group.values()),
               RUN_BOUND_S, "torchrun to restart every rank with new processes")

    assert run.wait(RUN_BOUND_S) == 0, run.output()[-4000:]
    assert uninterrupted.wait(RUN_BOUND_S) == 0, uninterrupted.output()[-4000:]
    assert (f"restart 1 of 2: rank 1 (host {socket.gethostname()}) was killed by SIGKILL; every rank of this host "
            "starts again from the newest checkpoint") in run.output()
    # The survivor's SIGTERM is torchrun tearing the group down, not a user's stop.
    assert "received SIGTERM: stopping within a step or two" not in run.output(), run.output()[-4000:]
    done, expected = read_summary(faulty / "runs"), read_summary(reference / "runs")
    assert done["status"] == "completed" and done["world_size"] == 2
    assert done["global_step"] == expected["global_step"] == 100  # 3200 samples / (16 x 2 ranks)
    assert done["resumed_from_step"] is not None and done["resumed_from_step"] % 10 == 0
    assert 0 < done["resumed_from_step"] < done["global_step"]
    assert expected["resumed_from_step"] is None
    assert f"resuming from {faulty / 'checkpoints'}/step-{done['resumed_from_step']:08d}.pt" in run.output()
    assert_same_params(final_params(faulty / "checkpoints"), final_params(reference / "checkpoints"))
    newest = f"step-{done['global_step']:08d}.pt"
    assert_same_params(load_checkpoint(faulty / "checkpoints" / newest)["optimizer"]["state"][0],
                       load_checkpoint(reference / "checkpoints" / newest)["optimizer"]["state"][0])


def test_a_restart_resumes_from_the_runs_newest_checkpoint_not_again_from_an_explicit_resume_file(tmp_path, launches):
    """--resume FILE starts the run; a worker killed after the run has committed later steps restarts from the
    newest of those, as the restart line says. Before: every restart loaded FILE again and threw the steps since
    away (only --resume never was switched to auto on a restart)."""
    source = tmp_path / "source"
    finished = run_trainer_forked(tiny_run(source, samples=640), tmp_path, timeout=RUN_BOUND_S)  # 40 steps
    assert finished.returncode == 0, finished.stderr[-3000:]
    start = source / "checkpoints" / "step-00000020.pt"
    # 100 steps: the kill comes after its checkpoint of step 40, and the restart trains on to the end from there.
    run = Launch([*tiny_run(tmp_path, samples=3200), "--resume", str(start)], tmp_path,
                 launcher_env(free_port(), MAX_RESTARTS="1"))
    launches.append(run)
    wait_until(lambda: any(step >= 40 for step in checkpoint_steps(tmp_path / "checkpoints"))
               or run.proc.poll() is not None, RUN_BOUND_S, f"this run's checkpoints\n{run.output()[-2000:]}")
    committed = max(checkpoint_steps(tmp_path / "checkpoints"))
    os.kill(run.workers()[1], signal.SIGKILL)
    assert run.wait(RUN_BOUND_S) == 0, run.output()[-4000:]
    output = run.output()
    assert f"resuming from {start} (step 20," in output
    after = output.split("restart 1 of 1: ", 1)
    assert len(after) == 2 and after[1].startswith(f"rank 1 (host {socket.gethostname()}) was killed by SIGKILL; "
                                                   "every rank of this host starts again from the newest checkpoint"), \
        output[-3000:]
    resumed = re.search(rf"resuming from {tmp_path / 'checkpoints'}/step-(\d+)\.pt", after[1])
    assert resumed and int(resumed.group(1)) >= committed, after[1][-3000:]
    assert read_summary(tmp_path / "runs")["resumed_from_step"] == int(resumed.group(1))


def test_a_static_job_takes_back_a_host_whose_launcher_was_started_again(tmp_path, launches):
    """NNODES=2 with MAX_RESTARTS: one host lost (its launcher SIGKILLed, its workers with it), the other
    restarts its ranks and waits; the lost host's launcher started again, with its restart count at 0, joins the
    group the other is waiting in at once (no failed attempt of its own) and the job completes at world size 2."""
    import torch.distributed as dist

    port = free_port()

    def host(node: int, name: str) -> Launch:
        return Launch(tiny_run(tmp_path, samples=3200), tmp_path,
                      launcher_env(port, NNODES="2", NODE_RANK=str(node), NPROC_PER_NODE="1",
                                   MASTER_ADDR="127.0.0.1", MAX_RESTARTS="3"), name=name)
    first = host(0, "host0")  # hosts the rendezvous store
    launches.append(first)
    time.sleep(1)
    second = host(1, "host1")
    launches.append(second)
    first_checkpoint(tmp_path / "checkpoints", first)
    lost_workers = list(second.workers().values())
    os.kill(second.pid, signal.SIGKILL)
    wait_until(lambda: not any(running(p) for p in lost_workers), 10, "the lost host's workers to die with it")
    # The survivor's restarted rank has joined its second group (attempt 1): the lost host returns now.
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=RUN_BOUND_S))
    wait_until(lambda: store.get("trainer/newest-attempt") == b"1", RUN_BOUND_S, f"the survivor's restart\n"
               f"{first.output()[-3000:]}")
    back = host(1, "host1-back")
    launches.append(back)
    assert back.wait(RUN_BOUND_S) == 0, back.output()[-4000:]
    assert first.wait(RUN_BOUND_S) == 0, first.output()[-4000:]
    assert "restart 1 of 3: " in first.output(), first.output()[-3000:]
    assert "restart " not in back.output(), back.output()[-4000:]  # it met the waiting group at its first try
    done = read_summary(tmp_path / "runs")
    assert done["status"] == "completed" and done["world_size"] == 2 and done["global_step"] == 100
    assert 0 < done["resumed_from_step"] < 100


# ------------------------------------------------------------------------------------ fail fast

def test_stalled_peer_fails_the_survivor_within_the_collective_timeout(tmp_path, launches):
    run = Launch(tiny_run(tmp_path, samples=9600) + ["--collective-timeout", str(COLLECTIVE_TIMEOUT_S)],
                 tmp_path, launcher_env(free_port()))
    launches.append(run)
    first_checkpoint(tmp_path / "checkpoints", run)
    workers = run.workers()
    os.kill(workers[1], signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        wait_until(lambda: not running(workers[0]), COLLECTIVE_TIMEOUT_S + SLACK_S,
                   f"rank 0 to give up on the stalled rank 1\n{run.output()[-3000:]}")
        waited = time.monotonic() - stopped_at
    finally:
        os.kill(workers[1], signal.SIGCONT)  # torchrun's SIGTERM is pending on it: let it act on it
    # It waited out the timeout, not less. Rank 0's wait may have begun up to a step or two (the stop vote is
    # read a step later) before rank 1 stopped: a second or two of a tiny CNN's steps on a loaded runner.
    assert waited > COLLECTIVE_TIMEOUT_S - 2, f"rank 0 gave up {waited:.1f} s after rank 1 stalled"

    assert run.wait(RUN_BOUND_S) != 0
    output = run.output()
    assert_no_traceback(output)
    # Rank 0's line comes first; rank 1, let go after it, may add its own (its peer is gone).
    survivor = [line for line in error_lines(output) if line.startswith("error: collective: ")]
    assert survivor, output[-3000:]
    # gloo words it by where the wait was: "Timed out waiting 5000ms for recv operation ..." in a
    # blocking call, "Application timeout caused pair closure" in an async one (the stop vote). Not
    # "timeout" anywhere in the line: every collective line names --collective-timeout in its advice.
    assert re.match(rf"error: collective: (Timed out waiting {COLLECTIVE_TIMEOUT_S * 1000}ms for \w+ operation to "
                    r"complete|Application timeout caused pair closure)\b", survivor[0]), survivor[0]
    assert f"--collective-timeout, now {COLLECTIVE_TIMEOUT_S} s, sets the wait" in survivor[0]
    # The survivor asked its host's other rank for its stack: a stopped process cannot answer.
    assert re.search(r"; rank 1 \(host .+\) did not answer \(stopped, or frozen in the kernel\) \(", survivor[0]), \
        survivor[0]
    assert error_lines(output)[-1].startswith("error: training failed: rank 0 exited with code 1")


def test_killed_peer_without_restarts_fails_fast_naming_the_signal(tmp_path, launches):
    run = Launch(tiny_run(tmp_path, samples=9600) + ["--collective-timeout", "300"], tmp_path,
                 launcher_env(free_port(), MAX_RESTARTS="0"))
    launches.append(run)
    first_checkpoint(tmp_path / "checkpoints", run)
    os.kill(run.workers()[1], signal.SIGKILL)

    assert run.wait(SLACK_S) == 1  # far below the 300 s collective timeout: a dead peer is seen at once
    output = run.output()
    assert_no_traceback(output)
    # The survivor's own line: the closed connection, not a timeout; a warning, since rank 1 of its host failed
    # first: the one error line is the launcher's, for the cause.
    survivor = [line for line in output.splitlines() if line.startswith("warning: collective: ")]
    assert len(survivor) == 1 and "Timed out" not in survivor[0], output[-3000:]
    assert "--collective-timeout, now 300 s, sets the wait" in survivor[0], survivor[0]
    assert survivor[0].endswith("; a rank of this host failed first"), survivor[0]
    assert len(error_lines(output)) == 1, output[-3000:]
    assert error_lines(output)[-1].startswith("error: training failed: rank 1 was killed by SIGKILL"), output[-3000:]


# ------------------------------------------------------------------------------------ rendezvous

def rendezvous(tmp_path: Path, node_rank: int | None, port: int) -> subprocess.Popen:
    """node_rank None: a host of an elastic job on the restart path (NNODES=2:2, MIN 2), alone."""
    topology = dict(NNODES="2", NODE_RANK=str(node_rank)) if node_rank is not None else \
        dict(NNODES="2:2", RECOVERY="restart")
    env = clean_env(launcher_env(port, MASTER_ADDR="127.0.0.1", RDZV_TIMEOUT="3", **topology))
    return subprocess.Popen([sys.executable, "-m", "trainer.cli.launch", *tiny_run(tmp_path / f"node{node_rank}")],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_rendezvous_that_cannot_complete_ends_within_rdzv_timeout(tmp_path):
    """Node 1 with nobody at MASTER_ADDR:MASTER_PORT, node 0 whose peer never comes (two worlds), and an elastic
    job's host that no other joins (its c10d rendezvous' timeout has no message: the line gives the reason)."""
    lone_port, empty_port, elastic_port = free_port(), free_port(), free_port()
    started = time.monotonic()
    lone_node0, lone_node1 = rendezvous(tmp_path, 0, lone_port), rendezvous(tmp_path, 1, empty_port)
    lone_elastic = rendezvous(tmp_path, None, elastic_port)
    for node, port, nodes, detail, bound_s in (
            (lone_node0, lone_port, "2", "1/2 clients joined", 3 + SLACK_S),
            # the store client retries its 3 s connect once or twice
            (lone_node1, empty_port, "2", "timed out", 3 * 3 + SLACK_S),
            (lone_elastic, elastic_port, "2:2", "failed: fewer than the 2 hosts NNODES=2:2 needs joined within "
             "RDZV_TIMEOUT (3 s) (every host needs the same NNODES, MASTER_ADDR, MASTER_PORT and the MASTER_ADDR "
             "host, which runs the rendezvous store, up;", 3 + SLACK_S)):
        _, stderr = node.communicate(timeout=RUN_BOUND_S)
        assert node.returncode == 1, stderr[-3000:]
        assert time.monotonic() - started < bound_s  # never the 900 s default
        (line,) = error_lines(stderr)
        assert line.startswith(f"error: rendezvous at 127.0.0.1:{port} ({nodes} nodes) failed: "), stderr[-3000:]
        assert detail in line and "RDZV_TIMEOUT" in line, line
        assert_no_traceback(stderr)
        assert "frame #" not in stderr  # no C++ stack traces from the store client's retries
    assert not list(tmp_path.glob("node*/checkpoints"))


def test_the_failure_that_came_first_is_the_one_reported():
    """torchrun's failure records: the peer it SIGTERMed in the same second is not the cause."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from trainer.cluster.agent import describe_child_failure

    def failure(rank: int, exitcode: int, timestamp: int) -> ProcessFailure:
        record = ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file="/nonexistent")
        record.timestamp = timestamp
        return record

    killed = {0: failure(0, -signal.SIGTERM, 100), 1: failure(1, -signal.SIGKILL, 100)}
    assert describe_child_failure(killed) == (  # rank 0: the agent's SIGTERM after rank 1 died, not one more failure
        "training failed: rank 1 was killed by SIGKILL; the signal came from outside the trainer", 1)
    crashed = {0: failure(0, -signal.SIGTERM, 100), 1: failure(1, 1, 100), 2: failure(2, 1, 101)}
    assert describe_child_failure(crashed)[0].startswith("training failed: rank 1 exited with code 1 (and 1 more)")
    returned = {0: failure(0, -signal.SIGTERM, 100), 1: failure(1, 1, 100)}  # rank 0's program had returned
    assert describe_child_failure(returned, ended=frozenset({0}))[0] == (
        "training failed: rank 1 exited with code 1; its own error is printed above")
    # Both exited with an error in one second; torchrun saw rank 1 first (rank 0 died of the stop it sent).
    seen_first = {1: failure(1, 1, 100), 0: failure(0, 1, 100)}
    assert describe_child_failure(seen_first)[0].startswith("training failed: rank 1 exited with code 1 (and 1 more)")
    earlier = {0: failure(0, -signal.SIGKILL, 101), 1: failure(1, 3, 100)}
    assert describe_child_failure(earlier) == (
        "training failed: rank 1 exited with code 3 (and 1 more); its own error is printed above", 3)


# ------------------------------------------------------------------------------------ checkpoint safety

SAVE_LOOP = """
import sys, torch
from pathlib import Path
from trainer.checkpoint import store as checkpoint
directory = Path(sys.argv[1])
for step in range(1, 1000):  # 64 MiB each: a write takes long enough to be caught in the middle
    state = {"format": checkpoint.FORMAT, "step": step, "weights": torch.full((16 << 20,), float(step))}
    checkpoint.save(directory, step, state, keep=2)
"""


def test_sigkill_during_checkpoint_write_leaves_only_loadable_checkpoints(tmp_path):
    """The trainer's own checkpoint.save in a real process, killed while a temp file is being written."""
    directory = tmp_path / "checkpoints"
    writer = subprocess.Popen([sys.executable, "-c", SAVE_LOOP, str(directory)], env=clean_env())
    try:
        wait_until(lambda: checkpoint.list_checkpoints(directory) and list(directory.glob(".tmp-*")), 120,
                   "a committed checkpoint and the next one being written")
        os.kill(writer.pid, signal.SIGKILL)
    finally:
        writer.kill()
        writer.wait()
    assert list(directory.glob(".tmp-*")), "killed between writes, not during one"
    committed = checkpoint.list_checkpoints(directory)
    assert committed
    for path in committed:  # every committed name loads, and holds what its name says
        state = checkpoint.load(path)
        assert path.name == f"step-{state['step']:08d}.pt"
        assert state["weights"].eq(state["step"]).all()
    state, path = checkpoint.load_for_resume(directory, "auto")
    assert path == committed[0]

    checkpoint.save(directory, state["step"] + 1, {"format": checkpoint.FORMAT, "step": state["step"] + 1}, keep=2)
    assert not list(directory.glob(".tmp-*")), "the next save removes what the killed writer left"


def test_an_in_place_writer_commits_only_in_the_jobs_generation_and_removes_no_one_elses_temp_file(tmp_path):
    """In place (trainer.engine.inplace) a checkpoint's temp file is written in its generation's folder and committed
    by the rename out of it: once a newer generation retired that folder, the rename publishes nothing (Superseded),
    however long the writer was frozen before it. A writer removes no temp file but its own: another host's in the
    directory, or a newer generation's writer's, stay. Real files; the folders are never taken for checkpoints."""
    directory = tmp_path / "checkpoints"
    directory.mkdir()

    def state(step: int) -> dict:
        return {"format": checkpoint.FORMAT, "global_step": step}

    assert checkpoint.open_generation(directory, 4) is None
    mine = checkpoint.generation_folder(directory, 4)
    # Generation 5 has just formed (its folder made, 4's not yet retired); its writer and another host's write of the
    # generation's number are under way.
    newer = checkpoint.generation_folder(directory, 5)
    newer.mkdir()
    live = [newer / ".tmp-step-00000020.pt.4242", directory / ".tmp-.generation.4243"]
    for temp in live:
        temp.write_bytes(b"being written")
    assert checkpoint.save(directory, 10, state(10), keep=3, staging=mine) == directory / "step-00000010.pt"
    assert all(temp.exists() for temp in live) and not list(mine.iterdir())

    assert checkpoint.open_generation(directory, 5) is None  # 5's first host retires 4
    assert not mine.exists() and newer.is_dir() and all(temp.exists() for temp in live)
    with pytest.raises(checkpoint.Superseded):
        checkpoint.save(directory, 11, state(11), keep=3, staging=mine)
    assert not (directory / "step-00000011.pt").exists() and not mine.exists()
    # A host of 4 frozen between its quorum and making its folder: it finds 5 and retires its own at once.
    assert checkpoint.open_generation(directory, 4) == 5 and not mine.exists()
    checkpoint.save(directory, 20, state(20), keep=3, staging=newer)
    assert all(temp.exists() for temp in live)

    assert [p.name for p in checkpoint.list_checkpoints(directory)] == ["step-00000020.pt", "step-00000010.pt"]
    assert checkpoint.load_for_resume(directory, "auto")[1] == directory / "step-00000020.pt"
    checkpoint.save(directory, 30, state(30), keep=3)  # off the in-place path, as before: the directory's own go
    assert not live[1].exists() and live[0].exists()


def test_each_new_quorum_takes_the_jobs_next_generation_above_every_one_on_disk_and_a_new_job_starts_over(tmp_path):
    """In place, a generation is the job's number for a quorum (trainer.engine.inplace.JobGenerations), not torchft's
    quorum id, which starts over when the lighthouse is started again: the counter only grows, stays above any
    generation's folder or number a host wrote, and is cleared with them when a new job takes the directory."""
    directory = tmp_path / "checkpoints"
    directory.mkdir()
    assert [checkpoint.next_generation(directory) for _ in range(3)] == [1, 2, 3]
    assert checkpoint.open_generation(directory, 7) is None  # a folder above the counter (written by hand, say)
    assert checkpoint.next_generation(directory) == 8
    (directory / checkpoint.GENERATION_FILE).write_text("12\n")
    assert checkpoint.next_generation(directory) == 13
    checkpoint.claim(directory, job="http://10.0.0.1:29500").close()  # a new job, alone: what the last one left goes
    assert checkpoint.next_generation(directory) == 1


def test_the_processes_of_a_host_agree_on_a_quorums_generation_though_torchft_gives_each_another_store(tmp_path):
    """Two hosts of two processes each, in place. torchft answers every process of the quorum with the same quorum
    id and members, but gives each process the store of another member (its group rank modulo the members: torchft's
    compute_quorum_results): counted there, the host's two processes took two numbers for one quorum, and the one
    with the smaller was fenced at its next step (a CI run of the compose and Kubernetes in-place pairs, whose
    surviving host's processes restarted). The host's first process agrees with the other hosts' first processes
    and hands the number to its host's others (inplace.HostStore): one generation for all four, and the next quorum
    the next one. Real TCPStores and checkpoint directory; torchft's client replaced by its answers."""
    import threading
    from types import SimpleNamespace

    from torch.distributed import TCPStore

    from trainer.engine.inplace import HostStore, JobGenerations

    directory = tmp_path / "checkpoints"
    directory.mkdir()
    primaries = [TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) for _ in range(2)]
    own = [TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) for _ in range(2)]  # each host's torchrun's

    class Answers:  # torchft's ManagerClient for one process: the quorum as torchft computes it for its group rank
        def __init__(self, group_rank: int):
            self.group_rank, self.quorum_id = group_rank, 0

        def _quorum(self, **asked):
            self.quorum_id += 1
            return SimpleNamespace(quorum_id=self.quorum_id, replica_ids=["hostA:0", "hostB:0"], max_step=40,
                                   store_address=f"127.0.0.1:{primaries[self.group_rank % 2].port}")

    timeout = timedelta(seconds=20)
    processes = []
    for host in range(2):
        for local_rank in range(2):
            ctx = SimpleNamespace(topology=SimpleNamespace(local_rank=local_rank, master_addr="127.0.0.1",
                                                           master_port=own[host].port))
            processes.append(JobGenerations(Answers(local_rank), directory, timeout, stale=lambda generation: None,
                                            host=HostStore(ctx, timeout)))

    def ask(index: int, found: dict[int, int]) -> None:
        found[index] = processes[index]._quorum().quorum_id

    for quorum in range(2):
        found: dict[int, int] = {}
        threads = [threading.Thread(target=ask, args=(index, found)) for index in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert found == dict.fromkeys(range(4), quorum + 1), found
    assert checkpoint.next_generation(directory) == 3  # two quorums, two numbers taken


def test_the_run_that_takes_a_checkpoint_directory_alone_clears_what_in_place_jobs_left(tmp_path):
    """Generation folders, the generation's number and temp files belong to no live process when nothing else holds
    the directory (a new job's lighthouse numbers its generations afresh: a finished job's must not look newer). A
    host that joins an in-place job holding it leaves them."""
    directory = tmp_path / "checkpoints"
    directory.mkdir()

    def leave_some() -> list[Path]:
        left = [checkpoint.generation_folder(directory, 7), directory / ".retired-generation-6.ab12",
                directory / checkpoint.GENERATION_FILE, directory / ".tmp-step-00000070.pt.99"]
        for path in left[:2]:
            path.mkdir(exist_ok=True)
            (path / ".tmp-step-00000070.pt.98").write_bytes(b"half")
        for path in left[2:]:
            path.write_text("7\n")
        return left

    left = leave_some()
    first = checkpoint.claim(directory, job="http://10.0.0.1:29500")
    assert not any(path.exists() for path in left), list(directory.iterdir())
    left = leave_some()
    second = checkpoint.claim(directory, job="http://10.0.0.1:29500")  # another host of the same job: not alone
    assert all(path.exists() for path in left)
    with pytest.raises(UsageError, match="is in use by another run"):
        checkpoint.claim(directory)  # a run of another kind
    with pytest.raises(UsageError, match=r"is in use by another run \(the in-place job of the lighthouse at "
                       r"http://10.0.0.1:29500, first taken by pid \d+ on "):
        checkpoint.claim(directory, job="http://10.0.0.1:29501")  # another in-place job
    first.close()
    second.close()
    checkpoint.claim(directory).close()
    assert not any(path.exists() for path in left)


def test_a_failed_write_calls_no_newer_checkpoint_older(tmp_path):
    """In place, a host whose write fails may find newer checkpoints than its own (the job's): the line says what is
    there, not that every checkpoint is older."""
    directory = tmp_path / "checkpoints"
    for step in (10, 30):
        checkpoint.save(directory, step, {"format": checkpoint.FORMAT, "global_step": step}, keep=3)
    (directory / "step-00000020.pt").mkdir()  # the rename over it fails: a directory, not writable as a file
    (directory / "step-00000020.pt" / "x").write_bytes(b"")
    with pytest.raises(checkpoint.CheckpointError) as raised:
        checkpoint.save(directory, 20, {"format": checkpoint.FORMAT, "global_step": 20}, keep=3)
    assert str(raised.value).endswith("the 3 checkpoint(s) there are intact, the newest step-00000030.pt)"), raised.value


def test_truncated_newest_checkpoint_falls_back_with_a_warning(tmp_path):
    args = tiny_run(tmp_path, samples=640) + ["--max-steps", "30", "--keep-checkpoints", "3"]
    first = subprocess.run([sys.executable, "-m", "trainer", *args], cwd=tmp_path, env=clean_env(),
                           capture_output=True, text=True, timeout=RUN_BOUND_S)
    assert first.returncode == 0, first.stderr[-3000:]
    directory = tmp_path / "checkpoints"
    assert checkpoint_steps(directory) == [10, 20, 30]
    newest = directory / "step-00000030.pt"
    newest_size = newest.stat().st_size
    newest.write_bytes(newest.read_bytes()[: newest_size // 2])
    leftover = directory / ".tmp-step-00000040.pt.4242"  # what a writer killed mid-save leaves
    leftover.write_bytes(b"half a checkpoint")

    second = subprocess.run([sys.executable, "-m", "trainer", *args], cwd=tmp_path, env=clean_env(),
                            capture_output=True, text=True, timeout=RUN_BOUND_S)
    assert second.returncode == 0, second.stderr[-3000:]
    warnings = [line for line in second.stderr.splitlines() if "WARNING" in line and str(newest) in line]
    assert len(warnings) == 1 and "does not load" in warnings[0] and "trying the previous one" in warnings[0]
    summary = read_summary(tmp_path / "runs")
    assert summary["resumed_from_step"] == 20 and summary["global_step"] == 30
    assert not leftover.exists()
    assert checkpoint.load(newest)["global_step"] == 30  # rewritten whole
    # Set aside: kept for inspection, out of the rotation (which keeps the highest steps).
    assert (directory / "step-00000030.pt.corrupt").stat().st_size == newest_size // 2


def test_when_every_checkpoint_is_corrupt_resume_auto_refuses_to_start_over(tmp_path):
    """Before, every checkpoint set aside and the run quietly began again at step 0. Now one line lists them
    and says how to start over; the files stay for the user, and nothing is trained or written."""
    args = tiny_run(tmp_path, samples=640) + ["--max-steps", "20"]
    first = subprocess.run([sys.executable, "-m", "trainer", *args], cwd=tmp_path, env=clean_env(),
                           capture_output=True, text=True, timeout=RUN_BOUND_S)
    assert first.returncode == 0, first.stderr[-3000:]
    directory = tmp_path / "checkpoints"
    for path in checkpoint.list_checkpoints(directory):
        path.write_bytes(b"not a checkpoint any more")
    again = subprocess.run([sys.executable, "-m", "trainer", *args], cwd=tmp_path, env=clean_env(),
                           capture_output=True, text=True, timeout=RUN_BOUND_S)
    errors = error_lines(again.stderr)
    assert again.returncode == 2 and len(errors) == 1, again.stderr[-3000:]
    assert errors[0].startswith(f"error: --checkpoint-dir: no checkpoint in {directory} loads: 2 are set aside as "
                                "corrupt (step-00000010.pt.corrupt, step-00000020.pt.corrupt) (to start over, move "
                                "them out"), errors[0]
    assert sorted(p.name for p in directory.iterdir() if not p.name.startswith(".")) == [
        "step-00000010.pt.corrupt", "step-00000020.pt.corrupt"]
    third = subprocess.run([sys.executable, "-m", "trainer", *args], cwd=tmp_path, env=clean_env(),
                           capture_output=True, text=True, timeout=RUN_BOUND_S)
    assert third.returncode == 2 and "2 are set aside as corrupt" in third.stderr  # not a fresh start either


@contextlib.contextmanager
def small_disk(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` mounted at path for the block: a disk the test can fill."""
    path.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                            capture_output=True, text=True)
    if result.returncode != 0:
        skip_or_fail_in_ci(f"cannot mount a tmpfs to fill up (needs root): {result.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(directory: Path) -> None:
    """Take every free byte of the file system, as a growing dataset or log would."""
    with open(directory / "filler", "wb", buffering=0) as f:  # unbuffered: nothing left to fail at close
        try:
            while True:
                f.write(b"\0" * 65536)
        except OSError:
            pass


def test_full_disk_while_saving_is_one_line_and_keeps_older_checkpoints(tmp_path, launches):
    with small_disk(tmp_path / "disk", "32m") as disk:
        args = tiny_run(tmp_path, samples=9600) + ["--checkpoint-dir", str(disk / "checkpoints")]
        run = Launch(args, tmp_path, launcher_env(free_port()))
        launches.append(run)
        first_checkpoint(disk / "checkpoints", run)
        fill(disk)
        assert run.wait(RUN_BOUND_S) != 0
        output = run.output()
        assert_no_traceback(output)
        full = [line for line in error_lines(output) if line.startswith("error: --checkpoint-dir: ")]
        assert len(full) == 1, output[-3000:]
        assert "no space left on device while writing step-" in full[0]
        assert re.search(r"the \d+ older checkpoint\(s\) are intact, the newest step-\d{8}\.pt\)$", full[0]), full[0]
        failed_step = int(full[0].split("step-")[1][:8])
        assert error_lines(output)[-1].startswith("error: training failed: rank "), output[-3000:]
        assert "exited with code 1" in error_lines(output)[-1]

        kept = checkpoint.list_checkpoints(disk / "checkpoints")
        assert kept and all(int(p.stem[5:]) < failed_step for p in kept)
        for path in kept:
            assert checkpoint.load(path)["global_step"] == int(path.stem[5:])
        assert not list((disk / "checkpoints").glob(".tmp-*"))


def test_a_disk_that_fills_during_the_write_is_called_full(tmp_path):
    """The partial temp file is what filled the disk: its free space is measured before it is removed (after,
    the disk looked half empty and the error blamed the directory's permissions, or torch's zip writer)."""
    with small_disk(tmp_path / "disk", "8m") as disk:
        state = {"format": checkpoint.FORMAT, "weights": torch.zeros(4 << 20)}  # 16 MiB: half of it fits
        with pytest.raises(checkpoint.CheckpointError) as raised:
            checkpoint.save(disk / "checkpoints", 1, state, keep=2)
        message = str(raised.value)
        assert "no space left on device while writing step-00000001.pt" in message, message
        assert message.endswith("; no earlier checkpoint exists)") and "intact" not in message, message
        assert not list((disk / "checkpoints").iterdir())


def test_a_checkpoint_dir_with_less_room_than_one_checkpoint_is_refused_before_training(tmp_path):
    """The run's first checkpoint would not fit: one line at the start, not an error at the first save."""
    with small_disk(tmp_path / "disk", "3m") as disk:
        result = run_trainer_forked([*tiny_run(tmp_path, samples=64), "--model", "resnet18", "--checkpoint-dir",
                                     str(disk / "checkpoints")], tmp_path, timeout=RUN_BOUND_S)
        line = assert_usage_error(result, "--checkpoint-dir")
        assert re.search(r"has \d+ MiB free, less than one checkpoint needs \(about \d+ MiB\)", line), line
        assert not checkpoint.list_checkpoints(disk / "checkpoints")


def test_full_log_disk_at_start_is_one_line_before_training(tmp_path):
    """An empty file still fits on a full disk, so the start-up check also asks for free space."""
    with small_disk(tmp_path / "disk", "2m") as disk:
        fill(disk)
        result = run_trainer_forked([*tiny_run(tmp_path, samples=64), "--log-dir", str(disk / "runs")], tmp_path,
                                    timeout=RUN_BOUND_S)
        line = assert_usage_error(result, "--log-dir")
        assert f"'{disk / 'runs'}' has 0 KiB free" in line
        assert not checkpoint.list_checkpoints(tmp_path / "checkpoints")


def test_log_disk_filling_up_mid_run_costs_the_events_not_the_training(tmp_path):
    with small_disk(tmp_path / "disk", "4m") as disk:
        # lr 0.05: at tiny_run's 0.1 this cnn's 600 steps diverged at step 202 on one of CI's CPUs (AMD EPYC, one
        # thread), and the run ended on that instead of on the full disk. 200 steps: the disk fills at the first
        # events, and every step logs (the writer meets the full disk within its first queue of 10 events).
        args = [*tiny_run(tmp_path, samples=3200), "--log-dir", str(disk / "runs"), "--log-every", "1", "--lr", "0.05"]
        worker = subprocess.Popen([sys.executable, "-m", "trainer", *args], cwd=tmp_path, env=clean_env(),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        wait_until(lambda: list((disk / "runs").glob("events.out.tfevents.*")), 120, "the first TensorBoard events")
        fill(disk)
        _, stderr = worker.communicate(timeout=RUN_BOUND_S)
        assert worker.returncode == 1 and "Traceback" not in stderr, stderr[-3000:]
        warned = [line for line in stderr.splitlines() if "TensorBoard events can no longer be written" in line]
        assert len(warned) == 1 and "training goes on without them" in warned[0], stderr[-3000:]
        assert stderr.strip().splitlines()[-1].startswith("error: --log-dir: cannot write summary.json (No space ")
        assert checkpoint_steps(tmp_path / "checkpoints")[-1] == 200  # training went on to its last step
        assert not list((disk / "runs").glob(".summary.json*"))


# ------------------------------------------------------------------------------------ divergence

@pytest.mark.parametrize("log_every, checkpoint_every", [(4, 100), (100, 3)], ids=["at a log step", "at a checkpoint"])
def test_a_diverging_run_stops_with_one_line_and_commits_no_nan_weights(tmp_path, launches, log_every,
                                                                       checkpoint_every):
    # A learning rate of 1e4 turns the weights to inf and NaN within a few steps (an epoch is 75).
    args = tiny_run(tmp_path) + ["--lr", "1e4", "--warmup-steps", "0", "--log-every", str(log_every),
                                 "--checkpoint-every", str(checkpoint_every)]
    run = Launch(args, tmp_path, launcher_env(free_port()))
    launches.append(run)
    assert run.wait(RUN_BOUND_S) == 1
    output = run.output()
    assert_no_traceback(output)
    lines = [line for line in error_lines(output) if line.startswith("error: training diverged by step ")]
    assert len(lines) == 2 and lines[0] == lines[1], output[-3000:]  # both ranks, the same step
    failed_step = int(lines[0].split("by step ")[1].split(":")[0])
    assert failed_step % min(log_every, checkpoint_every) == 0  # caught at the first check after it
    assert "were not committed" in lines[0] and "lower --lr" in lines[0]
    assert error_lines(output)[-1].startswith("error: training failed: rank "), output[-3000:]
    assert "exited with code 1" in error_lines(output)[-1] and "terminate called" not in output

    kept = checkpoint_steps(tmp_path / "checkpoints")  # oldest first
    # Every checkpoint step before the divergence was committed (every 3: step 3 at least), none after it:
    # the loop below has checkpoints to check whenever there were any.
    assert bool(kept) == (checkpoint_every < failed_step) and all(step < failed_step for step in kept), kept
    for step in kept:
        state = checkpoint.load(checkpoint.checkpoint_path(tmp_path / "checkpoints", step))
        assert all(t.isfinite().all() for t in state["model"].values() if t.is_floating_point())
    newest = f"the newest checkpoint is step {kept[-1]}" if kept else "no checkpoint of this run"
    assert newest in lines[0]


def test_a_non_finite_loss_with_finite_weights_trains_on(tmp_path):
    """An fp16 overflow the loss scaler skipped: the loss is inf, the weights are not, and the run is no
    divergence. A model whose class-0 logit is -inf (tests/user_code/infinite_loss.py) gives every batch
    holding a class-0 sample an infinite loss and finite gradients, on CPUs."""
    result = subprocess.run([sys.executable, "-m", "trainer", *tiny_run(tmp_path, samples=320), "--model",
                             "infinite_loss:build", "--log-every", "4"], cwd=tmp_path,
                            env=clean_env({"PYTHONPATH": f"{USER_CODE}:{REPO}"}), capture_output=True, text=True,
                            timeout=RUN_BOUND_S)
    assert result.returncode == 0 and "diverged" not in result.stderr, result.stderr[-3000:]
    losses = read_scalars(tmp_path / "runs")["Loss/train"]
    assert [step for step, _ in losses] == list(range(4, 21, 4))
    assert losses[0][1] == float("inf"), losses  # checked at step 4, and trained on to the end
    summary = read_summary(tmp_path / "runs")
    assert summary["status"] == "completed" and summary["global_step"] == 20  # 320 / 16
    assert summary["train_loss"] == float("inf")
    weights = checkpoint.load(checkpoint.checkpoint_path(tmp_path / "checkpoints", 20))["model"]
    assert all(t.isfinite().all() for t in weights.values())


# ------------------------------------------------------------------------------------ graceful stop

def test_sigterm_checkpoints_exits_zero_and_the_next_start_resumes(tmp_path, launches):
    args = tiny_run(tmp_path, samples=3200)
    run = Launch(args, tmp_path, launcher_env(free_port()))
    launches.append(run)
    first_checkpoint(tmp_path / "checkpoints", run)
    os.kill(run.pid, signal.SIGTERM)  # what `docker compose stop` sends to the container's PID 1
    assert run.wait(SLACK_S) == 0, run.output()[-4000:]
    assert_no_traceback(run.output())
    stopped = read_summary(tmp_path / "runs")
    assert stopped["status"] == "stopped" and 0 < stopped["global_step"] < 100
    assert checkpoint_steps(tmp_path / "checkpoints")[-1] == stopped["global_step"]
    assert run.output().strip().splitlines()[-1] == (  # what was saved, in the launcher's last line
        f"stopped by SIGTERM: every worker on this host exited 0; the stop checkpoint step {stopped['global_step']} "
        "is committed")

    again = Launch(args, tmp_path, launcher_env(free_port()), name="again")
    launches.append(again)
    assert again.wait(RUN_BOUND_S) == 0, again.output()[-4000:]
    done = read_summary(tmp_path / "runs")
    assert done["status"] == "completed"
    assert done["resumed_from_step"] == stopped["global_step"] and done["global_step"] == 100


@pytest.mark.parametrize("stopped_node", [0, 1], ids=["node 0 (the rendezvous host)", "node 1"])
def test_stopping_one_host_stops_the_whole_job_at_once(tmp_path, launches, stopped_node):
    """`docker compose stop` on one host of a two-host job: the ranks agree on a step, and the other
    host's launcher leaves too, instead of waiting out torchrun's 300 s exit barrier."""
    port = free_port()
    nodes = [Launch(tiny_run(tmp_path, samples=6400), tmp_path,
                    launcher_env(port, NPROC_PER_NODE="1", NNODES="2", NODE_RANK=str(rank), MASTER_ADDR="127.0.0.1"),
                    name=f"node{rank}") for rank in (0, 1)]
    launches.extend(nodes)
    first_checkpoint(tmp_path / "checkpoints", nodes[0])
    os.kill(nodes[stopped_node].pid, signal.SIGTERM)
    for node in nodes:
        assert node.wait(SLACK_S) == 0, node.output()[-4000:]
        assert_no_traceback(node.output())
    other = nodes[1 - stopped_node].output()
    assert "the stop was requested on another host: stopping this host's launcher too" in other, other[-3000:]
    stopped = read_summary(tmp_path / "runs")
    assert stopped["status"] == "stopped" and stopped["world_size"] == 2 and stopped["global_step"] < 200
    assert checkpoint_steps(tmp_path / "checkpoints")[-1] == stopped["global_step"]


@pytest.mark.parametrize("hold", ["data", "model"], ids=["building the data", "building the model"])
def test_ctrl_c_while_starting_ends_in_one_line(tmp_path, hold):
    """Before the training loop's handler exists, SIGINT is Python's KeyboardInterrupt: no traceback either.
    The worker's own dataset or model factory (tests/user_code/startup.py) holds it there, so the signal
    lands at that point of the start-up, whatever the machine's speed."""
    args = ["--dataset", "startup:data", "--model", "startup:model", "--batch-size", "16", "--epochs", "1",
            "--num-workers", "0", *dirs_args(tmp_path)]
    # As in a terminal: SIGINT at its default. A runner started in the background by a non-interactive shell
    # (`ci &`) hands its children SIGINT ignored, and Python keeps it ignored: no Ctrl-C would reach them.
    worker = subprocess.Popen([sys.executable, "-m", "trainer", *args], cwd=tmp_path,
                              env=clean_env({"STARTUP_HOLD": hold, "PYTHONPATH": f"{USER_CODE}:{REPO}"}),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        wait_until(lambda: (tmp_path / f"{hold}.started").exists() or worker.poll() is not None, RUN_BOUND_S,
                   f"the worker to start building the {hold}")
    finally:
        worker.send_signal(signal.SIGINT)
    _, stderr = worker.communicate(timeout=RUN_BOUND_S)
    assert "Traceback" not in stderr, stderr[-3000:]
    assert worker.returncode == 130, stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == "error: interrupted (SIGINT) before training started", stderr
    assert not checkpoint_files(tmp_path / "checkpoints")
