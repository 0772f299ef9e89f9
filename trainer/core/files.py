"""Atomic writes: the one home of the temp-name, fsync and rename rules every file the trainer writes follows.

A file is written under a temp name in its own directory (the rename must stay on one file system), flushed
and fsynced, renamed over its final name, and the directory is fsynced so the rename itself survives a power
loss. A reader therefore sees the whole old file or the whole new one, never a torn one. A writer killed
mid-write leaves a temp file (TEMP_PREFIX...) that its directory's owner removes (checkpoint rotation does).
A temp file may also be written in a folder of the same directory (`folder`): the rename then publishes only if
that folder is still there (in-place recovery's generations, trainer.checkpoint.store).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from pathlib import Path
from typing import IO, Any, Callable, Iterator

TEMP_PREFIX = ".tmp-"


def temp_path(path: Path, folder: Path | None = None) -> Path:
    """Where `path` is written before it is renamed into place: hidden, in the same directory (or in `folder`, on
    the same file system), and unique to this process and thread (two writers of one name never share a temp file:
    a worker's main thread and its background checkpoint or heartbeat thread included)."""
    return (path.parent if folder is None else folder) / f"{TEMP_PREFIX}{path.name}.{os.getpid()}.{threading.get_native_id()}"


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(f: IO) -> None:
    f.flush()
    os.fsync(f.fileno())


def commit(temp: Path, final: Path) -> None:
    """Rename a fully written temp file (or directory) over `final`, durably."""
    os.replace(temp, final)
    fsync_dir(final.parent)


@contextlib.contextmanager
def replacing(path: Path, durable: bool = True, before_cleanup: Callable[[BaseException], object] | None = None,
              folder: Path | None = None) -> Iterator[Path]:
    """`with replacing(path) as temp:` write `temp` (any writer that takes a path); on success it replaces `path`
    (fsynced first, the rename too, when durable), on failure it is removed and `path` stays as it was.
    durable=False skips the fsyncs, for files whose loss in a power cut costs nothing (they are rewritten).
    before_cleanup(error) runs on failure while the temp file still exists (to measure what it filled). folder: where
    the temp file is written (temp_path)."""
    temp = temp_path(path, folder)
    try:
        yield temp
        if durable:
            with open(temp, "rb") as f:
                os.fsync(f.fileno())
            commit(temp, path)
        else:
            os.replace(temp, path)
    except BaseException as err:
        if before_cleanup is not None:
            before_cleanup(err)
        with contextlib.suppress(OSError):
            temp.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def atomic_file(path: Path, mode: str = "wb", durable: bool = True,
                before_cleanup: Callable[[BaseException], object] | None = None,
                folder: Path | None = None) -> Iterator[IO]:
    """`with atomic_file(path) as f: f.write(...)`: `path` holds everything written, or stays as it was."""
    with replacing(path, durable, before_cleanup, folder) as temp, open(temp, mode, **({} if "b" in mode else {"newline": ""})) as f:
        yield f


def write_json_atomic(path: Path, payload: dict[str, Any], indent: int = 2) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path, "w") as f:
        f.write(json.dumps(payload, indent=indent) + "\n")
