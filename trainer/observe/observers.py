"""The observers of a run: they decide when to log, and write what the user reads.

Every optimizer step they count samples and time (Throughput, StepTiming) and keep the loss on the device.
Every --log-every steps, and at the last step, they make the loop's one host sync: the loss summed over ranks
with every rank's timing in the same all-reduce, then the scalars to every tracker (Loss/train, lr,
throughput/samples_per_s, time/*/rankN) and the progress line. Files the input skipped (image files that do not
decode) are summed over the ranks in the same all-reduce: shown on the progress line, bounded per epoch
(--max-bad-files), counted in summary.json. At the end, summary.json. The built-in loop and scripts on trainer.api
observe through them alike.
"""

from __future__ import annotations

import logging
import math
import os
import time
from pathlib import Path
from typing import Any, Callable

from trainer.config.settings import ELASTIC_WORLD_ENV, LIGHT_AUGMENT_BELOW, augment_policy, crop_sizes
from trainer.core.errors import os_reason, print_error
from trainer.core.files import write_json_atomic
from trainer.parallel.context import DistContext
from trainer.observe.metrics import WARMUP_STEPS_EXCLUDED, Progress, Scalars, Throughput
from trainer.observe.profiling import StepProfiler
from trainer.observe.steptiming import StepTiming

log = logging.getLogger("trainer")
# Kept for summary.json as val_loss, val_acc1, val_acc5 (and --model-ema's average's: val_ema_loss, ...).
VALIDATION = ("Loss/val", "acc1/val", "acc5/val", "Loss/val_ema", "acc1/val_ema", "acc5/val_ema")
MAX_PATHS_LISTED = 1000  # of the skipped files, in summary.json (bad_files counts them all)


# --augment's policies as the start line says them.
AUGMENT_WORDS = {"imagenet": "RandomResizedCrop + flip, as torchvision's reference crops",
                 "light": "a padded random crop + flip, the CIFAR recipe's", "none": "resize + centre crop"}


def augmenting(settings, dataset: str | None) -> str:
    """The start line's word on --augment, for the datasets it shapes (image folders, packs): the policy taken and,
    where auto took it, why (torchvision's reference crops with RandomResizedCrop at any size; auto below 128 px
    takes the light policy)."""
    if dataset not in ("imagefolder", "packed"):
        return ""
    side = crop_sizes(settings)[0]
    policy = augment_policy(settings.augment, side)
    if settings.augment != "auto":
        return f"; augment {policy} ({AUGMENT_WORDS[policy]})"
    if policy == "light":
        return (f"; augment light (auto: {side} px crops are below {LIGHT_AUGMENT_BELOW}): {AUGMENT_WORDS[policy]}, "
                "where torchvision's reference takes RandomResizedCrop at any size (--augment imagenet)")
    return f"; augment imagenet (auto: {side} px crops): {AUGMENT_WORDS[policy]}"


class Observers:
    def __init__(self, settings, ctx: DistContext, started: float, writes: Callable[[], bool] = lambda: True):
        """writes: whether this host writes the scalars and summary.json (in-place recovery: every host's first
        process observes, and the first host of the generation writes, which may change with every membership)."""
        import torch

        self.settings, self.ctx, self.started, self.writes = settings, ctx, started, writes
        self.log_every = settings.log_every
        self.scalars: Scalars | None = None
        self.progress: Progress | None = None
        self.timing: StepTiming | None = None
        self.profiler: StepProfiler | None = None
        cuda = ctx.device.type == "cuda"
        self.throughput = Throughput(0, WARMUP_STEPS_EXCLUDED, torch.cuda.synchronize if cuda else lambda: None)
        self.loss_sum = torch.zeros((), device=ctx.device)  # stays on the device: no per-step host sync
        self.loss_count = 0
        self.grad_norm_sum = torch.zeros((), device=ctx.device)  # --clip-grad-norm's norms, likewise
        self.grad_norm_count = 0
        self.train_loss: float | None = None
        self.validation: dict[str, float] = {}
        self.start_step, self.resumed = 0, False
        self.bad_files: list = []  # trainer.data.images.BadFiles of the run's splits; the first one's bound counts
        self.bad_this_epoch = 0    # its epoch's count over every rank, as of the last log step

    # ---------------------------------------------------------------- set-up, once the run's pieces are known
    def start(self, start_step: int, resumed: bool) -> None:
        """Where the run stands. The trackers open there at the first scalar (a finished run started again writes
        nothing): a resumed run drops the events a killed one wrote after its last checkpoint (TensorBoard's
        purge_step; metrics.csv likewise)."""
        self.start_step, self.resumed = start_step, resumed

    def announce(self, model: str, dataset: str | None, world: str, total_steps: int | None,
                 steps_per_epoch: int | None, world_size: int) -> None:
        """The run's first line: what trains on what, over which world, for how long (and elastic's global batch)."""
        steps = "" if total_steps is None else f", {total_steps} steps" + (
            f", {steps_per_epoch} per epoch" if steps_per_epoch is not None else "")
        settings = self.settings
        log.info("training %s on %s: world size %s (%s, %s), strategy %s%s%s", model, dataset or "the script's data",
                 world, self.ctx.backend, self.ctx.device, settings.strategy, steps, augmenting(settings, dataset))
        largest = os.environ.get(ELASTIC_WORLD_ENV, "")
        if largest.isdigit() and settings.global_batch_size:
            log.info("elastic: world size %d of at most %s; %d samples per process per micro-batch keep the job's "
                     "global batch of %d", world_size, largest, settings.batch_size, settings.global_batch_size)

    def _open(self) -> Scalars:
        if self.scalars is None:
            self.scalars = Scalars(self.ctx, self.settings.log_dir,
                                   purge_step=self.start_step + 1 if self.resumed else None, run=self.settings)
        return self.scalars

    def attach(self, model, wrapped, optimizer, total_steps: int | None, start_step: int) -> None:
        """Step timing and the profiler hook the model and the optimizer; the progress bar knows the length."""
        if self.timing is None:
            self.timing = StepTiming(self.settings, self.ctx, model, wrapped, optimizer)
            self.profiler = StepProfiler(self.settings, self.ctx, optimizer, total_steps, start_step)
            self.progress = Progress(self.ctx, total_steps, start_step)

    def batches(self, batches):
        """The batch iterator, timed (the time each rank waits for its next batch)."""
        return self.timing.batches(batches) if self.timing is not None else batches

    # ---------------------------------------------------------------- every step
    def record_loss(self, loss) -> None:
        """A micro-batch's loss, kept on the device until the next log."""
        self.loss_sum += loss.detach().float()
        self.loss_count += 1

    def record_grad_norm(self, norm) -> None:
        """A step's gradient norm before clipping (the same on every rank), kept on the device until the next log."""
        self.grad_norm_sum += norm.detach().float()
        self.grad_norm_count += 1

    def after_step(self, step: int, epoch: int, samples: int, last: bool, lr: float | None,
                   extra: dict[str, Any], check_weights: Callable[[int], None]) -> None:
        self.throughput.samples_per_step = samples
        self.throughput.step(last=last)
        if step == self.start_step + 1:
            log.info("first step done %.1f s after the worker started", time.perf_counter() - self.started)
        if step % self.log_every and not last:
            return
        head = self.loss_sum
        if self.bad_files:  # in the same all-reduce: no collective of its own
            import torch

            head = torch.stack([self.loss_sum, torch.tensor(float(self.bad_files[0].this_epoch),
                                                            device=self.loss_sum.device)])
        if self.timing is not None:
            reduced = self.timing.reduce_loss(head)
        else:
            from trainer.parallel.collectives import all_reduce_sum

            reduced = all_reduce_sum(self.ctx, head).reshape(-1).tolist()
        summed = reduced[0]
        if self.bad_files:
            self.bad_this_epoch = round(reduced[1])
            bound = self.bad_files[0].bound
            if bound is not None and self.bad_this_epoch > bound:  # the same sum on every rank: all stop here
                raise self.bad_files[0].too_many(self.bad_this_epoch, self.ctx.is_main)
        values: dict[str, float] = {}
        if self.loss_count:
            # The same loss on every rank, so every rank joins the check. A non-finite loss with finite weights
            # is an fp16 overflow the loss scaler skipped: training goes on.
            # Over the replicas: a pipeline's last stage keeps the loss, its other stages keep 0.
            self.train_loss = summed / (self.loss_count * (self.ctx.world_size // self.settings.pipeline_stages))
            if not math.isfinite(self.train_loss):
                check_weights(step)
            values["Loss/train"] = self.train_loss
        if self.grad_norm_count and self.ctx.is_main:  # the window's mean (the trackers are rank 0's)
            values["Grad/norm"] = self.grad_norm_sum.item() / self.grad_norm_count
        rate = self.throughput.window_rate()
        if lr is not None:
            values["lr"] = lr
        if samples:
            values["throughput/samples_per_s"] = rate
        # A script's own scalars (rank 0's values; a tensor's is read now only), its Loss/train over the run's.
        values.update({tag: float(value) for tag, value in extra.items()})
        if "Loss/train" in extra:
            self.train_loss = float(extra["Loss/train"])
        if self.timing is not None:
            values.update(self.timing.scalars())
        self.log(step, values)
        if self.progress is not None:
            self.progress.update(step, epoch, self.train_loss, lr, rate, self.bad_this_epoch)
        self.loss_sum.zero_()
        self.loss_count = 0
        self.grad_norm_sum.zero_()
        self.grad_norm_count = 0

    def log(self, step: int, values: dict[str, Any]) -> None:
        """Scalars to every tracker (rank 0) at `step`; validation metrics are kept for summary.json."""
        values = {tag: float(value) for tag, value in values.items()}
        self.validation.update({tag: value for tag, value in values.items() if tag in VALIDATION})
        if self.writes():
            self._open().add(step, **values)

    def paused(self):
        """Time outside training (validation, checkpoints): not counted in samples/s."""
        return self.throughput.paused()

    # ---------------------------------------------------------------- the end
    def close(self) -> None:
        for part in (self.profiler, self.progress):
            if part is not None:
                part.close()
        self.throughput.sync()
        if self.scalars is not None:
            self.scalars.close()

    def summary(self, status: str, step: int, epochs_completed: int, samples_seen: int, resumed_from: int | None,
                model: str, dataset: str | None) -> dict[str, Any]:
        settings, ctx = self.settings, self.ctx
        return {
            "status": status, "strategy": settings.strategy, "world_size": ctx.world_size, "backend": ctx.backend,
            "device": str(ctx.device), "model": model, "dataset": dataset, "global_step": step,
            "epochs_completed": epochs_completed, "samples_seen": samples_seen,
            "samples_per_second": self.throughput.samples_per_second(),
            "wall_seconds": time.perf_counter() - self.started, "train_loss": self.train_loss,
            "val_loss": self.validation.get("Loss/val"), "val_acc1": self.validation.get("acc1/val"),
            "val_acc5": self.validation.get("acc5/val"), "val_ema_loss": self.validation.get("Loss/val_ema"),
            "val_ema_acc1": self.validation.get("acc1/val_ema"), "val_ema_acc5": self.validation.get("acc5/val_ema"),
            "resumed_from_step": resumed_from, **self._bad_files_seen(),
            **(self.timing.summary() if self.timing is not None else {}),
        }

    def _bad_files_seen(self) -> dict[str, Any]:
        """Every file any rank skipped, once (a collective: every rank calls summary())."""
        if not self.bad_files:
            return {"bad_files": None, "bad_file_paths": []}
        from trainer.parallel.collectives import all_gather_objects

        mine = sorted({path for source in self.bad_files for path in source.named})
        seen = sorted({path for paths in all_gather_objects(self.ctx, mine) for path in paths})
        return {"bad_files": len(seen), "bad_file_paths": seen[:MAX_PATHS_LISTED]}

    def write_summary(self, summary: dict[str, Any]) -> bool:
        """summary.json in the log directory (rank 0); False, with one line, if it cannot be written."""
        if not self.ctx.is_main or not self.writes():
            return True
        path = Path(self.settings.log_dir) / "summary.json"
        try:
            write_json_atomic(path, summary)
        except OSError as err:
            print_error(f"--log-dir: cannot write summary.json ({os_reason(err)}) (free space in "
                        f"{self.settings.log_dir}; the checkpoints are committed)")
            return False
        log.info("%s at step %d: %s", summary["status"], summary["global_step"], path)
        return True
