"""Course: a run's loop from its first step to its end, over the parts Run built.

Run is the door a script calls; the course is what its loop calls go through: the epochs (each one's end timed and
checkpointed), the steps (the driver's, each one's end told to every part in order: the launcher's heartbeat, the
recipe, the driver, the observers, the stop vote, the checkpointer), and the end (the last step committed on every
host, summary.json, the launcher told how the run left). Each part decides for itself what to do at a step's end;
the course only keeps the order and the run's state (trainer.engine.train_state).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Iterable, Iterator

from trainer.checkpoint.checkpointer import Checkpointer
from trainer.checkpoint.claim import record_end
from trainer.engine.drivers import Replicated, Source
from trainer.engine.recipe import Recipe
from trainer.engine.train_state import TrainState
from trainer.observe.observers import Observers
from trainer.parallel.context import DistContext
from trainer.parallel.strategy import weights_are_finite
from trainer.parallel.supervised import Supervised

log = logging.getLogger("trainer")


def say_nothing_to_do(path, step: int, total_steps: int | None, label: Callable[[str], str]) -> None:
    """A finished run started again (compose up, a scheduler's retry): the one line that says it, the built-in
    loop's (before it builds its model) and a script's (at its end) alike. label: a setting as its user writes it."""
    of = f" of {total_steps}" if total_steps is not None else ""
    log.info("nothing to do: %s is at step %d%s, the run's end (raise %s or %s to train on)", path, step, of,
             label("epochs"), label("max_steps"))


class Course:
    def __init__(self, ctx: DistContext, settings, state: TrainState, driver: Replicated, observers: Observers,
                 checkpointer: Checkpointer, recipe: Recipe, lr: Callable[[], float | None],
                 label: Callable[[str], str]):
        """lr: the learning rate the observers log after a step (the first optimizer's, once there is one); label: a
        setting as the run's user wrote it (a flag or a keyword argument)."""
        self.ctx, self.settings, self.state, self.label = ctx, settings, state, label
        self.driver, self.observers, self.checkpointer, self.recipe, self.lr = driver, observers, checkpointer, \
            recipe, lr
        self.supervised = Supervised(ctx)  # what this process does for its launcher
        self.training = False  # epochs(), steps() or step() has begun

    def start(self, model, wrapped, optimizer, names: tuple[str, str | None], world_size: int) -> None:
        """The first step is next: the launcher's stop and heartbeat, step timing on the model, the run's first lines."""
        self.training = True
        state = self.state
        state.ended_mid_epoch = False
        self.supervised.start()
        if model is not None and optimizer is not None:
            self.observers.attach(model, wrapped if wrapped is not None else model, optimizer, state.total_steps,
                                  state.position.step)
        if state.resumed_from is not None:
            saved, now = self.checkpointer.saved_position, state.samples_per_batch(self.driver.members.largest)
            log.info("resuming from %s (step %d, epoch %d, batch %d)%s", self.checkpointer.resumed_path,
                     state.position.step, state.position.epoch, state.position.batch,
                     "" if saved is None or state.batch_size is None or saved["samples_per_batch"] == now else
                     f"; a micro-batch over all ranks is {now} samples, {saved['samples_per_batch']} at the "
                     "checkpoint (the batch size is per process, and the world size changed): the epochs left are "
                     "counted in this run's steps")
        if state.over():  # a finished run started again: it trains nothing, and says so at its end
            return
        # In place every step trains the largest world's global batch, whatever the membership.
        self.recipe.tune_ema(state.batch_size, self.driver.members.largest, state.epochs, state.total_steps,
                             state.steps_per_epoch, state.position.step)
        self.observers.announce(*names, self.driver.world_line(), state.total_steps, state.steps_per_epoch,
                                world_size)

    def epochs(self, count: int, sampler: Callable) -> Iterator[int]:
        state = self.state
        while state.position.epoch < count:  # under in-place recovery a peer's state may move the position on
            if state.over():
                return
            epoch, started = state.position.epoch, time.perf_counter()
            made = sampler()  # the run's, once the script made it
            if made is not None:
                made.set_epoch(epoch, state.position.batch)
            yield epoch
            if state.stopped or state.epoch_cut_short:
                return
            state.epoch_ended()
            self.observers.log(state.position.step, {"time/epoch_s": time.perf_counter() - started})
            self.checkpointer.epoch_ended()

    def steps(self, batches: Iterable, source: Source) -> Iterator[Iterator]:
        for step in self.driver.steps(batches, source):
            yield iter(step.counted)
            if self.driver.step_done(step) and self.step_ended(step.micro, step.samples, step.epoch_done, {}):
                return

    def step_ended(self, micro: int, samples: int, epoch_done: bool, scalars: dict[str, Any]) -> bool:
        """A step of `micro` micro-batches ended: each part is told, in order, and decides for itself what to do at
        it. True: the loop ends here (a stop voted, or the last step), on every rank at the same step."""
        epoch, step, last = self.state.step_counted(micro, samples)
        self.supervised.step_done()
        self.recipe.step_ended(step)  # a new step: its own mixes and clipping; the average, before the checkpoint
        self.driver.step_ended(step)
        self.observers.after_step(step, epoch, samples, last, self.lr(), scalars, self._check_weights)
        stopping = self.supervised.vote.vote(self.supervised.requested)
        self.checkpointer.step_ended(step, stopping, last, epoch_done)
        return self.state.step_ended(stopping, last, epoch_done)

    def _check_weights(self, step: int) -> None:
        for model in self.checkpointer.objects.modules.values():
            if not weights_are_finite(self.ctx, model):
                raise self.checkpointer.diverged(step)

    def finish(self, names: Callable[[], tuple[str, str | None]], world_size: int) -> int:
        """The end: the last step committed (on every host, in place), summary.json, the launcher told how the run
        left. 0; 1 when summary.json could not be written; the launcher's code when a stop had nothing committed."""
        code, state = 0, self.state
        if self.training:
            state.stopped = self.supervised.vote.finish() or state.stopped  # leave with no collective in flight
            if not (state.nothing_trained() and state.over()):  # a finished run started again writes nothing
                self.checkpointer.ending()  # the last one committed before the summary says so
            if not state.stopped and state.ended and not state.ended_elsewhere:
                self.driver.last_commit(state.position.step, self.checkpointer.last_committed == state.position.step,
                                        self._commit_last)
        self.supervised.close()
        self.observers.close()
        if self.training:
            code = self._summarise(*names(), world_size)
        left = self.supervised.leave(state.stopped, state.position.step,
                                     self.checkpointer.last_committed == state.position.step)
        return left or code

    def _commit_last(self) -> None:
        self.checkpointer.commit_now()
        self.checkpointer.wait()

    def _summarise(self, model: str, dataset: str | None, world_size: int) -> int:
        """summary.json (0; 1 if it cannot be written), and in place the job's end recorded for a host after it."""
        state = self.state
        if state.nothing_trained():  # a finished run started again (compose up, a scheduler's retry): as it was
            say_nothing_to_do(self.checkpointer.resumed_path, state.position.step, state.total_steps, self.label)
            return 0
        status = "stopped" if state.stopped else "completed"
        summary = self.observers.summary(status, state.position.step, state.position.epoch, state.position.samples,
                                         state.resumed_from, model, dataset)
        summary["world_size"] = world_size  # in place: the job's at its end
        code = 0 if self.observers.write_summary(summary) else 1
        if status == "completed" and self.ctx.is_main:  # in place: the job's end, for a host started after it
            self.driver.completed(lambda job: record_end(self.checkpointer.directory, job, state.position.step,
                                                         self.settings.as_dict()))
        return code
