"""Taking a checkpoint directory for one run, or for one in-place job's processes together (torch-free: the launcher
takes it for an in-place job before its workers start).

Two runs sharing one directory would delete each other's checkpoints in rotation (each keeps the highest steps) and
temp files, and an in-place host resumes whatever the directory's newest checkpoint is: another job's would be taken
for its own. A lock file (flock) says who holds the directory, for as long as the holder lives: a crashed job leaves
nothing that blocks the next one.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import socket
import time
from pathlib import Path
from typing import IO, Any

from trainer.config.settings import SHAPES_TRAINING
from trainer.core.errors import UsageError
from trainer.core.files import TEMP_PREFIX, fsync_file, temp_path, write_json_atomic

LOCK_NAME = ".lock"
# In-place recovery's generations (trainer.checkpoint.store, open_generation): one per quorum, numbered by the job.
GENERATION_FILE = ".generation"  # the newest generation that trained (its number)
GENERATION_PREFIX = ".generation-"  # + the number: a generation's folder for temp files (no step-* name: never resumed)
# The job's count of generations (trainer.checkpoint.store, next_generation): each new quorum takes the next number,
# whichever lighthouse formed it (torchft's quorum ids start over when its lighthouse is started again).
GENERATION_COUNTER = ".generations"
RETIRED_PREFIX = ".retired-generation-"


def claim(directory: Path, job: str | None = None) -> IO[str]:
    """Take the directory for this run: two runs sharing one would delete each other's checkpoints in
    rotation (each keeps the highest steps) and temp files, or (in place) resume each other's. Held until the returned
    file is closed. job: an in-place job's identity (its lighthouse): the processes of that job hold the directory
    together, each with a shared lock; a run of another kind, or another job, finds it taken."""
    lock = open(directory / LOCK_NAME, "a+")  # noqa: SIM115 (held for the run: the caller closes it)
    if job is not None:
        return _claim_for_job(lock, directory, job)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        raise _in_use(lock, directory) from None
    _say_holder(lock, f"pid {os.getpid()} on {socket.gethostname()}")
    clear_leftovers(directory)
    return lock


JOB_HOLDER = "the in-place job of the lighthouse at "  # the lock file's first words while an in-place job holds it
JOB_SETTINGS = ".job-settings.json"  # the settings of the in-place job that holds the directory (job_settings())
LIGHTHOUSE_LEASE = ".lighthouse-lease"  # the lighthouse the job trains with, and a count its first host changes (trainer.engine.lighthouses)
JOB_ENDED = ".job-ended.json"  # the in-place job that held the directory trained to its end (record_end())
CLAIM_WAIT_S = 5.0  # another job's first host converting its lock (exclusive -> shared) holds it this briefly


def _claim_for_job(lock: IO[str], directory: Path, job: str) -> IO[str]:
    """The directory for one in-place job. The first of its processes to find it free (an exclusive lock: nobody
    holds it) writes the job's identity into the lock file and clears what dead jobs left; every process
    of the job then holds it shared and reads that identity back. Another job's identity, or a holder of another
    kind (an exclusive lock for longer than a conversion takes), is refused. Linux converts a lock by releasing it
    first: a process of another job may take it in between, and then it is that job's (the identity read back
    under the shared lock decides)."""
    deadline = time.monotonic() + CLAIM_WAIT_S
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            pass
        else:
            _say_holder(lock, f"{JOB_HOLDER}{job}, first taken by pid {os.getpid()} on {socket.gethostname()}")
            clear_leftovers(directory)
        try:
            fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
            break
        except OSError:
            if time.monotonic() >= deadline:
                raise _in_use(lock, directory) from None
            time.sleep(0.05)
    if _holder(lock).startswith(f"{JOB_HOLDER}{job},"):
        return lock
    raise _in_use(lock, directory)


def trained_here(directory: Path, job: str) -> bool:
    """Whether this in-place job (its identity) took a generation in this directory before: its lighthouse answered a
    quorum there. Read before claim(), whose first holder clears the generations that dead processes left."""
    try:
        holder = (directory / LOCK_NAME).read_text()
    except OSError:
        return False
    return holder.startswith(f"{JOB_HOLDER}{job},") and \
        any((directory / name).is_file() for name in (GENERATION_COUNTER, GENERATION_FILE))


def clear_leftovers(directory: Path) -> None:
    """The directory taken while no other process of any job holds it: the temp files of writers killed mid-write
    and what in-place jobs leave (their generations' folders and newest number, the settings of the job that held
    it) belong to no live process, and a new job's generations (numbered afresh by its lighthouse) must not be taken
    for older than a finished job's. The record of a job's end stays: a host of that job started late finds it
    (check_ended); the next job's first generation removes it."""
    remove_stale_temps(directory)
    for path in [*directory.glob(f"{GENERATION_PREFIX}*"), *directory.glob(f"{RETIRED_PREFIX}*"),
                 directory / GENERATION_FILE, directory / GENERATION_COUNTER, directory / JOB_SETTINGS]:
        remove(path)


def remove_stale_temps(directory: Path) -> None:
    """Temp files left by a writer that was killed mid-save are never valid checkpoints."""
    for temp in directory.glob(f"{TEMP_PREFIX}*"):
        remove(temp)


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _say_holder(lock: IO[str], words: str) -> None:
    lock.truncate(0)
    lock.write(words + "\n")
    lock.flush()


def _holder(lock: IO[str]) -> str:
    lock.seek(0)
    return lock.read().strip()


def _in_use(lock: IO[str], directory: Path) -> UsageError:
    holder = _holder(lock) or "another process"
    lock.close()
    return UsageError("--checkpoint-dir", f"{directory} is in use by another run ({holder})",
                      "give each run its own --checkpoint-dir, or stop that run first")


def job_settings(directory: Path, mine: dict[str, Any]) -> dict[str, Any]:
    """The settings of the in-place job that holds `directory` (claim(job=...)): those its first process recorded,
    or `mine` if this is the first (recorded now: written whole, then linked to the name, which only one process
    can do)."""
    path = directory / JOB_SETTINGS
    with contextlib.suppress(FileNotFoundError):
        return json.loads(path.read_text())
    temp = temp_path(path)
    try:
        with open(temp, "w") as f:
            f.write(json.dumps(mine, indent=1, sort_keys=True) + "\n")
            fsync_file(f)
        os.link(temp, path)  # not a rename: it fails where the name exists
        return mine
    except FileExistsError:  # another host of the job recorded its own first
        return json.loads(path.read_text())
    finally:
        temp.unlink(missing_ok=True)


class Ended(Exception):
    """This host came to an in-place job that has ended: nothing to train, nothing to write (str(): its line)."""


def record_end(directory: Path, job: str, step: int, settings: dict[str, Any]) -> None:
    """The in-place job trained to its end (its writing host says so once it committed the last checkpoint), with
    these settings: a host of the job started after that finds it here (check_ended), whether or not the lighthouse
    still answers. It stays until a job trains in the directory again (forget_end)."""
    write_json_atomic(directory / JOB_ENDED, {"job": job, "step": step, "settings": _shaping(settings)})


def forget_end(directory: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        (directory / JOB_ENDED).unlink()


def check_ended(directory: Path, job: str, settings: dict[str, Any]) -> None:
    """Ended, if `directory` says the job `job` trained to its end with these settings (the same command with other
    settings is a new job, started to train on: not ended)."""
    try:
        end = json.loads((directory / JOB_ENDED).read_text())
    except (OSError, ValueError):
        return
    if isinstance(end, dict) and end.get("job") == job and end.get("settings") == _shaping(settings):
        raise Ended(f"nothing to do: the in-place job of the lighthouse at {job} ended at step {end.get('step')} "
                    f"({directory / JOB_ENDED}); this host, started as it ended, has nothing to train")


def _shaping(settings: dict[str, Any]) -> dict[str, Any]:
    """The settings that shape the training, as JSON reads them back."""
    return json.loads(json.dumps({key: settings.get(key) for key in SHAPES_TRAINING}, default=str))
