"""What a checkpoint holds, and putting it back: the one checkpoint dict of both doors.

A checkpoint holds, beside its `format`:
- one entry per object the run registered (`run.resume(model=..., optimizer=...)`; the built-in loop registers
  model, optimizer, scheduler and scaler), its state_dict() under the name it was registered as;
- where training stands: `epoch`, `batch` (the next micro-batch of that epoch), `global_step`, and
  `samples_per_batch` (one micro-batch over all ranks: what lets another world size go on exactly);
- torch's random state (`rng`), the run's settings (`config`), which door wrote it (`door`: built-in or script)
  and the names registered (`registered`);
- the hyper-parameters of its optimizers and LR schedulers as the run built them, before anything was loaded
  (`hyperparameters`): what lets the next resume tell a setting changed since (a new learning rate) from a value
  the run itself moved (the schedule's learning rate of the moment).
Under fsdp the model's and the optimizer's tensors are DCP shards (trainer.checkpoint.sharded) and the rest is
the directory's state file; `param_groups` is the optimizer's there.

Checkpoints written before this layout resume too: the built-in loop's had the same top-level names (without
`door` and `registered`); trainer.api's held the objects' states in one `objects` dict.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from trainer.core.errors import UsageError, first_line

log = logging.getLogger(__name__)

FORMAT = 1  # the "format" key of every checkpoint this trainer writes
BUILT_IN, SCRIPT = "built-in", "script"  # the "door" key: python -m trainer, or a script on trainer.api
BUILT_IN_OBJECTS = ("model", "optimizer", "scheduler", "scaler")  # what the built-in loop registers
# Keys of the checkpoint itself: no registered object may take these names.
RESERVED = ("format", "epoch", "batch", "global_step", "samples_seen", "samples_per_batch", "rng", "config", "door",
            "registered", "objects", "param_groups", "hyperparameters", "param_names")


@dataclass
class Position:
    """Where training stands: `step` optimizer steps done, and the next micro-batch is `batch` of `epoch`; `samples`
    trained in those steps over all ranks (not step x one step's: the global batch follows the world size where the
    batch size is per process, and a job may have resumed at another)."""
    epoch: int = 0
    batch: int = 0
    step: int = 0
    samples: int = 0


def saved_names(state: dict[str, Any]) -> list[str]:
    """The names of the objects a checkpoint holds."""
    if isinstance(state.get("objects"), dict):  # trainer.api before the one engine
        return list(state["objects"])
    if "registered" in state:
        return list(state["registered"])
    return [name for name in BUILT_IN_OBJECTS if name in state or name in ("model", "optimizer")]


def saved_object(state: dict[str, Any], name: str) -> Any:
    return state["objects"][name] if isinstance(state.get("objects"), dict) else state[name]


def door_of(state: dict[str, Any]) -> str:
    if isinstance(state.get("objects"), dict):
        return SCRIPT
    return state.get("door", BUILT_IN)


class Registered:
    """The objects a run checkpoints, by name: anything with state_dict() and load_state_dict() (a model, its
    optimizer, an LR scheduler, a GradScaler, an object of the user's own)."""

    def __init__(self, objects: dict[str, Any], setting: str = "resume()"):
        if not objects:
            raise UsageError(setting, "names nothing to checkpoint", "register the objects, e.g. "
                             "run.resume(model=model, optimizer=optimizer)")
        for name, obj in objects.items():
            if name in RESERVED:
                raise UsageError(setting, f"'{name}' is a name the checkpoint itself uses",
                                 f"register it under another name (not {', '.join(RESERVED)})")
            if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
                raise UsageError(setting, f"{name} is a {type(obj).__name__}, which has no state_dict() and "
                                 "load_state_dict()", "register models, optimizers, schedulers and objects that have both")
        self.objects = dict(objects)
        self.modules = {n: o for n, o in objects.items() if isinstance(o, torch.nn.Module)}
        self.optimizers = {n: o for n, o in objects.items() if isinstance(o, torch.optim.Optimizer)}

    @property
    def model(self) -> torch.nn.Module | None:
        """The model, where exactly one module is registered."""
        return next(iter(self.modules.values())) if len(self.modules) == 1 else None

    def sharded_pair(self, setting: str) -> tuple[str, torch.nn.Module, str | None, torch.optim.Optimizer | None]:
        """(model name, model, optimizer name, optimizer): what goes into DCP shards under fsdp."""
        if len(self.modules) != 1 or len(self.optimizers) > 1:
            raise UsageError(setting, f"fsdp checkpoints one model and at most one optimizer; this run registers "
                             f"{len(self.modules)} modules and {len(self.optimizers)} optimizers",
                             "register the wrapped model and its optimizer (other objects are fine), or use "
                             "strategy ddp")
        (model_name, model), = self.modules.items()
        optim_name, optimizer = next(iter(self.optimizers.items()), (None, None))
        return model_name, model, optim_name, optimizer

    def names(self) -> list[str]:
        return list(self.objects)

    def estimated_bytes(self) -> int:
        """About what one checkpoint of these objects takes on disk: the models' state, and the optimizers' (its
        per-parameter slots, counted before the first step has made them: Adam's two, SGD's momentum)."""
        def size(tensors) -> int:
            return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))

        total = sum(size(m.state_dict().values()) for m in self.modules.values())
        for optimizer in self.optimizers.values():
            params = [p for group in optimizer.param_groups for p in group["params"]]
            made = [v for state in optimizer.state.values() for v in state.values()]
            group = optimizer.param_groups[0] if optimizer.param_groups else {}
            slots = 2 if "betas" in group else 1 if group.get("momentum") else 0
            total += size(made) if made else slots * size(params)
        return total


def rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    """torch's random state (dropout, random augmentation in user code): a resumed run draws what the
    uninterrupted run would have drawn."""
    cuda = device.type == "cuda"
    return {"cpu": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if cuda else torch.empty(0, dtype=torch.uint8)}


def set_rng_state(device: torch.device, rng: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(rng["cpu"])
    if device.type == "cuda" and rng["cuda"].numel():
        torch.cuda.set_rng_state(rng["cuda"])


def meta(pos: Position, samples_per_batch: int, config: dict[str, Any], door: str, names: list[str],
         device: torch.device, built: dict[str, Any] | None = None) -> dict[str, Any]:
    """Everything a checkpoint holds besides the registered objects (built: as_built's record)."""
    return {"format": FORMAT, "epoch": pos.epoch, "batch": pos.batch, "global_step": pos.step,
            "samples_seen": pos.samples, "samples_per_batch": samples_per_batch, "config": config, "door": door,
            "registered": names, "rng": rng_state(device), "hyperparameters": built or {}}


def snapshot(objects: Registered, info: dict[str, Any], skip: tuple[str | None, ...] = ()) -> dict[str, Any]:
    """The whole checkpoint dict (skip: names whose tensors go elsewhere: fsdp's DCP shards), with the names of the
    parameters each optimizer's state is kept by position for (param_names: a layout that holds a part of the
    model, pipeline stages, maps them to its part)."""
    return {**{name: obj.state_dict() for name, obj in objects.objects.items() if name not in skip}, **info,
            "param_names": param_names(objects)}


def param_names(objects: Registered) -> dict[str, list[list[str]]]:
    """{optimizer: its groups' parameter names, in its order} for the optimizers of the one registered model."""
    model = objects.model
    if model is None:
        return {}
    names = {id(p): name for name, p in model.named_parameters()}
    found = {}
    for optim_name, optimizer in objects.optimizers.items():
        groups = [[names.get(id(p)) for p in group["params"]] for group in optimizer.param_groups]
        if all(name is not None for group in groups for name in group):
            found[optim_name] = groups
    return found


def restore(objects: Registered, state: dict[str, Any], path: Path, is_sharded: bool, setting: str, fix: str) -> None:
    """Load every registered object from a checkpoint (state: its dict, or a sharded directory's state file).
    A checkpoint that lacks one of them, or does not fit it, is one line."""
    from torch.distributed.checkpoint.api import CheckpointException

    from trainer.checkpoint import sharded

    missing = [name for name in objects.names() if name not in saved_names(state)]
    if missing:
        raise UsageError(setting, f"{path} holds {', '.join(saved_names(state)) or 'no objects'}; this run resumes "
                         f"{', '.join(objects.names())} ({', '.join(missing)} missing)", fix)
    current, done = None, set()
    try:
        if path.is_dir() or is_sharded:  # DCP reshards a directory for this world size and strategy
            model_name, model, optim_name, optimizer = objects.sharded_pair(setting)
            current, done = model_name, {model_name, optim_name}
            if path.is_dir():
                sharded.load_into(model, optimizer, path, state.get("param_groups", []), kernels_kept,
                                  (model_name, optim_name))
            else:  # a strategy ddp file into an fsdp run or pipeline stages: converted, each rank its part
                sharded.load_full_into(model, optimizer, saved_object(state, model_name),
                                       saved_object(state, optim_name) if optimizer is not None else None,
                                       kernels_kept, state.get("param_names", {}).get(optim_name))
        for name, obj in objects.objects.items():
            if name not in done:
                current = name
                load_object(obj, saved_object(state, name))
    except (RuntimeError, ValueError, KeyError, TypeError, CheckpointException) as err:
        what = "model" if current is None or current in objects.modules else current
        raise UsageError(setting, f"{path} does not fit this {what} ({first_line(err)})", fix) from None


def load_object(obj: Any, saved: Any) -> None:
    if isinstance(obj, torch.optim.Optimizer):
        with kernels_kept(obj):
            obj.load_state_dict(saved)
    elif isinstance(obj, torch.amp.GradScaler):
        load_scaler_state(obj, saved)
    else:
        obj.load_state_dict(saved)


@contextlib.contextmanager
def kernels_kept(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Loading saved hyper-parameters and state keeps this run's kernel choice: load_state_dict would
    take `fused` from the checkpoint, so an fp16 run resumed from an fp32 or bf16 checkpoint would
    switch back to fused SGD, and an fsdp run resumed from a ddp one to fused kernels (see build_optimizer)."""
    kernels = [{key: group[key] for key in ("fused", "foreach") if key in group} for group in optimizer.param_groups]
    yield
    for group, chosen in zip(optimizer.param_groups, kernels):
        group.update(chosen)


def load_scaler_state(scaler: torch.amp.GradScaler, saved: dict) -> None:
    """fp16's loss scale from the checkpoint; a checkpoint of an fp32 or bf16 run has none (an empty
    dict, which GradScaler.load_state_dict refuses), so an fp16 run resumed from it starts afresh."""
    if saved or not scaler.is_enabled():
        scaler.load_state_dict(saved)
    else:
        log.info("the checkpoint has no fp16 loss scale (it was not an fp16 run): starting at %g", scaler.get_scale())


def samples_seen(state: dict[str, Any]) -> int:
    """The samples a checkpoint's steps trained over all ranks; a checkpoint written before it recorded them (all of
    its steps taken as of its own global batch): its step count times its step's samples."""
    if "samples_seen" in state:
        return state["samples_seen"]
    accum = (state.get("config") or {}).get("grad_accum", 1)
    return state["global_step"] * state["samples_per_batch"] * accum


def batch_in(state: dict[str, Any], samples_per_batch: int, grad_accum: int = 1) -> tuple[int, bool]:
    """The micro-batch to go on from in the checkpoint's epoch, now that a batch holds samples_per_batch
    samples over all ranks, and whether it is exact. Every world size reads one global order per epoch
    (sampling.epoch_shard: global micro-batch k is samples [k*B, (k+1)*B) of it), so the position is exact
    whenever the samples already seen fill whole steps of the new size: always when the global batch is
    unchanged."""
    if state["samples_per_batch"] == samples_per_batch:
        return state["batch"], True
    seen = state["batch"] * state["samples_per_batch"]
    batch = seen // samples_per_batch
    batch -= batch % grad_accum
    return batch, batch * samples_per_batch == seen


def resized_batch(state: dict[str, Any], samples_per_batch: int, grad_accum: int = 1) -> int:
    """batch_in()'s micro-batch, with a warning where it is approximated."""
    batch, exact = batch_in(state, samples_per_batch, grad_accum)
    if not exact:
        log.warning("the global batch changed since the checkpoint: the rest of epoch %d is approximated "
                    "(%d micro-batches in; keep --global-batch-size to resume exactly)", state["epoch"], batch)
    return batch


# ------------------------------------------------------------------ settings changed since the checkpoint
# A resume loads an optimizer's hyper-parameters and a scheduler's settings from the checkpoint, over those the
# resuming run built from its own settings or code: a new learning rate, weight decay, momentum or schedule would
# be dropped in silence. Every checkpoint records what its run built (before anything was loaded); a value this
# run built differently is a setting the user changed, and it is applied after the load: the base learning rate
# scales the schedule's current one (the schedule goes on from the new base), anything else takes the new value.
# A value the run itself moved since (the schedule's learning rate, OneCycle's momentum) is not a setting: built
# the same, it stays as the checkpoint has it, which keeps the resume exact.
_HOW = ("params", "fused", "foreach", "differentiable", "capturable")  # how an optimizer computes, not what
# A scheduler's own progress, and its learning rates (the optimizer's base rate stands for them).
_PROGRESS = ("base_lrs", "_last_lr", "last_epoch", "_step_count", "_is_initial", "_get_lr_called_within_step",
             "lr_lambdas", "_schedulers", "verbose")
_SKIP = object()


@dataclass(frozen=True)
class Changed:
    """One setting whose value this run built differently from the checkpoint's run."""
    name: str           # the registered object
    group: int | None   # the optimizer's parameter group (None: a scheduler's setting)
    key: str            # lr, weight_decay, betas, step_size, ...
    old: Any
    new: Any

    def __str__(self) -> str:  # the same for every group that has it (shown once)
        return f"{self.name} {self.key} {_shown(self.old)} -> {_shown(self.new)}"


def _shown(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _plain(value: Any) -> Any:
    """value as plain data a weights_only checkpoint holds and == compares (a scalar tensor as a float); _SKIP
    for anything else (a function, a tensor of many elements)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else _SKIP
    if isinstance(value, (list, tuple)):
        items = [_plain(v) for v in value]
        return _SKIP if any(v is _SKIP for v in items) else type(value)(items)
    if isinstance(value, dict):
        items = {k: _plain(v) for k, v in value.items()}
        return _SKIP if any(v is _SKIP or not isinstance(k, (str, int)) for k, v in items.items()) else items
    return _SKIP


def _is_scheduler(obj: Any) -> bool:
    return isinstance(obj, torch.optim.lr_scheduler.LRScheduler)


def as_built(objects: Registered) -> dict[str, Any]:
    """The registered optimizers' parameter-group hyper-parameters and the LR schedulers' settings, as plain data:
    call it before a resume loads anything (what this run's settings or code built)."""
    built: dict[str, Any] = {}
    for name, obj in objects.objects.items():
        if isinstance(obj, torch.optim.Optimizer):
            built[name] = [{k: p for k, v in group.items() if k not in _HOW and (p := _plain(v)) is not _SKIP}
                           for group in obj.param_groups]
        elif _is_scheduler(obj):
            built[name] = {k: p for k, v in obj.state_dict().items()
                           if k not in _PROGRESS and (p := _plain(v)) is not _SKIP}
    return built


def _set(group: dict, key: str, value: Any) -> None:
    if isinstance(group.get(key), torch.Tensor):  # a tensor lr (capturable, fused): in place
        group[key].fill_(value)
    else:
        group[key] = value


def apply_changed(objects: Registered, recorded: dict[str, Any] | None, built: dict[str, Any],
                  live: dict[str, Any]) -> list[Changed]:
    """After a resume loaded the objects: put back every value this run built differently from the checkpoint's
    run (`recorded`: the checkpoint's as_built; `built`: this run's; `live`: this run's schedulers' state_dict()
    values as built, which are set back as they were). Returns what changed. A checkpoint without a record
    (written before it had one) changes nothing."""
    changed: list[Changed] = []
    if not recorded:
        return changed
    schedulers = [obj for obj in objects.objects.values() if _is_scheduler(obj)]
    for name, new_groups in built.items():
        obj, old = objects.objects[name], recorded.get(name)
        if isinstance(obj, torch.optim.Optimizer) and isinstance(old, list) and len(old) == len(new_groups):
            for index, (new, before, group) in enumerate(zip(new_groups, old, obj.param_groups)):
                base = "initial_lr" if "initial_lr" in new else "lr"  # with a scheduler, lr is the schedule's
                for key in [base, *(k for k in new if k not in ("lr", "initial_lr"))]:
                    value = new[key]
                    if key not in before or before[key] == value:
                        continue
                    changed.append(Changed(name, index, "lr" if key == base else key, before[key], value))
                    if key != base:
                        _set(group, key, value)
                        continue
                    # The new base rate, and the schedule's current rate scaled with it.
                    now = float(group["lr"])
                    _set(group, "lr", now * value / before[key] if before[key] else value)
                    if base == "initial_lr":
                        group["initial_lr"] = value
                    for scheduler in schedulers:
                        if scheduler.optimizer is obj and index < len(scheduler.base_lrs):
                            scheduler.base_lrs[index] = value
        elif _is_scheduler(obj) and isinstance(old, dict):
            for key, value in new_groups.items():
                if key in old and old[key] != value:
                    changed.append(Changed(name, None, key, old[key], value))
                    obj.__dict__[key] = live[name][key]
    for scheduler in schedulers:
        _follow_the_schedule(scheduler)
    return changed


def _follow_the_schedule(scheduler) -> None:
    """A LambdaLR's rate of this step from its lambda: the one this run built, which a changed warm-up, schedule or
    length makes another than the checkpoint's (unchanged, it is the very value the scheduler's last step set)."""
    if isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
        for group, base, schedule in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
            _set(group, "lr", base * schedule(scheduler.last_epoch))
    scheduler._last_lr = [float(group["lr"]) for group in scheduler.optimizer.param_groups]


def live_settings(objects: Registered) -> dict[str, Any]:
    """The schedulers' state_dict() values as built (copies), to set back where one changed."""
    import copy

    return {name: copy.deepcopy({k: v for k, v in obj.state_dict().items() if k not in _PROGRESS})
            for name, obj in objects.objects.items() if _is_scheduler(obj)}
