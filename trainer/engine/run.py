"""Run: one process's part in a training run, as pieces a loop calls (trainer.api documents it for users).

The built-in loop (trainer.engine.loop) is one user of these pieces; a user's script is another, with the same
capabilities and no private path between them. The pieces own their cadence: the checkpointer decides when to
commit (and checks the weights first), the observers when to log, the stop vote when every rank stops.

    with Run() as run:                                   # settings: TRAIN_* and .env; keyword arguments win
        model = run.wrap(build_model())                  # ddp or fsdp, channels_last, compile, checkpointing
        optimizer = torch.optim.AdamW(model.parameters())  # after wrap(): fsdp shards the parameters in place
        run.resume(model=model, optimizer=optimizer)     # the newest valid checkpoint, at any world size
        loader = DataLoader(data, batch_size=B, sampler=run.sampler(data, B), drop_last=True)
        for epoch in run.epochs():
            for micro_batches in run.steps(loader):      # one optimizer step each; ends on a stop
                for x, y in micro_batches:               # --grad-accum of them, no gradient sync but the last
                    x, y = run.mixup_cutmix(x, y, num_classes)   # mixup_alpha, cutmix_alpha (off: as they are)
                    with run.autocast():
                        loss = loss_fn(model(x), y)
                    run.backward(loss)
                run.optimizer_step(optimizer)            # clip_grad_norm; the model_ema average (run.ema) updates
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from trainer.checkpoint.checkpointer import Checkpointer, Labels, ResumePoint
from trainer.checkpoint.claim import record_end
from trainer.checkpoint.state import BUILT_IN, SCRIPT, Position
from trainer.cluster.topology import WORKER, resolve
from trainer.config.settings import ELASTIC_WORLD_ENV, TrainConfig, flag_name, script_settings
from trainer.core.errors import UsageError, exit_on_usage_error
from trainer.data.sampling import ResumableSampler
from trainer.engine import inplace
from trainer.engine.drivers import Source, driver_for, leave_if_ended
from trainer.engine.ema import ModelEma
from trainer.engine.process import check_same_software, exit_for, for_this_device, join
from trainer.engine.recipe import Recipe
from trainer.engine.resuming import check_changed_settings, check_order, say_changed_settings
from trainer.parallel import collectives
from trainer.parallel.context import teardown
from trainer.parallel.supervised import Supervised
from trainer.parallel.strategy import Strategy, for_run, weights_are_finite
from trainer.observe.metrics import setup_logging
from trainer.observe.observers import Observers

log = logging.getLogger("trainer")


class Run:
    """One process's part in a distributed training run (see the module's docstring and docs/your-code.md's table)."""

    def __init__(self, checkpoint_dir: str | os.PathLike | None = None, log_dir: str | os.PathLike | None = None, *,
                 config: TrainConfig | None = None, started: float | None = None, **settings: Any):
        """Settings: keyword arguments (any TRAIN_* setting by its lower-case name: strategy="fsdp",
        tracker="tensorboard,csv", amp="bf16", checkpoint_every=100, ...) win over the TRAIN_* environment and
        .env, as the built-in loop's flags do; None: not given. `config`: settings already resolved (the built-in
        loop passes its flags' TrainConfig: errors then name the flags, and its checkpoints say so)."""
        self.started = time.perf_counter() if started is None else started
        self.door = BUILT_IN if config is not None else SCRIPT
        with exit_on_usage_error():
            topology = resolve(os.environ, WORKER)
        # In-place recovery: the settings are those of the job's largest world, whose micro-batches it keeps.
        largest = inplace.largest_world(os.environ)
        # The same settings on every process of a host: its first process says what is wrong, once.
        with exit_on_usage_error(silent=topology.local_rank != 0):
            if config is None:
                config = script_settings({"checkpoint_dir": checkpoint_dir, "log_dir": log_dir, **settings},
                                         os.environ, largest or topology.world_size)
        self.ctx = join(topology, config, self._label("collective_timeout"))
        try:
            if self.door == BUILT_IN or not logging.getLogger().handlers:  # a script's own logging setup stays
                setup_logging(self.ctx)
            with exit_on_usage_error():
                self.settings = for_this_device(config, self.ctx, self._label)
                check_same_software(self.ctx)
            self._build_parts()
        except BaseException:
            teardown(self.ctx)
            raise
        import torch

        self.scaler = torch.amp.GradScaler("cuda", enabled=self.settings.amp == "fp16")
        # torchvision's reference recipe: clipping, mixup and cutmix, the average of model_ema (made in resume()).
        self._recipe = Recipe(self.settings, self._label, self.observers, self.scaler, self.checkpointer)
        self.strategy: Strategy | None = None
        self.position = Position()
        self.stopped = False
        self.resumed_from: int | None = None
        self._model = self._wrapped = None
        self._optimizers: list = []
        self._sampler: ResumableSampler | None = None
        self._batch_size: int | None = self.settings.batch_size if self.door == BUILT_IN else None
        self._names = (self.settings.model, self.settings.dataset) if self.door == BUILT_IN else (None, None)
        self._steps_per_epoch: int | None = None
        self._epochs: int | None = None
        self._supervised = Supervised(self.ctx)  # what this process does for its launcher
        self._training = False   # epochs(), steps() or step() has begun
        self._ended = False      # the last step (max_steps, or the planned total) is done
        self._epoch_start = time.perf_counter()
        self._ended_mid_epoch = False
        self._ended_elsewhere = False  # in place: hosts that left committed the last step before this one's quorum
        self._epoch_count: int | None = None  # run.epochs()'s, while it runs
        self._finished: int | None = None

    # ------------------------------------------------------------------ joining
    def _build_parts(self) -> None:
        """The way of training (its driver owns the step boundary and who is in the job), then what it serves: the
        observers and the checkpointer, given who writes (and, in place, where and behind which fence)."""
        with exit_on_usage_error(silent=not self.ctx.is_local_main):
            self._driver = driver_for(self.ctx, self.settings, os.environ, self._label, state=self._replica_state,
                                      load=self._from_replica, newer=self._from_newer_checkpoint)
        try:
            with exit_on_usage_error():
                self.observers = Observers(self.settings, self.ctx, self.started, self._driver.members.writes)
                self.checkpointer = self._new_checkpointer()
        except BaseException:  # in place: the replica group's manager (its threads, its lighthouse client) goes too
            self._driver.close()
            raise

    def _new_checkpointer(self) -> Checkpointer:
        """The run's checkpointer: it reads the run's moment (_where) when its cadence commits, out of samples/s."""
        cfg = self.settings
        labels = Labels(self._label("checkpoint_dir"), self._label("log_dir"), self._label("resume"))
        if self.door == SCRIPT:
            labels = replace(labels, diverged_fix="lower the learning rate or lengthen its warm-up; with amp fp16 "
                                                  "try bf16")
        return Checkpointer(self.ctx, cfg.checkpoint_dir, cfg.keep_checkpoints, cfg.checkpoint_every, cfg.resume,
                            cfg.strategy == "fsdp", self.door, labels, cfg.checkpoint_async, where=self._where,
                            paused=self.observers.paused, **self._driver.checkpoint_hooks())

    def _label(self, name: str) -> str:
        """A setting as this run's user wrote it: a flag (--collective-timeout) for the built-in loop, a keyword
        argument (collective_timeout) for a script."""
        return flag_name(name) if self.door == BUILT_IN else name

    def _where(self) -> tuple[Position, int, dict[str, Any]]:
        """What a checkpoint records of this moment: the position, one micro-batch over all ranks, the settings."""
        return self.position, self._samples_per_batch(), self.settings.as_dict()

    def _replica_state(self) -> dict:
        """What a host behind gets from this one: the checkpoint dict at the current position."""
        return self.checkpointer.state_at(*self._where())

    def _from_replica(self, state: dict) -> None:
        self.position = self.checkpointer.put_back(state, Path("a live peer's state"))

    def _from_newer_checkpoint(self) -> int | None:
        """A quorum of hosts all behind the job's newest checkpoint (the hosts that trained further left before it:
        a host that started again as the others finished): go on from that checkpoint, as a restart would, not from
        the older one this host loaded (its steps would be trained twice). The step it is at, or None."""
        behind = self.position.step
        position = self.checkpointer.newer_than(behind)
        if position is None:
            return None
        self.position, self.resumed_from = position, position.step
        if self.ctx.is_local_main:
            log.info("in place: the hosts here were at step %d, and the job committed step %d without them (the "
                     "hosts that trained it have left): going on from %s", behind, position.step,
                     self.checkpointer.resumed_path)
        if self._past_the_end():  # the job is done: nothing to train, write or validate
            self._ended = self._ended_elsewhere = True
        return position.step

    def _past_the_end(self) -> bool:
        total = self.total_steps
        return (total is not None and self.position.step >= total) or \
            (self._epoch_count is not None and self.position.epoch >= self._epoch_count)

    # ------------------------------------------------------------------ who does what
    # The job's members as its driver says (in-place recovery: as of the latest quorum; before the first, this host's).
    rank = property(lambda self: self._driver.members.rank)
    local_rank = property(lambda self: self.ctx.topology.local_rank)
    world_size = property(lambda self: self._driver.members.world_size)
    device = property(lambda self: self.ctx.device)
    is_main = property(lambda self: self.ctx.is_main and self._driver.members.writes())
    is_local_main = property(lambda self: self.ctx.is_local_main)
    distributed = property(lambda self: self.ctx.distributed)
    step_count = property(lambda self: self.position.step)
    epoch = property(lambda self: self.position.epoch)

    def barrier(self) -> None:
        collectives.barrier(self.ctx)

    def main_process_first(self):
        return collectives.main_first(self.ctx)

    def local_main_process_first(self):
        return collectives.local_main_first(self.ctx)

    def main_process_only(self, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def on_rank_0(*args, **kwargs):
            return fn(*args, **kwargs) if self.is_main else None
        return on_rank_0

    def all_or_none(self, fn: Callable[[], Any]) -> Any:
        """Every rank runs fn; a mistake on any rank (a UsageError) stops every rank with that one line, instead
        of the others going on into a collective that never completes."""
        with exit_on_usage_error():
            return collectives.all_or_none(self.ctx, fn)

    # ------------------------------------------------------------------ the model
    def wrap(self, model, **ddp_options):
        """The model on this rank's device, spread by the strategy setting (ddp: DistributedDataParallel; fsdp:
        sharded in place, so build the optimizer after this), with activation_checkpointing, channels_last,
        sync_bn, compile and local_sgd_period applied. Returns what the training step calls."""
        import torch

        cfg = self.settings
        self._model_name = type(model).__name__  # fsdp renames the class (FSDPSequential)
        with exit_on_usage_error():
            self.strategy = for_run(cfg, self.ctx, model, label=self._label,
                                    name=self._names[0] or type(model).__name__)
            if cfg.sync_bn and self.distributed:
                model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
            memory_format = torch.channels_last if cfg.channels_last else torch.contiguous_format
            self._wrapped = self.strategy.wrap(model, memory_format, **ddp_options)
        self._model = model
        if self._names[0] is None:
            self._names = (self._model_name, self._names[1])
        with exit_on_usage_error():
            forward = self._driver.forward(self._wrapped, self.position, self.total_steps, cfg)
        return self.strategy.compiled(forward)

    def autocast(self):
        """The amp setting's autocast (bf16 or fp16) around a forward pass; nothing with amp off."""
        import torch

        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.settings.amp)
        return torch.autocast(self.device.type, dtype=dtype) if dtype else contextlib.nullcontext()

    def backward(self, loss) -> None:
        """A micro-batch's backward pass: scaled for fp16, divided by grad_accum, its loss kept for Loss/train."""
        self.observers.record_loss(loss)
        self.scaler.scale(loss / self.settings.grad_accum).backward()

    def optimizer_step(self, optimizer, scheduler=None) -> None:
        """The optimizer step (through fp16's loss scaler; the gradients clipped first with clip_grad_norm),
        gradients cleared, the LR schedule advanced."""
        if not self._driver.commit(lambda: self._parameters(optimizer)):  # abandoned: it is taken again
            optimizer.zero_grad(set_to_none=True)
            self._recipe.step_abandoned()  # taken again: the same mixes
            return
        self._recipe.clip_before_step(optimizer)
        self.scaler.step(optimizer)
        self.scaler.update()
        optimizer.zero_grad(set_to_none=True)
        if scheduler is not None:
            scheduler.step()
        if optimizer not in self._optimizers:
            self._optimizers.append(optimizer)

    def _parameters(self, optimizer):
        """What a step's gradients are combined for: the wrapped model's parameters, else the optimizer's."""
        return self._model.parameters() if self._model is not None else \
            [p for group in optimizer.param_groups for p in group["params"]]

    def clip_gradients(self, optimizer, max_norm: float | None = None):
        """Clip the gradients' total L2 norm to max_norm (default: the clip_grad_norm setting), as nanoGPT does:
        fp16's loss scale taken out first (the scaler's unscale_), then torch.nn.utils.clip_grad_norm_ over the
        optimizer's parameters (under fsdp the norm over every shard). The norm before clipping is returned (on the
        device) and logged as Grad/norm with the loss. run.optimizer_step() calls it when clip_grad_norm is set;
        call it yourself before your own optimizer.step()."""
        import torch

        if not self._driver.commit(lambda: self._parameters(optimizer)):  # abandoned: nothing to clip
            return torch.zeros((), device=self.device)
        return self._recipe.clip_gradients(optimizer, max_norm)

    def mixup_cutmix(self, inputs, targets, num_classes: int):
        """A training batch mixed as mixup_alpha and cutmix_alpha say (torchvision.transforms.v2.MixUp and CutMix,
        one chosen at random per batch when both are on; both 0: the batch as it is): the targets become class
        probabilities (N x num_classes), which cross-entropy takes. The draws come from a generator seeded by (seed,
        epoch, micro-batch, rank), so a resumed run mixes as the uninterrupted one did; the mixing runs where the
        batch is (the GPU's memory for a GPU-resident batch). Call it once per micro-batch, before the forward."""
        return self._recipe.mixup_cutmix(inputs, targets, num_classes, self.position, self.rank, self._driver.shares())

    @property
    def ema(self) -> ModelEma | None:
        """With model_ema: the average of the model (its .module an AveragedModel), made by resume(); else None."""
        return self._recipe.ema

    def no_sync(self, last_micro_batch: bool):
        """Around a micro-batch's forward and backward when you accumulate by hand: no gradient exchange unless it
        is the step's last (run.steps() does this for you)."""
        return self.strategy.no_sync(last_micro_batch) if self.strategy is not None else contextlib.nullcontext()

    # ------------------------------------------------------------------ the data order
    def sampler(self, dataset_or_size, batch_size: int, seed: int | None = None) -> ResumableSampler:
        """This rank's shard of each epoch, in the built-in loop's order, from the next unseen batch on a resume;
        give DataLoader the same batch_size and drop_last=True."""
        size = dataset_or_size if isinstance(dataset_or_size, int) else len(dataset_or_size)
        # In-place recovery: the shards of the largest world; which of them this rank trains follows the quorum.
        rank, world = self._driver.sampler_place()
        with exit_on_usage_error():
            if size // world < batch_size:
                raise UsageError("batch_size", f"{size} samples over {world} processes make no batch of "
                                 f"{batch_size}", "use a smaller batch_size or more data")
        self._sampler = ResumableSampler(size, batch_size, rank, world,
                                         self.settings.seed if seed is None else seed,
                                         self.settings.ra_reps if self.settings.ra_sampler else 1)
        self._batch_size = batch_size
        self._resize_position()
        if self.door == SCRIPT and not isinstance(dataset_or_size, int):
            self._names = (self._names[0], type(dataset_or_size).__name__)
        self.plan(self._sampler.batches_per_epoch // self.settings.grad_accum)
        return self._sampler

    def count_bad_files(self, training, *others) -> None:
        """Files the input skipped (trainer.data.images.BadFiles of each split, the training one first): this
        epoch's training count summed over the ranks at each log step, shown on the progress line and checked
        against its bound (--max-bad-files: every rank stops at that step, one line); every one in summary.json."""
        self.observers.bad_files = [training, *others]

    def plan(self, steps_per_epoch: int, epochs: int | None = None) -> int | None:
        """The run's length: optimizer steps per epoch (and epochs, else the epochs setting or run.epochs(N)).
        The progress bar, the LR warm-up of local SGD and the profiler's window check use it; returns the
        total steps (max_steps caps it)."""
        self._steps_per_epoch = steps_per_epoch
        if epochs is not None:
            self._epochs = epochs
        from trainer.observe.profiling import check_window

        with exit_on_usage_error():
            check_window(self.settings, self.total_steps)
        return self.total_steps

    @property
    def total_steps(self) -> int | None:
        """The run's optimizer steps, where known (max_steps caps them)."""
        epochs = self._epochs if self._epochs is not None else self.settings.epochs
        planned = self._steps_per_epoch * epochs if self._steps_per_epoch is not None else None
        if self.settings.max_steps:
            return min(planned, self.settings.max_steps) if planned is not None else self.settings.max_steps
        return planned

    # ------------------------------------------------------------------ checkpoints
    @property
    def resume_point(self) -> ResumePoint | None:
        """The checkpoint this run resumes from (found at start-up), or None."""
        return self.checkpointer.resume_point

    def resume(self, **objects) -> int:
        """Register what every checkpoint holds (anything with state_dict()/load_state_dict(): model, optimizer,
        scheduler, ...) and load it from the newest valid checkpoint; the steps already done. The output
        directories are made and taken for this run here."""
        point = self.resume_point
        with self._once():
            if self.settings.amp == "fp16" and "scaler" not in objects and self.scaler.is_enabled():
                objects["scaler"] = self.scaler
            check_order(objects, self.strategy, self.settings.strategy == "fsdp" and self.distributed, self._model)
            ema_from_weights = self._recipe.attach_ema(objects, self._model)
            registered = self.checkpointer.register(objects, "resume()")
            check_changed_settings(self.door, self.settings, point)
        with exit_on_usage_error():
            self.checkpointer.prepare(self.settings.log_dir)
        with exit_on_usage_error(silent=not self.ctx.is_local_main):  # in place: the job's settings, or none of it
            self._driver.joined(self.settings.as_dict(), self.checkpointer.built, registered.modules,
                                self.checkpointer.job_settings, self._label)
        with exit_on_usage_error():
            self._optimizers = list(registered.optimizers.values())
            position = self.checkpointer.restore()
        if ema_from_weights:  # a checkpoint without an average: it starts from the weights just resumed
            self._recipe.start_ema_from_weights(objects)
        if position is not None:
            self.position = position
            self.resumed_from = position.step
            self._resize_position()
            say_changed_settings(self.door, self.settings, point, self.checkpointer.changed, self.position.step)
        self.observers.start(self.position.step, resumed=position is not None)
        self._driver.resumed(self.position.step, self._optimizers, self.checkpointer.before_commit)
        return self.position.step

    def _resize_position(self) -> None:
        """The checkpoint's position in this run's micro-batches, once their size is known (the built-in loop's
        from the start, a script's from run.sampler(), which may come after resume())."""
        saved = self.checkpointer.saved_position
        if saved is not None and self._batch_size is not None and self.position.step == saved["global_step"]:
            self.position = replace(self.position, batch=self.checkpointer.resized_batch(
                self._samples_per_batch(), self.settings.grad_accum))
            self._driver.moved(self.position.step)

    def _samples_per_batch(self) -> int:
        """One micro-batch over all ranks (a checkpoint's position is in micro-batches: this converts it); under
        in-place recovery, over the largest world's, whatever the membership."""
        return (self._batch_size or 1) * self._driver.members.largest

    def save(self, background: bool = False) -> None:
        """Commit a checkpoint now (every rank calls it); background: with --checkpoint-async, written while
        training goes on (the cadence's checkpoints; a stop's and the end's are written before the next step)."""
        with self._once():
            self._require("run.save()")
        self.checkpointer.commit_now(background)

    # ------------------------------------------------------------------ the loop
    def epochs(self, count: int | None = None) -> Iterator[int]:
        """The epochs left to train (count, else the epochs setting); sets the sampler's epoch and resume batch,
        and commits a checkpoint at each epoch's end."""
        if count is not None:
            self._epochs = count
        self._start("run.epochs()")
        count = self._epochs if self._epochs is not None else self.settings.epochs
        self._epoch_count = count
        while self.position.epoch < count:  # the position's: under in-place recovery a peer's state may move it on
            if self._ended:
                return
            epoch = self.position.epoch
            if self._sampler is not None:
                self._sampler.set_epoch(epoch, self.position.batch)
            self._epoch_start = time.perf_counter()
            yield epoch
            if self.stopped or self.ended_mid_epoch:
                return
            self.position = Position(self.position.epoch + 1, 0, self.position.step)
            self.observers.log(self.position.step, {"time/epoch_s": time.perf_counter() - self._epoch_start})
            self.checkpointer.epoch_ended()

    def steps(self, batches: Iterable) -> Iterator[Iterator]:
        """One optimizer step per item: an iterator over its grad_accum micro-batches, each in the strategy's
        no-sync context but the last. After each step the run counts it, logs, checkpoints and votes on a stop
        at its cadence; a stop (SIGTERM, Ctrl-C, on any rank) or the last step ends the iteration on every rank
        at the same step, with a checkpoint committed."""
        self._start("run.steps()")
        source = Source(self.settings.grad_accum, lambda: self.position, lambda: self._ended, self.observers.batches,
                        self.no_sync, self._once, self._model)
        for step in self._driver.steps(batches, source):
            yield iter(step.counted)
            if self._driver.step_done(step) and self._after_step(step.micro, step.samples, step.epoch_done, {}):
                return

    def step(self, **scalars) -> bool:
        """Count an optimizer step you took yourself (once per step, after optimizer.step()): the scalars are
        logged every log_every steps (rank 0; a tensor's value is read then only), a checkpoint is committed at
        the checkpoint cadence; True once a stop was requested on any rank (every rank returns True at the same
        step, after a commit), or max_steps is reached before the epoch's end: leave the loop."""
        self._start("run.step()")
        self._driver.counted_by_hand(self._once)
        accum = self.settings.grad_accum
        samples = (self._batch_size or 0) * accum * self.world_size
        # With the run's sampler the epoch's end is known: its last step ends the loop over the loader by itself.
        epoch_done = self._sampler is not None and \
            self.position.batch + accum >= self._sampler.batches_per_epoch // accum * accum
        ending = self._after_step(accum, samples, epoch_done, scalars)
        return self.stopped or (ending and not epoch_done)

    def _after_step(self, micro: int, samples: int, epoch_done: bool, scalars: dict[str, Any]) -> bool:
        pos = self.position
        self.position = Position(pos.epoch, pos.batch + micro, pos.step + 1)
        self._supervised.step_done()
        step, total = self.position.step, self.total_steps
        last = total is not None and step >= total
        self._recipe.step_ended(step)  # a new step: its own mixes and clipping; the average, before the checkpoint
        self._driver.step_ended(step)
        lr = self._optimizers[0].param_groups[0]["lr"] if self._optimizers else None
        self.observers.after_step(step, pos.epoch, samples, last, lr, scalars, self._check_weights)
        stopping = self._supervised.vote.vote(self._supervised.requested)
        self.checkpointer.step_ended(step, stopping, last, epoch_done)
        self.stopped = self.stopped or stopping
        self._ended = self._ended or last
        self._ended_mid_epoch = last and not epoch_done
        return stopping or last

    @property
    def ended_mid_epoch(self) -> bool:
        """The run's last step (max_steps) came before its epoch's end (or, in place, was committed by hosts that left
        before this one trained: nothing of the epoch's end is this host's to do)."""
        return self._ended_mid_epoch or self._ended_elsewhere

    def _check_weights(self, step: int) -> None:
        for model in self.checkpointer.objects.modules.values():
            if not weights_are_finite(self.ctx, model):
                raise self.checkpointer.diverged(step)

    def log(self, **scalars) -> None:
        """Scalars at the current step, to every tracker (rank 0; TensorBoard tags such as Loss/train)."""
        self.observers.log(self.position.step, scalars)

    def paused(self):
        """A block outside training (validation, your own evaluation): not counted in samples/s."""
        return self.observers.paused()

    def consistent(self) -> None:
        """Make every rank's model state the same before reading it (local SGD averages; else nothing to do)."""
        self._driver.synchronise()

    def _once(self):
        """A mistake every rank makes alike (the API's order, a setting): one line per host, exit code 2."""
        return exit_on_usage_error(silent=not self.is_local_main)

    def _require(self, what: str) -> None:
        if self.checkpointer.objects is None:
            raise UsageError(what, "called before run.resume(...)", "call run.resume(model=..., optimizer=...) "
                             "first: it names what a checkpoint holds")

    def _start(self, what: str) -> None:
        if self._training:
            return
        with self._once():
            self._require(what)
        self._training = True
        self._ended_mid_epoch = False
        self._supervised.start()
        model = self._model if self._model is not None else self.checkpointer.objects.model
        if model is not None and self._optimizers:
            self.observers.attach(model, self._wrapped if self._wrapped is not None else model, self._optimizers[0],
                                  self.total_steps, self.position.step)
        if self.resumed_from is not None:
            log.info("resuming from %s (step %d, epoch %d, batch %d)", self.checkpointer.resumed_path,
                     self.position.step, self.position.epoch, self.position.batch)
        # In place every step trains the largest world's global batch, whatever the membership.
        self._recipe.tune_ema(self._batch_size, self._driver.members.largest, self._epochs, self.total_steps)
        names = self._workload_names()
        steps = "" if self.total_steps is None else f", {self.total_steps} steps" + (
            f", {self._steps_per_epoch} per epoch" if self._steps_per_epoch is not None else "")
        world = self._driver.world_line()
        log.info("training %s on %s: world size %s (%s, %s), strategy %s%s", names[0], names[1] or "the script's data",
                 world, self.ctx.backend, self.device, self.settings.strategy, steps)
        largest = os.environ.get(ELASTIC_WORLD_ENV, "")
        if largest.isdigit() and self.settings.global_batch_size:
            log.info("elastic: world size %d of at most %s; %d samples per process per micro-batch keep the job's "
                     "global batch of %d", self.world_size, largest, self.settings.batch_size,
                     self.settings.global_batch_size)

    def _workload_names(self) -> tuple[str, str | None]:
        """(model, dataset) as summary.json names them: the settings' for the built-in loop, the classes' for a
        script."""
        model = self._model if self._model is not None else self.checkpointer.objects.model
        return self._names[0] or type(model).__name__, self._names[1]

    # ------------------------------------------------------------------ the end
    def finish(self) -> int:
        """The end (the with block calls it): the last step committed, summary.json written, the process group
        left; 0, or 1 when summary.json could not be written."""
        if self._finished is not None:
            return self._finished
        code = 0
        if self._training:
            self.stopped = self._supervised.vote.finish() or self.stopped  # leave with no collective in flight
            self.checkpointer.ending()  # the last one committed before the summary says so
            if not self.stopped and self._ended and not self._ended_elsewhere:
                self._driver.last_commit(self.position.step, self.checkpointer.last_committed == self.position.step,
                                         self._commit_last)
        self._supervised.close()
        self.observers.close()
        if self._training and self.resumed_from is not None and self.position.step == self.resumed_from \
                and not self.stopped:
            # A finished run started again (compose up, a scheduler's retry): its results stay as they are.
            log.info("nothing to do: %s is at step %d, the run's end (raise the epochs or max_steps to train on)",
                     self.checkpointer.resumed_path, self.position.step)
        elif self._training:
            status = "stopped" if self.stopped else "completed"
            summary = self.observers.summary(status, self.position.step, self.position.epoch,
                                             self.observers.throughput.samples_per_step, self.resumed_from,
                                             *self._workload_names())
            summary["world_size"] = self.world_size  # in place: the job's at its end
            code = 0 if self.observers.write_summary(summary) else 1
            if status == "completed" and self.ctx.is_main:  # in place: the job's end, for a host started after it
                self._driver.completed(lambda job: record_end(self.checkpointer.directory, job, self.position.step,
                                                              self.settings.as_dict()))
        left = self._supervised.leave(self.stopped, self.position.step,
                                      self.checkpointer.last_committed == self.position.step)
        code = left or code
        self._close()
        self._finished = code
        return code

    def _commit_last(self) -> None:
        self.checkpointer.commit_now()
        self.checkpointer.wait()

    def _close(self) -> None:
        self.checkpointer.close()
        self._driver.close()
        teardown(self.ctx)

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None:
            code = self.finish()
            if code:
                raise SystemExit(code)
            return False
        # No collective now (a peer may be gone); checkpoints stay as they are.
        self.observers.close()
        self._close()
        self._finished = 1
        if issubclass(exc_type, inplace.QuorumFailed):  # the lighthouse gone: the job may have ended meanwhile
            leave_if_ended(self.ctx, self.settings, os.environ)
        exit_for(exc_type, exc, self._label("collective_timeout"), self.settings.collective_timeout)
        return False  # the script's own error: its traceback, then the launcher's line naming the rank

