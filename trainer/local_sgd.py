"""Opt-in periodic parameter averaging (post-local SGD, Lin et al. 2020): communicate less.

During the learning-rate warm-up DDP all-reduces gradients every step as usual. After it, each
rank takes local optimizer steps (the gradient all-reduce becomes a no-op communication hook)
and the ranks average their parameters every `period` steps: one all-reduce per period instead
of one per step. This changes the numerics, so it is off unless --local-sgd-period is set.

Wherever the model state is read (a checkpoint, a validation pass) parameters and momentum are
averaged first, so every rank holds rank 0's saved state. All decisions are functions of the
global step, which is what makes a resumed run take exactly the steps of an uninterrupted one.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel


class PeriodicAveraging:
    def __init__(self, ddp_model: DistributedDataParallel, optimizer: torch.optim.Optimizer, period: int,
                 warmup_steps: int, start_step: int):
        self.model, self.optimizer = ddp_model.module, optimizer
        self.period, self.warmup_steps = period, warmup_steps
        self.step = start_step  # optimizer steps completed; restored from the checkpoint's global step
        self.params_averaged_at = self.synchronised_at = -1
        ddp_model.register_comm_hook(self, _gradient_hook)

    @property
    def local(self) -> bool:
        """Whether the next step is a local one (past the all-reduce warm-up)."""
        return self.step >= self.warmup_steps

    def after_step(self, step: int) -> None:
        """Call after every optimizer step with the global step count."""
        self.step = step
        if step > self.warmup_steps and (step - self.warmup_steps) % self.period == 0:
            _average([p.detach() for p in self.model.parameters()])
            self.params_averaged_at = step

    def synchronise(self) -> None:
        """Average parameters and momentum so all ranks agree (before checkpoints and validation)."""
        if self.step <= self.warmup_steps or self.synchronised_at == self.step:
            return  # warm-up steps all-reduce gradients: the ranks already agree
        state = [value for s in self.optimizer.state.values() for value in s.values()
                 if torch.is_tensor(value) and value.is_floating_point() and value.ndim > 0]
        params = [] if self.params_averaged_at == self.step else [p.detach() for p in self.model.parameters()]
        _average(params + state)
        self.synchronised_at = self.step


def _gradient_hook(state, bucket):  # unannotated: DDP checks annotations as objects, these would be strings
    """DDP's communication hook: the usual gradient all-reduce during warm-up, nothing afterwards."""
    if not state.local:
        return allreduce_hook(None, bucket)
    done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    done.set_result(bucket.buffer())  # local step: keep this rank's own gradient
    return done


def _average(tensors: list[torch.Tensor]) -> None:
    """Average in place over all ranks, as one flat all-reduce per dtype."""
    for dtype in {t.dtype for t in tensors}:
        group = [t for t in tensors if t.dtype == dtype]
        flat = torch.cat([t.reshape(-1) for t in group])
        dist.all_reduce(flat)
        flat /= dist.get_world_size()
        offset = 0
        for t in group:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()
