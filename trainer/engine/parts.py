"""A run's process joined to its job, and the parts the run is made of, each built with what it needs: the way of
training (its driver owns the step boundary and says who is in the job), then what it serves, the observers and the
checkpointer, given who writes (and, in place, where and behind which fence). Run holds them; nothing is patched in
after construction."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

from trainer.checkpoint.checkpointer import Checkpointer, Labels
from trainer.checkpoint.state import BUILT_IN, SCRIPT
from trainer.cluster.topology import WORKER, resolve
from trainer.config.settings import TrainConfig, script_settings
from trainer.core.errors import exit_on_usage_error
from trainer.engine import inplace
from trainer.engine.course import Course
from trainer.engine.drivers import Replicated, driver_for
from trainer.engine.process import check_same_software, end_for_lost_lighthouse, for_this_device, join
from trainer.engine.recipe import Recipe
from trainer.engine.train_state import TrainState
from trainer.observe.metrics import setup_logging
from trainer.observe.observers import Observers
from trainer.parallel.context import DistContext, teardown

log = logging.getLogger("trainer")


def join_job(config: TrainConfig | None, given: dict[str, Any], label: Callable[[str], str]) -> tuple[DistContext,
                                                                                                    TrainConfig]:
    """This process in its job: the topology its launcher gave it, the settings (`config`: the built-in loop's,
    resolved from its flags; else a script's keyword arguments `given` over the TRAIN_* environment and .env), the
    process group joined, logging, the settings for this device, the same software on every process."""
    script = config is None
    with exit_on_usage_error():
        topology = resolve(os.environ, WORKER)
    # In-place recovery: the settings are those of the job's largest world, whose micro-batches it keeps.
    largest = inplace.largest_world(os.environ)
    # The same settings on every process of a host: its first process says what is wrong, once.
    with exit_on_usage_error(silent=topology.local_rank != 0):
        if config is None:
            config = script_settings(given, os.environ, largest or topology.world_size)
    ctx = join(topology, config, label("collective_timeout"))
    try:
        if not script or not logging.getLogger().handlers:  # a script's own logging setup stays
            setup_logging(ctx)
        with exit_on_usage_error():
            settings = for_this_device(config, ctx, label)
            check_same_software(ctx)
    except BaseException:
        teardown(ctx)
        raise
    return ctx, settings


@dataclass
class Parts:
    driver: Replicated
    observers: Observers
    checkpointer: Checkpointer
    scaler: Any  # torch.amp.GradScaler: amp fp16's loss scale (off otherwise)
    recipe: Recipe
    state: TrainState
    course: Course


def build_parts(ctx: DistContext, settings, door: str, label: Callable[[str], str], started: float,
                lr: Callable[[], float | None]) -> Parts:
    """The run's parts. The driver's in-place callbacks read and move the run's state through the checkpointer:
    what a host behind gets from this one, a peer's state put back, the job's newer checkpoint gone on from.
    lr: the learning rate the observers log after each step."""
    # One micro-batch per rank: the built-in loop's from its settings, a script's once it makes run.sampler().
    state = TrainState(settings, settings.batch_size if door == BUILT_IN else None)
    checkpointer: Checkpointer | None = None  # made after the driver, which says who writes; the callbacks see it

    def where():
        return state.position, state.samples_per_batch(driver.members.largest), settings.as_dict()

    def load(replica: dict) -> None:
        state.position = checkpointer.put_back(replica, Path("a live peer's state"))

    with exit_on_usage_error(silent=not ctx.is_local_main):
        try:
            driver = driver_for(ctx, settings, os.environ, label, state=lambda: checkpointer.state_at(*where()),
                                load=load, newer=lambda: newer_checkpoint(ctx, state, checkpointer))
        except inplace.QuorumFailed as lost:  # the lighthouse gone: an infrastructure fault, one line and exit 1
            end_for_lost_lighthouse(lost, say=ctx.is_local_main)
    try:
        with exit_on_usage_error():
            observers = Observers(settings, ctx, started, driver.members.writes)
            labels = Labels(label("checkpoint_dir"), label("log_dir"), label("resume"))
            if door == SCRIPT:
                labels = replace(labels, diverged_fix="lower the learning rate or lengthen its warm-up; with amp "
                                                      "fp16 try bf16")
            checkpointer = Checkpointer(ctx, settings.checkpoint_dir, settings.keep_checkpoints,
                                        settings.checkpoint_every, settings.resume,
                                        settings.strategy == "fsdp" or settings.pipeline_stages > 1, door,
                                        labels, settings.checkpoint_async, where=where, paused=observers.paused,
                                        **driver.checkpoint_hooks())
    except BaseException:  # in place: the replica group's manager (its threads, its lighthouse client) goes too
        driver.close()
        raise
    import torch

    scaler = torch.amp.GradScaler("cuda", enabled=settings.amp == "fp16")
    # torchvision's reference recipe: clipping, mixup and cutmix, the average of model_ema (made in resume()).
    recipe = Recipe(settings, label, observers, scaler, checkpointer, script=door == SCRIPT)
    return Parts(driver, observers, checkpointer, scaler, recipe, state,
                 Course(ctx, settings, state, driver, observers, checkpointer, recipe, lr, label))


def newer_checkpoint(ctx: DistContext, state: TrainState, checkpointer: Checkpointer) -> int | None:
    """A quorum of hosts all behind the job's newest checkpoint (the hosts that trained further left before it: a
    host that started again as the others finished): go on from that checkpoint, as a restart would, not from the
    older one this host loaded (its steps would be trained twice). The step it is at, or None."""
    behind = state.position.step
    position = checkpointer.newer_than(behind)
    if position is None:
        return None
    state.resumed(position)
    if ctx.is_local_main:
        log.info("in place: the hosts here were at step %d, and the job committed step %d without them (the hosts "
                 "that trained it have left): going on from %s", behind, position.step, checkpointer.resumed_path)
    if state.past_the_end():  # the job is done: nothing to train, write or validate
        state.ended = state.ended_elsewhere = True
    return position.step
