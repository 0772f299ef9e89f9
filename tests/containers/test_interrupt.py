"""Ctrl-C during the container tests: scripts/test stops in seconds and leaves no container behind.

A terminal's Ctrl-C is SIGINT to its whole foreground process group; here, to the group of a pytest session (what
scripts/test execs) running a container test while its compose project trains.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from containerlib import CPU_IMAGE, ROOT, clean_env

INNER = "tests/containers/test_cpu_stack.py::test_cpu_profile_trains_to_completion_and_tensorboard_serves_the_run"
STOPPED_WITHIN_S = 45  # the project down (the trainer checkpoints on SIGTERM in a second or two) and pytest's exit


def project_containers(client, started: float) -> list:
    """The containers of compose projects the inner session made (named ddpt-cpu-<id> by containerlib.Project)."""
    found = client.containers.list(all=True, filters={"label": "com.docker.compose.project"})
    return [c for c in found if c.labels["com.docker.compose.project"].startswith("ddpt-cpu-")
            and c.attrs["Created"] >= time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(started - 1))]


def test_ctrl_c_while_a_project_trains_stops_the_tests_in_seconds_and_leaves_no_container(cpu_image, docker_client,
                                                                                          tmp_path):
    """Before: every `compose up` got the Ctrl-C too and stopped its containers gracefully (the trainer's
    stop_grace_period is 60 s) while pytest killed only its direct child; more than 60 s, and a container left."""
    started = time.time()
    env = clean_env(TEST_REUSE_IMAGE="1", TRAINER_CPU_IMAGE=CPU_IMAGE, **cpu_image,
                    PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    inner = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--basetemp",
                              str(tmp_path / "inner"), INNER], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and inner.poll() is None:
            trainers = [c for c in project_containers(docker_client, started)
                        if c.labels.get("com.docker.compose.service") == "trainer-cpu"]
            if trainers and b"first step done" in trainers[0].logs():
                break
            time.sleep(0.5)
        assert inner.poll() is None, f"the inner test ended before it trained:\n{inner.communicate()[0][-3000:]}"
        assert time.monotonic() < deadline, "the inner test's trainer did not start training"
        interrupted = time.monotonic()
        os.killpg(inner.pid, signal.SIGINT)  # what the terminal does
        output, _ = inner.communicate(timeout=300)
        took = time.monotonic() - interrupted
    finally:
        if inner.poll() is None:
            os.killpg(inner.pid, signal.SIGKILL)
            inner.wait()
    print(f"\nCtrl-C to the end of the test session: {took:.1f} s")
    assert "KeyboardInterrupt" in output or "Interrupted" in output, output[-3000:]
    assert took < STOPPED_WITHIN_S, f"{took:.0f} s after Ctrl-C:\n{output[-3000:]}"
    left = project_containers(docker_client, started)
    assert not left, f"left behind: {[(c.name, c.status) for c in left]}\n{output[-3000:]}"
