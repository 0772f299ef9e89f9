"""What a run will resume, known before any process starts: the checkpoint `--resume` names, its workload, read
without torch (the launcher's check, before torchrun: a mistake costs a second, not a start-up on every rank).

The one home of the checkpoints' names on disk: `step-NNNNNNNN.pt` files and `step-NNNNNNNN/` directories (fsdp's
shards), the latter counted once their commit marker is there (trainer/checkpoint/store.py and sharded.py write
them). A checkpoint file is torch's zip format; the launcher reads only its pickle (data.pkl) of a file or of a
directory's state file, with an unpickler that builds nothing: every class and function it names becomes an inert
stand-in, every tensor a None. So no code in a checkpoint can run here (as torch.load(weights_only=True) ensures
in the workers), and the settings (`config`) and the door that wrote it come out as the plain values they are.
"""

from __future__ import annotations

import io
import os
import pickle
import re
import zipfile
from pathlib import Path
from typing import Any, Mapping

from trainer.core.errors import UsageError

NAME = re.compile(r"^step-(\d{8,})(\.pt)?$")  # a file, or a sharded directory
COMMIT_MARKER = "COMMITTED"  # written last: a sharded directory without it is not a checkpoint
STATE_FILE = "trainer.pt"  # a sharded directory's non-tensor rest, a weights_only torch file
PEEK_LIMIT = 64 << 20  # bytes of pickle (tensor data lies beside it): more, and the launcher leaves it to the workers


def list_checkpoints(directory: Path) -> list[Path]:
    """Committed checkpoints (files, and directories with their commit marker), newest first."""
    if not directory.is_dir():
        return []
    # A step-N.pt counts whatever it is: one that cannot be read must stop the resume with its name, not
    # be passed over for an older step. A step-N directory counts once its marker is there.
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := NAME.match(p.name))
             and (m.group(2) or (p / COMMIT_MARKER).is_file())]
    return [p for _, p in sorted(found, reverse=True)]


class _Inert:
    """What the peek builds for anything a checkpoint's pickle names (a tensor's rebuild, a class, os.system):
    nothing is called, imported or kept."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        pass

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def append(self, value: Any) -> None:
        pass

    def extend(self, values: Any) -> None:
        pass


class _Mapping(dict):
    """An OrderedDict of the pickle (a state dict's container, with its `_metadata` attribute): kept as a dict."""


class _Peek(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        return _Mapping if (module, name) == ("collections", "OrderedDict") else _Inert

    def persistent_load(self, pid: Any) -> None:  # torch's storages: the tensor data, left unread
        return None


def peek(path: Path) -> dict[str, Any] | None:
    """The top-level entries of a checkpoint written by this trainer (a file, or a committed directory's state file)
    as plain values, tensors as None; None where it cannot be read so (the workers then say why, with torch)."""
    if path.is_dir():
        path = path / STATE_FILE
    try:
        with zipfile.ZipFile(path) as archive:
            pickles = [info for info in archive.infolist() if info.filename.count("/") == 1
                       and info.filename.endswith("/data.pkl")]
            if len(pickles) != 1 or pickles[0].file_size > PEEK_LIMIT:
                return None
            state = _Peek(io.BytesIO(archive.read(pickles[0]))).load()
    except Exception:  # noqa: BLE001 (not a zip, a damaged one, an unexpected pickle: the workers' business)
        return None
    return state if isinstance(state, dict) else None


def workload(config: Mapping[str, Any]) -> tuple[str, str]:
    """The model and the data its weights fit (synthetic data comes in several image sizes)."""
    data = config["dataset"]
    if data == "synthetic":
        side = config.get("synthetic_image_size", 32)  # checkpoints from before the option: 32
        data = f"synthetic {side}x{side}"
    return config["model"], data


def check_same_workload(cfg, saved: Mapping[str, Any] | None, door: str, path) -> None:
    """A checkpoint of the built-in loop holds its workload: another model, data set or optimizer is refused in
    one line. A script's checkpoint is accepted when it holds what this loop registers (resume checks that)."""
    if not isinstance(saved, Mapping) or door != "built-in":
        return
    (saved_model, saved_data), (model, data) = workload(saved), workload(cfg.as_dict())
    if (saved_model, saved_data) != (model, data):
        raise UsageError("--resume", f"{path} holds a {saved_model} trained on {saved_data}, this run is "
                         f"a {model} on {data}", "use another --checkpoint-dir or --resume never")
    if saved["optimizer"] != cfg.optimizer:
        raise UsageError("--optimizer", f"{path} was trained with {saved['optimizer']}, this run asks for "
                         f"{cfg.optimizer}", f"use --optimizer {saved['optimizer']} to resume it, or another "
                         "--checkpoint-dir to start afresh")


def check_resume(cfg, setting: str = "--resume") -> None:
    """The launcher's check of what the built-in loop will resume, before torchrun starts a rank: an empty
    checkpoint file named by --resume, and a checkpoint of another workload (explicit, or the newest that --resume
    auto would take). Anything it cannot read without torch is left to the workers, which read every checkpoint
    with torch.load(weights_only=True) and say why (a corrupt newest one under auto is set aside there)."""
    if cfg.resume == "never":
        return
    if cfg.resume != "auto":
        path = Path(cfg.resume)
        if path.is_file() and os.path.getsize(path) == 0:
            raise UsageError(setting, f"'{path}' is not a loadable checkpoint (an empty file)",
                             "give a checkpoint written by this trainer, or --resume auto")
    else:
        newest = list_checkpoints(Path(cfg.checkpoint_dir))
        if not newest:
            return
        path = newest[0]
    state = peek(path)
    if state is not None and "objects" not in state:  # trainer.api's layout before the one engine: no workload
        check_same_workload(cfg, state.get("config"), state.get("door", "built-in"), path)
