"""Validation: metrics over every rank's shard, reduced across ranks, at the validator's own cadence.

    validator = Validator(run, val_batches, every=1)     # a script: its DataLoader over run.eval_shard(val_set)
    for epoch in run.epochs():
        for micro_batches in run.steps(loader):
            ...
        validator.epoch_done()                           # every `every` whole epochs: Loss/val, acc1/val, acc5/val
                                                         # (model_ema: the average too, Loss/val_ema, acc1/val_ema...)

The loss is the model's own compute_loss(output, inputs, targets) where it has one, else cross-entropy on
class logits (the built-in loop's Objective); accuracy is reported where the outputs are class logits.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable

from trainer.parallel import collectives
from trainer.parallel.strategy import evaluation_batches
from trainer.engine.models import Objective

log = logging.getLogger("trainer")


def eval_shard(size: int, rank: int, world_size: int) -> list[int]:
    """This rank's validation samples: every world_size-th from `rank`, no padding (a padded duplicate would be
    counted twice in the metrics)."""
    return list(range(rank, size, world_size))


def evaluate(run, model, batches: Iterable, count: int | None = None, objective: Objective | None = None
             ) -> dict[str, float]:
    """Validation metrics over every rank's batches (a collective: every rank calls it): Loss/val, and acc1/val,
    acc5/val where the outputs are class logits. `model`: the model, what run.wrap() returned, or run.ema (the
    model_ema average)."""
    import torch

    # The module itself, not DistributedDataParallel's wrapper, whose forward would broadcast buffers (a
    # collective per batch); under fsdp it is the sharded model, whose forwards all-gather (evaluation_batches).
    module = getattr(model, "module", model) if isinstance(getattr(model, "module", None), torch.nn.Module) else model
    objective = objective or Objective(module, "the model")
    count = count if count is not None else len(batches)
    run.consistent()
    module.eval()
    sums = torch.zeros(5, dtype=torch.float64, device=run.device)  # loss, top-1, top-5, samples, predictions
    forward = run.strategy.evaluation(module) if run.strategy is not None else module
    with torch.no_grad(), run.autocast():
        for inputs, targets in evaluation_batches(module, batches, count, run.ctx):
            inputs, targets = inputs.to(run.device, non_blocking=True), targets.to(run.device, non_blocking=True)
            output = forward(inputs)
            if output is None:  # a pipeline stage before the last: the last one counts the batch
                continue
            sums[0] += objective.per_sample(output, inputs, targets).sum()
            sums[3] += len(inputs)
            if objective.classifies(output, targets):
                top5 = output.topk(min(5, output.shape[-1]), dim=-1).indices == targets[..., None]
                sums[1] += top5[..., 0].sum()
                sums[2] += top5.any(dim=-1).sum()
                sums[4] += targets.numel()
    module.train()
    loss, correct1, correct5, samples, predictions = collectives.all_reduce_sum(run.ctx, sums).tolist()
    metrics = {"Loss/val": loss / max(samples, 1)}
    if predictions:  # class logits (the sums are every rank's: the same metrics on every rank)
        metrics.update({"acc1/val": correct1 / predictions, "acc5/val": correct5 / predictions})
    return metrics


EMA_SUFFIX = "_ema"  # the average's metrics: Loss/val_ema, acc1/val_ema, acc5/val_ema


class Validator:
    """Validates every `every` whole epochs (0: never), the model and, with model_ema, its average (run.ema); the
    metrics go to every tracker and summary.json."""

    def __init__(self, run, batches: Any, model=None, objective: Objective | None = None, every: int = 1,
                 count: int | None = None):
        self.run, self.batches, self.model, self.objective = run, batches, model, objective
        self.every, self.count = every, count
        self.metrics: dict[str, float] = {}

    def epoch_done(self) -> dict[str, float]:
        """Call after each epoch's steps: validates when the epoch was whole and the cadence says so."""
        run = self.run
        if self.batches is None or not self.every or run.stopped or run.ended_mid_epoch:
            return {}
        completed = run.position.epoch + 1
        if completed % self.every:
            return {}
        model = self.model if self.model is not None else run.checkpointer.objects.model
        batches = self.batches() if callable(self.batches) else self.batches
        with run.paused():
            self.metrics = evaluate(run, model, batches, self.count, self.objective)
            if run.ema is not None:
                batches = self.batches() if callable(self.batches) else self.batches
                averaged = evaluate(run, run.ema, batches, self.count, self.objective)
                self.metrics.update({tag + EMA_SUFFIX: value for tag, value in averaged.items()})
        run.log(**self.metrics)
        log.info("epoch %d validation: %s", run.position.epoch, ", ".join(f"{k} {v:.4f}" for k, v in
                                                                        self.metrics.items()))
        return self.metrics
