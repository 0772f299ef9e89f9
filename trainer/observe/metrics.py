"""What the run tells its user: log lines, scalars (TensorBoard and the other trackers), a progress bar, summary.json.

Only rank 0 writes; other ranks log warnings, prefixed with their rank (errors are `error:` lines on any rank).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

from trainer.core.errors import first_line, os_reason
from trainer.core.files import write_json_atomic
from trainer.parallel.context import DistContext


def setup_logging(ctx: DistContext) -> None:
    level = logging.INFO if ctx.is_main else logging.WARNING
    prefix = f"[rank {ctx.rank}] " if ctx.distributed else ""
    logging.basicConfig(level=level, stream=sys.stderr, force=True,
                        format=f"%(asctime)s {prefix}%(levelname)s %(message)s", datefmt="%H:%M:%S")


class Scalars:
    """Rank 0's scalars, to every tracker of --tracker (trackers.py); silent elsewhere. A tracker that
    fails (a full disk, a lost server) is given up with one warning: the scalars are worth less than
    the training, whose checkpoints go elsewhere. `run`: the built-in trainer's config, which names the
    trackers and is recorded as the run's parameters (without one: TensorBoard only, as for trainer.api)."""

    def __init__(self, ctx: DistContext, log_dir: str, purge_step: int | None, run=None):
        self.trackers: list = []
        self.log_dir = log_dir
        if ctx.is_main:
            from trainer.config.settings import tracker_names
            from trainer.observe import trackers

            params = trackers.run_params(run, ctx) if run is not None else None
            if params is not None:
                try:
                    write_json_atomic(Path(log_dir) / trackers.PARAMS_FILE, params)
                except OSError as err:
                    logging.warning("cannot write %s in %s (%s)", trackers.PARAMS_FILE, log_dir, os_reason(err))
            names = tracker_names(run.tracker) if run is not None else ["tensorboard"]
            self.trackers = trackers.start(names, log_dir, purge_step, params)

    def add(self, step: int, **values: float) -> None:
        for tracker in list(self.trackers):
            try:
                tracker.log(step, values)
            except Exception as err:  # noqa: BLE001 (see the class doc)
                self._give_up(tracker, err)

    def close(self) -> None:
        for tracker in list(self.trackers):
            try:
                tracker.close()
            except Exception as err:  # noqa: BLE001
                self._give_up(tracker, err)

    def _give_up(self, tracker, err: Exception) -> None:
        why = os_reason(err) if isinstance(err, OSError) else f"{type(err).__name__}: {first_line(err)}"
        logging.warning("%s can no longer be written to %s (%s): training goes on without them",
                        tracker.what, tracker.where, why)
        self.trackers.remove(tracker)


class Progress:
    """A tqdm bar on a terminal; plain periodic lines in container logs."""

    def __init__(self, ctx: DistContext, total_steps: int | None, start_step: int):
        self.bar = None
        if ctx.is_main and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True)
        self.total = total_steps
        self.enabled = ctx.is_main
        self.last_step = start_step

    def update(self, step: int, epoch: int, loss: float | None, lr: float | None, samples_per_s: float,
               bad_files: int = 0) -> None:
        """loss and lr: None where the run does not know them (a script that logs neither); bad_files: the files
        this epoch skipped so far (shown once there are any)."""
        shown = {"loss": f"{loss:.4f}" if loss is not None else None, "lr": f"{lr:.4g}" if lr is not None else None,
                 "bad files": str(bad_files) if bad_files else None}
        if self.bar is not None:
            self.bar.update(step - self.last_step)
            self.bar.set_postfix(epoch=epoch, **{k: v for k, v in shown.items() if v is not None},
                                 sps=f"{samples_per_s:.0f}")
        elif self.enabled:
            of = f"/{self.total}" if self.total is not None else ""
            parts = " ".join(f"{k} {v}" for k, v in shown.items() if v is not None)
            logging.info("epoch %d step %d%s %s%.1f samples/s", epoch, step, of, parts + " " if parts else "",
                         samples_per_s)
        self.last_step = step

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class Throughput:
    """Training samples/s. Not counted: the first `warmup` steps (allocator, cudnn, compile) and time
    spent `paused()` (validation, checkpoints), which would make the number depend on their settings."""

    def __init__(self, samples_per_step: int, warmup: int, sync: Callable[[], None],
                 clock: Callable[[], float] = time.perf_counter):
        self.samples_per_step, self.warmup, self.sync, self.clock = samples_per_step, warmup, sync, clock
        self.steps_seen = 0
        self.paused_s = 0.0
        self.start: tuple[float, float] | None = None  # (clock, paused_s) where the steady-state window opens
        self.end: tuple[float, float] | None = None
        self.measured_steps = 0
        self.window, self.window_steps = self._now(), 0  # the logging window

    def _now(self) -> tuple[float, float]:
        return self.clock(), self.paused_s

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        self.sync()  # queued training work belongs to training, and queued pause work to the pause
        began = self.clock()
        yield
        self.sync()
        self.paused_s += self.clock() - began

    def step(self, last: bool = False) -> None:
        """last: the run's final step; the window closes there, before the final checkpoint is written."""
        self.steps_seen += 1
        self.window_steps += 1
        if self.steps_seen == self.warmup:
            self.sync()  # once: queued GPU work must not count in the window
            self.start = self._now()
        elif self.start is not None:
            self.measured_steps += 1
            if last:
                self.sync()
                self.end = self._now()

    def window_rate(self) -> float:
        """samples/s since the previous call (the caller has just synced, reading the loss)."""
        now = self._now()
        rate = self.window_steps * self.samples_per_step / _training_seconds(self.window, now)
        self.window, self.window_steps = now, 0
        return rate

    def samples_per_second(self) -> float | None:
        if self.start is None or self.measured_steps == 0:
            return None
        end = self.end
        if end is None:  # stopped before the last step: the window ends now
            self.sync()
            end = self._now()
        return self.measured_steps * self.samples_per_step / _training_seconds(self.start, end)


def _training_seconds(begin: tuple[float, float], end: tuple[float, float]) -> float:
    return (end[0] - begin[0]) - (end[1] - begin[1])


WARMUP_STEPS_EXCLUDED = 5  # allocator, cudnn autotune and compile make the first steps slow
