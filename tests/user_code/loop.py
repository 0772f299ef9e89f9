"""A user's own training script on trainer.api, as the tests run it: a tiny model on fixed random data.

Every rank appends the sample indices of each batch it trains on to <out>/seen-rank<N>.txt (one line
per batch), so a test can tell a replayed or skipped sample from an exact resume.

    trainer-launch tests/user_code/loop.py --out DIR [--epochs 2] [--checkpoint-every N]
"""

import argparse
import time

import torch
from numbered import Numbered
from torch.utils.data import DataLoader

from trainer import api


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--samples", type=int, default=48)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--checkpoint-every", type=int, default=0)
    parser.add_argument("--fail-at-step", type=int, default=0, help="raise in this step (on --fail-rank)")
    parser.add_argument("--fail-rank", type=int, default=1)
    parser.add_argument("--step-seconds", type=float, default=0.0, help="a slower loop: time to stop it")
    args = parser.parse_args()

    dataset = Numbered(args.samples)
    with api.Run(checkpoint_dir=f"{args.out}/checkpoints", log_dir=f"{args.out}/runs",
                 checkpoint_every=args.checkpoint_every, log_every=10) as run:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3)).to(run.device)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        sampler = run.sampler(dataset, args.batch_size)
        loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)
        run.resume(model=model, optimizer=optimizer)
        ddp = run.wrap(model)
        with open(f"{args.out}/seen-rank{run.rank}.txt", "a") as seen:
            for _epoch in run.epochs(args.epochs):
                for x, y, index in loader:
                    if run.step_count + 1 == args.fail_at_step and run.rank == args.fail_rank:
                        raise RuntimeError(f"user code failed in step {args.fail_at_step}")
                    loss = torch.nn.functional.cross_entropy(ddp(x.to(run.device)), y.to(run.device))
                    optimizer.zero_grad()
                    loss.backward()
                    optimizer.step()
                    seen.write(" ".join(map(str, index.tolist())) + "\n")
                    seen.flush()
                    time.sleep(args.step_seconds)
                    if run.step(**{"Loss/train": loss.detach()}):
                        break


if __name__ == "__main__":
    main()
