"""A user's script on trainer.api's whole engine, as the tests run it: the strategy, trackers, step timing and the
directories come from the TRAIN_* environment only; the loop is the script's own (one optimizer step per
iteration, its micro-batches inside).

Every rank appends the sample indices of each micro-batch it trains on, with the epoch, to
<out>/seen-rank<R>-world<W>.txt, so a test can tell a replayed or skipped sample from an exact resume.

    trainer-launch tests/user_code/engine_loop.py [--out DIR] [--epochs 1] [--global-batch 8] [--step-seconds 0]
"""

import argparse
import time

import torch
from numbered import Numbered
from torch.utils.data import DataLoader

from trainer import api


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="/tmp", help="where the seen-rank files go")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--samples", type=int, default=96)
    parser.add_argument("--global-batch", type=int, default=8, help="samples per micro-batch over all processes")
    parser.add_argument("--step-seconds", type=float, default=0.0, help="a slower loop: time to stop it")
    args = parser.parse_args()

    dataset = Numbered(args.samples)
    with api.Run() as run:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.ReLU(),
                                    torch.nn.Linear(16, 3))
        forward = run.wrap(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        run.resume(model=model, optimizer=optimizer)
        batch = args.global_batch // run.world_size
        loader = DataLoader(dataset, batch_size=batch, sampler=run.sampler(dataset, batch), drop_last=True)
        with open(f"{args.out}/seen-rank{run.rank}-world{run.world_size}.txt", "a") as seen:
            for epoch in run.epochs(args.epochs):
                for micro_batches in run.steps(loader):
                    for x, y, index in micro_batches:
                        with run.autocast():
                            loss = torch.nn.functional.cross_entropy(forward(x.to(run.device)), y.to(run.device))
                        run.backward(loss)
                        seen.write(f"{epoch} " + " ".join(map(str, index.tolist())) + "\n")
                    run.optimizer_step(optimizer)
                    seen.flush()
                    time.sleep(args.step_seconds)


if __name__ == "__main__":
    main()
