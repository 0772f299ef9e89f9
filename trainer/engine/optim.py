"""Optimizer, learning-rate schedule, and restoring them (with fp16's loss scaler) from a checkpoint."""

from __future__ import annotations

import logging
import math

import torch
from torch import nn

from trainer.config.settings import TrainConfig
from trainer.parallel import strategy

log = logging.getLogger(__name__)


# The norm layers of torchvision's reference (its set_weight_decay), by their public classes.
NORM_LAYERS = strategy.NORM_LAYERS + (nn.LocalResponseNorm,)


def parameter_groups(model: nn.Module, weight_decay: float, norm_weight_decay: float, bias_weight_decay: float
                     ) -> list[dict]:
    """The optimizer's parameter groups as torchvision's reference builds them (--norm-weight-decay,
    --bias-weight-decay): a parameter named `bias` takes the bias decay (a norm layer's too: the reference matches
    its custom keys first), a norm layer's other parameters the norm decay, every other one --weight-decay; the
    groups in that order, each in the model's parameter order. Equal norm and bias decays make one group, as the
    defaults (0: no decay on norms and biases, Goyal et al., 2017) always did: checkpoints of earlier runs keep
    fitting. Unlike the reference, frozen parameters are kept (the optimizer skips them; the groups stay those of
    earlier checkpoints)."""
    kinds: dict[int, str] = {}
    params: list[nn.Parameter] = []
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if id(param) in kinds:  # shared between modules: its first owner decides
                continue
            kinds[id(param)] = "bias" if name == "bias" else "norm" if isinstance(module, NORM_LAYERS) else "other"
            params.append(param)
    groups = [{"params": [p for p in params if kinds[id(p)] == "other"], "weight_decay": weight_decay}]
    if norm_weight_decay == bias_weight_decay:
        return groups + [{"params": [p for p in params if kinds[id(p)] != "other"], "weight_decay": norm_weight_decay}]
    return groups + [{"params": [p for p in params if kinds[id(p)] == kind], "weight_decay": decay}
                     for kind, decay in (("norm", norm_weight_decay), ("bias", bias_weight_decay))]


def clip_gradients(optimizer: torch.optim.Optimizer, max_norm: float, across=None) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ over the optimizer's parameters (the reference clips those): the total L2
    norm before clipping, on the device (no host sync). Call it on unscaled gradients (fp16: after the scaler's
    unscale_). Under fsdp the gradients are DTensor shards and clip_grad_norm_'s norm is a DTensor reduced over
    every shard: the same global norm as ddp's, returned here as a plain tensor. across: a process group whose
    members hold the model's other parameters (pipeline stages): the norm is the whole model's, the root of the sum
    of every member's squared norm, and every member clips with it (each stage's own norm would clip each part of
    the model by another factor)."""
    params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    if across is None:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    import torch.distributed as dist

    mine = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0)
    squared = (mine.full_tensor() if hasattr(mine, "full_tensor") else mine).float() ** 2
    dist.all_reduce(squared, group=across)
    norm = squared.sqrt()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


def build_optimizer(cfg: TrainConfig, model: nn.Module) -> torch.optim.Optimizer:
    groups = parameter_groups(model, cfg.weight_decay, cfg.norm_weight_decay, cfg.bias_weight_decay)
    # One fused kernel per tensor instead of several passes: the same update rule (equal up to float
    # rounding); on the CPU the default per-tensor loop costs ~5% more per ResNet-18 step (docs/benchmarks.md).
    # fsdp's sharded parameters (DTensors) have no fused kernels, only the foreach ones, which torch
    # picks by itself on GPUs only: on the CPU its per-tensor loop dispatches every op of every
    # parameter through DTensor, 66 ms per 2-process ResNet-50 step against foreach's 47.
    from torch.distributed.tensor import DTensor

    sharded = any(isinstance(p, DTensor) for p in model.parameters())
    fused = next(model.parameters()).device.type in ("cpu", "cuda")
    kernel = {"foreach": True} if sharded else {"fused": fused}
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.momentum, 0.999), **kernel)
    # Fused SGD and fp16's loss scaler do not mix: when the scaler skips an overflowing first step,
    # fused SGD leaves its momentum buffers allocated but never written, and the next step reads
    # that garbage (NaN weights within a few steps; seen on an H200, torch 2.11, and on the CPU).
    if not sharded:
        kernel = {"fused": fused and cfg.amp != "fp16"}
    return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, **kernel)


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


def reference_lr_factor(epoch: int, cfg: TrainConfig) -> float:
    """Multiplier of --lr through epoch `epoch` (from 0) of torchvision's reference schedule (--lr-scheduler): the
    value its SequentialLR, stepped once after each epoch, holds then. The warm-up (LinearLR from --lr-warmup-decay
    up to 1 over --lr-warmup-epochs, or ConstantLR at it), then the main schedule counted from 0 again at its
    milestone: StepLR, CosineAnnealingLR over --epochs less the warm-up down to --lr-min, or ExponentialLR. The
    closed forms of torch's schedulers, which their recursive steps follow up to float rounding."""
    warmup, decay = cfg.lr_warmup_epochs, cfg.lr_warmup_decay
    if epoch < warmup:
        return decay + (1 - decay) * epoch / warmup if cfg.lr_warmup_method == "linear" else decay
    main = epoch - warmup
    if cfg.lr_scheduler == "steplr":
        return cfg.lr_gamma ** (main // cfg.lr_step_size)
    if cfg.lr_scheduler == "exponentiallr":
        return cfg.lr_gamma ** main
    if not cfg.lr:  # a zero rate stays zero (the floor is a rate, the factor's base would be 0)
        return 0.0
    floor = cfg.lr_min / cfg.lr
    return floor + (1 - floor) * (1 + math.cos(math.pi * main / (cfg.epochs - warmup))) / 2


WARMUP_FRACTION = 0.05  # of the run's optimizer steps, when --warmup-steps is -1 (its default)


def warmup_length(cfg: TrainConfig, total_steps: int, steps_per_epoch: int | None = None) -> int:
    """Warm-up steps of this run. A fixed default would be most of a short run, and a larger world size
    (fewer steps per epoch) would spend a larger share of it warming up: 50 of the 64 steps of the CPU
    demo at 4 processes, which then ended at chance accuracy. The reference's schedule (--lr-scheduler): its
    --lr-warmup-epochs, in optimizer steps (none where the steps per epoch are not known)."""
    if cfg.lr_scheduler:
        return cfg.lr_warmup_epochs * (steps_per_epoch or 0)
    return cfg.warmup_steps if cfg.warmup_steps >= 0 else round(WARMUP_FRACTION * total_steps)


def build_scheduler(cfg: TrainConfig, optimizer: torch.optim.Optimizer, total_steps: int,
                    steps_per_epoch: int | None = None):
    """The run's LR schedule as a LambdaLR over optimizer steps, stepped after each one: its step count is the
    checkpoint's, so a resume mid-epoch goes on at the very rate. The reference's per-epoch schedule (--lr-scheduler)
    is constant through each epoch of `steps_per_epoch` steps, at the rate its SequentialLR has in that epoch."""
    if cfg.lr_scheduler:
        if not steps_per_epoch:
            raise ValueError("the reference's per-epoch schedule needs the steps per epoch")
        return torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: reference_lr_factor(step // steps_per_epoch, cfg))
    warmup = warmup_length(cfg, total_steps)
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, total_steps, warmup, cfg.lr_schedule))


# The settings build_optimizer and build_scheduler read: a resume that loads the checkpoint's optimizer and scheduler
# state would override a new value of any of them (trainer.checkpoint.state.apply_changed puts them back).
SCHEDULE_SETTINGS = ("lr", "momentum", "weight_decay", "lr_schedule", "warmup_steps", "lr_scheduler",
                     "lr_warmup_epochs", "lr_warmup_method", "lr_warmup_decay", "lr_step_size", "lr_gamma", "lr_min")


def changed_settings(cfg: TrainConfig, saved: dict | None) -> list[tuple[str, object, object]]:
    """(setting, the checkpoint's value, this run's) for each of SCHEDULE_SETTINGS that differs."""
    if not saved:
        return []
    current = cfg.as_dict()
    return [(name, saved[name], current[name]) for name in SCHEDULE_SETTINGS
            if name in saved and saved[name] != current[name]]
