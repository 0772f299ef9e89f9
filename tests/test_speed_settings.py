"""Speed settings keep training correct: the fused optimizer, mixed precision, and opt-in periodic averaging
(local SGD)."""
from __future__ import annotations

import copy
import shutil

import pytest
import torch
from helpers import (
    assert_same_params,
    dirs_args,
    final_params,
    finished_run,
    max_param_difference,
    read_summary,
    train_ok,
)

from trainer.checkpoint.state import load_object, load_scaler_state
from trainer.config.settings import TrainConfig
from trainer.data.datasets import SYNTHETIC_CLASSES
from trainer.data.images import synthetic_spec
from trainer.engine.models import build_model
from trainer.engine.optim import build_optimizer, build_scheduler

SPEC = synthetic_spec(32)

# 2 processes x 16 samples: 32 steps per epoch, 64 in all. Gradients are all-reduced for the 8
# warm-up steps, then parameters are averaged every 4 steps (12, 16, ...). Checkpoints every 18
# steps: 54 is mid-epoch 1 and not an averaging step, so resuming there needs the rank-0 state
# that the checkpoint-time synchronisation made every rank's.
STEPS = 64
LOCAL_SGD = ["--model", "cnn", "--synthetic-size", "1024", "--batch-size", "16", "--epochs", "2", "--lr", "0.05",
             "--warmup-steps", "8", "--checkpoint-every", "18", "--keep-checkpoints", "10", "--log-every", "8",
             "--num-workers", "0", "--local-sgd-period", "4"]


def textbook_optimizer(cfg: TrainConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    """The trainer's optimizer as the per-tensor Python loop (no fused or foreach kernels)."""
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.ndim > 1], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0}]
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.momentum, 0.999), foreach=False)
    return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, foreach=False)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_fused_optimizer_follows_the_textbook_update(optimizer):
    cfg = TrainConfig(optimizer=optimizer, lr=0.05, warmup_steps=3)
    torch.manual_seed(0)
    fused_model = build_model("cnn", SPEC)
    plain_model = copy.deepcopy(fused_model)
    start = copy.deepcopy(plain_model.state_dict())
    fused, plain = build_optimizer(cfg, fused_model), textbook_optimizer(cfg, plain_model)
    assert all(group["fused"] for group in fused.param_groups)
    schedules = [build_scheduler(cfg, opt, total_steps=10) for opt in (fused, plain)]
    for _ in range(10):
        images, labels = torch.randn(8, 3, 32, 32), torch.randint(0, SYNTHETIC_CLASSES, (8,))
        for model, opt, schedule in zip((fused_model, plain_model), (fused, plain), schedules):
            torch.nn.functional.cross_entropy(model(images), labels).backward()
            opt.step()
            opt.zero_grad()
            schedule.step()
    # Float rounding only (a fused multiply-add rounds once where the loop rounds twice), far below
    # what the 10 steps moved the weights.
    assert max_param_difference(fused_model.state_dict(), plain_model.state_dict()) < 1e-5
    assert max_param_difference(plain_model.state_dict(), start) > 1e-2


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_a_step_the_fp16_loss_scaler_skips_leaves_the_optimizer_sound(optimizer):
    # The trainer's scaler runs on CUDA only; the CPU scaler takes the same path through the
    # optimizer (a fused one is handed the overflow flag instead of being skipped).
    cfg = TrainConfig(optimizer=optimizer, amp="fp16", lr=0.05, warmup_steps=0)
    torch.manual_seed(0)
    model = build_model("cnn", SPEC)
    opt = build_optimizer(cfg, model)
    scaler = torch.amp.GradScaler("cpu")
    images, labels = torch.randn(8, 3, 32, 32), torch.randint(0, SYNTHETIC_CLASSES, (8,))
    for overflow in (True, False, False):
        loss = torch.nn.functional.cross_entropy(model(images), labels) * (float("inf") if overflow else 1.0)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
    assert scaler.get_scale() < 65536.0  # the first step was skipped
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert torch.isfinite(torch.nn.functional.cross_entropy(model(images), labels))


def test_an_fp16_run_resumes_from_a_checkpoint_of_another_precision():
    # The scaler and the kernel choice as an fp16 run on CUDA has them (the CPU scaler stands in).
    torch.manual_seed(0)
    bf16_model = build_model("cnn", SPEC)
    bf16_optimizer = build_optimizer(TrainConfig(amp="bf16"), bf16_model)
    images, labels = torch.randn(8, 3, 32, 32), torch.randint(0, SYNTHETIC_CLASSES, (8,))
    torch.nn.functional.cross_entropy(bf16_model(images), labels).backward()
    bf16_optimizer.step()
    saved_optimizer = bf16_optimizer.state_dict()
    saved_scaler = torch.amp.GradScaler("cpu", enabled=False).state_dict()  # bf16 runs have no scaler

    fp16_model = copy.deepcopy(bf16_model)
    fp16_optimizer = build_optimizer(TrainConfig(amp="fp16"), fp16_model)
    scaler = torch.amp.GradScaler("cpu")
    load_object(fp16_optimizer, saved_optimizer)
    load_scaler_state(scaler, saved_scaler)
    assert all(group["fused"] for group in bf16_optimizer.param_groups)
    assert not any(group["fused"] for group in fp16_optimizer.param_groups)  # this run's choice, not the file's
    momentum = [fp16_optimizer.state[p]["momentum_buffer"] for p in fp16_model.parameters()]
    assert all(torch.equal(m, bf16_optimizer.state[p]["momentum_buffer"])
               for m, p in zip(momentum, bf16_model.parameters()))
    assert scaler.get_scale() == 65536.0  # a fresh scale

    resumed = torch.amp.GradScaler("cpu")
    load_scaler_state(resumed, {**scaler.state_dict(), "scale": 32768.0})  # an fp16 checkpoint's own scale
    assert resumed.get_scale() == 32768.0


# The BatchNorm-free cnn, not a ResNet-18: bf16 convolutions on the CPU made this test CI's fifth slowest (141 s).
AMP_RUN = ["--model", "cnn", "--synthetic-size", "768", "--batch-size", "16", "--max-steps", "48", "--lr", "0.2",
           "--warmup-steps", "4", "--log-every", "8", "--val-every", "0", "--num-workers", "0"]


def test_bf16_trains_under_autocast_on_the_cpu_and_fp16_falls_back_to_fp32(tmp_path):
    runs = {}
    for amp in ("off", "bf16", "fp16"):
        # One process (CI's time): autocast is per process; bf16 across processes is tests/test_shm_allreduce.py's.
        # Forked from the interpreter that imported torch once: three runs, one import.
        result = train_ok([*AMP_RUN, "--amp", amp, *dirs_args(tmp_path / amp)], tmp_path, forked=True)
        runs[amp] = (result.stderr, final_params(tmp_path / amp / "checkpoints"))
    fp32, bf16, fp16 = (params for _, params in runs.values())
    # bf16 matmuls and convolutions round to 8 bits of mantissa: the run takes another path, and still learns.
    assert max_param_difference(bf16, fp32) > 1e-4
    assert read_summary(tmp_path / "bf16" / "runs")["train_loss"] < 1.5  # the mean of steps 41-48 (0.78 here); chance: 2.30
    # fp16 needs CUDA's loss scaler: on the CPU it is fp32, step for step, and says so.
    assert "--amp fp16 applies to CUDA only" in runs["fp16"][0]
    assert_same_params(fp16, fp32)


@pytest.fixture(scope="module")
def local_sgd_run(tmp_path_factory):
    return finished_run(tmp_path_factory.mktemp("local_sgd"), LOCAL_SGD, STEPS)


@pytest.mark.slow
def test_local_sgd_resumes_exactly_from_a_local_step(local_sgd_run, tmp_path):
    checkpoint = tmp_path / "from" / "step-00000054.pt"
    checkpoint.parent.mkdir()
    shutil.copy(local_sgd_run / "checkpoints" / checkpoint.name, checkpoint)
    train_ok([*LOCAL_SGD, "--resume", str(checkpoint), *dirs_args(tmp_path)], tmp_path, nproc=2, forked=True)
    assert read_summary(tmp_path / "runs")["resumed_from_step"] == 54
    # Equal only if every rank held rank 0's parameters and momentum at step 54, and the schedule of
    # local steps and averages was taken up at the same step.
    assert_same_params(final_params(tmp_path / "checkpoints"), final_params(local_sgd_run / "checkpoints"))


@pytest.mark.slow
def test_local_sgd_trains_differently_but_still_learns(local_sgd_run, tmp_path):
    train_ok([*LOCAL_SGD, "--local-sgd-period", "0", *dirs_args(tmp_path)], tmp_path, nproc=2, forked=True)
    local, every_step = read_summary(local_sgd_run / "runs"), read_summary(tmp_path / "runs")
    assert max_param_difference(final_params(local_sgd_run / "checkpoints"), final_params(tmp_path / "checkpoints")) > 1e-4
    assert local["val_acc1"] > 0.5 and every_step["val_acc1"] > 0.5  # chance is 0.1


@pytest.mark.parametrize("total_steps, warmup", [(64, 3), (128, 6), (10_000, 500)])
def test_default_warmup_is_five_percent_of_the_run_and_an_explicit_one_is_kept(total_steps, warmup):
    # The CPU demo at 4 processes has half the steps of 2 processes: a fixed 50-step warm-up was most of it.
    for cfg, expected in ((TrainConfig(lr=0.05), warmup), (TrainConfig(lr=0.05, warmup_steps=50), 50),
                          (TrainConfig(lr=0.05, warmup_steps=0), 0)):
        optimizer = build_optimizer(cfg, build_model("cnn", SPEC))
        schedule = build_scheduler(cfg, optimizer, total_steps)
        rates = []
        for _ in range(min(total_steps, expected + 2)):
            rates.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            schedule.step()
        peak = rates.index(max(rates))
        assert peak == max(expected - 1, 0) and rates[peak] == pytest.approx(0.05), (cfg.warmup_steps, rates)
