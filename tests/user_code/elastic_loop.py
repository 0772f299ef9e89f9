"""A user's script on trainer.api under elastic membership (NNODES=MIN:MAX), as the elastic tests run it.

The per-process batch is run.settings.batch_size: under elastic membership Run derives it from the job's
global batch at the current world size. Every rank appends, for each step it completes, one line to
<out>/seen-<pid>.txt: the step it resumed from, the world size, the step and the sample indices it
trained on; a test tells from them which attempt's steps were committed and that every sample of an
epoch was trained on exactly once across the world-size changes.

    trainer-launch tests/user_code/elastic_loop.py --out DIR [--samples N] [--step-seconds S]
"""

import argparse
import os
import time

import torch
from numbered import Numbered
from torch.utils.data import DataLoader

from trainer import api


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--samples", type=int, default=4800)
    parser.add_argument("--step-seconds", type=float, default=0.0, help="a slower loop: time to change the world")
    args = parser.parse_args()

    dataset = Numbered(args.samples)
    with api.Run(checkpoint_dir=f"{args.out}/checkpoints", log_dir=f"{args.out}/runs", checkpoint_every=10,
                 log_every=10) as run:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3)).to(run.device)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        batch = run.settings.batch_size
        loader = DataLoader(dataset, batch_size=batch, sampler=run.sampler(dataset, batch), drop_last=True)
        start = run.resume(model=model, optimizer=optimizer)
        ddp = run.wrap(model)
        with open(f"{args.out}/seen-{os.getpid()}.txt", "a") as seen:
            for _epoch in run.epochs(1):
                for x, y, index in loader:
                    loss = torch.nn.functional.cross_entropy(ddp(x.to(run.device)), y.to(run.device))
                    optimizer.zero_grad()
                    loss.backward()
                    optimizer.step()
                    seen.write(f"{start} {run.world_size} {run.step_count + 1} {' '.join(map(str, index.tolist()))}\n")
                    seen.flush()
                    time.sleep(args.step_seconds)
                    if run.step(**{"Loss/train": loss.detach()}):
                        break


if __name__ == "__main__":
    main()
