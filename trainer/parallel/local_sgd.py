"""Opt-in periodic parameter averaging (post-local SGD, Lin et al. 2020): communicate less.

During the learning-rate warm-up the model runs through DDP, which all-reduces gradients every
step as usual. After it, each rank runs the bare module (no gradient all-reduce, no BatchNorm
buffer broadcast: no collective at all in the step) and the ranks average their parameters every
`period` steps: one all-reduce per period instead of one per step. This changes the numerics, so
it is off unless --local-sgd-period is set.

Wherever the model state is read (a checkpoint, a validation pass) parameters, buffers and
momentum are averaged first, so every rank holds the state rank 0 saves. Every decision is a
function of the global step, which is what makes a resumed run take exactly the steps of an
uninterrupted one.
"""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel

from trainer.parallel.collectives import all_reduce_sum
from trainer.parallel.context import DistContext


class PeriodicAveraging:
    def __init__(self, ctx: DistContext, ddp_model: DistributedDataParallel, optimizer: torch.optim.Optimizer,
                 period: int, warmup_steps: int, start_step: int):
        self.ctx, self.ddp_model, self.model, self.optimizer = ctx, ddp_model, ddp_model.module, optimizer
        self.period, self.warmup_steps = period, warmup_steps
        self.step = start_step  # optimizer steps completed; restored from the checkpoint's global step
        self.averaged_at = self.synchronised_at = -1

    @property
    def local(self) -> bool:
        """Whether the next step is a local one (past the all-reduce warm-up)."""
        return self.step >= self.warmup_steps

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        # The bare module records no DDP work for the backward pass: the step communicates nothing.
        return (self.model if self.local else self.ddp_model)(inputs)

    def after_step(self, step: int) -> None:
        """Call after every optimizer step with the global step count."""
        self.step = step
        if step > self.warmup_steps and (step - self.warmup_steps) % self.period == 0:
            _average(self.ctx, self._model_state())
            self.averaged_at = step

    def synchronise(self) -> None:
        """Average model state and momentum so all ranks agree (before checkpoints and validation)."""
        if self.step <= self.warmup_steps or self.synchronised_at == self.step:
            return  # warm-up steps all-reduce gradients: the ranks already agree
        momentum = [value for state in self.optimizer.state.values() for value in state.values()
                    if torch.is_tensor(value) and value.is_floating_point() and value.ndim > 0]
        _average(self.ctx, momentum + ([] if self.averaged_at == self.step else self._model_state()))
        self.synchronised_at = self.step

    def _model_state(self) -> list[torch.Tensor]:
        """Parameters and floating-point buffers (BatchNorm running statistics)."""
        buffers = [b for b in self.model.buffers() if b.is_floating_point()]
        return [p.detach() for p in self.model.parameters()] + buffers


def _average(ctx: DistContext, tensors: list[torch.Tensor]) -> None:
    """Average in place over all ranks, as one flat all-reduce per dtype."""
    for dtype in {t.dtype for t in tensors}:
        group = [t for t in tensors if t.dtype == dtype]
        flat = torch.cat([t.reshape(-1) for t in group])
        all_reduce_sum(ctx, flat)
        flat /= ctx.world_size
        offset = 0
        for t in group:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()
