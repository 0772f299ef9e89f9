"""Committed checkpoints: a checkpoint exists only once it is fully on disk.

Write to a temp file in the same directory, fsync, rename, fsync the directory; keep the newest N.
At resume the newest file that loads is used; a truncated or corrupt one is skipped with a warning.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from trainer.errors import UsageError, first_line

log = logging.getLogger(__name__)

NAME = re.compile(r"^step-(\d{8,})\.pt$")
TEMP_PREFIX = ".tmp-"
FORMAT = 1  # the "format" key of every checkpoint this trainer writes
FULL_DISK_BYTES = 1 << 20


class CheckpointError(Exception):
    """A checkpoint could not be written; older checkpoints are untouched."""


def checkpoint_path(directory: Path, step: int) -> Path:
    return directory / f"step-{step:08d}.pt"


def list_checkpoints(directory: Path) -> list[Path]:
    """Committed checkpoints, newest first."""
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := NAME.match(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def save(directory: Path, step: int, state: dict[str, Any], keep: int) -> Path:
    final = checkpoint_path(directory, step)
    temp = directory / f"{TEMP_PREFIX}{final.name}.{os.getpid()}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with open(temp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, final)
        _fsync_dir(directory)
    except (OSError, RuntimeError) as err:
        with contextlib.suppress(OSError):
            temp.unlink(missing_ok=True)
        if _out_of_space(err, directory):
            raise CheckpointError(f"--checkpoint-dir: no space left on device while writing {final.name} "
                                  f"(free space in {directory}; older checkpoints are intact)") from None
        raise CheckpointError(f"--checkpoint-dir: cannot write {final}: {first_line(err)} (make {directory} a "
                              f"writable directory for uid {os.getuid()}; older checkpoints are intact)") from None
    for old in list_checkpoints(directory)[keep:]:
        old.unlink(missing_ok=True)
    _remove_stale_temps(directory)
    return final


def _out_of_space(err: BaseException, directory: Path) -> bool:
    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    # torch's zip writer reports a full disk as a failed write ("unexpected pos ..."): ask the disk.
    with contextlib.suppress(OSError):
        return shutil.disk_usage(directory).free < FULL_DISK_BYTES
    return False


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_stale_temps(directory: Path) -> None:
    """Temp files left by a writer that was killed mid-save are never valid checkpoints."""
    for temp in directory.glob(f"{TEMP_PREFIX}*"):
        temp.unlink(missing_ok=True)


def load(path: Path) -> dict[str, Any]:
    # weights_only: a checkpoint is data; unpickling arbitrary objects would run arbitrary code.
    return torch.load(path, map_location="cpu", weights_only=True)


def _load_ours(path: Path) -> dict[str, Any]:
    """A checkpoint this trainer wrote; OSError if the file cannot be read, ValueError if it is something else."""
    state = load(path)
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ValueError("a torch file, but not a checkpoint written by this trainer")
    return state


def _why_not(err: Exception) -> str:
    """Why a file is not a checkpoint, in a few words. torch's weights_only refusal begins with paragraphs
    of advice about pickles from trusted sources; its one useful line is the unpickler's own."""
    unpickler = re.search(r"WeightsUnpickler error:\s*(.+)", str(err))
    return f"{type(err).__name__}: {unpickler.group(1).strip()[:160] if unpickler else first_line(err)}"


def _unreadable(path: Path, err: OSError) -> UsageError:
    # Not corruption: the file may be fine (a uid mismatch, a stale mount), so it is neither set aside nor skipped.
    return UsageError("--checkpoint-dir", f"cannot read {path} ({err.strerror or first_line(err)})",
                      f"make the checkpoints readable by uid {os.getuid()}, or move the file away")


def load_for_resume(directory: Path, resume: str) -> tuple[dict[str, Any], Path] | None:
    """The state to resume from, or None to start fresh. An explicit path must load."""
    if resume == "never":
        return None
    if resume != "auto":
        path = Path(resume)
        try:
            return _load_ours(path), path
        except OSError as err:
            raise _unreadable(path, err) from None
        except Exception as err:  # noqa: BLE001 (pickle, zip and torch errors all mean "not a checkpoint")
            raise UsageError("--resume", f"'{path}' is not a loadable checkpoint ({_why_not(err)})",
                             "give a checkpoint written by this trainer, or --resume auto") from None
    for path in list_checkpoints(directory):
        try:
            return _load_ours(path), path
        except OSError as err:
            raise _unreadable(path, err) from None
        except Exception as err:  # noqa: BLE001
            # Set aside, not deleted (someone may want to inspect it), and out of the rotation, which
            # would otherwise keep this highest step and delete the good checkpoints below it.
            aside = path.with_name(path.name + ".corrupt")
            try:
                path.rename(aside)
            except OSError as rename_err:
                raise UsageError("--checkpoint-dir", f"{path} does not load ({first_line(err)}) and cannot be "
                                 f"moved aside ({rename_err.strerror})",
                                 "remove it, or make the checkpoint directory writable") from None
            log.warning("checkpoint %s does not load (%s); moved to %s, trying the previous one",
                        path, _why_not(err), aside.name)
    return None
