"""Sharded checkpoints (torch.distributed.checkpoint, DCP): a directory `step-NNNNNNNN/` per checkpoint.

Every rank writes its own shard of the model and optimizer state into `.tmp-step-NNNNNNNN/`; once
DCP's save returns (rank 0 has written `.metadata` after every rank's shard was on disk), rank 0
writes `trainer.pt` (position, schedule, config: what checkpoint.snapshot holds besides the tensors),
fsyncs, writes the commit marker last and renames the directory to its final name. A directory
counts as a checkpoint only with its marker, so a crash mid-save leaves a temp directory that the
next save removes, never a "newest" that fails to load. The same committed directory loads at any
world size and into either strategy: DCP reshards on load.

Loading is as safe as torch.load(weights_only=True): only tensors are stored through DCP (its
non-tensor entries would be unpickled unrestricted), its `.metadata` is read by a restricted
unpickler, and `trainer.pt` is a weights_only file.
"""

from __future__ import annotations

import contextlib
import io
import logging
import pickle
import shutil
import warnings
from pathlib import Path
from typing import Any, Iterator

import torch

from trainer.config.resume import COMMIT_MARKER, STATE_FILE  # a directory's marker (written last) and state file
from trainer.core.files import TEMP_PREFIX

log = logging.getLogger(__name__)

METADATA_FILE = ".metadata"  # DCP's index of every shard


# --------------------------------------------------------------------------------- safe reading

class _MetadataUnpickler(pickle.Unpickler):
    """DCP's index holds its own dataclasses, torch dtypes and sizes, nothing else; anything else
    (a crafted file) is refused before it can run code."""

    def find_class(self, module: str, name: str):
        if module.startswith("torch.distributed.checkpoint.") or (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout,
                                                                       torch.memory_format)):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a checkpoint index")


_ALLOWED_GLOBALS = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
                    ("pathlib", "PosixPath"), ("builtins", "set"), ("builtins", "frozenset")}


def read_metadata(directory: Path):
    with open(directory / METADATA_FILE, "rb") as f:
        return _MetadataUnpickler(f).load()


def _reader(directory: Path):
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any):
            metadata = read_metadata(Path(self.path))
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(str(directory))


def _planner():
    """DCP's default planner, refusing non-tensor entries."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class TensorsOnly(DefaultLoadPlanner):
        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            raise ValueError(f"{read_item.dest_index.fqn} is not a tensor (this trainer stores only tensors "
                             "through DCP)")

    return TensorsOnly()


def missing_parts(directory: Path) -> str | None:
    """What keeps a committed directory from loading, checked without loading it: the marker, the
    state file, the index, and every shard file the index names at its full length."""
    for name in (COMMIT_MARKER, STATE_FILE, METADATA_FILE):
        if not (directory / name).is_file():
            return f"{directory / name} is missing"
    try:
        metadata = read_metadata(directory)
    except Exception as err:  # noqa: BLE001 (pickle and OS errors alike: the index is unreadable)
        return f"{directory / METADATA_FILE} does not load ({type(err).__name__}: {str(err)[:120]})"
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        path = directory / name
        if not path.is_file():
            return f"shard {path} is missing"
        if path.stat().st_size < size:
            return f"shard {path} is truncated ({path.stat().st_size} of {size} bytes)"
    return None


def load_state_file(directory: Path) -> dict[str, Any]:
    # weights_only: a checkpoint is data; unpickling arbitrary objects would run arbitrary code.
    return torch.load(directory / STATE_FILE, map_location="cpu", weights_only=True)


# --------------------------------------------------------------------------------- the tensors

def tensor_state(model, optimizer, names: tuple[str, str] = ("model", "optimizer")) -> tuple[dict[str, Any], list]:
    """{model name: ..., optimizer name: {fqn: {name: tensor}}} and the optimizer's param_groups: each rank's shards
    (DTensors) under fsdp, whole tensors otherwise. Keys are the model's own parameter names under either
    strategy. `names`: what the run registered them as (the built-in loop: model, optimizer); no optimizer: the
    model alone."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    state = {names[0]: get_model_state_dict(model)}
    if optimizer is None:
        return state, []
    optim = get_optimizer_state_dict(model, optimizer)
    state[names[1]] = {fqn: {k: v for k, v in per_param.items() if isinstance(v, torch.Tensor)}
                       for fqn, per_param in optim["state"].items()}
    return state, optim["param_groups"]


def merged_groups(every_ranks: list[list[dict]]) -> list[dict]:
    """The optimizer's param_groups over every rank: each group's parameter names, in rank order, once."""
    merged = [dict(group) for group in every_ranks[0]]
    for groups in every_ranks[1:]:
        for into, group in zip(merged, groups):
            into["params"] = list(dict.fromkeys([*into["params"], *group["params"]]))
    return merged


def load_into(model, optimizer, directory: Path, param_groups: list, kernels_kept,
              names: tuple[str, str] = ("model", "optimizer")) -> None:
    """Every rank reads what it holds of the checkpoint's model and optimizer state (DCP reshards)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    state, current = tensor_state(model, optimizer, names)  # the shapes and shards to fill
    with _one_process_quietly():
        dcp.load(state, storage_reader=_reader(directory), planner=_planner())
    set_model_state_dict(model, state[names[0]])
    if optimizer is not None:
        held = {name for group in current for name in group["params"]}  # a pipeline stage's names, or every one
        groups = [{**group, "params": [name for name in group["params"] if name in held]} for group in param_groups]
        with kernels_kept(optimizer):
            set_optimizer_state_dict(model, optimizer, {"state": state[names[1]], "param_groups": groups})


def load_full_into(model, optimizer, model_state: dict[str, Any], optim_state: dict[str, Any] | None,
                   kernels_kept, saved_names: list[list[str]] | None = None) -> None:
    """A single-file checkpoint's states (every tensor whole, optimizer state keyed by index, as
    Optimizer.state_dict writes it) into a model this rank holds a part of: each rank keeps its shard (fsdp), or its
    stage's tensors (pipeline stages). saved_names: the parameter names of the saved optimizer's indices, by group
    (checkpoints name them); without them, the indices are this optimizer's own order (the model whole)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    full = StateDictOptions(full_state_dict=True)
    held = set(model.state_dict())
    set_model_state_dict(model, {key: value for key, value in model_state.items() if key in held}, options=full)
    if optimizer is None:
        return
    names = {id(p): name for name, p in model.named_parameters()}
    mine = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    order = [name for group in saved_names for name in group] if saved_names else mine
    kept = set(mine)
    converted = {"state": {order[i]: s for i, s in optim_state["state"].items() if order[i] in kept},
                 "param_groups": [{**g, "params": [order[i] for i in g["params"] if order[i] in kept]}
                                  for g in optim_state["param_groups"]]}
    with kernels_kept(optimizer):
        set_optimizer_state_dict(model, optimizer, converted, options=full)


@contextlib.contextmanager
def _one_process_quietly() -> Iterator[None]:
    """DCP warns that it is 'assuming the intent is to load in a single process' without a process
    group: for one plain process, and trainer-export, it is."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to (load|save) in a single process")
        yield


def full_model_state(directory: Path, key: str = "model") -> dict[str, torch.Tensor]:
    """The whole model state of a committed directory in this one process, no process group needed
    (trainer-export): tensors shaped as the index says, filled by DCP's public load."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    prefix = f"{key}."
    entries = read_metadata(directory).state_dict_metadata
    model = {fqn[len(prefix):]: torch.empty(meta.size, dtype=meta.properties.dtype)
             for fqn, meta in entries.items() if fqn.startswith(prefix) and isinstance(meta, TensorStorageMetadata)}
    state = {key: model}
    with _one_process_quietly():
        dcp.load(state, storage_reader=_reader(directory), planner=_planner())
    return state[key]


# --------------------------------------------------------------------------------- committing

def async_save_available() -> bool:
    """DCP's async_save (public, marked experimental): without it (an older or changed torch) --checkpoint-async
    writes fsdp's checkpoints in the step, as before."""
    import torch.distributed.checkpoint as dcp

    return callable(getattr(dcp, "async_save", None))


def save(directory: Path, step: int, model, optimizer, rest: dict[str, Any], ctx, final: Path,
         names: tuple[str, str] = ("model", "optimizer"), background_group=None):
    """Every rank calls this; `final` is step-NNNNNNNN/ in directory. Raises OSError/RuntimeError on
    any rank's failure (every rank raises: DCP and the broadcast below share the outcome).

    background_group: a gloo group of its own for DCP's async_save, whose thread runs its collectives while
    training uses the others. Each rank's shard is then copied to CPU memory here and written in the
    background, and this returns `finish`: it waits for every rank's shard (DCP's index is written once all
    are), then rank 0 commits; only rank 0 learns of a failure then."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    from trainer.parallel import collectives

    temp = directory / f"{TEMP_PREFIX}{final.name}"  # one name on every rank: they write into one directory

    def prepare() -> str | None:
        try:
            directory.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(temp, ignore_errors=True)  # a killed writer's leftover of this very step
            temp.mkdir()
        except OSError as err:
            return f"{type(err).__name__}: {err}"
        return None

    _raise_if(collectives.broadcast_from_main(ctx, prepare() if ctx.is_main else None))
    tensors, param_groups = tensor_state(model, optimizer, names)
    # Every rank's parameters in the groups: a pipeline stage's optimizer holds its stage's alone (fsdp's hold every
    # name, sharded: the union is any rank's). Loading keeps the names the loading rank holds (load_into).
    param_groups = merged_groups(collectives.all_gather_objects(ctx, param_groups))
    writer = FileSystemWriter(str(temp), sync_files=True, single_file_per_rank=True)
    if background_group is not None:
        with _one_process_quietly():
            future = dcp.async_save(tensors, storage_writer=writer, process_group=background_group)

        def finish() -> None:
            future.result()
            if ctx.is_main:
                _raise_if(_commit(temp, final, step, ctx.world_size, {**rest, "param_groups": param_groups}))
        return finish
    with _one_process_quietly():
        dcp.save(tensors, storage_writer=writer)
    failure = _commit(temp, final, step, ctx.world_size, {**rest, "param_groups": param_groups}) if ctx.is_main else None
    _raise_if(collectives.broadcast_from_main(ctx, failure))
    return None


def _commit(temp: Path, final: Path, step: int, shards: int, state: dict[str, Any]) -> str | None:
    """Rank 0, once every shard is on disk: the state file, the marker last, the rename. None, or what failed."""
    from trainer.core import files
    from trainer.core.files import fsync_dir, fsync_file

    try:
        with open(temp / STATE_FILE, "wb") as f:
            torch.save(state, f)
            fsync_file(f)
        fsync_dir(temp)
        with open(temp / COMMIT_MARKER, "w") as f:  # last: from here on the directory is complete
            f.write(f"step {step}, {shards} shards\n")
            fsync_file(f)
        fsync_dir(temp)
        if final.exists():  # the same step saved again (a rerun): the old copy goes first
            shutil.rmtree(final)
        files.commit(temp, final)
    except OSError as err:
        return f"{type(err).__name__}: {err}"
    return None


def _raise_if(failure: str | None) -> None:
    if failure is not None:
        raise OSError(failure)
