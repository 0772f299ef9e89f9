"""The arithmetic of in-place recovery's sum over the hosts against DistributedDataParallel's, in real gloo processes.

    python tests/user_code/sum_arithmetic.py WORLD STEPS PORT

WORLD processes train inplace_loop.py's model (Linear-ReLU-Linear) on the same batches twice, with SGD and momentum:
once under DistributedDataParallel (each rank's gradient scaled by 1/WORLD, then summed by gloo), once as
trainer.engine.inplace.GradientSum sums, each process being a host of one process (the flat gradients of its one
bucket, in reverse order, each scaled by 1/WORLD as it is copied in, then summed by gloo); and, for the gradients of
the first step, as the hosts sum after a loss: process 0 trains its share and the last one's through one .grad, the
last process (the lost host) adds zeros. Prints one JSON line: how many elements of the first step's gradients
differ from DDP's and by how much at most (fault-free, after a loss), and of the weights after STEPS steps.
"""

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


def batch(step: int, share: int):
    g = torch.Generator().manual_seed(1000 * step + share)
    return torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)


def backward(net, step: int, share: int) -> None:
    x, y = batch(step, share)
    torch.nn.functional.cross_entropy(net(x), y).backward()


def in_place_sum(grads: list, world: int) -> torch.Tensor:
    # inplace.GradientSum's one bucket here (the model is far under its 1 MiB cap): the gradients in reverse order,
    # each scaled by its host's weight (1 process / WORLD) as it is copied in, then summed; returned in the parameters'
    # order.
    flat = torch.cat([torch.mul(g.reshape(-1), 1 / world) for g in reversed(grads)])
    dist.all_reduce(flat)
    parts, offset = [], 0
    for g in reversed(grads):
        parts.append(flat[offset:offset + g.numel()])
        offset += g.numel()
    return torch.cat(parts[::-1])


def differ(a: torch.Tensor, b: torch.Tensor) -> list:
    return [int((a != b).sum()), float((a - b).abs().max())]


def work(rank: int, world: int, steps: int, port: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    ddp, plain = torch.nn.parallel.DistributedDataParallel(model()), model()
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ddp, plain)]
    first = lost = None
    for step in range(steps):
        for net, optimizer in zip((ddp, plain), optimizers):
            optimizer.zero_grad()
            backward(net, step, rank)
        if step == 0:  # a host lost: process 0 trains its own share and the lost one's through one .grad
            survivor = model()
            for share in (0, world - 1) if rank == 0 else (() if rank == world - 1 else (rank,)):
                backward(survivor, step, share)
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in survivor.parameters()]
            lost = in_place_sum(grads, world)
        summed = in_place_sum([p.grad for p in plain.parameters()], world)
        expected = torch.cat([p.grad.reshape(-1) for p in ddp.parameters()])
        if step == 0:
            first, lost = differ(summed, expected), differ(lost, expected)
        offset = 0
        for p in plain.parameters():
            p.grad.copy_(summed[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        for optimizer in optimizers:
            optimizer.step()
    weights = differ(torch.cat([p.detach().reshape(-1) for p in plain.parameters()]),
                     torch.cat([p.detach().reshape(-1) for p in ddp.parameters()]))
    if rank == 0:
        out.put(json.dumps({"world": world, "elements": expected.numel(), "first_sum": first, "after_a_loss": lost,
                            "weights": weights}))
    dist.destroy_process_group()


if __name__ == "__main__":
    world, steps, port = (int(a) for a in sys.argv[1:4])
    context = mp.get_context("spawn")
    out = context.Queue()
    workers = [context.Process(target=work, args=(r, world, steps, port, out)) for r in range(world)]
    for w in workers:
        w.start()
    print(out.get(timeout=120))
    for w in workers:
        w.join()
