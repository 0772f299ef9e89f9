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
from typing import Any, Callable, Iterable, Iterator

from trainer.checkpoint.checkpointer import ResumePoint
from trainer.checkpoint.state import BUILT_IN, SCRIPT
from trainer.config.settings import TrainConfig, flag_name
from trainer.core.errors import UsageError, exit_on_usage_error
from trainer.data.sampling import ResumableSampler
from trainer.engine import inplace
from trainer.engine.drivers import Source, leave_if_ended
from trainer.engine.ema import ModelEma
from trainer.engine.process import exit_for
from trainer.engine.parts import build_parts, join_job
from trainer.engine.resuming import check_changed_settings, check_order, say_changed_settings
from trainer.parallel import collectives
from trainer.parallel.context import teardown
from trainer.parallel.strategy import Strategy, for_run

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
        self.ctx, self.settings = join_job(config, {"checkpoint_dir": checkpoint_dir, "log_dir": log_dir, **settings},
                                           self._label)
        try:
            parts = build_parts(self.ctx, self.settings, self.door, self._label, self.started,
                                lambda: self._optimizers[0].param_groups[0]["lr"] if self._optimizers else None)
        except BaseException:
            teardown(self.ctx)
            raise
        self._driver, self.observers, self.checkpointer = parts.driver, parts.observers, parts.checkpointer
        self.scaler, self._recipe, self._state, self._course = parts.scaler, parts.recipe, parts.state, parts.course
        self.strategy: Strategy | None = None
        self._model = self._wrapped = None
        self._optimizers: list = []
        self._sampler: ResumableSampler | None = None
        self._names = (self.settings.model, self.settings.dataset) if self.door == BUILT_IN else (None, None)
        self._finished: int | None = None

    # ------------------------------------------------------------------ who does what
    def _label(self, name: str) -> str:
        """A setting as its user wrote it: a flag (--collective-timeout) in the built-in loop, a keyword in a script."""
        return flag_name(name) if self.door == BUILT_IN else name

    # The job's members as its driver says (in-place recovery: as of the latest quorum; before the first, this host's).
    rank = property(lambda self: self._driver.members.rank)
    local_rank = property(lambda self: self.ctx.topology.local_rank)
    world_size = property(lambda self: self._driver.members.world_size)
    device = property(lambda self: self.ctx.device)
    is_main = property(lambda self: self.ctx.is_main and self._driver.members.writes())
    is_local_main = property(lambda self: self.ctx.is_local_main)
    distributed = property(lambda self: self.ctx.distributed)
    # Where the run is (trainer.engine.train_state): its position, and whether a stop ended it.
    position = property(lambda self: self._state.position)
    stopped = property(lambda self: self._state.stopped)
    resumed_from = property(lambda self: self._state.resumed_from)
    step_count = property(lambda self: self._state.position.step)
    epoch = property(lambda self: self._state.position.epoch)
    total_steps = property(lambda self: self._state.total_steps, doc="The run's optimizer steps, where known "
                                                                     "(max_steps caps them).")

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
        """The model on this rank's device, spread as the settings say (ddp; fsdp and pipeline_stages cut it in place:
        build the optimizer after this; pipeline stages trace it with example=one batch's inputs), compile and the
        rest applied. Returns what the training step calls."""
        import torch

        cfg = self.settings
        name = type(model).__name__  # before wrap(): fsdp renames the class (FSDPSequential)
        with self._once():  # the model's mistakes are every rank's alike
            self.strategy = for_run(cfg, self.ctx, model, label=self._label, name=self._names[0] or name)
            self.strategy.comm_hook = self._driver.comm_hook  # in place: the host's DDP reports its buckets
            if cfg.sync_bn and self.distributed:
                model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
            memory_format = torch.channels_last if cfg.channels_last else torch.contiguous_format
            self._wrapped = self.strategy.wrap(model, memory_format, **ddp_options)
        self._model, self._recipe.norm_group = model, self.strategy.norm_group
        self._names = (self._names[0] or name, self._names[1])
        with exit_on_usage_error():
            forward = self._driver.forward(self._wrapped, self.position, self.total_steps, cfg,
                                           self._state.steps_per_epoch)
        return self.strategy.compiled(forward)

    def autocast(self):
        """The amp setting's autocast (bf16 or fp16) around a forward pass; nothing with amp off."""
        import torch

        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.settings.amp)
        return torch.autocast(self.device.type, dtype=dtype) if dtype else contextlib.nullcontext()

    def forward_backward(self, forward, inputs, targets, loss_fn: Callable):
        """A micro-batch's forward and backward under any layout: loss_fn(output, targets) -> its mean loss, run in the
        amp setting's autocast; the loss, kept for Loss/train (pipeline stages: the last stage's; None elsewhere)."""
        return self._driver.forward_backward(self.strategy, forward, inputs, targets, loss_fn, self.autocast,
                                             self.backward, self.observers.record_loss)

    def backward(self, loss) -> None:
        """A micro-batch's backward pass: scaled for fp16, divided by grad_accum, its loss kept for Loss/train."""
        self.observers.record_loss(loss)
        self.scaler.scale(loss / self.settings.grad_accum).backward()

    def optimizer_step(self, optimizer, scheduler=None) -> bool:
        """The optimizer step (through fp16's loss scaler; the gradients clipped first with clip_grad_norm),
        gradients cleared, the LR schedule advanced. Returns whether the step counts: False only under in-place
        recovery, when a host came or went during it (its gradients are dropped, and run.steps() gives the same
        step's micro-batches again), so that a script keeping its own per-step records keeps none of it."""
        if not self._driver.commit(lambda: self._parameters(optimizer)):  # abandoned: it is taken again
            optimizer.zero_grad(set_to_none=True)
            self._recipe.step_abandoned()  # taken again: the same mixes
            return False
        self._recipe.optimizer_step(optimizer, scheduler)
        if optimizer not in self._optimizers:
            self._optimizers.append(optimizer)
        return True

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
        self._state.batch_size = batch_size
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
        state = self._state
        resumed = None if state.batch_size is None else self.checkpointer.resumed_position(  # a script's batch size
            state.samples_per_batch(self._driver.members.largest), self.settings.grad_accum)  # comes with its sampler
        state.plan(steps_per_epoch, epochs, resumed)
        from trainer.observe.profiling import check_window

        with exit_on_usage_error():
            check_window(self.settings, self.total_steps)
        return self.total_steps

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
            self._state.resumed(position)
            self._resize_position()
            say_changed_settings(self.door, self.settings, point, self.checkpointer.changed, self.position.step)
        self.observers.start(self.position.step, resumed=position is not None)
        self._driver.resumed(self.position.step, self._optimizers, self.checkpointer.before_commit)
        return self.position.step

    def _resize_position(self) -> None:
        """The checkpoint's position in this run's micro-batches, once their size is known (the built-in loop's
        from the start, a script's from run.sampler(), which may come after resume())."""
        saved, state = self.checkpointer.saved_position, self._state
        if saved is not None and state.resized(saved["global_step"], self.checkpointer.resized_batch(
                state.samples_per_batch(self._driver.members.largest), self.settings.grad_accum)):
            self._driver.moved(state.position.step)

    def save(self, background: bool = False) -> None:
        """Commit a checkpoint now (every rank calls it); background: with --checkpoint-async, written while
        training goes on (the cadence's checkpoints; a stop's and the end's are written before the next step)."""
        with self._once():
            self._require("run.save()")
        self.checkpointer.commit_now(background)

    # ------------------------------------------------------------------ the loop (trainer.engine.course)
    def epochs(self, count: int | None = None) -> Iterator[int]:
        """The epochs left to train (count, else the epochs setting); sets the sampler's epoch and resume batch,
        and commits a checkpoint at each epoch's end."""
        count = self._state.epochs_to_train(count)
        self._start("run.epochs()")
        yield from self._course.epochs(count, lambda: self._sampler)

    def steps(self, batches: Iterable) -> Iterator[Iterator]:
        """One optimizer step per item: an iterator over its grad_accum micro-batches, each in the strategy's
        no-sync context but the last. After each step the run counts it, logs, checkpoints and votes on a stop
        at its cadence; a stop (SIGTERM, Ctrl-C, on any rank) or the last step ends the iteration on every rank
        at the same step, with a checkpoint committed."""
        self._start("run.steps()")
        state = self._state
        yield from self._course.steps(batches, Source(self.settings.grad_accum, lambda: state.position,
                                                  state.over, self.observers.batches, self.no_sync,
                                                  self._once, self._model))

    def step(self, **scalars) -> bool:
        """Count an optimizer step you took yourself (once per step, after optimizer.step()): the scalars are
        logged every log_every steps (rank 0; a tensor's value is read then only), a checkpoint is committed at
        the checkpoint cadence; True once a stop was requested on any rank (every rank returns True at the same
        step, after a commit), or max_steps is reached before the epoch's end: leave the loop."""
        self._start("run.step()")
        self._driver.counted_by_hand(self._once)
        accum = self.settings.grad_accum
        samples = (self._state.batch_size or 0) * accum * self.world_size
        # With the run's sampler the epoch's end is known: its last step ends the loop over the loader by itself.
        epoch_done = self._sampler is not None and self._state.last_of_epoch(accum, self._sampler.batches_per_epoch)
        ending = self._course.step_ended(accum, samples, epoch_done, scalars)
        return self.stopped or (ending and not epoch_done)

    @property
    def ended_mid_epoch(self) -> bool:
        """The run's last step (max_steps) came before its epoch's end (or, in place, was committed by hosts that left
        before this one trained: nothing of the epoch's end is this host's to do)."""
        return self._state.epoch_cut_short

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
        if self._course.training:
            return
        with self._once():
            self._require(what)
        model = self._model if self._model is not None else self.checkpointer.objects.model
        self._course.start(model, self._wrapped, self._optimizers[0] if self._optimizers else None,
                           self._workload_names(), self.world_size)

    def _workload_names(self) -> tuple[str, str | None]:
        """(model, dataset) as summary.json names them: the settings' for the built-in loop, the classes' for a
        script."""
        model = self._model if self._model is not None else self.checkpointer.objects.model
        return self._names[0] or type(model).__name__, self._names[1]

    # ------------------------------------------------------------------ the end
    def finish(self) -> int:
        """The end (the with block calls it): the last step committed, summary.json written, the process group
        left; 0, or 1 when summary.json could not be written."""
        if self._finished is None:
            self._finished = self._course.finish(self._workload_names, self.world_size)
            self._close()
        return self._finished

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

