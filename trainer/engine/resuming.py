"""What run.resume() checks and says around the restore: what the checkpoint resumed from allows to change, the
order of run.wrap() and the optimizer's construction under fsdp, and the settings a resume applied."""

from __future__ import annotations

import logging
from typing import Any

from trainer.checkpoint.checkpointer import ResumePoint
from trainer.checkpoint.state import BUILT_IN
from trainer.config.settings import TrainConfig, flag_name
from trainer.core.errors import UsageError
from trainer.parallel.strategy import FSDPStrategy, is_sharded

log = logging.getLogger("trainer")


def check_changed_settings(door: str, settings: TrainConfig, point: ResumePoint | None) -> None:
    """The built-in loop's checkpoints before the record of what their run built cannot take a changed learning
    rate, weight decay, momentum, schedule or warm-up: refused in one line, not ignored."""
    from trainer.engine.optim import changed_settings

    if door != BUILT_IN or point is None or point.records_built or point.door != BUILT_IN:
        return
    for name, old, new in changed_settings(settings, point.config):
        raise UsageError(flag_name(name), f"{new} on resume, and {point.path} (written before a resume could "
                         f"apply a changed setting) was trained with {old}",
                         f"resume with {flag_name(name)} {old} until it commits a checkpoint, then change it; "
                         "or start afresh in another --checkpoint-dir")


def say_changed_settings(door: str, settings: TrainConfig, point: ResumePoint, changed: list, step: int) -> None:
    """One line naming the settings a resume applied over the checkpoint's (rank 0); changed: the checkpointer's
    record of the optimizers' and schedulers' changes (a script's)."""
    from trainer.engine.optim import changed_settings

    if door == BUILT_IN and point.door == BUILT_IN:
        changes = [f"{flag_name(name)} {old if old != '' else 'unset'} -> {new if new != '' else 'unset'}"
                   for name, old, new in changed_settings(settings, point.config)]
    else:  # each change once, though every parameter group of the optimizer has it
        changes = list(dict.fromkeys(str(change) for change in changed))
    if changes:
        log.info("settings changed since %s, applied: %s (the schedule goes on from step %d with them)",
                 point.path.name, ", ".join(changes), step)


def check_order(objects: dict[str, Any], strategy, fsdp_planned: bool, model) -> None:
    """Under fsdp, run.wrap(model) comes before resume(), and the optimizer is built after it (on the shards)."""
    import torch

    if not isinstance(strategy, FSDPStrategy) and not fsdp_planned:
        return
    if strategy is None:
        raise UsageError("resume()", "called before run.wrap(model), and strategy fsdp shards the model in place",
                         "call run.wrap(model) first, then build the optimizer, then run.resume(...)")
    if not is_sharded(model):
        return
    held = {id(p) for p in model.parameters()}
    for name, obj in objects.items():
        if isinstance(obj, torch.optim.Optimizer) and any(id(p) not in held for g in obj.param_groups
                                                         for p in g["params"]):
            raise UsageError("resume()", f"{name} was built before run.wrap(model): fsdp replaced the model's "
                             "parameters by their shards, so it would train copies nobody uses",
                             "build the optimizer after run.wrap(model)")
