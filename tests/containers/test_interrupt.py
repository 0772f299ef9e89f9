"""Ctrl-C during the container tests: scripts/test stops in seconds and leaves no container behind.

A terminal's Ctrl-C is SIGINT to its whole foreground process group; here, to the group of a pytest session (what
scripts/test execs by default: one process) running a container test while its containers train: a compose project's `up`, and the
benchmark's `docker compose run` of the trainer. (Slurm's podman containers, tests/containers/test_slurm_podman.py,
are not covered: Slurm runs them outside the session.)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from containerlib import ROOT, clean_env

STOPPED_WITHIN_S = 45  # the containers stopped (the trainer checkpoints on SIGTERM in a second or two), pytest's exit
UP = "tests/containers/test_cpu_stack.py::test_cpu_profile_trains_to_completion_and_tensorboard_serves_the_run"
RUN = "tests/containers/test_bench_parity.py::test_bench_runs_the_trainer_bare_metal_and_in_the_container_and_reports_parity"
CASES = {"compose up": UP, "the benchmark's compose run": RUN}


def terminal_signals() -> None:
    """Ctrl-C as in a terminal: a session started from a background job of a script (`.ci/run &`, nohup) inherits
    SIGINT ignored, and Python then raises no KeyboardInterrupt; a terminal's foreground job never has it so."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def new_containers(client, before: set[str]) -> list:
    return [c for c in client.containers.list(all=True) if c.id not in before]


@pytest.mark.parametrize("inner", CASES.values(), ids=CASES.keys())
def test_ctrl_c_while_containers_train_stops_the_tests_in_seconds_and_leaves_no_container(cpu_image, docker_client,
                                                                                         tmp_path, inner):
    """A compose project's `up` (its fixture takes it down) and the benchmark's `compose run --rm` (bench removes
    its container, and the test helper waits for bench to do so). Before, the benchmark's container was still
    training when the session ended: the helper killed bench 0.25 s after the Ctrl-C, and nothing removed it."""
    before = {c.id for c in docker_client.containers.list(all=True)}
    env = clean_env(TEST_REUSE_IMAGE="1", **cpu_image,
                    PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    session = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--basetemp",
                                str(tmp_path / "inner"), inner], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True,
                               preexec_fn=terminal_signals)
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and session.poll() is None:
            if any(b"first step done" in c.logs() for c in new_containers(docker_client, before)):
                break
            time.sleep(0.5)
        assert session.poll() is None, f"the inner test ended before it trained:\n{session.communicate()[0][-3000:]}"
        assert time.monotonic() < deadline, "no container of the inner test trained"
        interrupted = time.monotonic()
        os.killpg(session.pid, signal.SIGINT)  # what the terminal does
        output, _ = session.communicate(timeout=300)
        took = time.monotonic() - interrupted
    finally:
        if session.poll() is None:
            os.killpg(session.pid, signal.SIGKILL)
            session.wait()
    print(f"\nCtrl-C to the end of the test session: {took:.1f} s")
    assert "KeyboardInterrupt" in output or "Interrupted" in output, output[-3000:]
    left = new_containers(docker_client, before)
    assert not left, f"left behind: {[(c.name, c.status) for c in left]}\n{output[-3000:]}"
    assert took < STOPPED_WITHIN_S, f"{took:.0f} s after Ctrl-C:\n{output[-3000:]}"
