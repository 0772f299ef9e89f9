"""The launcher's word and exit status tell the truth (docs/reliability.md, "the launcher" rows).

Real launcher, real torchrun, real gloo ranks: the tutorials' own launch patterns run under trainer-launch; a
stop that saved nothing is not called a success; a lost launcher leaves no process behind, and its peer host
stops at once; a rank stuck in the user's code is named with its stack.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fault_helpers import Launch, descendants, error_lines, launcher_env, running, tiny_run, wait_until
from helpers import REPO, assert_usage_error, clean_env, free_port

USER_CODE = REPO / "tests" / "user_code"
RUN_BOUND_S = 240  # a whole short run on a loaded 2-core machine; a bound on a hang, not a speed goal


def pids_of(fragment: str) -> list[int]:
    """Processes whose command line holds `fragment` (this test's script path)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if fragment in cmdline and running(int(entry.name)):
                found.append(int(entry.name))
    return found


# ------------------------------------------------------------------ the tutorials' own launch patterns

def test_a_script_that_spawns_its_own_processes_runs_once_per_host(tmp_path, launches):
    """The mp.spawn tutorial as written (its own MASTER_ADDR/PORT, ranks from -g and -nr): before, every
    torchrun copy spawned its own pair and waited on a store nobody hosted, silently, for 30 minutes."""
    run = Launch([str(USER_CODE / "tutorial_spawn.py"), "-n", "1", "-g", "2", "-nr", "0", "--epochs", "1"],
                 tmp_path, launcher_env(free_port()))
    launches.append(run)
    assert run.wait(RUN_BOUND_S) == 0, run.output()[-4000:]
    output = run.output()
    assert "starts its own processes (it calls torch.multiprocessing's spawn): running it once on this host" in output
    assert "rank 0 of 2 done" in output and "rank 1 of 2 done" in output
    assert "Training complete in:" in output


SPAWNED_CYCLE = """
import sys
import torch.multiprocessing as mp


class Held:  # what a DDP model's hooks do to its process group: kept alive by a reference cycle only
    def __init__(self, rank):
        self.rank, self.me = rank, self

    def __del__(self):
        print(f"rank {self.rank} freed {'in the teardown' if sys.is_finalizing() else 'while alive'}", flush=True)


def train(rank):
    Held(rank)


if __name__ == "__main__":
    mp.spawn(train, nprocs=2)
"""


def test_the_processes_a_script_spawns_itself_free_their_cycles_while_alive(tmp_path, launches):
    """A DDP model holds its process group through reference cycles; freed in the interpreter's teardown, the
    group's threads aborted the process after its last step (SIGABRT: CI's mp.spawn tutorial, the job failed after
    it finished). The bootstrap frees them while the interpreter is whole in its own workers; the ranks a script
    run once on its host spawns itself (mp.spawn) do too, at their exit: a cycle of each is freed before the
    teardown, not in it."""
    (tmp_path / "spawned_cycle.py").write_text(SPAWNED_CYCLE)
    run = Launch(["spawned_cycle.py"], tmp_path, launcher_env(free_port()))
    launches.append(run)
    assert run.wait(RUN_BOUND_S) == 0, run.output()[-4000:]
    output = run.output()
    assert "running it once on this host" in output, output[-2000:]
    assert "rank 0 freed while alive" in output and "rank 1 freed while alive" in output, output[-2000:]
    assert "in the teardown" not in output, output[-2000:]


def test_a_tcp_init_script_runs_once_per_host_on_two_hosts(tmp_path, launches):
    """The tcp:// notebooks: each host's copy gives its own --rank; the launcher runs one copy per host."""
    address = f"tcp://127.0.0.1:{free_port()}"
    port = free_port()
    nodes = []
    for node in (1, 0):
        env = launcher_env(port, NNODES="2", NODE_RANK=str(node), MASTER_ADDR="127.0.0.1", NPROC_PER_NODE="1")
        nodes.append(Launch([str(USER_CODE / "tutorial_tcp.py"), "--init-method", address, "--rank", str(node),
                             "--world-size", "2"], tmp_path, env, name=f"node{node}"))
    launches.extend(nodes)
    for node in nodes:
        assert node.wait(RUN_BOUND_S) == 0, node.output()[-4000:]
    assert "rank 1 of 2 done" in nodes[0].output() and "rank 0 of 2 done" in nodes[1].output()
    assert "joins its process group at a tcp:// address with its own rank" in nodes[1].output()


def test_script_launch_torchrun_overrides_what_the_source_suggests(tmp_path):
    def dry_run(**env: str) -> dict:
        result = subprocess.run([sys.executable, "-m", "trainer.cli.launch", "--dry-run",
                                 str(USER_CODE / "tutorial_spawn.py")], cwd=tmp_path, capture_output=True, text=True,
                                env=clean_env(env), timeout=60)
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)

    forced = dry_run(SCRIPT_LAUNCH="torchrun")
    assert forced["command"][0] == "torchrun" and "once_per_host" not in forced
    detected = dry_run()
    assert detected["command"][:2] == [sys.executable, str(USER_CODE / "tutorial_spawn.py")]
    assert detected["once_per_host"] == "it calls torch.multiprocessing's spawn"
    assert forced["mode"] == "torchrun" and detected["mode"] == "per-host"  # not torchrun's, beside once_per_host
    assert dry_run(SCRIPT_LAUNCH="per-host")["once_per_host"] == "SCRIPT_LAUNCH=per-host"


@pytest.mark.parametrize("setting, value", [("SCRIPT_LAUNCH", "always"), ("HANG_TIMEOUT", "soon"),
                                            ("HANG_TIMEOUT", "-1"), ("STOP_GRACE_PERIOD", "0"),
                                            ("STOP_GRACE_PERIOD", "-1"), ("STOP_GRACE_PERIOD", "abc"),
                                            ("STOP_GRACE_PERIOD", "1m30"), ("STOP_GRACE_PERIOD", "70 s")])
def test_bad_launcher_settings_are_one_line(tmp_path, setting, value):
    result = subprocess.run([sys.executable, "-m", "trainer.cli.launch", str(USER_CODE / "tutorial_tcp.py")],
                            cwd=tmp_path, capture_output=True, text=True, env=clean_env({setting: value}), timeout=60)
    assert_usage_error(result, setting)


# ------------------------------------------------------------------ a stop's exit status

NO_HANDLER = """
import time
import torch.distributed as dist

dist.init_process_group("gloo")
time.sleep(0.5)  # training began: the launcher's record of it polls every 50 ms
print(f"rank {dist.get_rank()} training", flush=True)
while True:
    time.sleep(0.1)
"""


def test_sigterm_to_a_script_without_a_handler_is_not_called_a_success(tmp_path, launches):
    """Its workers die of the signal and save nothing: 128 + SIGTERM (Slurm and Kubernetes read it), and a
    last line that says so. Before: exit 0 and 'workers were asked to checkpoint and exit'."""
    (tmp_path / "no_handler.py").write_text(NO_HANDLER)
    run = Launch(["no_handler.py"], tmp_path, launcher_env(free_port()))
    launches.append(run)
    wait_until(lambda: run.output().count("training") >= 2, RUN_BOUND_S, "both ranks to start")
    os.kill(run.pid, signal.SIGTERM)
    assert run.wait(60) == 128 + signal.SIGTERM, run.output()[-3000:]
    last = run.output().strip().splitlines()[-1]
    assert last == ("stopped by SIGTERM: ranks 0, 1 were killed before exiting (no handler for SIGTERM, or still "
                    "busy after the 55 s a stop gives, STOP_GRACE_PERIOD less the launcher's room); no checkpoint "
                    "through trainer.api (the launcher does not see a script's own checkpoint files)"), last


# ------------------------------------------------------------------ one grace period

SLOW_STOP = """
import os, signal, sys, time
import torch.distributed as dist


def stop(signum, frame):
    print(f"rank {os.environ['RANK']} stopping: a checkpoint that takes 40 s", flush=True)
    time.sleep(40)
    print(f"rank {os.environ['RANK']} done", flush=True)
    sys.exit(0)


signal.signal(signal.SIGTERM, stop)
dist.init_process_group("gloo")
time.sleep(0.5)  # training began: the launcher's record of it polls every 50 ms
print(f"rank {dist.get_rank()} training", flush=True)
while True:
    time.sleep(0.1)
"""


@pytest.mark.slow
def test_a_40_s_stop_under_stop_grace_period_70_exits_0_with_both_ranks_done(tmp_path, launches):
    """STOP_GRACE_PERIOD is the workers' time to stop on bare metal too (less the launcher's few seconds): a stop
    whose checkpoint takes 40 s finishes. Before: torchrun's fixed 30 s, then SIGKILL, exit 143."""
    (tmp_path / "slow_stop.py").write_text(SLOW_STOP)
    run = Launch(["slow_stop.py"], tmp_path, launcher_env(free_port(), STOP_GRACE_PERIOD="70"))
    launches.append(run)
    wait_until(lambda: run.output().count("training") >= 2, RUN_BOUND_S, "both ranks to start")
    os.kill(run.pid, signal.SIGTERM)
    stopped_at = time.monotonic()
    assert run.wait(70 + 30) == 0, run.output()[-3000:]
    assert time.monotonic() - stopped_at >= 40
    output = run.output()
    assert "rank 0 done" in output and "rank 1 done" in output
    assert "--shutdown-timeout=65 " in output  # the equivalent torchrun command says the same
    assert output.strip().splitlines()[-1] == ("stopped by SIGTERM: every worker on this host exited 0; no checkpoint "
                                               "through trainer.api (the launcher does not see a script's own "
                                               "checkpoint files)")


def test_a_stop_grace_period_longer_than_the_platforms_is_one_warning(tmp_path):
    """compose.yaml passes its own stop_grace_period (COMPOSE_STOP_GRACE_PERIOD), the Kubernetes manifests their
    terminationGracePeriodSeconds: a longer STOP_GRACE_PERIOD (docker compose run -e ...) would be cut short."""
    env = {"STOP_GRACE_PERIOD": "2m", "COMPOSE_STOP_GRACE_PERIOD": "60s", "TERMINATION_GRACE_PERIOD_SECONDS": "90"}
    result = subprocess.run([sys.executable, "-m", "trainer.cli.launch", "--dry-run", str(USER_CODE /
                            "tutorial_tcp.py")], cwd=tmp_path, capture_output=True, text=True, env=clean_env(env),
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip().splitlines() == [
        "warning: STOP_GRACE_PERIOD (120 s) is longer than compose's stop_grace_period (COMPOSE_STOP_GRACE_PERIOD=60s,"
        " 60 s): the platform kills the container first; give both the same time",
        "warning: STOP_GRACE_PERIOD (120 s) is longer than the pod's terminationGracePeriodSeconds "
        "(TERMINATION_GRACE_PERIOD_SECONDS=90, 90 s): the platform kills the container first; give both the same time"]
    assert json.loads(result.stdout)["mode"] == "per-host"
    quiet = subprocess.run([sys.executable, "-m", "trainer.cli.launch", "--dry-run", str(USER_CODE /
                           "tutorial_tcp.py")], cwd=tmp_path, capture_output=True, text=True,
                           env=clean_env({**env, "STOP_GRACE_PERIOD": "60s"}), timeout=60)
    assert quiet.returncode == 0 and quiet.stderr == "", quiet.stderr


LAST_STEP = """
import os, sys, time
import torch.distributed as dist

dist.init_process_group("gloo")
dist.barrier()  # the last step, on both hosts
rank = dist.get_rank()
print(f"rank {rank} after its last step", flush=True)
time.sleep(1)
dist.destroy_process_group()
time.sleep(30 if rank == 1 else 3)  # rank 1's host is lost here (its summary, say), rank 0's is done
"""


@pytest.mark.slow
def test_a_host_lost_after_the_last_step_holds_the_others_only_stop_grace_period_and_they_say_so(tmp_path, launches):
    """Two hosts; the second one's launcher is SIGKILLed after the last step, before its agent reaches the exit
    barrier: the first host's workers are done, and its agent waits for the lost one at most STOP_GRACE_PERIOD,
    announcing the wait, then exits 0 naming the host that went away. Before: torchrun's silent 300 s."""
    (tmp_path / "last_step.py").write_text(LAST_STEP)
    port = free_port()
    nodes = [Launch(["last_step.py"], tmp_path, launcher_env(port, NNODES="2", NODE_RANK=str(node), NPROC_PER_NODE="1",
                                                             MASTER_ADDR="127.0.0.1", STOP_GRACE_PERIOD="10s"),
                    name=f"node{node}") for node in (0, 1)]
    launches.extend(nodes)
    wait_until(lambda: "rank 1 after its last step" in nodes[1].output(), RUN_BOUND_S,
               f"the last step\n{nodes[0].output()[-2000:]}\n{nodes[1].output()[-2000:]}")
    os.kill(nodes[1].pid, signal.SIGKILL)
    lost_at = time.monotonic()
    assert nodes[0].wait(3 + 10 + 30) == 0, nodes[0].output()[-3000:]
    assert time.monotonic() - lost_at >= 10
    output = nodes[0].output()
    assert "this host's workers are done; waiting up to 10 s (STOP_GRACE_PERIOD) for the other hosts to finish " \
        "theirs" in output, output[-3000:]
    last = output.strip().splitlines()[-1]
    assert last.startswith(f"warning: node 1 (host {socket.gethostname()}) went away (its launcher stopped "
                           "answering the rendezvous store"), last
    assert last.endswith("; this host's workers finished, and it stopped waiting for the other hosts after "
                         "STOP_GRACE_PERIOD (10 s)"), last
    assert "Traceback" not in output


REWORD = """
import logging, sys

print("torch's elastic log reworded here", file=sys.stderr, flush=True)

_log = logging.Logger._log


def _reworded(self, level, msg, args, *rest, **kwargs):
    if self.name.startswith("torch.distributed.elastic") and isinstance(msg, str):
        msg = msg.replace("failed (exitcode", "ended (status").replace("exitcode", "status")
    return _log(self, level, msg, args, *rest, **kwargs)


logging.Logger._log = _reworded
"""
FAILS_ONCE = """
import os, sys

if os.environ["RANK"] == "1" and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    sys.exit(3)
print(f"rank {os.environ['RANK']} attempt {os.environ['TORCHELASTIC_RESTART_COUNT']} done", flush=True)
"""


def test_a_torchrun_log_line_reworded_changes_nothing_in_the_launchers_end(tmp_path):
    """torch's agent logs every worker failure ("failed (exitcode: 3) local_rank: 1 ..."); the launcher's restart
    line and its end come from the agent's RunResult, not from that text. Reworded (every process loads the
    rewording: a sitecustomize on PYTHONPATH), the restart is still announced and the job still ends well."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(REWORD)
    (tmp_path / "fails_once.py").write_text(FAILS_ONCE)
    env = launcher_env(free_port(), MAX_RESTARTS="1", PYTHONPATH=f"{tmp_path / 'site'}:{REPO}")
    result = subprocess.run([sys.executable, "-m", "trainer.cli.launch", "fails_once.py"], cwd=tmp_path,
                            env=clean_env(env), capture_output=True, text=True, timeout=RUN_BOUND_S)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "torch's elastic log reworded here" in result.stderr
    assert (f"restart 1 of 1: rank 1 (host {socket.gethostname()}) exited with code 3; every rank of this host starts "
            "again from the newest checkpoint") in result.stderr, result.stderr[-3000:]
    assert "rank 0 attempt 1 done" in result.stdout and "rank 1 attempt 1 done" in result.stdout


# ------------------------------------------------------------------ lines that are true, and one per cause

FAILS_ONCE_ELASTIC = """
import os, sys
import torch.distributed as dist

dist.init_process_group("gloo")
dist.barrier()
if dist.get_rank() == 1 and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    sys.exit(3)
dist.barrier()
print(f"rank {dist.get_rank()} of {dist.get_world_size()} done", flush=True)
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_an_elastic_restart_names_the_global_rank_and_its_host(tmp_path, launches):
    """NNODES=1:2, two launchers of one worker each on this machine: the worker with RANK=1 (its local rank is 0)
    exits 3 once. Its host's restart line names rank 1 and the host. Before: the local rank ("rank 0"), no host."""
    (tmp_path / "fails_once.py").write_text(FAILS_ONCE_ELASTIC)
    port = free_port()
    hosts = [Launch(["fails_once.py"], tmp_path, launcher_env(port, NNODES="1:2", NPROC_PER_NODE="1",
                                                              MASTER_ADDR="127.0.0.1", MAX_RESTARTS="1"),
                    name=f"host{n}") for n in (0, 1)]
    launches.extend(hosts)
    for one in hosts:
        assert one.wait(RUN_BOUND_S) == 0, one.output()[-3000:]
    both = hosts[0].output() + hosts[1].output()
    assert re.search(rf"^restart 1 of 1: rank 1 \(host {re.escape(socket.gethostname())}\) exited with code 3; the "
                     r"hosts still here meet again \(NNODES=1:2\)", both, re.M), both[-3000:]
    assert "rank 0 of 2 done" in both and "rank 1 of 2 done" in both


SLOW_IMPORTS = """
import time

print("importing", flush=True)
time.sleep(60)  # a framework's imports
"""


def test_a_stop_during_start_up_says_so(tmp_path, launches):
    """SIGTERM while the workers are still starting (no process group yet): the line says what happened, not the
    reasons of a stop in training (no handler, a stop that took too long)."""
    (tmp_path / "slow_imports.py").write_text(SLOW_IMPORTS)
    run = Launch(["slow_imports.py"], tmp_path, launcher_env(free_port()))
    launches.append(run)
    wait_until(lambda: run.output().count("importing") >= 2, RUN_BOUND_S, "both workers to start")
    os.kill(run.pid, signal.SIGTERM)
    assert run.wait(60) == 128 + signal.SIGTERM, run.output()[-3000:]
    assert run.output().strip().splitlines()[-1] == (
        "stopped by SIGTERM during start-up, before training began; no checkpoint through trainer.api (the launcher "
        "does not see a script's own checkpoint files)")


RAISES = """
import os


def load_batch():
    raise ValueError("a batch the script cannot read")


if os.environ["RANK"] == "1":
    load_batch()
"""


def test_a_scripts_traceback_starts_at_the_scripts_own_frames(tmp_path):
    """The worker runs the script through runpy and the launcher's bootstrap: their frames are left out of the
    script's traceback, as torchrun's @record leaves its own out; the launcher's line follows."""
    (tmp_path / "raises.py").write_text(RAISES)
    result = subprocess.run([sys.executable, "-m", "trainer.cli.launch", "raises.py"], cwd=tmp_path,
                            env=clean_env(launcher_env(free_port())), capture_output=True, text=True,
                            timeout=RUN_BOUND_S)
    assert result.returncode == 1, result.stderr[-3000:]
    lines = result.stderr.splitlines()
    first = lines.index("Traceback (most recent call last):")
    assert lines[first + 1] == '  File "raises.py", line 10, in <module>', lines[first:first + 6]
    assert "runpy" not in result.stderr and "bootstrap.py" not in result.stderr, result.stderr
    assert "ValueError: a batch the script cannot read" in lines
    assert error_lines(result.stderr) == ["error: training failed: rank 1 exited with code 1; its own error is "
                                          "printed above"]


# ------------------------------------------------------------------ no orphans

def test_a_killed_launcher_takes_its_workers_and_their_children_along(tmp_path, launches):
    """SIGKILL to the launcher (an OOM kill, a lost container runtime): its worker, and the processes that
    worker spawned itself (the mp.spawn tutorial's two), are gone within seconds instead of training on."""
    run = Launch([str(USER_CODE / "tutorial_spawn.py"), "-n", "1", "-g", "2", "-nr", "0", "--epochs", "50"],
                 tmp_path, launcher_env(free_port()))
    launches.append(run)
    wait_until(lambda: "Step [4/" in run.output(), RUN_BOUND_S, f"training to start\n{run.output()[-2000:]}")
    started = descendants(run.pid)
    assert len(started) >= 3, started  # the script, and the two processes it spawned
    os.kill(run.pid, signal.SIGKILL)
    run.proc.wait()
    wait_until(lambda: not [pid for pid in started if running(pid)], 10, "every process it started to be gone")


WAITS = """
import time

print("waiting", flush=True)
time.sleep(600)
"""


def test_the_next_launcher_removes_a_killed_launchers_folder_and_keeps_a_live_ones(tmp_path, launches):
    """A SIGKILLed launcher cannot remove its temp folder (trainer-agent-*: its workers' records); the next launcher
    on the host removes it, even where its pid is a live process's by now, and leaves the folder of a launcher that
    still runs (another job on the host) alone. Before: every killed launcher's folder stayed in /tmp for good."""
    (tmp_path / "waits.py").write_text(WAITS)
    (tmp_path / "done.py").write_text('print("done", flush=True)\n')
    temp = tmp_path / "tmp"
    temp.mkdir()
    env = launcher_env(free_port(), NPROC_PER_NODE="1", TMPDIR=str(temp))

    def folders() -> set[Path]:
        return set(temp.glob("trainer-agent-*"))

    def start(name: str) -> tuple[Launch, Path]:
        before = folders()
        run = Launch(["waits.py"], tmp_path, {**env, "MASTER_PORT": str(free_port())}, name=name)
        launches.append(run)
        wait_until(lambda: "waiting" in run.output(), RUN_BOUND_S, f"{name}'s worker to start\n{run.output()}")
        new, = folders() - before
        return run, new

    killed, killed_folder = start("killed")
    live, live_folder = start("live")
    started = descendants(killed.pid)
    for pid in [killed.pid, *started]:
        os.kill(pid, signal.SIGKILL)
    killed.proc.wait()
    wait_until(lambda: not [pid for pid in started if running(pid)], 10, "the killed launcher's worker to be gone")
    assert killed_folder.is_dir()  # what a SIGKILL leaves
    if (killed_folder / "launcher.lock").is_file():  # its pid, now a live process's (pid reuse)
        (killed_folder / "launcher.lock").write_text(f"{os.getpid()}\n")

    after = Launch(["done.py"], tmp_path, {**env, "MASTER_PORT": str(free_port())}, name="after")
    launches.append(after)
    assert after.wait(RUN_BOUND_S) == 0, after.output()[-3000:]
    assert not killed_folder.exists(), sorted(killed_folder.iterdir())
    assert live_folder.is_dir() and live.proc.poll() is None, live.output()[-3000:]
    assert (live_folder / "launcher.lock").read_text() == f"{live.pid}\n"
    assert folders() == {live_folder}  # the one that ended removed its own


@pytest.mark.parametrize("lost", [1, 0], ids=["a worker host", "the rendezvous host"])
def test_when_one_hosts_launcher_dies_the_other_stops_at_once_naming_it(tmp_path, launches, lost):
    """Two launcher nodes; one launcher SIGKILLed mid-run: its worker dies with it, the other node's rank loses
    its peer at the next collective and that node exits non-zero well within the collective timeout, naming
    the host that went away (node 0 is the one whose store the rendezvous lives in), with no exit-barrier
    wait and no DistStoreError pages."""
    port = free_port()
    nodes = []
    for node in (0, 1):
        env = launcher_env(port, NNODES="2", NODE_RANK=str(node), MASTER_ADDR="127.0.0.1", NPROC_PER_NODE="1")
        nodes.append(Launch(tiny_run(tmp_path / f"n{node}", samples=96000) + ["--collective-timeout", "300"],
                            tmp_path, env, name=f"node{node}"))
    launches.extend(nodes)
    wait_until(lambda: (tmp_path / "n0" / "checkpoints").is_dir() and
               any((tmp_path / "n0" / "checkpoints").glob("step-*.pt")), RUN_BOUND_S,
               f"a first checkpoint\n{nodes[0].output()[-2000:]}")
    worker = nodes[lost].workers()[lost]
    os.kill(nodes[lost].pid, signal.SIGKILL)
    killed_at = time.monotonic()
    wait_until(lambda: not running(worker), 10, f"node {lost}'s worker to die with its launcher")
    survivor = nodes[1 - lost]
    code = survivor.wait(60)
    assert code != 0
    assert time.monotonic() - killed_at < 60
    output = survivor.output()
    assert "DistStoreError" not in output, output[-3000:]
    last = error_lines(output)[-1]
    if lost == 1:
        assert last.startswith(f"error: training failed: node 1 (host {socket.gethostname()}) went away (its "
                               "launcher stopped answering the rendezvous store"), output[-3000:]
        assert last.endswith("; rank 0 exited with code 1 when it lost its peers"), last
    else:
        assert last.startswith("error: training failed: the rendezvous host 127.0.0.1 went away (its store at "
                               f"127.0.0.1:{port} stopped answering"), output[-3000:]


# ------------------------------------------------------------------ hangs are named

STUCK = """
import time

import torch
import torch.distributed as dist


def load_batch(step):
    if dist.get_rank() == 1 and step == 3:
        time.sleep(3600)  # a read that never returns
    return torch.ones(4)


def main():
    dist.init_process_group("gloo")
    for step in range(1000):
        batch = load_batch(step)
        dist.all_reduce(batch)
        print(f"rank {dist.get_rank()} step {step}", flush=True)
        time.sleep(0.1)


main()
"""


def test_a_rank_stuck_in_the_users_code_is_named_with_its_stack(tmp_path, launches):
    """HANG_TIMEOUT=30: no output from any rank for 30 s; every rank's stack, the stuck rank named at its line,
    exit 1. Without it the job waits out gloo's 30-minute default."""
    (tmp_path / "stuck.py").write_text(STUCK)
    run = Launch(["stuck.py"], tmp_path, launcher_env(free_port(), HANG_TIMEOUT="30"))
    launches.append(run)
    wait_until(lambda: "rank 0 step 2" in run.output(), RUN_BOUND_S, "the first steps")
    started = time.monotonic()
    assert run.wait(RUN_BOUND_S) == 1, run.output()[-4000:]
    assert time.monotonic() - started >= 25  # not before the bound (output stopped at step 3, after this)
    output = run.output()
    line = error_lines(output)[-1]
    sleeping = next(n for n, text in enumerate(STUCK.splitlines(), 1) if "time.sleep(3600)" in text)
    assert re.fullmatch(r"error: hang: no progress for 30 s \(HANG_TIMEOUT\): rank 1 \(host .+\) is not in the "
                        rf"collective: stuck at stuck\.py:{sleeping} in load_batch; the stacks are above .*", line), line
    assert "--- rank 0 " in output and "--- rank 1 " in output
    assert re.search(r'File ".*distributed_c10d\.py", line \d+ in all_reduce', output)  # rank 0's wait
    assert not pids_of(" stuck.py")  # the workers are gone with the job


# ------------------------------------------------------------------ ports

HELLO = """
import torch.distributed as dist

dist.init_process_group("gloo")
dist.barrier()
print(f"rank {dist.get_rank()} joined at port {__import__('os').environ['MASTER_PORT']}", flush=True)
"""


def test_on_one_host_with_master_port_unset_a_taken_29500_is_no_conflict(tmp_path):
    """Host networking shares the host's ports: something on 29500 (another job, another user's torchrun)
    made the fixed default fail. On one host with MASTER_PORT unset the launcher takes a free port."""
    (tmp_path / "hello.py").write_text(HELLO)
    with socket.socket() as taken:
        try:
            taken.bind(("", 29500))
            taken.listen()
        except OSError:
            pass  # taken already, by something else: the same situation
        env = {key: value for key, value in launcher_env(0).items() if key != "MASTER_PORT"}
        result = subprocess.run([sys.executable, "-m", "trainer.cli.launch", "hello.py"], cwd=tmp_path,
                                env=clean_env(env), capture_output=True, text=True, timeout=RUN_BOUND_S)
    assert result.returncode == 0, result.stderr[-3000:]
    ports = set(re.findall(r"joined at port (\d+)", result.stdout))
    assert len(ports) == 1 and ports != {"29500"}, result.stdout
    assert f"--master-port={ports.pop()}" in result.stderr


# ------------------------------------------------------------------ every process trained alone

ALONE = """
import torch

print("training on my own", flush=True)
"""


@pytest.mark.parametrize("script, env, warning", [
    ("tutorial_accelerate.py", {}, "accelerate ran every rank as DistributedType.NO, a job of one: set "
                                   "ACCELERATE_USE_CPU=1 on CPUs"),
    ("tutorial_accelerate.py", {"ACCELERATE_USE_CPU": "1"}, None),
    ("alone.py", {}, "the script never called init_process_group"),
], ids=["accelerate on CPUs", "accelerate told to use the CPUs", "no process group"])
def test_ranks_that_trained_alone_are_told_in_one_warning(tmp_path, script, env, warning):
    """accelerate on CPUs without ACCELERATE_USE_CPU runs every rank as a whole job of its own (each on all the
    data, each printing its own results) and exits 0: the launcher's last line says so, and why."""
    (tmp_path / "alone.py").write_text(ALONE)
    path = str(USER_CODE / script) if script.startswith("tutorial") else script
    result = subprocess.run([sys.executable, "-m", "trainer.cli.launch", path], cwd=tmp_path,
                            env=clean_env(launcher_env(free_port(), **env)), capture_output=True, text=True,
                            timeout=RUN_BOUND_S)
    assert result.returncode == 0, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    if warning is None:
        assert "trained alone" not in result.stderr, result.stderr[-2000:]
        assert "process 1 of 2: DistributedType.MULTI_CPU" in result.stdout
    else:
        assert last == f"warning: every process trained alone, not as one job of 2 ranks ({warning})", last


# The tutorials' ending: destroy_process_group(), then return, with the DDP model still in reference cycles.
TUTORIAL_ENDING = """
import os, sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


class Witness:
    \"\"\"Freed with the model's cycles: says whether the interpreter was still whole then.\"\"\"
    def __del__(self):
        print(f"rank {os.environ['RANK']} freed the model, finalizing={sys.is_finalizing()}", file=sys.stderr,
              flush=True)


def main():
    dist.init_process_group("gloo")
    model = DDP(torch.nn.Linear(4, 2))
    model.witness = Witness()
    model.cycle = model  # what DDP's hooks do, made certain
    model(torch.ones(2, 4)).sum().backward()
    dist.destroy_process_group()
    if os.environ.get("ABORT_AT_EXIT") == os.environ["RANK"]:
        import atexit
        atexit.register(os.abort)  # a library's thread torn down in the interpreter's exit, made certain


main()
"""


def test_a_script_ending_as_the_tutorials_do_frees_its_process_group_before_the_interpreter_exits(tmp_path):
    """A model still holding the process group at the interpreter's exit aborted plain-torchrun runs (SIGABRT,
    "terminate called without an active exception") after their last step; under the launcher it is freed while
    the interpreter is whole."""
    (tmp_path / "ending.py").write_text(TUTORIAL_ENDING)
    result = subprocess.run([sys.executable, "-m", "trainer.cli.launch", "ending.py"], cwd=tmp_path,
                            env=clean_env(launcher_env(free_port())), capture_output=True, text=True,
                            timeout=RUN_BOUND_S)
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in (0, 1):
        assert f"rank {rank} freed the model, finalizing=False" in result.stderr, result.stderr[-3000:]


API_ENDING = """
import os, sys

import torch
from trainer import api


class Witness:
    def __del__(self):
        print(f"rank {os.environ['RANK']} freed the model, finalizing={sys.is_finalizing()}", file=sys.stderr,
              flush=True)


def main():
    with api.Run(checkpoint_every=0) as run:
        model = run.wrap(torch.nn.Linear(4, 2))
        model.witness = Witness()
        model.witness.model = model  # a cycle, as DDP's hooks make one, made certain
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        run.resume(model=model, optimizer=optimizer)
        for _ in range(2):
            run.backward(model(torch.ones(8, 4)).sum())
            run.optimizer_step(optimizer)
            run.step()


main()
"""


def test_a_script_on_the_api_under_plain_torchrun_frees_its_model_while_the_interpreter_is_whole(tmp_path):
    """Not only under the launcher: a process that formed its group through trainer.api (the built-in loop too)
    frees what still holds the group at its exit, before the interpreter's teardown (CI: rank 1 of the built-in
    loop under plain torchrun aborted after its last step, "terminate called without an active exception")."""
    (tmp_path / "ending.py").write_text(API_ENDING)
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                             str(free_port()), "ending.py"], cwd=tmp_path,
                            env=clean_env({"TRAIN_CHECKPOINT_DIR": str(tmp_path / "c"),
                                           "TRAIN_LOG_DIR": str(tmp_path / "r")}),
                            capture_output=True, text=True, timeout=RUN_BOUND_S)
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in (0, 1):
        assert f"rank {rank} freed the model, finalizing=False" in result.stderr, result.stderr[-3000:]


def test_a_rank_that_aborts_at_exit_after_its_last_step_is_named_so(tmp_path):
    """A SIGABRT after the program returned is not a crash in training: the end line says so and where the fix is."""
    (tmp_path / "ending.py").write_text(TUTORIAL_ENDING)
    result = subprocess.run([sys.executable, "-m", "trainer.cli.launch", "ending.py"], cwd=tmp_path,
                            env=clean_env(launcher_env(free_port(), ABORT_AT_EXIT="1")), capture_output=True,
                            text=True, timeout=RUN_BOUND_S)
    assert result.returncode == 1, result.stderr[-3000:]
    assert error_lines(result.stderr) == [
        "error: training failed: rank 1 aborted at exit, after its last step (its program had returned; a process "
        "group still held by a model at the interpreter's exit aborts it: docs/scripts.md#the-end-of-a-script says "
        "how to end cleanly)"], result.stderr[-3000:]


STUCK_ON_THE_API = """
import time

import torch
from trainer import api


def load_batch(run, step):
    if run.rank == 1 and step == 3:
        time.sleep(3600)  # a read that never returns
    return torch.ones(8, 4)


with api.Run(collective_timeout=5, checkpoint_every=0) as run:
    model = run.wrap(torch.nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    run.resume(model=model, optimizer=optimizer)
    for step in range(1000):
        run.backward(model(load_batch(run, step)).sum())
        run.optimizer_step(optimizer)
        if run.step():
            break
"""


def test_a_collective_timeout_names_the_rank_stuck_outside_it(tmp_path, launches):
    """trainer.api (and the built-in loop): the rank whose collective timed out asks its host's other ranks for
    their stacks, and its one line names the one that is not in the collective, at its line."""
    (tmp_path / "api_stuck.py").write_text(STUCK_ON_THE_API)
    run = Launch(["api_stuck.py"], tmp_path, launcher_env(free_port(), TRAIN_CHECKPOINT_DIR=str(tmp_path / "c"),
                                                          TRAIN_LOG_DIR=str(tmp_path / "r")))
    launches.append(run)
    assert run.wait(RUN_BOUND_S) == 1, run.output()[-4000:]
    sleeping = next(n for n, text in enumerate(STUCK_ON_THE_API.splitlines(), 1) if "time.sleep(3600)" in text)
    survivor = [line for line in error_lines(run.output()) if line.startswith("error: collective: ")]
    assert survivor and re.search(rf"; rank 1 \(host .+\) is not in the collective: stuck at api_stuck\.py:{sleeping} "
                                  r"in load_batch \(", survivor[0]), run.output()[-3000:]
    # The stuck rank leaves soon after torchrun's stop, not at its SIGKILL 30 s later.
    assert re.search(rf"\[rank 1\] WARNING still running 5 s after torchrun's stop, outside any collective \(at "
                     rf"api_stuck\.py:{sleeping} in load_batch when it came\): this rank leaves now", run.output()), \
        run.output()[-3000:]
    assert "forcefully exiting via 9" not in run.output(), run.output()[-3000:]


def test_a_workers_facts_noted_by_two_threads_at_once_are_all_kept(tmp_path, monkeypatch):
    """A rank's record is read, merged and rewritten by whichever thread notes a fact (the main thread its stop, a
    background checkpoint thread its commit). Unlocked, one thread's write dropped the other's fact: a stopped
    launcher then read no committed stop and exited 143 on torch 2.13 (issue 45, item 11)."""
    import threading

    from trainer.cluster.workers import AGENT_DIR_ENV
    from trainer.parallel import bootstrap

    monkeypatch.setenv(AGENT_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "0")
    go = threading.Barrier(2)

    def noter(name: str) -> None:
        go.wait()
        for i in range(160):
            bootstrap.note(**{f"{name}{i}": i})

    threads = [threading.Thread(target=noter, args=(name,)) for name in ("main", "saver")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    record = json.loads((tmp_path / "rank-0.json").read_text())
    assert len(record) == 320, f"{320 - len(record)} of 320 facts lost"
    assert not list(tmp_path.glob(".tmp-*")), "a temp file was left behind"


def test_every_worker_of_a_new_group_keeps_its_record_when_they_start_at_once(tmp_path):
    """After a restart the agent starts a new group where the last one left its records. Each new worker used to
    remove the records of other groups itself, and read its peers' as they were replaced: it removed a peer's new
    record written a moment before. The launcher then read a running worker as never started, and a stop every worker
    had committed exited 143 (CI, a Kubernetes pod after its elastic round). Now the agent clears the folder between
    groups (workers.clear_records) and a worker writes its own record only. Sixteen real workers start at the same
    instant over the records of the group before, three times: each round ends with the new group's sixteen."""
    from trainer.cluster.workers import AGENT_DIR_ENV, clear_records, read_workers

    ranks = 16
    for attempt in range(3):
        for rank in range(ranks):  # the group before's, as a worker of the new one may still see them
            (tmp_path / f"rank-{rank}.json").write_text(json.dumps({"pid": 1, "pgid": 1, "group": f"{attempt}/20/1"}))
        at = time.time() + 2.5  # after every interpreter has started
        start = f"import time; from trainer.parallel import bootstrap; time.sleep(max(0, {at} - time.time())); " \
                "bootstrap.start()"
        workers = [subprocess.Popen([sys.executable, "-c", start], env=clean_env({
            AGENT_DIR_ENV: str(tmp_path), "RANK": str(rank), "TORCHELASTIC_RESTART_COUNT": str(attempt + 1),
            "WORLD_SIZE": str(ranks), "MASTER_PORT": "2", "PYTHONPATH": str(REPO)})) for rank in range(ranks)]
        assert all(w.wait(60) == 0 for w in workers)
        found = read_workers(tmp_path)
        assert [w.rank for w in found] == list(range(ranks)), f"round {attempt}: {[w.rank for w in found]}"
        assert {w.group for w in found} == {f"{attempt + 1}/{ranks}/2"}
    # What the agent leaves a new group (its ranks may be others: this host's 2 and 3 becoming 0 and 1): nothing
    (tmp_path / "rank-19.stacks").write_text("")
    clear_records(tmp_path)
    assert not list(tmp_path.glob("rank-*")), sorted(p.name for p in tmp_path.iterdir())
