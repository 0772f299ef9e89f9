"""A user's own script on trainer.api whose model is cut into pipeline stages (TRAIN_PIPELINE_STAGES=2): the loop of
docs/your-code.md, with run.forward_backward() for the micro-batch and wrap() given one batch's inputs to trace with.

    TRAIN_PIPELINE_STAGES=2 NPROC_PER_NODE=2 trainer-launch tests/user_code/pipeline_script.py --out DIR
"""

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainer import api


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()

    g = torch.Generator().manual_seed(0)
    inputs = torch.randn(256, 16, generator=g)
    data = TensorDataset(inputs, (inputs[:, :4].sum(1) > 0).long())  # a task a small MLP learns
    with api.Run(checkpoint_dir=f"{args.out}/checkpoints", log_dir=f"{args.out}/runs", log_every=4,
                 batch_size=16) as run:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 2))
        loader = DataLoader(data, batch_size=16, sampler=run.sampler(data, 16), drop_last=True)
        forward = run.wrap(model, example=next(iter(loader))[0])
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # after wrap(): this rank's stage
        run.resume(model=model, optimizer=optimizer)
        for _epoch in run.epochs(args.epochs):
            for micro_batches in run.steps(loader):
                for x, y in micro_batches:
                    run.forward_backward(forward, x.to(run.device), y.to(run.device), nn.functional.cross_entropy)
                run.optimizer_step(optimizer)


if __name__ == "__main__":
    main()
