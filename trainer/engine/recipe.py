"""Recipe: torchvision's reference recipe around a run's steps, for the built-in loop and scripts alike (Run holds
one and its public methods delegate to it: run.clip_gradients(), run.mixup_cutmix(), run.ema).

- clip_grad_norm: the gradients clipped inline before the optimizer step, after the scaler's unscale_ (nanoGPT's
  order), the norm before clipping logged as Grad/norm;
- mixup_alpha, cutmix_alpha: each micro-batch mixed with a draw of its own, keyed by (seed, epoch, micro-batch,
  rank) so that a resumed run (or a step taken again in place) mixes as the uninterrupted one did;
- model_ema: the average of the weights (trainer.engine.ema), in every checkpoint under "model_ema".

What the recipe does not know (the position, the rank, in-place recovery's shares and commit, the run's length)
Run gives it at each call.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from trainer.checkpoint.checkpointer import Checkpointer
from trainer.checkpoint.state import Position, Registered
from trainer.config.settings import TrainConfig
from trainer.core.errors import UsageError
from trainer.data.augment import MixUpCutMix, mix_key
from trainer.engine import ema as model_ema
from trainer.engine import optim
from trainer.engine.ema import ModelEma
from trainer.observe.observers import Observers

log = logging.getLogger("trainer")


class Recipe:
    """Clipping, mixup and cutmix, and the average of the weights, for one run. `label`: a setting as the run's user
    wrote it (a flag or a keyword argument), for the messages."""

    def __init__(self, settings: TrainConfig, label: Callable[[str], str], observers: Observers, scaler,
                 checkpointer: Checkpointer, script: bool = False):
        """script: a script's run (trainer.api), whose learning rate is its own: the stack's warm-up is only a count
        of steps there."""
        self.settings, self._label, self._script = settings, label, script
        self._observers, self._scaler, self._checkpointer = observers, scaler, checkpointer
        self.ema: ModelEma | None = None  # the average of model_ema (made in attach_ema(), from run.resume())
        self._mixer: MixUpCutMix | None = None
        self._mixed = 0         # mixup_cutmix() calls in this step: each micro-batch's own draw
        self._clipped = False   # clip_gradients() was called in this step
        self.norm_group = None  # the strategy's: the group the gradient norm is summed over (pipeline stages)

    # ------------------------------------------------------------------ clipping
    def clip_gradients(self, optimizer, max_norm: float | None = None):
        """run.clip_gradients() once in-place recovery (if any) has summed the step's gradients: the scaler's
        unscale_, then clip_grad_norm_; the norm before clipping, logged as Grad/norm."""
        self._scaler.unscale_(optimizer)
        norm = optim.clip_gradients(optimizer, max_norm if max_norm is not None else self.settings.clip_grad_norm,
                                    self.norm_group)
        self._observers.record_grad_norm(norm)
        self._clipped = True
        return norm

    def optimizer_step(self, optimizer, scheduler) -> None:
        """run.optimizer_step() once the step's gradients are combined: clipped first with clip_grad_norm set (unless
        the user's own run.clip_gradients() did), the step through fp16's loss scaler, the gradients cleared, the LR
        schedule advanced."""
        if self.settings.clip_grad_norm and not self._clipped:
            self.clip_gradients(optimizer)
        self._clipped = False
        self._scaler.step(optimizer)
        self._scaler.update()
        optimizer.zero_grad(set_to_none=True)
        if scheduler is not None:
            scheduler.step()

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
        if shares is not None:  # a step's micro-batches are grad_accum of each share in turn (drivers.InPlace)
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
    def step_ended(self, step: int) -> None:
        """Optimizer step `step` (counted from 1) is done, before its checkpoint: the average updated at its
        cadence."""
        self._mixed, self._clipped = 0, False  # a new step: its own mixes, its own clipping
        if self.ema is not None:  # before the checkpoint of this step
            self.ema.after_step(step)

    def step_abandoned(self) -> None:
        """In-place recovery abandoned the step: it is taken again, with the same mixes."""
        self._mixed, self._clipped = 0, False

    # ------------------------------------------------------------------ the average of the weights
    def attach_ema(self, objects: dict[str, Any], model) -> bool:
        """model_ema: the average of the model (run.ema), registered as model_ema where the checkpoint resumed holds
        one (or there is none); True: it holds none, and the average starts from its weights once resumed. Off: an
        average the checkpoint holds is carried along untouched into this run's checkpoints. `model`: the one
        run.wrap() was given, else the one module of `objects`."""
        found = self._checkpointer.resume_point
        saved = found.names if found is not None else ()
        if model_ema.NAME in objects and (self.settings.model_ema or model_ema.NAME in saved):
            raise UsageError("resume()", f"'{model_ema.NAME}' is the name of the {self._label('model_ema')} "
                             "average in a checkpoint", "register your object under another name")
        if not self.settings.model_ema:
            if model_ema.NAME in saved:
                objects[model_ema.NAME] = model_ema.KeptState()
            return False
        model = model if model is not None else Registered(objects).model
        if model is None:
            raise UsageError(self._label("model_ema"), "averages one model, and resume() registers "
                             f"{len(Registered(objects).modules)} modules", "register one model, or drop it")
        self.ema = ModelEma(model, self.settings.model_ema_decay, self.settings.model_ema_steps, 0)
        if found is None or model_ema.NAME in saved:
            objects[model_ema.NAME] = self.ema
            return False
        return True

    def start_ema_from_weights(self, objects: dict[str, Any]) -> None:
        """A checkpoint without an average (attach_ema() said so): it starts from the weights just resumed, and is
        in every checkpoint from now on."""
        self.ema.start_from_model()
        self._checkpointer.register({**objects, model_ema.NAME: self.ema}, "resume()")
        log.info("%s: %s holds no average of the weights: it starts from the weights resumed",
                 self._label("model_ema"), self._checkpointer.resumed_path)

    def tune_ema(self, batch_size: int | None, world: int, epochs: int | None, total_steps: int | None,
                 steps_per_epoch: int | None = None, start_step: int = 0) -> None:
        """The average's decay and warm-up, once the global batch, the epochs and the run's length are known (a
        script may give them after resume(): run.sampler(), run.epochs(N)); None: the settings' batch size and
        epochs. start_step: the step the run starts from (a resumed one's). Nothing without model_ema."""
        if self.ema is None:
            return
        cfg = self.settings
        global_batch = (batch_size or cfg.batch_size) * world * cfg.grad_accum
        epochs = epochs if epochs is not None else cfg.epochs
        self.ema.set_decay(model_ema.adjusted_decay(cfg.model_ema_decay, global_batch, cfg.model_ema_steps, epochs))
        self.ema.warmup_steps = optim.warmup_length(cfg, total_steps or 0, steps_per_epoch)
        every = "every step" if cfg.model_ema_steps == 1 else f"every {cfg.model_ema_steps} steps"
        log.info("%s: an average of the weights %s, decay %.6g (%g adjusted for a global batch of %d over %d epoch%s); "
                 "%s", self._label("model_ema"), every, self.ema.decay, cfg.model_ema_decay, global_batch, epochs,
                 "s" * (epochs != 1), self._warmup_words(self.ema.warmup_steps, total_steps, start_step))

    def _warmup_words(self, warmup: int, total_steps: int | None, start_step: int) -> str:
        """What the average does in the warm-up (the reference's copies follow its LR warm-up), true of this run: the
        built-in loop's LR warm-up; a script's learning rate is its own, and its warm-up only warmup_steps' count."""
        if not self._script:
            if warmup == 0:
                return "every update averages (no LR warm-up)"
            if start_step >= warmup:
                return f"every update averages (resumed at step {start_step}, past the LR warm-up's {warmup} steps)"
            return f"updates up to step {warmup} (the LR warm-up) copy the weights"
        cfg, setting = self.settings, self._label("warmup_steps")
        count = f"{setting} {cfg.warmup_steps}" if cfg.warmup_steps >= 0 else \
            f"{setting} -1: {optim.WARMUP_FRACTION:.0%} of the run's {total_steps or 0} steps"
        if warmup == 0:
            return f"every update averages ({count}: no warm-up)"
        if start_step >= warmup:
            return f"every update averages (resumed at step {start_step}, past the {warmup} steps of {count})"
        return (f"updates up to step {warmup} copy the weights ({count}; the script's learning rate is its own: "
                f"{setting}=0 averages from the first)")
