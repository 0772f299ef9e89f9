"""Recipe: torchvision's reference recipe around a run's steps, for the built-in loop and scripts alike (Run holds
one and its public methods delegate to it: run.clip_gradients(), run.mixup_cutmix()).

- clip_grad_norm: the gradients clipped inline before the optimizer step, after the scaler's unscale_ (nanoGPT's
  order), the norm before clipping logged as Grad/norm;
- mixup_alpha, cutmix_alpha: each micro-batch mixed with a draw of its own, keyed by (seed, epoch, micro-batch,
  rank) so that a resumed run (or a step taken again in place) mixes as the uninterrupted one did.

What the recipe does not know (the position, the rank, in-place recovery's shares and commit) Run gives it at
each call.
"""

from __future__ import annotations

from trainer.checkpoint.state import Position
from trainer.config.settings import TrainConfig
from trainer.data.augment import MixUpCutMix, mix_key
from trainer.engine import optim
from trainer.observe.observers import Observers


class Recipe:
    """Clipping, mixup and cutmix, for one run."""

    def __init__(self, settings: TrainConfig, observers: Observers, scaler):
        self.settings = settings
        self._observers, self._scaler = observers, scaler
        self._mixer: MixUpCutMix | None = None
        self._mixed = 0         # mixup_cutmix() calls in this step: each micro-batch's own draw
        self._clipped = False   # clip_gradients() was called in this step

    # ------------------------------------------------------------------ clipping
    def clip_gradients(self, optimizer, max_norm: float | None = None):
        """run.clip_gradients() once in-place recovery (if any) has summed the step's gradients: the scaler's
        unscale_, then clip_grad_norm_; the norm before clipping, logged as Grad/norm."""
        self._scaler.unscale_(optimizer)
        norm = optim.clip_gradients(optimizer, max_norm if max_norm is not None else self.settings.clip_grad_norm)
        self._observers.record_grad_norm(norm)
        self._clipped = True
        return norm

    def clip_before_step(self, optimizer) -> None:
        """run.optimizer_step()'s clip, before the scaler's step: with clip_grad_norm set, unless the step's
        gradients were clipped already (the user's own run.clip_gradients())."""
        if self.settings.clip_grad_norm and not self._clipped:
            self.clip_gradients(optimizer)
        self._clipped = False

    # ------------------------------------------------------------------ mixup and cutmix
    def mixup_cutmix(self, inputs, targets, num_classes: int, position: Position, rank: int,
                     shares: list[int] | None):
        """run.mixup_cutmix() at the run's position, for this rank; `shares`: under in-place recovery, the ranks of
        the largest world this rank trains now (else None)."""
        if not (self.settings.mixup_alpha or self.settings.cutmix_alpha):
            return inputs, targets
        if self._mixer is None or self._mixer.num_classes != num_classes:
            self._mixer = MixUpCutMix(self.settings.mixup_alpha, self.settings.cutmix_alpha, num_classes)
        micro = self._mixed
        if shares is not None:  # a step's micro-batches are grad_accum of each share in turn (inplace.steps)
            share, micro = divmod(self._mixed, self.settings.grad_accum)
            rank = shares[share] if share < len(shares) else rank
        key = mix_key(self.settings.seed, position.epoch, position.batch + micro, rank)
        self._mixed += 1
        mixed, soft = self._mixer(inputs, targets, key)
        if self.settings.channels_last and mixed.ndim == 4:  # MixUp's roll makes a contiguous tensor
            import torch

            mixed = mixed.contiguous(memory_format=torch.channels_last)
        return mixed, soft

    # ------------------------------------------------------------------ the step's end
    def step_ended(self) -> None:
        """An optimizer step is done: the next one has its own mixes and its own clipping."""
        self._mixed, self._clipped = 0, False

    def step_abandoned(self) -> None:
        """In-place recovery abandoned the step: it is taken again, with the same mixes."""
        self._mixed, self._clipped = 0, False
