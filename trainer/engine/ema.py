"""--model-ema: an exponential moving average of the model's weights, torchvision's reference recipe on
torch.optim.swa_utils.AveragedModel.

    ema = ModelEma(model, decay, every, warmup_steps)                   # run.ema: run.resume() builds it (Recipe)
    ...after optimizer step N:  ema.after_step(N)                       # run.steps() / run.step() call it
    evaluate(run, ema.module, val_batches)                              # the average, as a model

The average is AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=True): weights and
buffers (BatchNorm's running statistics) both, as the reference's ExponentialMovingAverage averages them (its own
avg_fn computes decay * avg + (1 - decay) * param; the library's multi_avg_fn is the same update as one foreach
lerp). The reference's adjustments, followed here:
- the decay per update is adjusted for the global batch, the updates' spacing and the epochs (pycls's rule):
  alpha = min(1, (1 - decay) * global_batch * steps / epochs), decay = 1 - alpha;
- it updates every --model-ema-steps optimizer steps; the reference counts the iterations of each epoch from 0
  (it updates after the first step of every epoch), this stack counts optimizer steps over the run (after step N
  when N is a multiple), so that a resumed run updates where the uninterrupted one did whatever its epochs;
- during the LR warm-up it copies the weights instead of averaging them (n_averaged reset to 0 after each update:
  the next update copies); a script's learning rate is its own, and there the warm-up is warmup_steps' count of
  steps. Its line at the start (Recipe.tune_ema) says which steps copy, if any, for the run as it starts.
Its state (the averaged module's state_dict and n_averaged) is in every checkpoint, under "model_ema".
"""

from __future__ import annotations

import torch
from torch import nn

NAME = "model_ema"  # its name in a checkpoint (the reference's checkpoint key)


def adjusted_decay(decay: float, global_batch: int, every: int, epochs: int) -> float:
    """The reference's decay adjustment: total_updates ~ dataset / (global_batch * every) * epochs, the dataset size
    taken as a constant, so alpha scales with global_batch * every / epochs."""
    alpha = min(1.0, (1.0 - decay) * global_batch * every / epochs)
    return 1.0 - alpha


class ModelEma:
    """The average (`.module`, an AveragedModel: call it, evaluate it) and when to update it. Not an nn.Module
    itself: the run's one model stays the one module a checkpoint holds; this is checkpointed as an object."""

    def __init__(self, model: nn.Module, decay: float, every: int, warmup_steps: int):
        from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

        self.model, self.decay, self.every, self.warmup_steps = model, decay, every, warmup_steps
        self.module = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=True)
        self.module.eval()  # it is evaluated, never trained

    def set_decay(self, decay: float) -> None:
        """The decay per update, once the run's global batch and epochs are known (adjusted_decay)."""
        from torch.optim.swa_utils import get_ema_multi_avg_fn

        self.decay = decay
        self.module.multi_avg_fn = get_ema_multi_avg_fn(decay)

    def after_step(self, step: int) -> None:
        """Optimizer step `step` (counted from 1) is done: update every `every` steps."""
        if step % self.every:
            return
        self.module.update_parameters(self.model)
        if step <= self.warmup_steps:  # the reference: keep copying the weights during the warm-up
            self.module.n_averaged.fill_(0)

    def start_from_model(self) -> None:
        """The average set to the model's weights now (a resumed checkpoint without one)."""
        self.module.n_averaged.fill_(0)
        self.module.update_parameters(self.model)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.module.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.module.load_state_dict(state)


class KeptState:
    """A checkpoint's EMA carried along untouched by a run with --model-ema off: its next checkpoints hold it as it
    was, so that turning --model-ema on again resumes it."""

    def __init__(self):
        self.state: dict = {}

    def state_dict(self) -> dict:
        return self.state

    def load_state_dict(self, state: dict) -> None:
        self.state = state
