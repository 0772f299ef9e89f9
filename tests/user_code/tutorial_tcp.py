"""A script in the shape of the tcp:// tutorials (PyTorch's "init_method" examples, notebooks run by hand on
each machine): the rank and the world size are the script's own arguments, the rendezvous a tcp:// address.
Only the data are local (random tensors).

    python tutorial_tcp.py --init-method tcp://10.1.1.20:23456 --rank 0 --world-size 2
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--init-method", type=str, default="tcp://127.0.0.1:23456")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--world-size", type=int, default=1)
    args = parser.parse_args()
    dist.init_process_group(backend="gloo", init_method=args.init_method, rank=args.rank,
                            world_size=args.world_size)
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(8, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(args.rank)
    for _ in range(20):
        x, y = torch.randn(16, 8, generator=gen), torch.randint(0, 3, (16,), generator=gen)
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    print(f"rank {dist.get_rank()} of {dist.get_world_size()} done: loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
