"""The built-in loop's workload written as a user's script on trainer.api (the `script` stack of `python -m bench`).

Its settings come from the TRAIN_* environment (the bench sets them from the trainer's flags), its data and model
from the trainer's own pieces, so the script and `python -m trainer` do the same work: their ratio is the cost of
the script door, which is none by construction (one engine) and measured all the same.

    TRAIN_MODEL=resnet18 ... torchrun --standalone --nproc-per-node=2 -m bench.api_script
"""

import torch

from trainer import api
from trainer.data.datasets import Batches, build_datasets
from trainer.engine.models import Objective, build_model
from trainer.engine.optim import build_optimizer, build_scheduler


def main() -> None:
    with api.Run() as run:
        cfg = run.settings
        torch.manual_seed(cfg.seed)
        train, _, spec = build_datasets(cfg, run.ctx)
        batches = Batches(train, spec, cfg, run.ctx, train=True)
        steps_per_epoch = batches.num_batches // cfg.grad_accum
        total = run.plan(steps_per_epoch, cfg.epochs)
        model = build_model(cfg.model, spec)
        objective = Objective(model, cfg.model)
        forward = run.wrap(model)
        optimizer = build_optimizer(cfg, model)
        scheduler = build_scheduler(cfg, optimizer, total, steps_per_epoch)
        run.resume(model=model, optimizer=optimizer, scheduler=scheduler)
        model.train()
        for epoch in run.epochs():
            for micro_batches in run.steps(batches.epoch(epoch, run.position.batch, steps_per_epoch * cfg.grad_accum)):
                for inputs, labels in micro_batches:
                    with run.autocast():
                        loss = objective.per_sample(forward(inputs), inputs, labels).mean()
                    run.backward(loss)
                run.optimizer_step(optimizer, scheduler)


if __name__ == "__main__":
    main()
