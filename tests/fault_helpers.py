"""Real launcher and worker processes for the fault tests: start them, find them, signal them.

A `Launch` is `python -m trainer.cli.launch` in a clean environment with its output in a file. The
launcher becomes torchrun in the same process, so its PID is torchrun's and the workers are its
children; they are found by scanning /proc (rank from each worker's environment), no psutil needed.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import weakref
from pathlib import Path
from typing import Callable, Mapping, Sequence

from helpers import children, clean_env, descendants, running

from trainer.cluster.workers import AGENT_DIR_ENV, STACKS_SIGNAL

POLL_S = 0.05
# Bounds on waits below turn a hang into a failure; they are not speed goals. A loaded 2-core CI
# runner needs seconds just to import torch in every process.
START_BOUND_S = 120


def tiny_run(root: Path, samples: int = 2400, epochs: int = 1, every: int = 10) -> list[str]:
    """A small CNN run that checkpoints often, with its files under root."""
    return ["--model", "cnn", "--synthetic-size", str(samples), "--batch-size", "16", "--epochs", str(epochs),
            "--checkpoint-every", str(every), "--log-every", str(every), "--warmup-steps", "5",
            "--checkpoint-dir", str(root / "checkpoints"), "--log-dir", str(root / "runs")]


def wait_until(condition: Callable[[], object], bound_s: float, what: str):
    """Poll until condition() is truthy and return it; fail naming `what` after bound_s. `what` is often made with
    outputs as they were when the wait began: the failure adds what the launches said during the wait and where
    every running one's workers are, so that a rare failure in CI is understood from its log alone."""
    began, deadline = time.time(), time.monotonic() + bound_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(POLL_S)
    raise AssertionError(f"not within {bound_s:.0f} s: {what}{since(began)}")


RUNNING: "weakref.WeakSet[Launch]" = weakref.WeakSet()  # every Launch still referenced (a test's)


def since(began: float, tail: int = 2000) -> str:
    """The end of the output of each Launch that ran or wrote after `began` (time.time()), and the stacks of the
    workers of those still running (their threads' innermost frames), asked as the launcher's hang watchdog asks
    them: faulthandler, registered on STACKS_SIGNAL by the bootstrap, writes into the agent's folder."""
    said, asked = [], []
    for launch in sorted(RUNNING, key=lambda launch: launch.started):
        alive = launch.proc.poll() is None
        try:
            changed = launch.log_path.stat().st_mtime >= began
        except OSError:
            changed = False
        if not (alive or changed):
            continue
        state = "running" if alive else f"exited {launch.proc.returncode}"
        said.append(f"\n--- {launch.log_path.stem} now ({state}), the end of its output:\n{launch.output()[-tail:]}")
        if not alive:
            continue
        for pid in children(launch.pid):  # torchrun's: every worker, the trainer's or a script's
            env = _environ(pid)
            folder, rank = env.get(AGENT_DIR_ENV), env.get("RANK")
            if not folder or rank is None:
                continue
            path = Path(folder) / f"rank-{rank}.stacks"
            try:
                path.write_text("")
                os.kill(pid, STACKS_SIGNAL)
            except OSError:
                continue
            asked.append((launch.log_path.stem, rank, pid, path))
    if asked:
        time.sleep(2.0)  # faulthandler writes from its signal handler; a loaded host is slow to schedule it
    return "".join(said) + "".join(
        f"\n--- {name} rank {rank} (pid {pid}), its stacks:\n{_innermost(path.read_text(errors='replace'))}"
        for name, rank, pid, path in asked)


NOISE = re.compile(r"threading\.py\", line \d+ in (_bootstrap|_bootstrap_inner|run)$|<frozen runpy>")


def _innermost(dump: str, frames: int = 6) -> str:
    """A faulthandler dump (innermost frame first) cut to each thread's innermost frames."""
    kept, taken = [], 0
    for line in dump.splitlines():
        if line.startswith(("Thread ", "Current thread ")):
            kept.append(line)
            taken = 0
        elif line.strip() and taken < frames and not NOISE.search(line):
            kept.append(line)
            taken += 1
    return "\n".join(kept) or "(no answer)"


def _environ(pid: int) -> dict[str, str]:
    try:
        items = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return {}
    return dict(item.decode(errors="replace").split("=", 1) for item in items if b"=" in item)


def _rank_of_worker(pid: int) -> int | None:
    """The RANK torchrun gave a `python -m trainer` worker (started through the launcher's bootstrap, or
    not); None for any other process."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    program = argv[argv.index(b"-m") + 1:] if b"-m" in argv else []
    if program[:1] == [b"trainer.parallel.bootstrap"]:
        program = program[1:][program[1:2] == [b"-m"]:]
    if program[:1] != [b"trainer"]:
        return None
    rank = _environ(pid).get("RANK")
    return int(rank) if rank is not None else None


def checkpoint_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("step-*.pt")) if directory.is_dir() else []


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error: ")]


class Launch:
    """`python -m trainer.cli.launch <args>` (or under a prefix such as `ip netns exec ns`), output to a file."""

    def __init__(self, args: Sequence[str], cwd: Path, env: Mapping[str, str], name: str = "launch",
                 prefix: Sequence[str] = ()):
        self.log_path = cwd / f"{name}.log"
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([*prefix, sys.executable, "-m", "trainer.cli.launch", *args], cwd=cwd,
                                         env=clean_env(env), stdout=log, stderr=subprocess.STDOUT)
        self.started = time.monotonic()
        RUNNING.add(self)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def workers(self) -> dict[int, int]:
        """{rank: pid} of the workers running now."""
        found = {}
        for pid in children(self.pid):
            rank = _rank_of_worker(pid)
            if rank is not None and running(pid):
                found[rank] = pid
        return found

    def wait(self, bound_s: float) -> int:
        try:
            return self.proc.wait(timeout=bound_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"launcher still running after {bound_s:.0f} s:\n{self.output()[-4000:]}") from None

    def stop_everything(self) -> None:
        """Cleanup after a failed test: this launcher and the processes it started, by PID."""
        for pid in [*descendants(self.pid), self.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()


def launcher_env(port: int, **extra: str) -> dict[str, str]:
    """One node, two CPU workers, no preflight (test_doctor covers it), on a port of its own."""
    return {"PREFLIGHT": "0", "NPROC_PER_NODE": "2", "MASTER_PORT": str(port), **extra}
