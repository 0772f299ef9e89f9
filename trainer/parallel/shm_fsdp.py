"""fsdp's all-gathers and reduce-scatters through shared memory, for CPU processes all on one host.

The reason is shm_allreduce.py's: gloo moves every byte through TCP even between processes of one
host, on the cores that compute. Under fsdp that is worse than under ddp, as a block's parameters
are all-gathered twice per step (forward, then backward) besides its gradients' reduce-scatter: at 2
processes ResNet-50 spent ~360 ms of a 1.3 s step in gloo. FSDP2 lets a module take its own
collectives (`set_custom_all_gather`, `set_custom_reduce_scatter`); these use shared memory
(the classes below say how, and why no rank can overwrite what a peer still reads):

- all-gather: every rank's shard goes straight into one shared buffer, and a barrier later the
  buffer holds them all;
- reduce-scatter: every rank's gradients go into its own shared buffer, and after a barrier each
  rank sums its part over all of them.

The calls come in the same order with the same sizes on every rank (fsdp pads every shard to one
size), so a buffer that is too small grows on every rank at the same call, shared anew.
"""

from __future__ import annotations

import logging
import math
import weakref

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from trainer.parallel.collectives import all_gather_objects, barrier
from trainer.parallel.context import DistContext
from trainer.parallel.shm_allreduce import all_cpu_on_one_host, open_shared, share, sharing_problem

log = logging.getLogger(__name__)


class _Areas:
    """Shared buffers used in turn (call k uses area k % count); `per_rank`: each rank has its own set
    (mapped by its peers), otherwise one set for all, made by rank 0."""

    def __init__(self, ctx: DistContext, count: int, per_rank: bool):
        self.ctx, self.count, self.per_rank = ctx, count, per_rank
        self.areas: list[list[torch.Tensor] | None] = [None] * count
        self.handed: list[weakref.ref | None] = [None] * count  # the tensor fsdp got from each area
        self.calls = 0

    def next(self, nbytes: int) -> tuple[int, list[torch.Tensor]]:
        index = self.calls % self.count
        self.calls += 1
        area = self.areas[index]
        if area is None or area[0].numel() < nbytes:  # on every rank at the same call: a collective
            rank = self.ctx.rank
            if self.per_rank:
                mine = torch.empty(nbytes, dtype=torch.uint8)
                handles = all_gather_objects(self.ctx, share(mine))
                area = [mine if peer == rank else open_shared(handle, torch.uint8)
                        for peer, handle in enumerate(handles)]
            else:
                mine = torch.empty(nbytes, dtype=torch.uint8) if rank == 0 else None
                handles = all_gather_objects(self.ctx, None if mine is None else share(mine))
                area = [mine if rank == 0 else open_shared(handles[0], torch.uint8)]
            self.areas[index] = area
        return index, area

    def released(self, index: int) -> bool:
        """Whether fsdp has let go of what it got from this area (every view of it included)."""
        handed = self.handed[index]
        return handed is None or handed() is None

    def hand_out(self, index: int, tensor: torch.Tensor) -> torch.Tensor:
        self.handed[index] = weakref.ref(tensor)
        return tensor


def _view(area: torch.Tensor, dtype: torch.dtype, numel: int) -> torch.Tensor:
    return area[:numel * dtype.itemsize].view(dtype)


class SharedMemoryAllGather(AllGather):
    """All ranks gather into one shared buffer: fsdp's copy-in writes each rank's shard straight into
    its place there, one barrier later the buffer holds every shard, and fsdp copies its parameters
    out of it. Nothing is copied besides. Four buffers, used in turn: a rank writes buffer k % 4 again
    at call k + 4, after the barrier of call k + 3, which a peer reaches only once fsdp let go of what
    call k gave it (checked: a peer still holding it stops the run, rather than read a shard overwritten
    under it; fsdp copies out of a gathered buffer before its next all-gather but one)."""

    AREAS = 4

    def __init__(self, ctx: DistContext):
        self.ctx = ctx
        self.areas = _Areas(ctx, self.AREAS, per_rank=False)
        self.last: dist.Work | None = None

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if self.last is not None:  # fsdp waits for a gather before the next but one; this makes sure
            self.last.wait()
            self.last = None
        numel = math.prod(int(n) for n in size)
        index, (area,) = self.areas.next(numel * dtype.itemsize)
        # Before this rank's barrier of this call, which lets its peers write into the buffer of call - 3.
        ahead = (index + 1) % self.AREAS
        if not self.areas.released(ahead):
            raise RuntimeError(f"shared-memory all-gather: fsdp still holds the buffer of {self.AREAS - 1} "
                               "all-gathers ago (run with --shm-allreduce false)")
        return self.areas.hand_out(index, _view(area, dtype, numel).view(size))

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, async_op: bool = False):
        handed = self.areas.handed[(self.areas.calls - 1) % self.AREAS]
        ours = handed() if handed is not None else None
        if ours is None or ours.data_ptr() != output_tensor.data_ptr():
            raise RuntimeError("shared-memory all-gather: called on a buffer it did not allocate")
        # Done once every rank's shard is in place: the barrier's work, which fsdp waits on before it
        # copies the parameters out. Its backward pass gathers the next block before computing this
        # one, so a rank a little behind its peers holds up no one there.
        self.last = dist.barrier(group=self.ctx.control_group, async_op=True)
        return self.last


class SharedMemoryReduceScatter(ReduceScatter):
    """Each rank's gradients go to its own shared buffer (fsdp's copy-in writes them there); after a
    barrier each rank sums its part over every rank's buffer, in rank order (so every rank's sum is
    the one any other would compute), and averages it as fsdp asks. Two buffers per rank, used in
    turn: a rank writes buffer k % 2 again at call k + 2, after the barrier of call k + 1, which a
    peer reaches only once it has read call k."""

    def __init__(self, ctx: DistContext):
        self.ctx = ctx
        self.areas = _Areas(ctx, 2, per_rank=True)
        self.inputs = 0  # fsdp allocates a reduce-scatter's input, then its output

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        self.inputs += 1
        if self.inputs % 2 == 0:  # an output: this rank's own memory
            return torch.empty(*size, dtype=dtype, device=device)
        numel = math.prod(int(n) for n in size)
        # fsdp reads a reduce-scatter's input only in the call (and may keep it until the next one).
        _, areas = self.areas.next(numel * dtype.itemsize)
        return _view(areas[self.ctx.rank], dtype, numel).view(size)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, op, async_op: bool = False):
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):  # e.g. a premultiplied sum: gloo's own path
            return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
        total, shard = input_tensor.numel(), output_tensor.numel()
        dtype, rank = input_tensor.dtype, self.ctx.rank
        index = (self.areas.calls - 1) % 2
        staged = _view(self.areas.areas[index][rank], dtype, total)
        if output_tensor.untyped_storage().data_ptr() == staged.untyped_storage().data_ptr():
            # fsdp allocated in another order than input, then output: staging would overwrite the output
            raise RuntimeError("shared-memory reduce-scatter: its output is in a staging buffer "
                               "(run with --shm-allreduce false)")
        if staged.data_ptr() != input_tensor.data_ptr():  # fsdp wrote elsewhere: stage the peers' parts
            for peer in range(self.ctx.world_size):
                if peer != rank:
                    staged[peer * shard:(peer + 1) * shard].copy_(input_tensor[peer * shard:(peer + 1) * shard])
        barrier(self.ctx)  # every rank's gradients are staged
        mine = slice(rank * shard, (rank + 1) * shard)
        for peer, area in enumerate(self.areas.areas[index]):
            part = input_tensor[mine] if peer == rank else _view(area, dtype, total)[mine]
            if peer == 0:
                output_tensor.copy_(part)
            else:
                output_tensor.add_(part)
        if op == dist.ReduceOp.AVG:
            output_tensor.div_(self.ctx.world_size)
        return None


def register_if_usable(modules: list[nn.Module], ctx: DistContext) -> None:
    """Give every fsdp module of the model (its blocks, then its root) the shared-memory collectives,
    when every rank is a CPU process of this host and all agree (a collective)."""
    if not all_cpu_on_one_host(ctx) or not all(hasattr(FSDPModule, name) for name in
                                               ("set_custom_all_gather", "set_custom_reduce_scatter")):
        return
    root = modules[-1]
    in_blocks = {id(p) for module in modules[:-1] for p in module.parameters()}
    sizes = [sum(p.numel() for p in module.parameters()) for module in modules[:-1]]
    sizes.append(sum(p.numel() for p in root.parameters() if id(p) not in in_blocks))
    largest = max(sizes) * 4  # a block's whole gradients in fp32 (a DTensor's numel is the global one)
    # Each rank's two reduce-scatter buffers hold a block's gradients; the four gather buffers, one set
    # for all ranks, a gathered block.
    problem = sharing_problem(ctx, ctx.world_size * 2 * largest + SharedMemoryAllGather.AREAS * largest)
    if problem:
        log.warning("fsdp's all-gathers and reduce-scatters go through gloo's TCP, not shared memory: %s "
                    "(raise shm_size, or --shm-allreduce false to silence this)", problem)
        return
    gather, scatter = SharedMemoryAllGather(ctx), SharedMemoryReduceScatter(ctx)
    for module in modules:
        if isinstance(module, FSDPModule):
            module.set_custom_all_gather(gather)
            module.set_custom_reduce_scatter(scatter)
    log.info("fsdp's all-gathers and reduce-scatters go through shared memory (all %d processes on this host)",
             ctx.world_size)
