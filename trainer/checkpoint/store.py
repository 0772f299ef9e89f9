"""Checkpoints: what they hold, and committing them (a checkpoint exists only once it is fully on disk).

Write to a temp file in the same directory, fsync, rename, fsync the directory; keep the newest N.
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


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


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
            _remove(directory / f"{TEMP_PREFIX}{final.name}")
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
                _remove(old)
            _remove_stale_temps(directory)
        return final
    return committed


def save(directory: Path, step: int, state: dict[str, Any], keep: int, fence: Callable[[], None] | None = None
         ) -> Path:
    """fence: called once the file is written, before it is committed; what it raises (trainer.core.errors.Fenced:
    the job went on without this host) leaves nothing behind."""
    final = checkpoint_path(directory, step)
    measured: list[bool] = []
    try:
        directory.mkdir(parents=True, exist_ok=True)
        # The free space is measured while the partial temp file still fills the disk: once it is removed,
        # a full disk no longer looks full.
        with atomic_file(final, before_cleanup=lambda err: measured.append(_out_of_space(err, directory))) as f:
            torch.save(state, f)
            if fence is not None:
                fence()
    except (OSError, RuntimeError) as err:
        full = measured[0] if measured else _out_of_space(err, directory)
        raise _save_failed(err, final, directory, full) from None
    for old in list_checkpoints(directory)[keep:]:
        _remove(old)
    _remove_stale_temps(directory)
    return final


def _save_failed(err: BaseException, final: Path, directory: Path, full: bool, where: str = "") -> CheckpointError:
    older = list_checkpoints(directory)
    kept = (f"the {len(older)} older checkpoint(s) are intact, the newest {older[0].name}" if older else
            "no earlier checkpoint exists")
    if full:
        return CheckpointError(f"--checkpoint-dir: no space left on device while writing {final.name} (free space "
                               f"in {directory}; {kept})")
    return CheckpointError(f"--checkpoint-dir: cannot write {final}: {first_line(err)} (make {directory} a writable "
                           f"directory for uid {os.getuid()}{where}; {kept})")


def _out_of_space(err: BaseException, directory: Path) -> bool:
    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    # torch's zip writer reports a full disk as a failed write ("unexpected pos ..."): ask the disk.
    with contextlib.suppress(OSError):
        return shutil.disk_usage(directory).free < FULL_DISK_BYTES
    return False


def _remove_stale_temps(directory: Path) -> None:
    """Temp files left by a writer that was killed mid-save are never valid checkpoints."""
    for temp in directory.glob(f"{TEMP_PREFIX}*"):
        _remove(temp)


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
