"""Checkpoints: what they hold, and committing them (a checkpoint exists only once it is fully on disk).

Write to a temp file in the same directory, fsync, rename, fsync the directory; keep the newest N. Under in-place
recovery the temp file is written in its generation's folder of the directory instead, and the rename commits only
while that generation is the job's (open_generation).
At resume the newest file that loads is used; a truncated or corrupt one is skipped with a warning.
A run's checkpoints form one line: a run resumed from step S (or started afresh, at 0) continues from there, and the
committed checkpoints above S, the future it abandons, are set aside in a folder of their own (nothing is deleted),
so that `--resume auto` follows the newest run's line and the rotation keeps that run's checkpoints.
Under --strategy fsdp a checkpoint is a directory of shards, committed by its marker (trainer.checkpoint.sharded);
both kinds share the names, the rotation and the resume rules, and either strategy resumes either kind.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import shutil
import socket
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

from trainer.checkpoint.claim import (  # noqa: F401 (claim: the store's callers take it from here too)
    GENERATION_COUNTER,
    GENERATION_FILE,
    GENERATION_PREFIX,
    RETIRED_PREFIX,
    claim,
    remove,
    remove_stale_temps,
)
from trainer.checkpoint.state import FORMAT
from trainer.config.resume import NAME, list_checkpoints  # the checkpoints' names on disk (one home)
from trainer.core.errors import UsageError, first_line, os_reason
from trainer.core.files import TEMP_PREFIX, atomic_file, fsync_dir
from trainer.parallel.context import DistContext

log = logging.getLogger(__name__)

FULL_DISK_BYTES = 1 << 20  # less free than this: the disk is full, for a checkpoint or a start-up check


class CheckpointError(Exception):
    """A checkpoint could not be written; older checkpoints are untouched."""


def ensure_output_dir(path: str, setting: str) -> None:
    """Create an output directory and prove it takes a file now, not at the first checkpoint an hour in."""
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
        free = shutil.disk_usage(path).free
    except OSError as err:
        raise UsageError(setting, f"'{path}' is not a writable directory ({os_reason(err)})",
                         f"point it at a directory uid {os.getuid()} can write, e.g. a mounted volume") from None
    if free < FULL_DISK_BYTES:  # an empty file still fits on a full disk
        raise UsageError(setting, f"'{path}' has {free >> 10} KiB free", "free some space or use a bigger volume")


SHARED_MARKER = ".shared-check-"
SHARED_WAIT_S = 5.0  # a network file system's attribute cache may show a new file to another host a little late


def leave_marker(directory: Path) -> tuple[str, str]:
    """A marker file only this run's rank 0 wrote, for the other hosts to look for: (its name, this host)."""
    name = f"{SHARED_MARKER}{secrets.token_hex(8)}"
    with atomic_file(directory / name, "w") as f:
        f.write(socket.gethostname())
    return name, socket.gethostname()


def sees_marker(directory: Path, name: str, wait_s: float = SHARED_WAIT_S) -> bool:
    """Whether this host sees rank 0's marker in its own `directory` (the same path on every host)."""
    deadline = time.monotonic() + wait_s
    while True:
        with contextlib.suppress(OSError):
            if (directory / name).is_file():
                return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.5)


def remove_marker(directory: Path, name: str) -> None:
    with contextlib.suppress(OSError):
        (directory / name).unlink()


def checkpoint_path(directory: Path, step: int) -> Path:
    return directory / f"step-{step:08d}.pt"


def step_of(path: Path) -> int:
    return int(NAME.match(path.name).group(1))


ABANDONED = "abandoned-after-step-"  # a folder of checkpoints set aside: no step-* name, so never resumed or rotated


def set_aside_after(directory: Path, step: int) -> tuple[Path, list[str]] | None:
    """Move the committed checkpoints above `step` into a new folder of `directory` (a run that resumes from `step`,
    or starts afresh at 0, abandons them: `--resume auto` would go back to them, and the rotation, which keeps the
    highest steps, would delete this run's own checkpoints first). (The folder, the names moved), or None."""
    later = sorted((p for p in list_checkpoints(directory) if step_of(p) > step), key=step_of)
    if not later:
        return None
    folder = directory / f"{ABANDONED}{step:08d}-{time.strftime('%Y%m%dT%H%M%S')}"
    try:
        if folder.exists():  # the same second: another start that set aside another line
            folder = folder.with_name(f"{folder.name}-{os.getpid()}")
        folder.mkdir()
        for path in later:
            path.rename(folder / path.name)
        fsync_dir(directory)
    except OSError as err:
        raise UsageError("--checkpoint-dir", f"cannot set aside the checkpoints above step {step} in {directory} "
                         f"({os_reason(err)})", "make the checkpoint directory writable, or move them away") from None
    return folder, [path.name for path in later]


# In-place recovery (trainer.engine.inplace): a generation is a number the job gives each new quorum of torchft's
# (next_generation: they only grow, across restarts of the lighthouse, whose quorum ids start over). Its first host
# writes the number to GENERATION_FILE and makes the generation's folder, where the checkpoints of its state are
# written before the rename that commits them; the next generation's first host retires the folder (one rename), so a
# writer of an older generation cannot commit, however long it was frozen: its rename finds no file.
# (Their names: trainer.checkpoint.claim, whose first holder of a directory clears what dead jobs left.)


class Superseded(Exception):
    """In place: the generation whose folder held a checkpoint's temp file ended before its commit (a newer generation
    retired the folder); nothing was published."""


def generation_folder(directory: Path, generation: int) -> Path:
    return directory / f"{GENERATION_PREFIX}{generation}"


def generations_on_disk(directory: Path) -> list[int]:
    """The generations whose folders are in `directory` (not retired)."""
    found = []
    with contextlib.suppress(OSError):
        for path in directory.iterdir():
            number = path.name[len(GENERATION_PREFIX):]
            if path.name.startswith(GENERATION_PREFIX) and number.isdigit():
                found.append(int(number))
    return found


def next_generation(directory: Path) -> int:
    """The job's next generation number, taken once (a lock on the counter file, GENERATION_COUNTER): above every
    number taken before in this directory, and above every generation on disk. OSError: the directory cannot be
    written."""
    import fcntl

    with open(directory / GENERATION_COUNTER, "a+") as counter:
        fcntl.flock(counter, fcntl.LOCK_EX)  # released when the file closes
        counter.seek(0)
        text = counter.read().strip()
        taken = [int(text)] if text.isdigit() else []
        with contextlib.suppress(OSError, ValueError):
            taken.append(int((directory / GENERATION_FILE).read_text().strip()))
        number = max([*taken, *generations_on_disk(directory)], default=0) + 1
        counter.seek(0)
        counter.truncate()
        counter.write(f"{number}\n")
        counter.flush()
        os.fsync(counter.fileno())
    return number


def open_generation(directory: Path, generation: int) -> int | None:
    """The first host of a new generation, before anyone trains in it: the generation's folder made and every older
    one retired. A newer generation's folder found there means that this host is the stale one (frozen between its
    quorum and here): its folder is retired at once, and that newer generation returned; else None. CheckpointError:
    the folder cannot be made (the checkpoints of this generation could not be committed)."""
    folder = generation_folder(directory, generation)
    try:
        folder.mkdir(exist_ok=True)
    except OSError as err:
        raise CheckpointError(f"--checkpoint-dir: cannot write {folder}: {os_reason(err)} (make {directory} a "
                              f"writable directory for uid {os.getuid()})") from None
    # Checked after the folder is made: a newer generation's first host that listed the folders before it was made
    # made its own first, so one of the two always sees the other.
    newer = [g for g in generations_on_disk(directory) if g > generation]
    for other in [generation] if newer else [g for g in generations_on_disk(directory) if g < generation]:
        _retire(directory, other)
    for retired in directory.glob(f"{RETIRED_PREFIX}*"):  # any left by a retirement that could not finish
        shutil.rmtree(retired, ignore_errors=True)
    return max(newer, default=None)


def _retire(directory: Path, generation: int) -> None:
    # One rename: a writer of that generation opens its temp file and renames it out by the generation's name, so from
    # this rename on it cannot commit (a frozen writer cannot be halfway through a rename). The retired folder is then
    # removed: no one reaches into it by a path any more, and a frozen writer writing into an open file of it writes
    # into an unlinked one.
    retired = directory / f"{RETIRED_PREFIX}{generation}.{secrets.token_hex(4)}"
    try:
        os.rename(generation_folder(directory, generation), retired)
    except FileNotFoundError:  # another host retired it
        return
    except OSError as err:
        log.warning("in place: cannot retire %s (%s): a host of that generation frozen while it wrote a checkpoint "
                    "could still commit it", generation_folder(directory, generation), os_reason(err))
        return
    shutil.rmtree(retired, ignore_errors=True)


def save_sharded(directory: Path, step: int, model, optimizer, rest: dict[str, Any], ctx: DistContext, keep: int,
                 names: tuple[str, str | None]) -> Path:
    """Every rank writes its shard (trainer.checkpoint.sharded); rank 0 commits, rotates and cleans up."""
    return _sharded(directory, step, model, optimizer, rest, ctx, keep, names, None)()


def save_sharded_in_background(directory: Path, step: int, model, optimizer, rest: dict[str, Any],
                               ctx: DistContext, keep: int, names: tuple[str, str | None], group) -> Callable[[], Path]:
    """save_sharded with DCP's async_save on `group`: each rank's shard is copied to CPU memory now; the
    returned function waits for the writes, then rank 0 commits, rotates and cleans up (CheckpointError on
    rank 0 if any of it failed)."""
    return _sharded(directory, step, model, optimizer, rest, ctx, keep, names, group)


def _sharded(directory: Path, step: int, model, optimizer, rest: dict[str, Any], ctx: DistContext, keep: int,
             names: tuple[str, str | None], group) -> Callable[[], Path]:
    from torch.distributed.checkpoint.api import CheckpointException

    from trainer.checkpoint import sharded

    final = directory / f"step-{step:08d}"
    errors = (OSError, RuntimeError, CheckpointException)

    def failed(err: BaseException) -> CheckpointError:
        full = _out_of_space(err, directory) or "No space left" in str(err)  # before the partial shards go
        if ctx.is_main:
            remove(directory / f"{TEMP_PREFIX}{final.name}")
        return _save_failed(err, final, directory, full, " on every host")

    try:
        finish = sharded.save(directory, step, model, optimizer, rest, ctx, final, names, group)
    except errors as err:
        raise failed(err) from None

    def committed() -> Path:
        if finish is not None:
            try:
                finish()
            except errors as err:
                raise failed(err) from None
        if ctx.is_main:
            for old in list_checkpoints(directory)[keep:]:
                remove(old)
            remove_stale_temps(directory)
        return final
    return committed


def save(directory: Path, step: int, state: dict[str, Any], keep: int, staging: Path | None = None) -> Path:
    """staging: the folder the temp file is written in and renamed out of (in place: its generation's, see
    open_generation), which must still be there at the rename: if it was retired, Superseded and nothing published.
    None: the directory itself."""
    final = checkpoint_path(directory, step)
    measured: list[bool] = []
    try:
        directory.mkdir(parents=True, exist_ok=True)
        # The free space is measured while the partial temp file still fills the disk: once it is removed,
        # a full disk no longer looks full.
        with atomic_file(final, before_cleanup=lambda err: measured.append(_out_of_space(err, directory)),
                         folder=staging) as f:
            torch.save(state, f)
            _hold_for_tests(step)
    except (OSError, RuntimeError) as err:
        if staging is not None and not staging.is_dir():
            raise Superseded(f"{final.name}: {staging.name} was retired before its commit") from None
        full = measured[0] if measured else _out_of_space(err, directory)
        raise _save_failed(err, final, directory, full) from None
    for old in list_checkpoints(directory)[keep:]:
        remove(old)
    if staging is None:  # in place the directory is shared: its temp files may be another host's, being written
        remove_stale_temps(directory)
    return final


HOLD_ENV = "TRAINER_TEST_HOLD_BEFORE_COMMIT"


def _hold_for_tests(step: int) -> None:
    """A test's hook (tests/test_inplace.py), unset otherwise: a test must stop a writer exactly between the end of its
    write and the rename that commits it, which no sleep or signal's timing can do. While the file HOLD_ENV names
    exists, the writer says it is there (<that file>.reached: the step and its pid) and waits for the file to go."""
    hold = os.environ.get(HOLD_ENV)
    if not hold or not os.path.exists(hold):
        return
    with atomic_file(Path(f"{hold}.reached"), "w", durable=False) as f:
        f.write(f"{step} {os.getpid()}\n")
    while os.path.exists(hold):
        time.sleep(0.05)


def _save_failed(err: BaseException, final: Path, directory: Path, full: bool, where: str = "") -> CheckpointError:
    kept = _intact(final, directory)
    if full:
        return CheckpointError(f"--checkpoint-dir: no space left on device while writing {final.name} (free space "
                               f"in {directory}; {kept})")
    return CheckpointError(f"--checkpoint-dir: cannot write {final}: {first_line(err)} (make {directory} a writable "
                           f"directory for uid {os.getuid()}{where}; {kept})")


def _intact(final: Path, directory: Path) -> str:
    """The checkpoints a failed write left as they were: older ones, or (another host's, in place) newer ones too."""
    found = list_checkpoints(directory)
    older = [p for p in found if step_of(p) < step_of(final)]
    if not found:
        return "no earlier checkpoint exists"
    if len(older) == len(found):
        return f"the {len(older)} older checkpoint(s) are intact, the newest {older[0].name}"
    return f"the {len(found)} checkpoint(s) there are intact, the newest {found[0].name}"


def _out_of_space(err: BaseException, directory: Path) -> bool:
    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    # torch's zip writer reports a full disk as a failed write ("unexpected pos ..."): ask the disk.
    with contextlib.suppress(OSError):
        return shutil.disk_usage(directory).free < FULL_DISK_BYTES
    return False


def load(path: Path) -> dict[str, Any]:
    # weights_only: a checkpoint is data; unpickling arbitrary objects would run arbitrary code.
    return torch.load(path, map_location="cpu", weights_only=True)


def load_ours(path: Path) -> dict[str, Any]:
    """A checkpoint this trainer wrote; OSError if the file cannot be read, ValueError if it is something else.
    Of a sharded directory only its small state file is read (every rank reads its shards later). A
    step-N.pt is a file whatever it is on disk: one that is a directory cannot be read (OSError)."""
    if path.is_dir() and path.suffix != ".pt":
        from trainer.checkpoint import sharded

        if list_checkpoints(path):
            raise ValueError("a --checkpoint-dir holding checkpoints, not one checkpoint (give one of them, or "
                             "the directory as --checkpoint-dir with --resume auto)")
        problem = sharded.missing_parts(path)
        if problem:
            raise ValueError(problem + (" (a save that did not finish)" if sharded.COMMIT_MARKER in problem else ""))
        state = sharded.load_state_file(path)
        if not isinstance(state, dict) or state.get("format") != FORMAT:
            raise ValueError("a directory, but not a checkpoint written by this trainer")
        return state
    state = load(path)
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ValueError("a torch file, but not a checkpoint written by this trainer")
    return state


def why_not(err: Exception) -> str:
    """Why a file is not a checkpoint, in a few words. torch's weights_only refusal wraps its one useful
    line (the unpickler's) in paragraphs of advice about trusted sources."""
    text = str(err)
    reason = first_line(err)
    if text.startswith("Weights only load failed"):
        advice = ("Please file an issue", "Check the documentation")
        lines = [line.strip() for line in text.splitlines()[1:]]
        useful = [line for line in lines if line and not line.startswith(advice)]
        reason = useful[0][:160] if useful else "refused by weights_only"
    return f"{type(err).__name__}: {reason}"


def _unreadable(path: Path, err: OSError) -> UsageError:
    # Not corruption: the file may be fine (a uid mismatch, a stale mount), so it is neither set aside nor skipped.
    return UsageError("--checkpoint-dir", f"cannot read {path} ({os_reason(err)})",
                      f"make the checkpoints readable by uid {os.getuid()}, or move the file away")


def load_for_resume(directory: Path, resume: str) -> tuple[dict[str, Any], Path] | None:
    """The state to resume from, or None to start fresh. An explicit path must load."""
    if resume == "never":
        return None
    if resume != "auto":
        path = Path(resume)
        try:
            return load_ours(path), path
        except OSError as err:
            raise _unreadable(path, err) from None
        except Exception as err:  # noqa: BLE001 (pickle, zip and torch errors all mean "not a checkpoint")
            raise UsageError("--resume", f"'{path}' is not a loadable checkpoint ({why_not(err)})",
                             "give a checkpoint written by this trainer, or --resume auto") from None
    for path in list_checkpoints(directory):
        try:
            return load_ours(path), path
        except OSError as err:
            raise _unreadable(path, err) from None
        except Exception as err:  # noqa: BLE001
            # Set aside, not deleted (someone may want to inspect it), and out of the rotation, which
            # would otherwise keep this highest step and delete the good checkpoints below it.
            aside = path.with_name(path.name + ".corrupt")
            if aside.exists():  # set aside before (a copied-back directory): keep both
                aside = path.with_name(f"{path.name}.corrupt.{os.getpid()}")
            try:
                path.rename(aside)
            except OSError as rename_err:
                raise UsageError("--checkpoint-dir", f"{path} does not load ({first_line(err)}) and cannot be "
                                 f"moved aside ({rename_err.strerror})",
                                 "remove it, or make the checkpoint directory writable") from None
            log.warning("checkpoint %s does not load (%s); moved to %s, trying the previous one",
                        path, why_not(err), aside.name)
    set_aside = sorted(p.name for p in directory.glob("step-*.corrupt*")) if directory.is_dir() else []
    if set_aside:
        # Starting again from step 0 would quietly throw away the run: the user decides.
        raise UsageError("--checkpoint-dir", f"no checkpoint in {directory} loads: {len(set_aside)} are set aside "
                         f"as corrupt ({', '.join(set_aside[:4])}{', ...' if len(set_aside) > 4 else ''})",
                         "to start over, move them out of the directory or give another --checkpoint-dir; to "
                         "resume from one, repair it and give it to --resume") from None
    return None
