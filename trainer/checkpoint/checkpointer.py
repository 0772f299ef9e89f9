"""The checkpointer: one run's checkpoint directory, what it resumes from, and when it commits.

It owns its cadence (every N optimizer steps, at epoch ends, on a stop, at the end): the run only tells it what
happened (step_ended, epoch_ended, ending), and it decides what to write, and when. It owns its checks too: a
checkpoint counts only once committed, the weights are checked finite on every rank before a commit (rotation
would otherwise drop the good checkpoints below a diverged one), and every rank waits for the commit before it
goes on or exits. The built-in loop and scripts on trainer.api commit through it alike.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ContextManager

from trainer.checkpoint import state as ckpt
from trainer.checkpoint.sharded import async_save_available
from trainer.checkpoint.state import Position, Registered
from trainer.checkpoint.claim import claim, job_settings
from trainer.checkpoint.store import (
    CheckpointError,
    Superseded,
    ensure_output_dir,
    leave_marker,
    load_for_resume,
    remove_marker,
    save,
    save_sharded,
    save_sharded_in_background,
    sees_marker,
    set_aside_after,
)
from trainer.config.resume import NAME, list_checkpoints
from trainer.config.settings import ELASTIC_WORLD_ENV
from trainer.core.errors import Diverged, EchoedUsageError, Fenced, UsageError
from trainer.parallel import collectives
from trainer.parallel.context import DistContext
from trainer.parallel.supervised import writing
from trainer.parallel.strategy import is_sharded, weights_are_finite

log = logging.getLogger("trainer")


@dataclass(frozen=True)
class ResumePoint:
    """The checkpoint a run resumes from: where it is, where it stood, and what wrote it."""
    path: Path
    step: int
    epoch: int
    door: str                 # ckpt.BUILT_IN or ckpt.SCRIPT
    config: dict | None       # the settings it was written with (None: trainer.api before the one engine)
    names: tuple[str, ...]    # the objects it holds
    records_built: bool = True  # it records its optimizers' settings as built (checkpoints before that did not)


# What saved_position keeps of a checkpoint: where it stood, and the size of its micro-batches over all ranks.
SAVED_POSITION = ("epoch", "batch", "global_step", "samples_per_batch")


@dataclass(frozen=True)
class Labels:
    """How this run's user names the settings in one-line errors: flags for the built-in loop
    (--checkpoint-dir), keyword arguments for a script (checkpoint_dir)."""
    checkpoint_dir: str
    log_dir: str
    resume: str

    diverged_fix: str = "lower --lr or lengthen --warmup-steps; with --amp fp16 try bf16"

    @property
    def fix(self) -> str:
        return f"use another {self.checkpoint_dir} or {self.resume} never"


class Checkpointer:
    def __init__(self, ctx: DistContext, directory: str, keep: int, every: int, resume: str, sharded: bool,
                 door: str, labels: Labels, background: bool = False,
                 where: Callable[[], tuple[Position, int, dict[str, Any]]] | None = None,
                 paused: Callable[[], ContextManager] = contextlib.nullcontext,
                 writes: Callable[[], bool] = lambda: True, staging: Callable[[], Path | None] = lambda: None,
                 fence: Callable[[], None] | None = None, job: str | None = None):
        """where: the run's moment as a checkpoint records it (its position, one micro-batch over all ranks, its
        settings), for the commits this checkpointer decides on; paused: around a commit, out of samples/s.
        In-place recovery: hosts hold the same state, and one writes it (writes: the first of the generation, which
        may change with every membership). staging: the folder of the generation of the state being written, which a
        commit must still find (store.save); fence, once a commit did not: trainer.core.errors.Fenced for a host the
        job went on without; job: the job whose hosts hold the directory together."""
        self.ctx, self.directory, self.keep, self.every = ctx, Path(directory), keep, every
        self.where, self.paused = where, paused
        self.writes, self.staging, self.fence, self.job = writes, staging, fence, job
        self.sharded, self.door, self.labels, self.resume = sharded, door, labels, resume
        self.objects: Registered | None = None
        self.built: dict[str, Any] = {}  # the optimizers' and schedulers' settings as this run built them
        self.changed: list[ckpt.Changed] = []  # those the resume found changed since its checkpoint, applied
        self._live: dict[str, Any] = {}
        self.last_committed: int | None = None  # on disk, whole and renamed: what a resume would find
        self.last_requested: int | None = None  # the same on every rank: committed, or being written by rank 0
        # --checkpoint-async: rank 0 copies the state to CPU memory and a thread writes it while training goes
        # on (one write at a time); under fsdp every rank copies its shard and DCP's async_save writes them, its
        # collectives on a gloo group of their own (the training's groups are busy meanwhile).
        self.background = background and (not sharded or async_save_available())
        self._background_group = None
        if self.background and sharded and ctx.distributed:
            import torch.distributed as dist

            self._background_group = dist.new_group(backend="gloo", timeout=dist.default_pg_timeout)
        elif background and not self.background:
            log.warning("--checkpoint-async: this torch has no torch.distributed.checkpoint.async_save; fsdp's "
                        "checkpoints are written in the step")
        self._writer: threading.Thread | None = None
        self._write_failed: CheckpointError | None = None
        self._superseded: int | None = None  # the step of a background write whose generation ended first (in place)
        self._copy: Any = None  # rank 0's CPU copy of the last background checkpoint, reused by the next
        self.before_commit: list[Callable[[], None]] = []  # e.g. local SGD: make every rank's state rank 0's
        self._claimed: list = []
        self.saved_position: dict[str, int] | None = None  # what the checkpoint resumed from said
        self.resumed_path: Path | None = None
        # Read before anything is built: a checkpoint that cannot be resumed fails in seconds, with nothing written.
        self._found = collectives.on_main_then_share(ctx, self._find(resume))

    def _find(self, resume: str) -> Callable[[], Any]:
        def find():
            try:
                return load_for_resume(self.directory, resume)
            except UsageError as err:  # the store names the built-in loop's flags
                setting, problem, fix = err.parts
                raise UsageError({"--checkpoint-dir": self.labels.checkpoint_dir, "--resume": self.labels.resume}
                                 .get(setting, setting), problem, fix) from None
        return find

    @property
    def resume_point(self) -> ResumePoint | None:
        if self._found is None:
            return None
        state, path = self._found
        return ResumePoint(path, state["global_step"], state["epoch"], ckpt.door_of(state), state.get("config"),
                           tuple(ckpt.saved_names(state)), "hyperparameters" in state)

    def prepare(self, log_dir: str) -> None:
        """Create the output directories, prove they take files, and take the checkpoint directory for this run
        (rank 0, which owns the disk; every rank learns the outcome)."""
        def prepare():
            ensure_output_dir(str(self.directory), self.labels.checkpoint_dir)
            ensure_output_dir(log_dir, self.labels.log_dir)
            if self.objects is not None:
                self._check_room()
            try:
                self._claimed.append(claim(self.directory, job=self.job))
                # In place, a host that joins follows the job's newest checkpoint, which the running hosts may pass
                # between its look and this line: what is above its own is theirs, not an abandoned future.
                if not (self.job is not None and self.resume == "auto"):
                    self._set_aside_abandoned()
            except UsageError as err:
                raise UsageError(self.labels.checkpoint_dir, *err.parts[1:]) from None

        collectives.on_main_then_share(self.ctx, prepare)
        if os.environ.get(ELASTIC_WORLD_ENV) and self.ctx.world_size > self.ctx.topology.local_world_size:
            self._check_shared()

    def job_settings(self, mine: dict[str, Any]) -> dict[str, Any]:
        """In place: the settings of the job that holds the directory (the first host's; `mine` if this is it)."""
        return job_settings(self.directory, mine)

    def _set_aside_abandoned(self) -> None:
        """This run continues the line of the checkpoint it resumes (or starts one, at step 0): the committed
        checkpoints above it are another future of that line, which this run abandons. They are set aside with one
        line (rank 0, holding the directory), so that --resume auto follows this run and the rotation keeps its
        checkpoints; nothing is deleted."""
        step = self._found[0]["global_step"] if self._found is not None else 0
        aside = set_aside_after(self.directory, step)
        if aside is None:
            return
        folder, names = aside
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        what = (f"{self.labels.resume} {self._found[1]} goes back to step {step}" if self._found is not None else
                f"{self.labels.resume} never starts afresh")
        log.warning("%s: the %d checkpoint(s) above it in %s (%s) are set aside in %s, nothing deleted (move them "
                    "back to resume one)", what, len(names), self.directory, shown, folder.name)

    def _check_shared(self) -> None:
        """An elastic job's rank 0 may be on another host after each change, and resumes from what it finds there:
        every host must see one directory (a network file system), not a local one of the same name. Rank 0 leaves
        a marker; the first process of every host looks for it in its own directory; any host that does not see
        it stops the job (exit 2 on every rank) before a step is trained."""
        marker, writer = collectives.on_main_then_share(self.ctx, lambda: leave_marker(self.directory))
        seen = sees_marker(self.directory, marker) if self.ctx.is_local_main else True
        blind = collectives.all_gather_objects(self.ctx, None if seen else (self.ctx.rank, socket.gethostname()))
        if self.ctx.is_main:
            remove_marker(self.directory, marker)
        blind = [who for who in blind if who is not None]
        if blind:
            hosts = ", ".join(f"rank {rank} on {host}" for rank, host in blind)
            error = UsageError if self.ctx.is_local_main else EchoedUsageError  # one line per host
            raise error(self.labels.checkpoint_dir, f"{self.directory} is not one directory that every host of this "
                        f"elastic job shares: {hosts} does not see the file rank 0 (on {writer}) wrote there",
                        "use a directory every host mounts (NFS, a cloud file system): after a host is lost, rank 0 "
                        "may be on another host and resumes from what it finds there")

    def register(self, objects: dict[str, Any], setting: str) -> Registered:
        self.objects = Registered(objects, setting)
        if self.sharded and self.ctx.distributed:
            self.objects.sharded_pair(setting)  # refused now, not at the first commit
        self.built, self._live = ckpt.as_built(self.objects), ckpt.live_settings(self.objects)
        return self.objects

    def _check_room(self) -> None:
        """Refused now, not at the first checkpoint an hour in: a disk with less free space than one checkpoint
        (the rotation removes an old one only after the new one is committed). Rank 0, in prepare()."""
        free = None
        needed = self.objects.estimated_bytes()
        with contextlib.suppress(OSError):  # unreadable: the first save says why
            free = shutil.disk_usage(self.directory).free
        if free is not None and free < needed:
            raise UsageError(self.labels.checkpoint_dir, f"'{self.directory}' has {free >> 20} MiB free, less than "
                             f"one checkpoint needs (about {max(1, needed >> 20)} MiB)",
                             "free some space, or point it at a bigger volume")

    def restore(self) -> Position | None:
        """Load the registered objects from the checkpoint found at start-up; the position it saved (its batch
        in its own micro-batches: resized_batch converts it once this run's are known)."""
        if self._found is None:
            return None
        state, path = self._found
        position = self.put_back(state, path)
        self.changed = ckpt.apply_changed(self.objects, state.get("hyperparameters"), self.built, self._live)
        self._live = {}
        self._found = None  # the objects hold their own copies now
        self.last_committed = state["global_step"]
        self.resumed_path = path
        return position

    def newer_than(self, step: int) -> Position | None:
        """In place: the objects, RNG and position from the newest committed checkpoint, where it is past `step` (the
        hosts that trained further left before this host's quorum: no live peer holds their state); else None. Rank
        0 looks and reads, every rank gets the same."""
        def find():
            listed = list_checkpoints(self.directory)
            newest = NAME.match(listed[0].name) if listed else None
            if newest is None or int(newest.group(1)) <= step:  # the common case: a name, not a load
                return None
            found = load_for_resume(self.directory, "auto")
            return found if found is not None and found[0]["global_step"] > step else None

        found = collectives.on_main_then_share(self.ctx, find)
        if found is None:
            return None
        state, path = found
        position = self.put_back(state, path)
        self.last_committed = self.last_requested = position.step  # on disk already: nothing to write again
        self.resumed_path = path
        return position

    def put_back(self, state: dict[str, Any], source: Path) -> Position:
        """The registered objects, the RNG and the position from a checkpoint dict (read from `source`: a file, or
        a live peer's state under in-place recovery)."""
        model = self.objects.model
        ckpt.restore(self.objects, state, source, model is not None and is_sharded(model), self.labels.resume,
                     self.labels.fix)
        ckpt.set_rng_state(self.ctx.device, state["rng"])
        self.saved_position = {key: state[key] for key in SAVED_POSITION}
        return Position(state["epoch"], state["batch"], state["global_step"], ckpt.samples_seen(state))

    def state_at(self, pos: Position, samples_per_batch: int, config: dict[str, Any]) -> dict[str, Any]:
        """The checkpoint dict of the registered objects at `pos` (their live tensors, not copies)."""
        info = ckpt.meta(pos, samples_per_batch, config, self.door, self.objects.names(), self.ctx.device,
                         self.built)
        return ckpt.snapshot(self.objects, info)

    def resized_batch(self, samples_per_batch: int, grad_accum: int) -> int:
        """The saved position's batch in micro-batches of samples_per_batch (over all ranks)."""
        return ckpt.resized_batch(self.saved_position, samples_per_batch, grad_accum)

    def resumed_position(self, samples_per_batch: int, grad_accum: int) -> Position | None:
        """Where the checkpoint this run resumes from stood (found at start-up, or restored already), its batch in
        micro-batches of samples_per_batch (over all ranks); None: the run starts afresh."""
        saved = self.saved_position
        if saved is None and self._found is not None:
            saved = {key: self._found[0][key] for key in SAVED_POSITION}
        if saved is None:
            return None
        return Position(saved["epoch"], ckpt.batch_in(saved, samples_per_batch, grad_accum)[0], saved["global_step"])

    # ---------------------------------------------------------------- the cadence: the run's news, this one's choice
    def due(self, step: int) -> bool:
        """Whether step N is one of the cadence's (every N optimizer steps)."""
        return bool(self.every) and step % self.every == 0

    def step_ended(self, step: int, stopping: bool, last: bool, epoch_done: bool) -> None:
        """A step ended, the same news on every rank. A stop or the run's last step commits now; a step of the
        cadence in the background (--checkpoint-async); an epoch's last step waits for epoch_ended(), whose
        position is the next epoch's start."""
        if stopping or (not epoch_done and last):
            self.commit_now()
        elif not epoch_done and self.due(step):
            self.commit_now(background=True)

    def epoch_ended(self) -> None:
        """An epoch ended: a checkpoint at the next epoch's start, unless one of this step was asked for already (a
        stop's, the last step's say the same)."""
        self._unless_asked()

    def ending(self) -> None:
        """The run ends: its last step committed (unless it was already), and every write waited for."""
        self._unless_asked()
        self.wait()

    def _unless_asked(self) -> None:
        position, samples_per_batch, config = self.where()
        if self.last_requested != position.step:
            with self.paused():
                self.commit(position, samples_per_batch, config)

    def commit_now(self, background: bool = False) -> None:
        """Commit the run's moment (every rank calls this; see commit())."""
        with self.paused():
            self.commit(*self.where(), background)

    def commit(self, pos: Position, samples_per_batch: int, config: dict[str, Any], background: bool = False) -> None:
        """Commit a checkpoint of the registered objects at `pos` (every rank calls this). background: a cadence
        checkpoint, which --checkpoint-async writes while training goes on; a stop's and the end's are written
        before this returns."""
        if self.objects is None:
            raise RuntimeError("call run.resume(model=..., optimizer=...) first: it names what a checkpoint holds")
        self.wait()
        for hook in self.before_commit:
            hook()
        for model in self.objects.modules.values():
            if not weights_are_finite(self.ctx, model):
                raise self.diverged(pos.step)
        info = ckpt.meta(pos, samples_per_batch, config, self.door, self.objects.names(), self.ctx.device,
                         self.built)
        self.last_requested = pos.step
        if background and self.background:
            self._in_background(pos.step, info)
        else:
            self._now(pos.step, info)

    def _in_background(self, step: int, info: dict[str, Any]) -> None:
        if self.sharded:  # every rank: its shard copied now, written by DCP's thread, committed by rank 0
            model_name, model, optim_name, optimizer = self.objects.sharded_pair(self.labels.checkpoint_dir)
            rest = ckpt.snapshot(self.objects, info, skip=(model_name, optim_name))
            try:
                finish = save_sharded_in_background(self.directory, step, model, optimizer, rest, self.ctx,
                                                    self.keep, (model_name, optim_name), self._background_group)
            except CheckpointError as err:
                raise CheckpointError(str(err).replace("--checkpoint-dir", self.labels.checkpoint_dir, 1)) from None
            self._writer = threading.Thread(target=self._write, args=(step, finish), name="checkpoint-writer")
            self._writer.start()
        elif self.ctx.is_main and self.writes():  # a copy the next steps cannot change, written in a thread
            # Into the previous copy's tensors where they fit: a fresh copy also faults in and zeroes every
            # page, in the step. The previous write is done (wait() above), so nothing reads them.
            state = cpu_copy(ckpt.snapshot(self.objects, info), reuse=self._copy)
            self._copy = state
            self._writer = threading.Thread(target=self._write, args=(step, state, self.staging()),
                                            name="checkpoint-writer")
            self._writer.start()

    def _now(self, step: int, info: dict[str, Any]) -> None:
        committed = True
        try:
            with writing():
                if self.sharded:
                    model_name, model, optim_name, optimizer = self.objects.sharded_pair(self.labels.checkpoint_dir)
                    rest = ckpt.snapshot(self.objects, info, skip=(model_name, optim_name))
                    path = save_sharded(self.directory, step, model, optimizer, rest, self.ctx, self.keep,
                                        (model_name, optim_name))
                else:
                    writer = self.ctx.is_main and self.writes()
                    state = ckpt.snapshot(self.objects, info) if writer else None
                    path = save(self.directory, step, state, self.keep, self.staging()) if writer else None
        except CheckpointError as err:  # the store names the built-in loop's flag
            raise CheckpointError(str(err).replace("--checkpoint-dir", self.labels.checkpoint_dir, 1)) from None
        except Superseded:
            self._not_committed(step)
            path, committed = None, False
        if path is not None and self.ctx.is_main:
            log.info("checkpoint committed: %s", path)
        if committed:
            self.last_committed = step
        collectives.barrier(self.ctx)  # nobody runs ahead (or exits) before the checkpoint is on disk

    def _write(self, step: int, state: dict[str, Any] | Callable[[], Path], staging: Path | None = None) -> None:
        """The writer thread: rank 0's copy of the state (its temp file in `staging`, see store.save), or (fsdp) the
        function that waits for the shards and commits them."""
        idle_priority()
        try:
            with writing():
                path = state() if callable(state) else save(self.directory, step, state, self.keep, staging)
        except CheckpointError as err:
            self._write_failed = CheckpointError(str(err).replace("--checkpoint-dir", self.labels.checkpoint_dir, 1))
            return
        except Superseded:  # told by the step that waits for this write: this thread cannot tell why
            self._superseded = step
            return
        if self.ctx.is_main:
            log.info("checkpoint committed: %s", path)
        self.last_committed = step

    def _not_committed(self, step: int) -> None:
        """In place: the generation of the checkpoint of `step` ended before its commit, and nothing was published.
        A host the job went on without leaves (fence raises trainer.core.errors.Fenced); a host still in the job
        (its background write spanned a change of membership) goes on, and its next checkpoint commits."""
        if self.fence is not None:
            self.fence()
        log.warning("in place: the checkpoint of step %d was not committed: the membership changed while it was "
                    "written (the next one commits)", step)

    def wait(self) -> None:
        """The background write in flight, if any, committed; its failure raised (on rank 0, which wrote it)."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        if self._write_failed is not None:
            failed, self._write_failed = self._write_failed, None
            raise failed
        if self._superseded is not None:
            step, self._superseded = self._superseded, None
            self._not_committed(step)

    def diverged(self, at_step: int) -> Diverged:
        newest = (f"the newest checkpoint is step {self.last_committed}" if self.last_committed is not None else
                  "no checkpoint of this run was committed")
        return Diverged(f"training diverged by step {at_step}: the weights hold NaN or inf and were not committed; "
                        f"{newest} ({self.labels.diverged_fix})")

    def close(self) -> None:
        """The write in flight finishes first (a crash in the user's code still commits it)."""
        try:
            self.wait()
        except (CheckpointError, Fenced) as err:
            log.error("%s", err)
        self._copy = None
        for lock in self._claimed:
            lock.close()
        self._claimed = []


def cpu_copy(value: Any, reuse: Any = None) -> Any:
    """A state dict with every tensor copied to CPU memory: what the background write saves, whatever the next
    steps do to the live tensors. reuse: an earlier copy of the same state, whose tensors are written over where
    the place, shape and dtype match (no one may still read it)."""
    import torch

    if isinstance(value, torch.Tensor):
        value = value.detach()
        if (isinstance(reuse, torch.Tensor) and reuse.shape == value.shape and reuse.dtype == value.dtype
                and reuse.layout == value.layout == torch.strided and reuse.device.type == "cpu"):
            return reuse.copy_(value)
        return value.to("cpu", copy=True)
    if isinstance(value, dict):
        earlier = reuse if isinstance(reuse, dict) else {}
        return {k: cpu_copy(v, earlier.get(k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        earlier = reuse if type(reuse) is type(value) and len(reuse) == len(value) else [None] * len(value)
        return type(value)(cpu_copy(v, e) for v, e in zip(value, earlier))
    return value


def idle_priority() -> None:
    """The calling thread runs only on a core training leaves idle (Linux's SCHED_IDLE): the background write
    takes no CPU from the step on a host whose cores the ranks fill. Elsewhere, or where refused, it stays as
    it is: the write still finishes, at the ordinary priority."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        pass


__all__ = ["Checkpointer", "CheckpointError", "Labels", "Position", "ResumePoint"]
