"""The built-in loop (`python -m trainer`): a script on the public pieces of trainer.engine.run, read top to bottom.

Its only differences from a user's script are its inputs: the flags (which win over TRAIN_* and .env), the
catalogue's models and datasets, the input paths of trainer.data, and the optimizer and LR schedule the
settings name. One optimizer step per iteration, its micro-batches in an inner loop; the run's pieces decide
when to log, checkpoint, stop and validate.
"""

from __future__ import annotations

import os
import time

from trainer.cluster.topology import WORKER, resolve
from trainer.config.resume import check_same_workload
from trainer.config.settings import TrainConfig, flag_name, load_config, no_step_error
from trainer.core.errors import UsageError, exit_on_usage_error, print_error


def main(argv: list[str] | None = None) -> int:
    try:
        return run_worker(argv)
    except KeyboardInterrupt:  # Ctrl-C before GracefulStop took over (it makes later ones a checkpointed stop)
        print_error("interrupted (SIGINT) before training started")
        return 130


def run_worker(argv: list[str] | None) -> int:
    started = time.perf_counter()
    from trainer.engine import inplace

    with exit_on_usage_error():
        # In-place recovery: the settings of the job's largest world, whose micro-batches every membership trains.
        cfg = load_config(argv, os.environ, inplace.largest_world(os.environ) or resolve(os.environ, WORKER).world_size)
    from trainer.engine.run import Run

    with Run(config=cfg, started=started) as run:
        return train(run)


def train(run) -> int:
    import torch

    from trainer.data.datasets import Batches, build_datasets
    from trainer.engine.course import say_nothing_to_do
    from trainer.engine.models import Objective, build_model
    from trainer.engine.optim import build_optimizer, build_scheduler
    from trainer.engine.validate import Validator

    cfg = run.settings
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank
    if run.device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    found = run.resume_point
    if found is not None:  # a checkpoint of another workload fails before the data and the model are built
        with exit_on_usage_error():
            check_same_workload(cfg, found.config, found.door, found.path)

    train_data, val_data, spec = run.all_or_none(lambda: build_datasets(cfg, run.ctx))
    train_batches = Batches(train_data, spec, cfg, run.ctx, train=True, sampler=run.sampler(len(train_data),
                                                                                           cfg.batch_size))
    val_batches = Batches(val_data, spec, cfg, run.ctx, train=False) if val_data is not None and cfg.val_every \
        else None
    if cfg.dataset in ("imagefolder", "packed"):  # image files, read one by one: some may not decode
        run.count_bad_files(train_batches.bad_files, *([val_batches.bad_files] if val_batches is not None else []))
    steps_per_epoch = train_batches.num_batches // cfg.grad_accum
    if steps_per_epoch == 0:
        with exit_on_usage_error():
            raise no_step_error(train_batches.num_batches, cfg.grad_accum)
    total_steps = run.plan(steps_per_epoch, cfg.epochs)
    if found is not None and found.step >= total_steps:
        # A finished job started again (compose up, a scheduler's retry): its results stay as they are.
        say_nothing_to_do(found.path, found.step, total_steps, flag_name)
        return 0

    model = run.all_or_none(lambda: recipe_fits(cfg, build_model(cfg.model, spec)))  # before anything is written
    objective = Objective(model, cfg.model, cfg.label_smoothing)
    # Pipeline stages trace the model with a batch's inputs; fsdp shards the model in place, pipeline stages cut it
    # to this rank's stage: either way the optimizer holds this rank's part.
    example = next(iter(train_batches.epoch(0)))[0] if cfg.pipeline_stages > 1 else None
    forward = run.wrap(model, example=example)
    optimizer = build_optimizer(cfg, model)
    scheduler = build_scheduler(cfg, optimizer, total_steps, steps_per_epoch)
    run.resume(model=model, optimizer=optimizer, scheduler=scheduler, scaler=run.scaler)
    validator = Validator(run, val_batches and (lambda: val_batches.epoch(0)), model, Objective(model, cfg.model),
                          cfg.val_every, count=val_batches.num_batches if val_batches is not None else None)

    model.train()
    for epoch in run.epochs():
        batches = train_batches.epoch(epoch, run.position.batch, steps_per_epoch * cfg.grad_accum)
        for micro_batches in run.steps(batches):
            for inputs, labels in micro_batches:
                inputs, labels = run.mixup_cutmix(inputs, labels, spec.num_classes)
                run.forward_backward(forward, inputs, labels, mean_loss(objective, inputs))
            run.optimizer_step(optimizer, scheduler)
        validator.epoch_done()
    return run.finish()


def mean_loss(objective, inputs):
    """The loss run.forward_backward() takes, (output, targets) -> their mean: a pipeline's last stage has a pipeline
    micro-batch's output and targets, not the inputs (a model's own compute_loss, which takes them, is refused with
    pipeline stages: recipe_fits)."""
    if objective.custom is not None:
        return lambda output, targets: objective.per_sample(output, inputs, targets).mean()
    return lambda output, targets: objective.per_sample(output, targets, targets).mean()


def recipe_fits(cfg: TrainConfig, model):
    """The model, refused in one line where the recipe's loss settings cannot reach its loss: a model with its own
    compute_loss gets neither smoothed nor mixed targets."""
    if cfg.pipeline_stages > 1 and getattr(model, "compute_loss", None) is not None:
        raise UsageError("--pipeline-stages", f"{cfg.model} computes its own loss from its inputs (compute_loss), "
                         "which a pipeline's last stage does not have", "use --pipeline-stages 1 for this model")
    given = [name for name in ("label_smoothing", "mixup_alpha", "cutmix_alpha") if getattr(cfg, name)]
    if given and getattr(model, "compute_loss", None) is not None:
        flag = "--" + given[0].replace("_", "-")
        raise UsageError(flag, f"changes cross-entropy's targets, and {cfg.model} computes its own loss "
                         "(compute_loss)", f"drop {flag} for this model")
    return model

