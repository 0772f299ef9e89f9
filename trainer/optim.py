"""Optimizer and learning-rate schedule."""

from __future__ import annotations

import math

import torch
from torch import nn

from trainer.config import TrainConfig


def build_optimizer(cfg: TrainConfig, model: nn.Module) -> torch.optim.Optimizer:
    # Weight decay on norm scales and biases only hurts accuracy (Goyal et al., 2017).
    decay = [p for p in model.parameters() if p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.ndim <= 1]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # One fused kernel per tensor instead of several passes: the same update rule (equal up to float
    # rounding); on the CPU the default per-tensor loop costs ~5% more per ResNet-18 step (docs/benchmarks.md).
    fused = next(model.parameters()).device.type in ("cpu", "cuda")
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.momentum, 0.999), fused=fused)
    # Fused SGD and fp16's loss scaler do not mix: when the scaler skips an overflowing first step,
    # fused SGD leaves its momentum buffers allocated but never written, and the next step reads
    # that garbage (NaN weights within a few steps; seen on an H200, torch 2.11, and on the CPU).
    fused = fused and cfg.amp != "fp16"
    return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, fused=fused)


def lr_factor(step: int, total_steps: int, warmup_steps: int, schedule: str) -> float:
    """Multiplier of the peak LR after `step` optimizer steps: linear warm-up, then the schedule."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    if schedule == "cosine":
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    if schedule == "step":  # divide by 10 at 50% and 75% of training
        return 0.1 ** ((progress >= 0.5) + (progress >= 0.75))
    return 1.0


def build_scheduler(cfg: TrainConfig, optimizer: torch.optim.Optimizer, total_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, total_steps, cfg.warmup_steps, cfg.lr_schedule))
