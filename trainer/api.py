"""The helper API for your own training script: what the built-in trainer does, around your own loop.

    from trainer import api

    with api.Run(checkpoint_dir="checkpoints", log_dir="runs", checkpoint_every=100) as run:
        sampler = run.sampler(len(dataset), batch_size=32)      # DataLoader(..., sampler=sampler)
        run.resume(model=model, optimizer=optimizer)           # newest valid checkpoint, if any
        ddp = run.wrap(model)
        for epoch in run.epochs(10):
            for inputs, labels in loader:
                ...                                            # forward, backward, optimizer.step()
                if run.step(**{"Loss/train": loss}):           # SIGTERM: checkpointed, leave
                    break

Run it with `trainer-launch my_train.py ARGS`, plain torchrun, Slurm's srun, or `python my_train.py`.
Everything here is the code the built-in trainer (`python -m trainer`) runs, not a copy of it:

Run(checkpoint_dir="./checkpoints", log_dir="./runs", checkpoint_every=0, keep_checkpoints=3,
    log_every=10, backend="auto", collective_timeout=300.0)
    Joins the process group of whichever launcher started the process (torchrun, srun, or none: one
    process) and pins this rank's GPU (trainer.topology.resolve + setup).
    .ctx .rank .local_rank .world_size .device .is_main .is_local_main .distributed
    .barrier()                   every rank waits for every other
    .main_process_first()        context manager: rank 0 runs the block first (a download, a shared file)
    .local_main_process_first()  the same per host
    .main_process_only(fn)       decorator: fn runs on rank 0 only (returns None elsewhere)
    .wrap(model, **ddp_options)  DistributedDataParallel on this rank's device (the model itself alone)
    .sampler(dataset_or_size, batch_size, seed=0) -> ResumableSampler
                                 this rank's shard of each epoch, the order the built-in trainer uses;
                                 give DataLoader the same batch_size and drop_last=True
    .resume(**objects) -> int    objects with state_dict()/load_state_dict() (model, optimizer, LR
                                 scheduler, GradScaler) go into every checkpoint and are loaded now from
                                 the newest valid one (weights_only=True); returns the steps already done
    .epochs(count)               the epochs left to train; sets the sampler's epoch and resume batch
    .step(**scalars) -> bool     once per batch, after optimizer.step(): counts it, logs the scalars to
                                 TensorBoard every log_every steps (rank 0; a tensor's value is read
                                 then only), checkpoints every checkpoint_every steps; True
                                 once a stop (SIGTERM, Ctrl-C) was requested on any rank: every rank
                                 returns True at the same step, after committing a checkpoint
    .log(**scalars)              TensorBoard scalars at the current step (rank 0; tags like "Loss/train")
    .save()                      commit a checkpoint now (every rank calls it)
    .finish()                    commit the last step, leave the process group (the `with` block does it)
    .step_count .epoch .stopped
ResumableSampler(size, batch_size, rank=0, world_size=1, seed=0), epoch_shard(...)  (trainer.data.sampling)
dataloader_worker_init       DataLoader(..., num_workers=N, worker_init_fn=api.dataloader_worker_init):
                             a stop (SIGTERM, Ctrl-C) reaches the training process only, which
                             checkpoints (torchrun signals the workers' process group too)

Checkpoints are committed atomically (temp file, fsync, rename) as step-<N>.pt, the newest
keep_checkpoints kept; a torn or corrupt newest one is set aside and the one before it used.
A stop checkpoints and returns: leave the loop, and the script exits 0; the next run resumes at the
next unseen batch, so no sample is replayed or skipped. The same SIGTERM handler and the same
agreement on the stopping step (GracefulStop, StopVote) as the built-in trainer.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from typing import Any, Callable, Iterator

from trainer.cluster.supervisor import stop_host_agent
from trainer.cluster.topology import WORKER, resolve
from trainer.core.errors import UsageError, exit_on_usage_error, first_line, print_error
from trainer.data.sampling import ResumableSampler, epoch_shard
from trainer.dist import collectives
from trainer.dist.context import rendezvous_failure, setup, teardown
from trainer.dist.stop import GracefulStop, StopVote

__all__ = ["Run", "ResumableSampler", "epoch_shard", "dataloader_worker_init", "UsageError"]

# DataLoader(..., worker_init_fn=api.dataloader_worker_init): with worker processes, a stop (SIGTERM,
# Ctrl-C) must reach only the training process, which checkpoints; see GracefulStop.
dataloader_worker_init = GracefulStop.dataloader_worker_init

log = logging.getLogger("trainer")
STATE_KEY = "objects"  # a script checkpoint's user state: {name given to resume(): state_dict}


class Run:
    """One process's part in a distributed training run of your own loop (see the module's docstring)."""

    def __init__(self, checkpoint_dir: str | os.PathLike = "./checkpoints", log_dir: str | os.PathLike = "./runs",
                 checkpoint_every: int = 0, keep_checkpoints: int = 3, log_every: int = 10,
                 backend: str = "auto", collective_timeout: float = 300.0):
        from trainer.checkpoint.store import Position
        from trainer.observe.metrics import setup_logging

        with exit_on_usage_error():
            if keep_checkpoints < 1:
                raise UsageError("keep_checkpoints", f"{keep_checkpoints} keeps no checkpoint", "give 1 or more")
            if log_every < 1:
                raise UsageError("log_every", f"{log_every} is below 1", "give 1 or more")
            if checkpoint_every < 0:
                raise UsageError("checkpoint_every", f"{checkpoint_every} is negative",
                                 "give 0 (epoch ends only) or more")
            topology = resolve(os.environ, WORKER)
        try:
            self.ctx = setup(topology, backend, collective_timeout)
        except UsageError:
            with exit_on_usage_error():
                raise
        except Exception as err:
            message = rendezvous_failure(topology, err, "collective_timeout", collective_timeout)
            if message is None:
                raise
            print_error(message)
            raise SystemExit(1) from None
        if not logging.getLogger().handlers:  # the script's own logging setup, if any, stays
            setup_logging(self.ctx)
        self.checkpoint_dir, self.log_dir = Path(checkpoint_dir), str(log_dir)
        self.checkpoint_every, self.keep_checkpoints, self.log_every = checkpoint_every, keep_checkpoints, log_every
        self.position = Position()
        self.stopped = False
        self._objects: dict[str, Any] | None = None  # set by resume()
        self._sampler: ResumableSampler | None = None
        self._scalars = None
        self._stop: GracefulStop | None = None
        self._vote = StopVote(self.ctx)
        self._last_saved: int | None = None
        self._claimed: list = []  # rank 0's lock on the checkpoint directory

    # ------------------------------------------------------------------ who does what
    rank = property(lambda self: self.ctx.rank)
    local_rank = property(lambda self: self.ctx.topology.local_rank)
    world_size = property(lambda self: self.ctx.world_size)
    device = property(lambda self: self.ctx.device)
    is_main = property(lambda self: self.ctx.is_main)
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

    def wrap(self, model, **ddp_options):
        if not self.distributed:
            return model
        from torch.nn.parallel import DistributedDataParallel as DDP

        cuda = self.device.type == "cuda"
        return DDP(model, device_ids=[self.device.index] if cuda else None, **ddp_options)

    # ------------------------------------------------------------------ data order
    def sampler(self, dataset_or_size, batch_size: int, seed: int = 0) -> ResumableSampler:
        size = dataset_or_size if isinstance(dataset_or_size, int) else len(dataset_or_size)
        with exit_on_usage_error():
            if size // self.world_size < batch_size:
                raise UsageError("batch_size", f"{size} samples over {self.world_size} processes make no batch of "
                                 f"{batch_size}", "use a smaller batch_size or more data")
        self._sampler = ResumableSampler(size, batch_size, self.rank, self.world_size, seed)
        return self._sampler

    # ------------------------------------------------------------------ checkpoints
    def resume(self, **objects) -> int:
        from trainer.checkpoint import store as checkpoint
        from trainer.dist.collectives import on_main_then_share
        from trainer.observe.metrics import Scalars

        if not objects:
            raise TypeError("resume() needs the objects to checkpoint, e.g. resume(model=model, optimizer=optimizer)")
        with exit_on_usage_error():
            found = on_main_then_share(self.ctx, lambda: checkpoint.load_for_resume(self.checkpoint_dir, "auto"))
            on_main_then_share(self.ctx, self._prepare_outputs)
            if found is not None:
                self._restore(objects, *found)
        self._objects = objects
        self._scalars = Scalars(self.ctx, self.log_dir, purge_step=self.position.step + 1 if found else None)
        return self.position.step

    def _prepare_outputs(self) -> None:
        from trainer.checkpoint import store as checkpoint

        checkpoint.ensure_output_dir(str(self.checkpoint_dir), "checkpoint_dir")
        checkpoint.ensure_output_dir(self.log_dir, "log_dir")
        self._claimed.append(checkpoint.claim(self.checkpoint_dir))

    def _restore(self, objects: dict[str, Any], state: dict, path: Path) -> None:
        from trainer.checkpoint import store as checkpoint

        saved = state.get(STATE_KEY)
        if not isinstance(saved, dict):
            raise UsageError("checkpoint_dir", f"{path} was written by the built-in trainer, not by trainer.api",
                             "give this script its own checkpoint_dir")
        if saved.keys() != objects.keys():
            raise UsageError("checkpoint_dir", f"{path} holds {', '.join(sorted(saved))}; this script resumes "
                             f"{', '.join(sorted(objects))}",
                             "pass resume() the same names, or use another checkpoint_dir")
        for name, obj in objects.items():
            try:
                obj.load_state_dict(saved[name])
            except (RuntimeError, ValueError, KeyError) as err:
                raise UsageError("checkpoint_dir", f"{path} does not fit this script's {name} ({first_line(err)})",
                                 "use another checkpoint_dir") from None
        checkpoint.set_rng_state(self.ctx, state["rng"])
        batch = checkpoint.resized_batch(state, self._samples_per_batch()) if self._sampler else state["batch"]
        self.position = checkpoint.Position(state["epoch"], batch, state["global_step"])
        self._last_saved = self.position.step
        log.info("resuming from %s (step %d, epoch %d, batch %d)", path, state["global_step"], state["epoch"], batch)

    def _samples_per_batch(self) -> int:
        return self._sampler.batch_size * self.world_size if self._sampler else self.world_size

    def save(self) -> None:
        from trainer.checkpoint import store as checkpoint

        if self._objects is None:
            raise RuntimeError("call run.resume(model=..., optimizer=...) first: it names what a checkpoint holds")
        pos = self.position
        if self.is_main:
            objects = {name: obj.state_dict() for name, obj in self._objects.items()}
            state = {"format": checkpoint.FORMAT, STATE_KEY: objects,
                     "epoch": pos.epoch, "batch": pos.batch, "global_step": pos.step,
                     "samples_per_batch": self._samples_per_batch(), "rng": checkpoint.rng_state(self.ctx)}
            try:
                path = checkpoint.save(self.checkpoint_dir, pos.step, state, self.keep_checkpoints)
            except checkpoint.CheckpointError as err:  # the other ranks wait in the barrier until torchrun stops them
                print_error(str(err).replace("--checkpoint-dir", "checkpoint_dir", 1))
                raise SystemExit(1) from None
            log.info("checkpoint committed: %s", path)
        self._last_saved = pos.step
        collectives.barrier(self.ctx)  # nobody runs ahead (or exits) before the checkpoint is on disk

    # ------------------------------------------------------------------ the loop
    def epochs(self, count: int) -> Iterator[int]:
        from trainer.checkpoint.store import Position

        if self._objects is None:
            raise RuntimeError("call run.resume(model=..., optimizer=...) before run.epochs()")
        if self._stop is None:
            self._stop = GracefulStop()
        for epoch in range(self.position.epoch, count):
            if self._sampler is not None:
                self._sampler.set_epoch(epoch, self.position.batch if epoch == self.position.epoch else 0)
            yield epoch
            if self.stopped:
                return
            self.position = Position(epoch + 1, 0, self.position.step)
            if self._last_saved != self.position.step:  # else the checkpoint of this step says the same
                self.save()

    def step(self, **scalars) -> bool:
        if self._stop is None:
            raise RuntimeError("run.step() belongs in a loop over run.epochs(...)")
        self.position.batch += 1
        self.position.step += 1
        if scalars and self.position.step % self.log_every == 0:  # reading a GPU tensor waits for the GPU
            self.log(**scalars)
        stopping = self._vote.vote(self._stop.requested)
        if stopping or (self.checkpoint_every and self.position.step % self.checkpoint_every == 0):
            self.save()
        self.stopped = self.stopped or stopping
        return stopping

    def log(self, **scalars) -> None:
        if self._scalars is None:
            from trainer.observe.metrics import Scalars

            self._scalars = Scalars(self.ctx, self.log_dir, purge_step=None)
        self._scalars.add(self.position.step, **scalars)

    def finish(self) -> None:
        if self._objects is not None:
            self.stopped = self._vote.finish() or self.stopped  # every rank leaves with no collective in flight
            if self._last_saved != self.position.step:
                self.save()
        if self._stop is not None:
            self._stop.close()
            if self.stopped and not self._stop.requested and self.is_local_main and stop_host_agent(os.environ):
                log.warning("the stop was requested on another host: stopping this host's launcher too")
        if self._scalars is not None:
            self._scalars.close()
        for lock in self._claimed:
            lock.close()
        teardown(self.ctx)

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None:
            self.finish()
        else:  # the traceback is the script's; no collective now (a peer may be gone), checkpoints stay as they are
            if self._scalars is not None:
                self._scalars.close()
            teardown(self.ctx)
        return False
