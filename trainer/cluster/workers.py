"""What a host's workers tell their launcher, through files in one folder the supervisor makes (torch-free).

The supervisor (torchrun in the launcher's process) creates the folder and names it in TRAINER_AGENT_DIR; the
bootstrap (trainer.cluster.bootstrap) that starts every worker writes into it, and so does trainer.api's Run:

    rank-<R>.json       the worker's pid and process group; then how it ended (its exit code) and what it
                        committed at a stop. A worker killed by a signal writes no end: its record has none.
    rank-<R>.progress   touched (at most once a second) on each completed step, and on each output line of a
                        script that does not use trainer.api: its modification time is the rank's last progress.
    rank-<R>.stacks     every thread's Python stack, written by faulthandler when the supervisor asks for it.

Nothing here is a torchrun interface: a worker started by plain torchrun or srun has no folder, and every
function below then does nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from trainer.core.files import atomic_file

AGENT_DIR_ENV = "TRAINER_AGENT_DIR"
# The signal that asks a worker for its stacks: a real-time one, which no framework the seeds use claims
# (Lightning's Slurm requeue takes SIGUSR1, some profilers SIGUSR2, SIGPROF).
STACKS_SIGNAL = signal.SIGRTMIN + 4
PROGRESS_EVERY = 1.0  # seconds: the watchdog's bound is in minutes, so a touch a second is plenty
# An elastic job's worker whose stop came from another host (that host is leaving: docker compose stop, a
# drained node) exits with this code, so that its agent restarts it and the hosts left meet again at the new
# world size; BSD's EX_TEMPFAIL, "try again".
HOST_LEFT_EXIT_CODE = 75


def agent_dir() -> Path | None:
    raw = os.environ.get(AGENT_DIR_ENV, "")
    return Path(raw) if raw and os.path.isdir(raw) else None


def this_rank() -> int:
    return int(os.environ.get("RANK", "0") or 0)


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def _write(path: Path, facts: dict) -> None:
    """Whole or not at all: the supervisor may read while a worker writes (not durable: the folder lives as long
    as the job)."""
    with atomic_file(path, "w", durable=False) as f:
        f.write(json.dumps(facts))


def group() -> str:
    """Which start of the worker group this worker belongs to: torchrun's restart count, with the world size and
    the group's store port, which an elastic round changes without counting a restart."""
    return "/".join(os.environ.get(name, "") for name in ("TORCHELASTIC_RESTART_COUNT", "WORLD_SIZE", "MASTER_PORT"))


def start() -> None:
    """A new worker's record (a restarted rank's replaces its predecessor's). An earlier group's records go: after
    an elastic round the ranks are others (this host's 2 and 3 became 0 and 1), and what the supervisor reads of
    this host's workers (the end of a stop, its exit status) is this group's."""
    folder = agent_dir()
    if folder is not None:
        mine = group()
        _write(folder / f"rank-{this_rank()}.json", {"pid": os.getpid(), "pgid": os.getpgid(0), "group": mine})
        for w in read_workers(folder):
            if w.group != mine:
                with contextlib.suppress(OSError):
                    (folder / f"rank-{w.rank}.json").unlink()
        progress()


def note(**facts) -> None:
    """Add facts to this rank's record (nothing without a supervisor)."""
    folder = agent_dir()
    if folder is None:
        return
    path = folder / f"rank-{this_rank()}.json"
    try:
        record = json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError):
        record = {}
    try:
        _write(path, {**record, **facts})
    except OSError:
        pass  # the folder went away with its supervisor: nobody is left to read it


_progress_path: Path | None | bool = False  # False: not looked up yet
_next_touch = 0.0


def progress() -> None:
    """This rank made progress (a completed step, a line of output). Cheap: one clock read, and a file
    touch at most once a second."""
    global _progress_path, _next_touch
    now = time.monotonic()
    if now < _next_touch:
        return
    _next_touch = now + PROGRESS_EVERY
    if _progress_path is False:
        folder = agent_dir()
        _progress_path = None if folder is None else folder / f"rank-{this_rank()}.progress"
    if _progress_path is not None:
        try:
            _progress_path.touch()
        except OSError:
            _progress_path = None


@dataclass(frozen=True)
class Worker:
    """One worker as its record tells it: exit None means it wrote no end (killed, or still running)."""
    rank: int
    pid: int
    pgid: int
    exit: int | None
    committed: str | None  # the checkpoint it committed at a stop, if any
    joined: bool = False  # it was in a torch.distributed process group at some point
    frameworks: tuple[str, ...] = ()  # training frameworks it had imported, by the end
    single_process: tuple[str, ...] = ()  # of those, the ones that ran it as a job of one
    group: str = ""  # workers.group() of its start

    @property
    def alive(self) -> bool:
        """Running (a zombie torchrun has not reaped yet is not)."""
        try:
            return Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except (OSError, IndexError):
            pass
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def read_workers(folder: Path) -> list[Worker]:
    """The records of this host's workers (of the current attempt), by rank."""
    workers = []
    for path in folder.glob("rank-*.json"):
        try:
            facts = json.loads(path.read_text())
            workers.append(Worker(int(path.stem.split("-")[1]), int(facts["pid"]), int(facts.get("pgid", 0)),
                                  facts.get("exit"), facts.get("committed"), bool(facts.get("joined")),
                                  tuple(facts.get("frameworks", ())), tuple(facts.get("single_process", ())),
                                  str(facts.get("group", ""))))
        except (OSError, ValueError, KeyError):
            continue
    return sorted(workers, key=lambda w: w.rank)


def kill(found: list[Worker]) -> None:
    """SIGKILL these workers with their process groups (a worker under torchrun leads its own: its DataLoader
    workers go with it)."""
    for w in found:
        try:
            os.killpg(w.pgid or w.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def last_progress(folder: Path, rank: int) -> float | None:
    try:
        return (folder / f"rank-{rank}.progress").stat().st_mtime
    except OSError:
        return None


def trained_alone(found: list[Worker], world_size: int) -> str | None:
    """The one warning line when a job of several ranks trained as separate jobs of one: no rank of this host
    joined a process group, or a framework ran every one as a job of one (None: nothing to say)."""
    if world_size < 2 or not found or any(w.exit is None for w in found):
        return None
    single = {name for w in found for name in w.single_process}
    if single and all(w.single_process for w in found):
        cause = ("accelerate ran every rank as DistributedType.NO, a job of one: set ACCELERATE_USE_CPU=1 on CPUs"
                 if "accelerate" in single else f"{', '.join(sorted(single))} ran every rank as a job of one")
    elif not any(w.joined for w in found):
        cause = "the script never called init_process_group"
    else:
        return None
    return f"warning: every process trained alone, not as one job of {world_size} ranks ({cause})"


def peer_failed_here() -> bool:
    """A sibling worker of this group on this host ended without a clean exit: a SIGTERM now is torchrun stopping
    the group after that failure, not a user's stop. An earlier group's records (an elastic round's other ranks,
    which exited 75 when a host left) do not count: a SIGTERM after them is the next round's stop."""
    folder = agent_dir()
    if folder is None:
        return False
    me, mine = this_rank(), group()
    return any(w.rank != me and w.group == mine and w.exit != 0 and (w.exit is not None or not w.alive)
               for w in read_workers(folder))
