"""TrainState: where a run is (epoch, micro-batch, optimizer step) and where it ends.

Run moves it (a step counted, an epoch ended, a checkpoint or a live peer's state loaded) and asks it where the run
ends (the plan: steps per epoch, epochs, max_steps). The checkpointer records its position; a resume, a host behind
catching up, a script's sampler made after resume() all move it through here. Torch-free: arithmetic and state only.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from trainer.checkpoint.state import Position


class TrainState:
    """The run's position and plan, and how far it has gone: stopped (a stop vote passed), ended (the last step is
    done), ended mid-epoch (max_steps before the epoch's end), ended elsewhere (in place: the job's last step was
    committed by hosts that left before this one trained)."""

    def __init__(self, settings: Any, batch_size: int | None):
        self.settings = settings
        self.position = Position()
        self.resumed_from: int | None = None  # the checkpoint's step, when the run resumed from one
        self.stopped = False
        self.ended = False
        self.ended_mid_epoch = False
        self.ended_elsewhere = False
        self.batch_size = batch_size  # one micro-batch per rank: the built-in loop's from its settings, a script's
        #                               from run.sampler()
        self.epochs: int | None = None  # run.epochs(N)'s or plan()'s, else the epochs setting
        self.steps_per_epoch: int | None = None
        # The steps done before the checkpoint resumed from, less what its epochs make at this run's steps per epoch:
        # not 0 when they were trained at another global batch (--batch-size is per process: another world size).
        self.steps_before = 0
        self.epoch_count: int | None = None  # run.epochs()'s, while it runs

    @property
    def total_steps(self) -> int | None:
        """The run's optimizer steps, where known (max_steps caps them)."""
        epochs = self.epochs if self.epochs is not None else self.settings.epochs
        planned = self.steps_before + self.steps_per_epoch * epochs if self.steps_per_epoch is not None else None
        if self.settings.max_steps:
            return min(planned, self.settings.max_steps) if planned is not None else self.settings.max_steps
        return planned

    def plan(self, steps_per_epoch: int, epochs: int | None, resumed: Position | None = None) -> None:
        """resumed: the checkpoint the run resumes from, its batch in this run's micro-batches. The run ends where
        its epochs end at this run's steps per epoch, counted on from that checkpoint's step."""
        self.steps_per_epoch = steps_per_epoch
        if epochs is not None:
            self.epochs = epochs
        self.steps_before = 0 if resumed is None else resumed.step - (
            resumed.epoch * steps_per_epoch + min(resumed.batch // self.settings.grad_accum, steps_per_epoch))

    def epochs_to_train(self, count: int | None) -> int:
        """run.epochs(count)'s epochs (count, else plan()'s, else the setting), kept while it runs."""
        if count is not None:
            self.epochs = count
        self.epoch_count = self.epochs if self.epochs is not None else self.settings.epochs
        return self.epoch_count

    def over(self) -> bool:
        """No step is left: the last one is done, or the run resumed at or past its end (a finished run started
        again: a script's, which trained a step past max_steps; the built-in loop returns before it builds its
        model)."""
        return self.ended or (self.resumed_from is not None and self.past_the_end())

    def past_the_end(self) -> bool:
        total = self.total_steps
        return (total is not None and self.position.step >= total) or \
            (self.epoch_count is not None and self.position.epoch >= self.epoch_count)

    def resumed(self, position: Position) -> None:
        self.position, self.resumed_from = position, position.step

    def resized(self, saved_step: int | None, batch: int) -> bool:
        """The checkpoint's position in this run's micro-batches (their size known once the sampler is made): moved,
        if the run is still where the checkpoint left it."""
        if saved_step is None or self.batch_size is None or self.position.step != saved_step:
            return False
        self.position = replace(self.position, batch=batch)
        return True

    def samples_per_batch(self, largest: int) -> int:
        """One micro-batch over all ranks (a checkpoint's position is in micro-batches: this converts it); under
        in-place recovery, over the largest world's (`largest`), whatever the membership."""
        return (self.batch_size or 1) * largest

    def step_counted(self, micro: int, samples: int) -> tuple[int, int, bool]:
        """A step of `micro` micro-batches, `samples` over all ranks, trained: (its epoch, the step it makes, whether
        it is the run's last)."""
        pos = self.position
        self.position = Position(pos.epoch, pos.batch + micro, pos.step + 1, pos.samples + samples)
        total = self.total_steps
        return pos.epoch, self.position.step, total is not None and self.position.step >= total

    def step_ended(self, stopping: bool, last: bool, epoch_done: bool) -> bool:
        """After the step's vote: True when the loop ends here (a stop, or the last step)."""
        self.stopped = self.stopped or stopping
        self.ended = self.ended or last
        self.ended_mid_epoch = last and not epoch_done
        return stopping or last

    @property
    def epoch_cut_short(self) -> bool:
        """Nothing of the epoch's end is this run's to do: its last step (max_steps) came before the epoch's end, or
        (in place) hosts that left committed the job's last step before this one trained."""
        return self.ended_mid_epoch or self.ended_elsewhere

    def epoch_ended(self) -> None:
        self.position = replace(self.position, epoch=self.position.epoch + 1, batch=0)

    def last_of_epoch(self, accum: int, batches_per_epoch: int) -> bool:
        """Whether a step of `accum` micro-batches from here is the epoch's last (a sampler's epoch of that many)."""
        return self.position.batch + accum >= batches_per_epoch // accum * accum

    def nothing_trained(self) -> bool:
        """A finished run started again (compose up, a scheduler's retry): it resumed at its end and trained none."""
        return self.resumed_from is not None and self.position.step == self.resumed_from and not self.stopped
