"""The step boundary, one object per way of training: which micro-batches this rank trains, how a step's gradients are
combined across the processes and hosts, whether the step commits or is taken again. `Run.steps()`,
`Run.optimizer_step()` and `Run.clip_gradients()` delegate to the run's driver, and `Run` has no branch on which one it
is; the next ways of training (pipeline stages) are drivers beside these.

- `Replicated`: DistributedDataParallel, FSDP or one process. The strategy's collectives combine the gradients in
  the backward pass; every step commits.
- `Averaging`: local SGD (local_sgd_period): steps as Replicated's, no gradient exchange between averages, the models
  averaged every period (trainer.parallel.local_sgd), and made the same before every checkpoint.
- `InPlace`: in-place recovery on torchft (trainer.engine.inplace): each step begins with a quorum of the hosts, this
  rank trains the shares of the largest world that membership gives it, the gradients are summed over the hosts
  before any clipping, and a step that the hosts did not all commit is taken again from the same position.

Who this process is in the job (its rank, the world size, whether its host writes the checkpoints and scalars, the
largest world whose micro-batches the job keeps) is the driver's `members`: `Fixed` for a world fixed for the
processes' life, the replica groups' membership (inplace.InPlace) under in place, which changes with every quorum.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterable, Iterator, Protocol

from trainer.checkpoint.claim import Ended, check_ended
from trainer.checkpoint.state import Position
from trainer.config.settings import INPLACE_JOB_ENV, LIGHTHOUSE_ENV, TrainConfig
from trainer.core.errors import UsageError
from trainer.engine import inplace
from trainer.engine.microbatches import Counted
from trainer.parallel.context import DistContext

log = logging.getLogger("trainer")


class Members(Protocol):
    """Who this process is in the job now."""
    largest: int  # the world whose micro-batches the job keeps (its global batch, its sampler's order)

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def writes(self) -> bool:
        """Whether this host writes the job's checkpoints, scalars and summary."""


class Fixed:
    """The world of a job whose processes stay for its life (a change of hosts restarts them all)."""

    def __init__(self, ctx: DistContext):
        self.ctx = ctx
        self.largest = ctx.world_size

    rank = property(lambda self: self.ctx.rank)
    world_size = property(lambda self: self.ctx.world_size)

    def writes(self) -> bool:
        return True


@dataclass
class Step:
    """One optimizer step to train: its micro-batches (this rank's), how far it moves the position (in micro-batches
    of the largest world), the samples it trains over every rank, and whether it is the epoch's last."""
    counted: Counted
    micro: int
    samples: int
    epoch_done: bool


@dataclass
class Source:
    """What a driver reads of the run while it hands out steps."""
    grad_accum: int
    position: Callable[[], Position]          # where the run stands (a peer's state or a checkpoint may move it)
    ended: Callable[[], bool]                 # the run's last step is done
    batches: Callable[[Iterable], Iterable]   # the loader's batches, timed by the observers
    no_sync: Callable[[bool], ContextManager]  # the strategy's no-sync context for a micro-batch (True: the last)
    once: Callable[[], ContextManager]        # a usage mistake every rank makes alike: one line per host
    model: Any = None                         # the model run.wrap() spread, if it did


class Replicated:
    """DistributedDataParallel, FSDP or one process: every step commits."""

    def __init__(self, members: Members):
        self.members = members

    comm_hook = None  # who registers DDP's comm hook instead of the strategy (Strategy.comm_hook)

    # ------------------------------------------------------------------ the steps
    def steps(self, batches: Iterable, source: Source) -> Iterator[Step]:
        """grad_accum micro-batches per step, each in the no-sync context but the last. With a length, an epoch's
        last partial step is dropped; without one, a short last group (it would skip the gradient sync) too."""
        accum = source.grad_accum
        length = len(batches) if hasattr(batches, "__len__") else None
        per_epoch = length // accum if length is not None else None
        it = iter(source.batches(batches))
        done = 0
        while not source.ended() and (per_epoch is None or done < per_epoch):
            first = next(it, None)
            if first is None:
                return
            group = None
            if per_epoch is None:
                group = [first, *(batch for _, batch in zip(range(accum - 1), it))]
                if len(group) < accum:
                    return
            counted = Counted(first, iter(group[1:]) if group is not None else it, accum, source.no_sync)
            done += 1
            yield Step(counted, 0, 0, per_epoch is not None and done == per_epoch)

    def step_done(self, step: Step) -> bool:
        """After the caller trained `step`: True if it counts (it committed). Fills in what it moved and trained."""
        step.micro, step.samples = step.counted.micro, step.counted.samples * self.members.world_size
        return True

    def counted_by_hand(self, once: Callable[[], ContextManager]) -> None:
        """run.step(): a step the script took itself counts."""

    def forward_backward(self, strategy, forward, inputs, targets, loss_fn, autocast, backward, record):
        """run.forward_backward(): a micro-batch's forward in autocast, its loss, the backward (scaled, / grad_accum,
        the loss kept for Loss/train); the loss."""
        with autocast():
            loss = loss_fn(forward(inputs), targets)
        backward(loss)
        return loss

    # ------------------------------------------------------------------ the gradients
    def commit(self, parameters: Callable[[], Iterable]) -> bool:
        """Before the optimizer step (and any clipping): the step's gradients combined; False: abandoned."""
        return True

    # ------------------------------------------------------------------ the model and the run's moments
    def forward(self, wrapped, position: Position, total_steps: int | None, settings: TrainConfig,
                steps_per_epoch: int | None = None):
        return wrapped

    def joined(self, settings: dict[str, Any], built: dict[str, Any], modules: dict[str, Any],
               job_settings: Callable[[dict], dict], label: Callable[[str], str]) -> None:
        """resume(), before the restore: this process's settings and model against the job's."""

    def resumed(self, step: int, optimizers: list, before_commit: list) -> None:
        """resume(), after the restore: the step the run is at, its optimizers."""

    def moved(self, step: int) -> None:
        """The position changed without a step (a script's sampler resized the checkpoint's)."""

    def step_ended(self, step: int) -> None:
        """After each committed step, before its checkpoint."""

    def synchronise(self) -> None:
        """Every rank's model state the same (run.consistent())."""

    def sampler_place(self) -> tuple[int, int]:
        """(rank, world size) of this rank's part of the data."""
        return self.members.rank, self.members.world_size

    def shares(self) -> list[int] | None:
        """The ranks of the largest world whose micro-batches this rank trains in a step, in order; None: its own."""
        return None

    def checkpoint_hooks(self) -> dict[str, Any]:
        """The Checkpointer's keyword arguments for this way of training (who writes, where, the fence)."""
        return {}

    def world_line(self) -> str:
        return str(self.members.world_size)

    def last_commit(self, step: int, committed: bool, commit: Callable[[], None]) -> None:
        """The run's last step trained: its checkpoint is committed (committed: this process committed it)."""

    def completed(self, record: Callable[[str], None]) -> None:
        """The run completed and its summary is written."""

    def close(self) -> None:
        pass


class Staged(Replicated):
    """Pipeline stages (pipeline_stages > 1, trainer.parallel.pipeline): a micro-batch goes through the schedule, which
    cuts it into pipeline_microbatches and runs every stage's forwards and backwards; the data is the replicas'
    (every stage of a replica reads the same batches: the first stage takes the inputs, the last the targets)."""

    def __init__(self, ctx: DistContext, cfg: TrainConfig):
        members = Fixed(ctx)
        members.largest = ctx.world_size // cfg.pipeline_stages  # the micro-batches the job keeps are the replicas'
        super().__init__(members)
        self.stages, self.microbatches, self.accum = cfg.pipeline_stages, cfg.pipeline_microbatches, cfg.grad_accum
        self.replica = ctx.rank // cfg.pipeline_stages

    def step_done(self, step: Step) -> bool:
        step.micro, step.samples = step.counted.micro, step.counted.samples * self.members.largest
        return True

    def sampler_place(self) -> tuple[int, int]:
        return self.replica, self.members.largest

    def shares(self) -> list[int]:
        """Mixup's and cutmix's draws are keyed by the replica, not the rank: the stages of a replica mix the same
        batch alike (the first stage's inputs and the last's targets, one draw)."""
        return [self.replica]

    def forward_backward(self, strategy, forward, inputs, targets, loss_fn, autocast, backward, record):
        """The schedule over the micro-batch: each pipeline micro-batch's loss / (its count x grad_accum) is what the
        backward starts from, so a step's gradients are those of the replicated step. The last stage keeps the
        micro-batch's loss for Loss/train and returns it; the others keep 0 (the observers average over the
        replicas) and return None."""
        import torch

        scale = self.microbatches * self.accum
        strategy.loss_fn = lambda output, target: loss_fn(output, target) / scale
        with autocast():
            losses = strategy.stage.step(inputs, targets, sync=strategy.boundary)
        if not losses:
            record(torch.zeros((), device=inputs.device))
            return None
        loss = torch.stack([part.detach() for part in losses]).sum() * self.accum
        record(loss)
        return loss

    def world_line(self) -> str:
        replicas = self.members.largest
        return f"{self.members.world_size} ({self.stages} pipeline stages x {replicas} replica{'s' * (replicas != 1)})"


class Averaging(Replicated):
    """Local SGD: after the LR warm-up each rank steps on its own gradients, and the models are averaged every
    local_sgd_period steps (trainer.parallel.local_sgd)."""

    def __init__(self, ctx: DistContext, period: int, label: Callable[[str], str]):
        super().__init__(Fixed(ctx))
        self.ctx, self.period, self.label = ctx, period, label
        self.averaging = None  # trainer.parallel.local_sgd.PeriodicAveraging, once the model is wrapped

    def forward(self, wrapped, position: Position, total_steps: int | None, settings: TrainConfig,
                steps_per_epoch: int | None = None):
        from trainer.engine.optim import warmup_length
        from trainer.parallel.local_sgd import PeriodicAveraging

        if total_steps is None and settings.warmup_steps < 0:
            raise UsageError(self.label("local_sgd_period"), "starts after the LR warm-up, whose length follows the "
                             "run's (unknown here)", "call run.plan(steps_per_epoch, epochs) before run.wrap(), or "
                             "give warmup_steps")
        self.averaging = PeriodicAveraging(self.ctx, wrapped, None, self.period,
                                           warmup_length(settings, total_steps or 0, steps_per_epoch), position.step)
        return self.averaging.forward

    def resumed(self, step: int, optimizers: list, before_commit: list) -> None:
        if self.averaging is not None:
            self.averaging.optimizer = optimizers[0] if optimizers else None
            self.averaging.step = step
            before_commit.append(self.averaging.synchronise)

    def moved(self, step: int) -> None:
        if self.averaging is not None:
            self.averaging.step = step

    def step_ended(self, step: int) -> None:
        if self.averaging is not None:
            self.averaging.after_step(step)

    def synchronise(self) -> None:
        if self.averaging is not None:
            self.averaging.synchronise()


class InPlace(Replicated):
    """In-place recovery (trainer.engine.inplace): the replica groups over the hosts are the membership."""

    def __init__(self, replicas: inplace.InPlace):
        super().__init__(replicas)
        self.replicas = replicas
        self._committed: bool | None = None  # this step's gradients summed and committed; None: not yet asked
        # A host of one process under a DDP all the same (run.wrap() wraps as on the restart path): DDP kept out of
        # every backward (its no_sync), the sum taking each gradient as autograd accumulates it.
        self._ddp_idle = False

    # ------------------------------------------------------------------ the overlapped sum (inplace.GradientSum)
    def comm_hook(self, ddp, chained: tuple | None) -> None:
        """A host of several processes: its DDP's comm hook averages each bucket over them (as its own hook, or
        `chained`, would), then hands the averages to the sum over the hosts as they come. A host of one process:
        its DDP is kept out of the backward."""
        if ddp.process_group.size() == 1:
            # Nothing for that DDP to average, and its copy of every gradient into a bucket of its own would be one
            # pass over the gradients more than the restart path makes (110 ms a step at VGG-11's 491 MiB on the
            # 2-core VM): its backward is left out (no_sync, see _arming) and the sum takes each gradient from
            # autograd, as for a model without DDP.
            self._made(ddp.module).hook_parameters()
            self._ddp_idle = True
            return
        self._ddp_idle = False
        summed = self._made(ddp.module)
        summed.hook_ddp(ddp, chained)

    def forward(self, wrapped, position: Position, total_steps: int | None, settings: TrainConfig,
                steps_per_epoch: int | None = None):
        """A host of one process (no DDP): each parameter's gradient goes into its bucket as soon as the backward of
        the step's last micro-batch accumulated it."""
        if self.replicas.summed is None or not self.replicas.summed.matches(self._trained(wrapped)):
            self._made(wrapped).hook_parameters()
        return wrapped

    @staticmethod
    def _trained(model) -> list:
        return [p for p in model.parameters() if p.requires_grad]

    def _made(self, model) -> inplace.GradientSum:
        return self.replicas.summing(self._trained(model), fresh=True)

    def _arming(self, no_sync: Callable[[bool], ContextManager]) -> Callable[[bool], ContextManager]:
        """The strategy's no-sync context, which also tells the sum whether this micro-batch's backward makes the
        gradients final (the step's last: the others accumulate, and a hook of theirs must not send anything)."""
        def context(last: bool) -> ContextManager:
            if self.replicas.summed is not None:
                self.replicas.summed.armed = last
            return no_sync(last and not self._ddp_idle)

        return context

    def forward_backward(self, strategy, forward, inputs, targets, loss_fn, autocast, backward, record):
        """As Replicated's, timed for the step's line of costs (inplace.StepTiming)."""
        import time

        timing, began = self.replicas.timing, time.perf_counter()
        with autocast():
            loss = loss_fn(forward(inputs), targets)
        middle = time.perf_counter()
        backward(loss)
        timing.add("forward", middle - began)
        timing.add("backward", time.perf_counter() - middle)
        return loss

    def steps(self, batches: Iterable, source: Source) -> Iterator[Step]:
        """Each step begins with the quorum; this rank's micro-batches are those of the shares it trains now
        (grad_accum per share, the last one synchronised with the host's other processes); an abandoned step is
        taken again from the same position at the new membership, and the batches are read again from there (a
        DataLoader's persistent workers stay: a new iterator of it reuses them)."""
        from trainer.data.sampling import ResumableSampler

        replicas = self.replicas
        sampler = getattr(batches, "sampler", None)
        if not isinstance(sampler, ResumableSampler) or sampler.world_size != replicas.largest or \
                iter(batches) is batches:
            with source.once():
                raise UsageError("run.steps()", "under in-place recovery it reads the batches again after a host comes "
                                 "or goes, and these are not a DataLoader on run.sampler()'s order", "give run.steps() "
                                 "the DataLoader made with sampler=run.sampler(dataset, batch_size), or set "
                                 "RECOVERY=restart")
        self._source = source
        replicas.chain = inplace.BufferChain.of(source.model)
        accum = source.grad_accum
        per_epoch = sampler.batches_per_epoch if sampler.stop_batch is None else \
            min(sampler.stop_batch, sampler.batches_per_epoch)
        per_epoch //= accum
        samples = sampler.batch_size * accum * replicas.largest  # every step trains the largest world's global batch
        it = None
        while not source.ended() and source.position().batch // accum < per_epoch:
            # The step's first batch is read while the quorum is asked (its thread): kept when the quorum changed
            # nothing, read again at the new shares when it did.
            changed, first = replicas.begin_step(None if it is None else functools.partial(next, it, None))
            if changed or it is None:
                if source.ended():  # the newest checkpoint is the job's end: it finished without this host
                    return
                sampler.train_shares(replicas.shares, accum)
                sampler.set_epoch(source.position().epoch, source.position().batch, sampler.stop_batch)
                it = iter(source.batches(batches))
                first = next(it, None)
            if first is None:
                return
            no_sync = self._arming(source.no_sync)
            counted = Counted(first, it, accum * len(replicas.shares), no_sync if replicas.chain is None else
                              replicas.chain.micro_batches(no_sync, replicas.shares, accum))
            self._committed = None
            step = Step(counted, accum, samples, source.position().batch // accum + 1 == per_epoch)
            yield step
            if self._committed is False:
                it = None  # the step again, from the same position, with the hosts still here

    def step_done(self, step: Step) -> bool:
        """The step's answer, which steps() reads too (False: it takes the step again); None is a usage mistake."""
        if self._committed is None:
            with self._source.once():
                raise UsageError("run.steps()", "a step ended without run.optimizer_step(optimizer), which under "
                                 "in-place recovery sums the gradients over the hosts", "call run.optimizer_step("
                                 "optimizer) once per step, after the backward passes")
        if self._committed:
            self.replicas.recovered(self._source.position().step + 1)
        return self._committed

    def counted_by_hand(self, once: Callable[[], ContextManager]) -> None:
        with once():
            raise UsageError("run.step()", "in-place recovery takes an abandoned step again, which needs the step "
                             "boundary of run.steps() and run.optimizer_step()", "train through run.steps(loader) "
                             "and run.optimizer_step(optimizer), or set RECOVERY=restart for this job")

    def commit(self, parameters: Callable[[], Iterable]) -> bool:
        """The step's gradients summed over the hosts, once per step and before any clipping (the norm is the whole
        job's, as under one DistributedDataParallel); False: the step is abandoned."""
        if self._committed is None:
            self._committed = self.replicas.commit(parameters())
        return self._committed

    def joined(self, settings: dict[str, Any], built: dict[str, Any], modules: dict[str, Any],
               job_settings: Callable[[dict], dict], label: Callable[[str], str]) -> None:
        """Before this host's first quorum: the job's settings, or none of its state."""
        self.replicas.agree(inplace.fingerprint(settings, built, modules), job_settings, label)

    def resumed(self, step: int, optimizers: list, before_commit: list) -> None:
        self.replicas.set_step(step)

    def sampler_place(self) -> tuple[int, int]:
        """The largest world's order: each step's quorum decides which of its shares this rank trains."""
        return 0, self.replicas.largest

    def shares(self) -> list[int] | None:
        return self.replicas.shares

    def checkpoint_hooks(self) -> dict[str, Any]:
        replicas = self.replicas
        return {"writes": replicas.writes, "staging": replicas.staging, "fence": replicas.fence, "job": replicas.job}

    def world_line(self) -> str:
        return f"up to {self.replicas.largest} (in place: each step's quorum decides)"

    def last_commit(self, step: int, committed: bool, commit: Callable[[], None]) -> None:
        """The end of an in-place job, on every host together: the first host committed the last checkpoint; the
        others leave once it says so, and write it themselves if it cannot (it was lost meanwhile)."""
        if not self.replicas.confirm(self.replicas.writes() and committed):
            log.warning("in place: the host that writes the checkpoints did not confirm step %d: this host writes it",
                        step)
            self.replicas.take_over()
            commit()

    def completed(self, record: Callable[[str], None]) -> None:
        if self.replicas.writes():
            record(self.replicas.job)

    def close(self) -> None:
        self.replicas.close()


def driver_for(ctx: DistContext, cfg: TrainConfig, env, label: Callable[[str], str],
               **replica_state: Callable) -> Replicated:
    """The run's driver, from its settings and what trainer-launch chose (in place: the lighthouse it runs);
    replica_state: the run's state, load and newer callbacks for inplace.InPlace."""
    if inplace.largest_world(env) is not None:
        if cfg.strategy == "fsdp" or cfg.local_sgd_period or cfg.pipeline_stages > 1:
            setting = "strategy" if cfg.strategy == "fsdp" else "local_sgd_period" if cfg.local_sgd_period else \
                "pipeline_stages"
            what = {"strategy": "strategy fsdp shards the model",
                    "local_sgd_period": "local_sgd_period averages the models now and then",
                    "pipeline_stages": "pipeline_stages cuts the model across processes"}[setting]
            raise UsageError(label(setting),
                             f"{what}, and in-place recovery replicates whole models, summing gradients every step",
                             "set RECOVERY=restart for this job (trainer-launch then restarts the workers on a change)")
        try:
            replicas = inplace.InPlace(ctx, env, cfg.collective_timeout, cfg.checkpoint_dir, job=job_of(env),
                                       label=label("checkpoint_dir"), **replica_state,
                                       ended=functools.partial(check_job_ended, cfg, env))
        except (UsageError, inplace.QuorumFailed):  # no lighthouse: the job may have ended as this host started
            leave_if_ended(ctx, cfg, env)
            raise
        return InPlace(replicas)
    if cfg.local_sgd_period and ctx.distributed:
        return Averaging(ctx, cfg.local_sgd_period, label)
    if cfg.pipeline_stages > 1:
        return Staged(ctx, cfg)
    return Replicated(Fixed(ctx))


def leave_if_ended(ctx: DistContext, cfg: TrainConfig, env) -> None:
    """In place, the lighthouse gone: where the checkpoint directory says the job trained to its end with these
    settings, this host (started as it ended) leaves with one line, exit 0, having trained and written nothing."""
    try:
        check_job_ended(cfg, env)
    except Ended as ended:
        if ctx.is_local_main:
            log.info("%s", ended)
        raise SystemExit(0) from None


def check_job_ended(cfg: TrainConfig, env) -> None:
    """claim.Ended where the checkpoint directory says this in-place job trained to its end with these settings."""
    check_ended(Path(cfg.checkpoint_dir), job_of(env), cfg.as_dict())


def job_of(env) -> str:
    """The in-place job's name: the one trainer-launch gave it, else its lighthouse's address."""
    return env.get(INPLACE_JOB_ENV, "").strip() or env[LIGHTHOUSE_ENV].strip()

