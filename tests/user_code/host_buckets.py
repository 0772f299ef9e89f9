"""A host of two processes hands its DistributedDataParallel's averaged buckets to in place's sum over the hosts
(trainer.engine.inplace.GradientSum, through DDP's comm hook), in real gloo processes.

    python tests/user_code/host_buckets.py PORT

Two processes (one host) train a Linear(8, 90000)-ReLU-Linear(90000, 3) (two buckets of the sum: the second layer's,
over the first bucket's 1 MiB cap, and the first layer's) under two DDPs: one as the restart path has it, one whose
comm hook is GradientSum's, chaining DDP's default all-reduce, then shm_allreduce's. The sum over the hosts is that of
one host (its torchft group of one: each bucket as it is). Prints one JSON line per chained hook: for each of three
steps, how many of the sum's buckets were launched during the backward, of how many, and how many gradient elements
differ from DDP's.
"""

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class Summed:
    """torchft's managed allreduce over a group of one host: the bucket as it is, done at once."""

    def __init__(self, tensor):
        self.tensor = tensor

    def wait(self) -> bool:
        return True


class OneHost:
    def allreduce(self, tensor, reduce_op=None):
        return Summed(tensor)


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 90000), torch.nn.ReLU(), torch.nn.Linear(90000, 3))


def work(rank: int, port: int, shm: bool, out) -> None:
    from trainer.cluster.topology import Topology
    from trainer.engine.inplace import GradientSum
    from trainer.parallel.context import DistContext
    from trainer.parallel.shm_allreduce import register_if_usable

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    ddp, overlapped = (torch.nn.parallel.DistributedDataParallel(model(), gradient_as_bucket_view=True)
                       for _ in range(2))
    chained = None
    if shm:
        ctx = DistContext(Topology("DIRECT", 1, 0, 2, "127.0.0.1", port, rank, rank, 2, 2, "explicit"), "gloo",
                          torch.device("cpu"))
        register_if_usable(ddp, ctx)
        chained = register_if_usable(overlapped, ctx, register=False)
        assert chained is not None
    summed = GradientSum(list(overlapped.module.parameters()), OneHost())
    summed.hook_ddp(overlapped, chained)
    steps = []
    for step in range(3):
        g = torch.Generator().manual_seed(10 * step + rank)
        x, y = torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)
        for net in (ddp, overlapped):
            net.zero_grad()
            torch.nn.functional.cross_entropy(net(x), y).backward()
        early = summed.launched
        summed.finish()
        summed.apply()  # scale 1.0: local world 2 / largest world 2
        summed.new_step()
        steps.append([early, len(summed.buckets), sum(int((a.grad != b.grad).sum())
                                                      for a, b in zip(ddp.parameters(), overlapped.parameters()))])
    if rank == 0:
        out.put(json.dumps({"chained": "shm_allreduce" if shm else "default", "steps": steps}))
    dist.destroy_process_group()


if __name__ == "__main__":
    port = int(sys.argv[1])
    context = mp.get_context("spawn")
    out = context.Queue()
    for shm in (False, True):
        workers = [context.Process(target=work, args=(r, port + shm, shm, out)) for r in range(2)]
        for w in workers:
            w.start()
        print(out.get(timeout=120), flush=True)
        for w in workers:
            w.join()
