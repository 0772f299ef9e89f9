"""The training worker: set up, then one loop you can read top to bottom."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Mapping

from trainer.cluster.supervisor import stop_host_agent
from trainer.cluster.topology import WORKER, resolve
from trainer.config.settings import TrainConfig, check_gpu_options, load_config, no_step_error
from trainer.core.errors import UsageError, exit_on_usage_error, os_reason, print_error
from trainer.dist import collectives
from trainer.dist.collectives import MainRankFailed, on_main_then_share
from trainer.dist.context import DistContext, collective_failure, rendezvous_failure, setup, teardown
from trainer.dist.stop import GracefulStop, StopVote

log = logging.getLogger("trainer")


def main(argv: list[str] | None = None) -> int:
    try:
        return run_worker(argv)
    except KeyboardInterrupt:  # Ctrl-C before GracefulStop took over (it makes later ones a checkpointed stop)
        print_error("interrupted (SIGINT) before training started")
        return 130


def run_worker(argv: list[str] | None) -> int:
    started = time.perf_counter()
    with exit_on_usage_error():
        topology = resolve(os.environ, WORKER)
        cfg = load_config(argv, os.environ, topology.world_size)
        try:
            ctx = setup(topology, cfg.backend, cfg.collective_timeout)
        except Exception as err:
            message = rendezvous_failure(topology, err, "--collective-timeout", cfg.collective_timeout)
            if message is None:
                raise
            print_error(message)
            return 1
    from trainer.checkpoint.store import CheckpointError
    from trainer.observe.metrics import setup_logging

    setup_logging(ctx)
    try:
        with exit_on_usage_error():
            check_same_software(ctx)
            return train(cfg, ctx, started)
    except (CheckpointError, Diverged, MainRankFailed) as err:
        print_error(str(err))
        return 1
    except Exception as err:
        what = collective_failure(err)
        if what is None:
            raise
        print_error(f"collective: {what} (a peer rank died or stalled, or the network between hosts broke; see "
                    f"the other ranks' logs; --collective-timeout, now {cfg.collective_timeout:g} s, sets the wait)")
        return 1
    finally:
        teardown(ctx)


def check_same_software(ctx: DistContext) -> None:
    """Mismatched images across hosts fail here, clearly, instead of hanging in a collective."""
    from trainer.cluster.versions import check_same_versions, version_fingerprint

    problem = check_same_versions(collectives.all_gather_objects(ctx, version_fingerprint()))
    if problem:
        raise UsageError("image", problem, "run the same trainer image on every host")


def _workload(config: Mapping[str, Any]) -> tuple[str, str]:
    """The model and the data its weights fit (synthetic data comes in several image sizes)."""
    data = config["dataset"]
    if data == "synthetic":
        side = config.get("synthetic_image_size", 32)  # checkpoints from before the option: 32
        data = f"synthetic {side}x{side}"
    return config["model"], data


def check_same_workload(cfg: TrainConfig, state: dict, path: Path) -> None:
    if "config" not in state:  # trainer.api writes the same files for a user's own loop
        raise UsageError("--resume", f"{path} is a checkpoint of a training script (trainer.api), not of the built-in "
                         "trainer", "use another --checkpoint-dir, or run the script that wrote it")
    (saved_model, saved_data), (model, data) = _workload(state["config"]), _workload(cfg.as_dict())
    if (saved_model, saved_data) != (model, data):
        raise UsageError("--resume", f"{path} holds a {saved_model} trained on {saved_data}, this run is "
                         f"a {model} on {data}", "use another --checkpoint-dir or --resume never")
    if state["config"]["optimizer"] != cfg.optimizer:
        saved = state["config"]["optimizer"]
        raise UsageError("--optimizer", f"{path} was trained with {saved}, this run asks for {cfg.optimizer}",
                         f"use --optimizer {saved} to resume it, or another --checkpoint-dir to start afresh")


class Diverged(Exception):
    """The weights hold NaN or inf: the run stops and does not commit them."""


def weights_are_finite(ctx: DistContext, model) -> bool:
    """Whether every rank's weights and buffers are finite; a collective, so every rank calls it."""
    import torch

    from trainer.dist.strategy import local_tensors

    tensors = local_tensors(model)
    bad = torch.stack([~torch.isfinite(t).all() for t in tensors]).sum(dtype=torch.float32).reshape(1)
    return collectives.all_reduce_sum(ctx, bad).item() == 0


def precision_on(device, cfg: TrainConfig) -> TrainConfig:
    """--amp as this device runs it, decided once (the optimizer and the checkpoint follow it)."""
    import torch

    if device.type == "cuda" or cfg.amp == "off":
        return cfg
    if cfg.amp == "fp16":  # its loss scaler is CUDA's
        log.warning("--amp fp16 applies to CUDA only; training in fp32 on the CPU (--amp bf16 works on CPUs)")
        return replace(cfg, amp="off")
    if not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        log.warning("this CPU has no bf16 instructions (AVX512-BF16, AMX or Arm BF16): --amp bf16 will likely be "
                    "slower than fp32 here")
    return cfg


def evaluate(model, batches, ctx: DistContext, autocast: Callable, objective) -> dict[str, float]:
    """Validation metrics over every rank's shard (a collective); accuracy where the outputs are class logits."""
    import torch

    from trainer.dist.strategy import evaluation_batches

    model.eval()
    sums = torch.zeros(5, dtype=torch.float64, device=ctx.device)  # loss, top-1, top-5, samples, predictions
    classifies = False
    with torch.no_grad(), autocast():
        for inputs, targets in evaluation_batches(model, batches, ctx):
            output = model(inputs)
            sums[0] += objective.per_sample(output, inputs, targets).sum()
            sums[3] += len(inputs)
            if objective.classifies(output, targets):
                classifies = True
                top5 = output.topk(min(5, output.shape[-1]), dim=-1).indices == targets[..., None]
                sums[1] += top5[..., 0].sum()
                sums[2] += top5.any(dim=-1).sum()
                sums[4] += targets.numel()
    model.train()
    loss, correct1, correct5, samples, predictions = collectives.all_reduce_sum(ctx, sums).tolist()
    metrics = {"Loss/val": loss / samples}
    if classifies:  # the same on every rank: each saw batches of the same model and data
        metrics.update({"acc1/val": correct1 / predictions, "acc5/val": correct5 / predictions})
    return metrics


def train(cfg: TrainConfig, ctx: DistContext, started: float) -> int:
    import torch

    from trainer.checkpoint import store as checkpoint
    from trainer.core.files import write_json_atomic
    from trainer.data.datasets import Batches, build_datasets
    from trainer.dist import strategy
    from trainer.engine.models import Objective, build_model
    from trainer.engine.optim import build_optimizer, build_scheduler, warmup_length
    from trainer.observe import profiling, steptiming
    from trainer.observe.metrics import WARMUP_STEPS_EXCLUDED, Progress, Scalars, Throughput

    torch.manual_seed(cfg.seed)  # the same initial weights on every rank
    cuda = ctx.device.type == "cuda"
    if cuda:
        torch.backends.cudnn.benchmark = True
    cfg = precision_on(ctx.device, cfg)
    check_gpu_options(cfg.backend, cfg.sync_bn, cuda, ctx.world_size)
    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.amp)
    memory_format = torch.channels_last if cfg.channels_last else torch.contiguous_format

    # A checkpoint that cannot be resumed fails before the data and the model are built.
    found = on_main_then_share(ctx, lambda: checkpoint.load_for_resume(Path(cfg.checkpoint_dir), cfg.resume))
    if found is not None:
        check_same_workload(cfg, *found)
    train_data, val_data, spec = collectives.all_or_none(ctx, lambda: build_datasets(cfg, ctx))
    train_batches = Batches(train_data, spec, cfg, ctx, train=True)
    val_batches = Batches(val_data, spec, cfg, ctx, train=False) if val_data is not None and cfg.val_every else None
    steps_per_epoch = train_batches.num_batches // cfg.grad_accum
    if steps_per_epoch == 0:
        raise no_step_error(train_batches.num_batches, cfg.grad_accum)
    micro_per_epoch = steps_per_epoch * cfg.grad_accum
    total_steps = steps_per_epoch * cfg.epochs
    total_steps = min(total_steps, cfg.max_steps) if cfg.max_steps else total_steps
    profiling.check_window(cfg, total_steps)
    if found is not None and found[0]["global_step"] >= total_steps:
        # A finished job started again (compose up, a scheduler's retry): its results stay as they are.
        log.info("nothing to do: %s is at step %d of %d (raise --epochs or --max-steps to train on)",
                 found[1], found[0]["global_step"], total_steps)
        return 0
    # Built before anything is written: a factory that fails leaves no output directories behind.
    model = collectives.all_or_none(ctx, lambda: build_model(cfg.model, spec))
    objective = Objective(model, cfg.model)
    runner = collectives.all_or_none(ctx, lambda: strategy.for_run(cfg, ctx, model))
    claimed = []  # rank 0's lock on the checkpoint directory, held until train() returns

    def prepare_outputs() -> None:
        checkpoint.ensure_output_dir(cfg.checkpoint_dir, "--checkpoint-dir")
        checkpoint.ensure_output_dir(cfg.log_dir, "--log-dir")
        claimed.append(checkpoint.claim(Path(cfg.checkpoint_dir)))

    on_main_then_share(ctx, prepare_outputs)

    if cfg.sync_bn and ctx.distributed:
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    ddp_model = runner.wrap(model, memory_format)  # fsdp shards model in place: the optimizer holds this rank's shards
    optimizer = build_optimizer(cfg, model)
    scheduler = build_scheduler(cfg, optimizer, total_steps)
    parts = checkpoint.Trainable(model, optimizer, scheduler, torch.amp.GradScaler("cuda", enabled=cfg.amp == "fp16"))
    position = checkpoint.restore(parts, *found, cfg, ctx) if found is not None else checkpoint.Position()
    resumed_from = last_committed = position.step if found is not None else None
    del found  # the model and optimizer hold their own copies now
    local_sgd = None
    if ctx.distributed and cfg.local_sgd_period:
        from trainer.dist.local_sgd import PeriodicAveraging

        local_sgd = PeriodicAveraging(ctx, ddp_model, optimizer, cfg.local_sgd_period,
                                      warmup_length(cfg, total_steps), position.step)
    forward = local_sgd.forward if local_sgd else ddp_model
    forward = runner.compiled(forward)

    def autocast():
        return torch.autocast(ctx.device.type, dtype=amp_dtype) if amp_dtype else contextlib.nullcontext()

    def diverged(at_step: int) -> Diverged:
        newest = f"the newest checkpoint is step {last_committed}" if last_committed is not None else \
            "no checkpoint of this run was committed"
        return Diverged(f"training diverged by step {at_step}: the weights hold NaN or inf and were not committed; "
                        f"{newest} (lower --lr or lengthen --warmup-steps; with --amp fp16 try bf16)")

    def save(pos: checkpoint.Position) -> None:
        nonlocal last_committed
        if local_sgd:
            local_sgd.synchronise()  # the checkpoint holds rank 0's state: make it every rank's
        if not weights_are_finite(ctx, model):  # rotation would otherwise drop the good checkpoints
            raise diverged(pos.step)
        checkpoint.commit(parts, pos, cfg, ctx)
        last_committed = pos.step
        collectives.barrier(ctx)  # nobody runs ahead (or exits) before the checkpoint is on disk

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    timing = steptiming.StepTiming(cfg, ctx, model, ddp_model, optimizer)
    profiler = profiling.StepProfiler(cfg, ctx, optimizer, total_steps, position.step)
    scalars = Scalars(ctx, cfg.log_dir, purge_step=position.step + 1 if position.step else None, run=cfg)
    progress = Progress(ctx, total_steps, position.step)
    throughput = Throughput(cfg.samples_per_step, WARMUP_STEPS_EXCLUDED, sync)
    stop = GracefulStop()
    stop_vote = StopVote(ctx)
    loss_sum = torch.zeros((), device=ctx.device)  # stays on the device: no per-step host sync
    loss_count, train_loss, val_metrics = 0, None, {}
    step, status, epochs_completed = position.step, "completed", position.epoch
    log.info("training %s on %s: world size %d (%s, %s), %d steps of %d samples, %d steps per epoch",
             cfg.model, cfg.dataset, ctx.world_size, ctx.backend, ctx.device, total_steps, cfg.samples_per_step,
             steps_per_epoch)

    model.train()
    for epoch in range(position.epoch, cfg.epochs):
        if step >= total_steps:
            break
        epoch_start = time.perf_counter()
        micro = position.batch if epoch == position.epoch else 0
        for inputs, labels in timing.batches(train_batches.epoch(epoch, micro, micro_per_epoch)):
            micro += 1
            boundary = micro % cfg.grad_accum == 0
            with runner.no_sync(boundary):
                with autocast():
                    loss = objective.per_sample(forward(inputs), inputs, labels).mean()
                parts.scaler.scale(loss / cfg.grad_accum).backward()
            loss_sum += loss.detach()
            loss_count += 1
            if not boundary:
                continue
            parts.scaler.step(optimizer)
            parts.scaler.update()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            step += 1
            if local_sgd:
                local_sgd.after_step(step)
            throughput.step(last=step == total_steps)
            if step == position.step + 1:
                log.info("first step done %.1f s after the worker started", time.perf_counter() - started)
            if step % cfg.log_every == 0 or step == total_steps:
                train_loss = timing.reduce_loss(loss_sum) / (loss_count * ctx.world_size)
                # The same loss on every rank, so every rank joins the check. A non-finite loss with
                # finite weights is an fp16 overflow the loss scaler skipped: training goes on.
                if not math.isfinite(train_loss) and not weights_are_finite(ctx, model):
                    raise diverged(step)
                rate = throughput.window_rate()
                lr = scheduler.get_last_lr()[0]
                scalars.add(step, **{"Loss/train": train_loss, "lr": lr, "throughput/samples_per_s": rate},
                            **timing.scalars())
                progress.update(step, epoch, train_loss, lr, rate)
                loss_sum.zero_()
                loss_count = 0
            epoch_done = micro == micro_per_epoch
            if epoch_done:
                epochs_completed = epoch + 1
                if val_batches is not None and epochs_completed % cfg.val_every == 0:
                    with throughput.paused():
                        if local_sgd:
                            local_sgd.synchronise()
                        val_metrics = evaluate(model, val_batches, ctx, autocast, objective)
                    scalars.add(step, **val_metrics)
                    log.info("epoch %d validation: %s", epoch,
                             ", ".join(f"{k} {v:.4f}" for k, v in val_metrics.items()))
                scalars.add(step, **{"time/epoch_s": time.perf_counter() - epoch_start})
            stopping = stop_vote.vote(stop.requested)
            here = checkpoint.Position(epoch + 1, 0, step) if epoch_done else checkpoint.Position(epoch, micro, step)
            if epoch_done or stopping or (cfg.checkpoint_every and step % cfg.checkpoint_every == 0) \
                    or step == total_steps:
                with throughput.paused():
                    save(here)
            if stopping:
                status = "stopped"
                break
            if step >= total_steps:
                break
        if status == "stopped":
            break

    stop_vote.finish()  # every rank leaves with no collective in flight
    stop.close()
    profiler.close()
    sync()
    progress.close()
    scalars.close()
    summary = {
        "status": status, "strategy": cfg.strategy, "world_size": ctx.world_size, "backend": ctx.backend, "device": str(ctx.device),
        "model": cfg.model, "dataset": cfg.dataset, "global_step": step, "epochs_completed": epochs_completed,
        "samples_seen": step * cfg.samples_per_step, "samples_per_second": throughput.samples_per_second(),
        "wall_seconds": time.perf_counter() - started, "train_loss": train_loss,
        "val_loss": val_metrics.get("Loss/val"), "val_acc1": val_metrics.get("acc1/val"),
        "val_acc5": val_metrics.get("acc5/val"), "resumed_from_step": resumed_from, **timing.summary(),
    }
    if ctx.is_main:
        try:
            write_json_atomic(Path(cfg.log_dir) / "summary.json", summary)
        except OSError as err:
            print_error(f"--log-dir: cannot write summary.json ({os_reason(err)}) (free space in "
                        f"{cfg.log_dir}; the checkpoints are committed)")
            return 1
        log.info("%s at step %d: %s", status, step, Path(cfg.log_dir) / "summary.json")
    if status == "stopped" and not stop.requested and ctx.is_local_main and stop_host_agent(os.environ):
        log.warning("the stop was requested on another host: stopping this host's launcher too")
    return 0
