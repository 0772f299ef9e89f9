"""What a host's workers tell their launcher, through files in one folder the agent makes (torch-free).

The agent (trainer.cluster.agent) creates the folder and names it in TRAINER_AGENT_DIR; the workers write into it
(trainer.parallel.bootstrap, which starts every worker, and trainer.api's Run through it); the agent reads:

    rank-<R>.json       the worker's pid and process group; then how it ended (its exit code) and what it
                        committed at a stop (in place: its rank in the job as of its latest quorum too). A worker
                        killed by a signal writes no end: its record has none.
    rank-<R>.progress   touched (at most once a second) on each completed step, and on each output line of a
                        script that does not use trainer.api: its modification time is the rank's last progress.
    rank-<R>.stacks     every thread's Python stack, written by faulthandler when the agent asks for it.
"""

from __future__ import annotations

import json
import os
import signal
from dataclasses import dataclass
from pathlib import Path

AGENT_DIR_ENV = "TRAINER_AGENT_DIR"
RUN_ONCE_ENV = "TRAINER_RUN_ONCE"  # the worker is a script run once on its host, which starts its own processes
AGENT_PID_ENV = "TRAINER_AGENT_PID"  # a worker whose stop came from another host stops its agent (static jobs)
# The key prefix a static job's group meets under in the agent's store (kept across restarts, so each attempt
# needs its own): the agent names it, the newest attempt any host has reached (presence.newest_attempt).
STORE_PREFIX_ENV, STORE_PREFIX = "TRAINER_STORE_PREFIX", "trainer/attempt-"
# The signal that asks a worker for its stacks: a real-time one, which no framework the seeds use claims
# (Lightning's Slurm requeue takes SIGUSR1, some profilers SIGUSR2, SIGPROF).
STACKS_SIGNAL = signal.SIGRTMIN + 4
PROGRESS_EVERY = 1.0  # seconds: the watchdog's bound is in minutes, so a touch a second is plenty
# An elastic job's worker whose stop came from another host (that host is leaving: docker compose stop, a
# drained node) exits with this code, so that its agent restarts it and the hosts left meet again at the new
# world size; BSD's EX_TEMPFAIL, "try again".
HOST_LEFT_EXIT_CODE = 75


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
    supervised: bool = False  # it runs trainer.api's Run (its stop checkpoints are noted here)
    training: bool = False  # ... whose training loop has begun (a stop now is a checkpointed one)
    # In place, the host's group is its own (rank above is the host's): the job's rank, the host's replica and the
    # generation of its latest quorum (None before its first)
    job_rank: int | None = None
    replica: int | None = None
    generation: int | None = None

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
                                  str(facts.get("group", "")), bool(facts.get("supervised")),
                                  bool(facts.get("training")), facts.get("job_rank"), facts.get("replica"),
                                  facts.get("generation")))
        except (OSError, ValueError, KeyError):
            continue
    return sorted(workers, key=lambda w: w.rank)


def clear_records(folder: Path) -> None:
    """Remove the records of a group whose workers are gone, before the agent starts the next (a restart, an elastic
    round: the ranks may be others, this host's 2 and 3 becoming 0 and 1), so that what the agent reads of this
    host's workers (the end of a stop, its exit status, their progress) is the new group's alone. The agent's to do:
    its workers are stopped then and the next not yet started, where a worker could only race its new peers."""
    for pattern in ("rank-*.json", "rank-*.progress", "rank-*.stacks"):
        for path in folder.glob(pattern):
            try:
                path.unlink()
            except OSError:
                pass


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
