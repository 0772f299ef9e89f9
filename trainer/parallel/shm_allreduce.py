"""The gradient all-reduce through shared memory, for CPU processes that all run on one host.

gloo all-reduces over TCP even between processes of one host: every byte is copied into the kernel
and out again, ~26 ms of CPU per 2-process ResNet-18 step (44.7 MB of gradients) on the same cores
that compute. Instead, each process moves its DDP gradient buckets into shared memory once (an
unlinked /dev/shm file: the storage moves, every view of it follows), maps its peers' buckets
(reopening their descriptors through /proc, so no helper process outlives a rank and keeps its
sockets open), and sums one slice of every bucket over all processes, writing the sum back into
all of them. Two gloo barriers keep the processes in step: before (every bucket holds its
gradients) and after (every slice is summed); a lost peer fails them as it fails any collective.

The result is DDP's: each gradient is divided by the world size, then summed. With 2 processes it
equals gloo's bit for bit (float addition is commutative); with more, a slice's summation order
differs from gloo's ring, as between any two all-reduce algorithms.
"""

from __future__ import annotations

import logging
import os
import time
import weakref

import torch

from trainer.core.errors import first_line
from trainer.parallel.compat import private
from trainer.parallel.collectives import all_gather_objects, barrier
from trainer.parallel.context import DistContext

log = logging.getLogger(__name__)
# The hook state registered on each DDP model (step timing reads its intervals): ours, not DDP's private list.
HOOKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
SHM_DIR = "/dev/shm"


Handle = tuple  # (pid, fd, storage bytes, offset, numel): where a peer finds a shared tensor


def share(tensor: torch.Tensor) -> Handle:
    """Move the tensor's storage into shared memory (its views follow) and say where peers find it.
    Storage sharing by file descriptor is torch's private API: without it (or with TRAINER_PUBLIC_TORCH_ONLY=1)
    this raises, and the callers fall back to gloo's collectives."""
    share_fd = private("UntypedStorage._share_fd_cpu_", lambda: tensor.untyped_storage()._share_fd_cpu_)
    if share_fd is None or private("UntypedStorage._new_shared_fd_cpu",
                                   lambda: torch.UntypedStorage._new_shared_fd_cpu) is None:
        raise RuntimeError("this torch cannot share memory by file descriptor (a private API)")
    fd, size = share_fd()
    return os.getpid(), fd, size, tensor.storage_offset(), tensor.numel()


def open_shared(handle: Handle, dtype: torch.dtype) -> torch.Tensor:
    """A peer's shared tensor (same host, same user), mapped into this process."""
    pid, fd, size, offset, numel = handle
    peer_fd = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR)
    try:
        storage = torch.UntypedStorage._new_shared_fd_cpu(peer_fd, size)  # maps its own duplicate
    finally:
        os.close(peer_fd)
    return torch.empty(0, dtype=dtype).set_(storage, offset, (numel,))


class SharedMemoryAllReduce:
    """A DDP communication hook; the state DDP hands back to `hook` on every bucket."""

    def __init__(self, ctx: DistContext):
        self.ctx = ctx
        self.buffers: dict[int, list[torch.Tensor]] = {}  # bucket index -> every rank's buffer, mapped here
        self.intervals: list[tuple[float, float]] = []  # perf_counter spans in the hook, for step timing

    def map_bucket(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        handles = all_gather_objects(self.ctx, share(buffer))
        return [buffer if rank == self.ctx.rank else open_shared(handle, buffer.dtype)
                for rank, handle in enumerate(handles)]

    @staticmethod
    def hook(state, bucket):  # no annotations: DDP checks them, and this module's are strings
        """All-reduce one torch.distributed.GradBucket in place; returns a completed future of its buffer."""
        began = time.perf_counter()
        buffer = bucket.buffer()
        mapped = state.buffers.get(bucket.index())
        if mapped is None or mapped[state.ctx.rank].data_ptr() != buffer.data_ptr():  # DDP rebuilt its buckets
            mapped = state.buffers[bucket.index()] = state.map_bucket(buffer)
        buffer.div_(state.ctx.world_size)
        barrier(state.ctx)  # every rank's gradients are in its bucket
        begin = buffer.numel() * state.ctx.rank // state.ctx.world_size
        end = buffer.numel() * (state.ctx.rank + 1) // state.ctx.world_size
        mine = buffer[begin:end]
        for rank, peer in enumerate(mapped):
            if rank != state.ctx.rank:
                mine.add_(peer[begin:end])
        for rank, peer in enumerate(mapped):
            if rank != state.ctx.rank:
                peer[begin:end].copy_(mine)
        barrier(state.ctx)  # every slice is summed: the buckets may be read, and next step written
        done = torch.futures.Future()
        done.set_result(buffer)
        if len(state.intervals) < 10_000:  # read and cleared every step while step timing is on
            state.intervals.append((began, time.perf_counter()))
        return done


def local_problem(nbytes: int) -> str | None:
    """Why this process cannot share nbytes of gradients (None: it can)."""
    stats = os.statvfs(SHM_DIR)
    free = stats.f_bavail * stats.f_frsize
    if free < nbytes:
        return f"{SHM_DIR} has {free / 2**20:.0f} MiB free and the gradients need {nbytes / 2**20:.0f} MiB"
    return None


def sharing_problem(ctx: DistContext, nbytes: int) -> str | None:
    """Why the ranks cannot all-reduce through shared memory, the same answer on every rank (a collective).

    Every rank needs the room and must be able to map every other rank's memory (one PID namespace,
    one user): a probe tensor is shared and mapped both ways before any gradient is."""
    probe = torch.zeros(1)  # alive until the last gather: the peers map it before that
    try:
        mine = local_problem(nbytes) or share(probe)
    except (OSError, RuntimeError) as err:
        mine = f"cannot share memory ({first_line(err)})"
    handles = all_gather_objects(ctx, mine)
    problem = next((h for h in handles if isinstance(h, str)), None)
    if problem is None:
        try:
            for rank, handle in enumerate(handles):
                if rank != ctx.rank:
                    open_shared(handle, probe.dtype)
        except (OSError, RuntimeError) as err:
            problem = f"cannot map another process's shared memory ({first_line(err)})"
    return next((p for p in all_gather_objects(ctx, problem) if p), None)


def all_cpu_on_one_host(ctx: DistContext) -> bool:
    """Whether every rank is a CPU (gloo) process of this host: where shared memory can replace TCP."""
    return ctx.device.type == "cpu" and ctx.backend == "gloo" and ctx.topology.local_world_size == ctx.world_size


def register_if_usable(ddp_model: torch.nn.parallel.DistributedDataParallel, ctx: DistContext,
                       register: bool = True) -> tuple | None:
    """Use shared memory when every rank is a CPU process of this host and all agree (a collective): the hook's
    (state, hook), registered unless register is False (in-place recovery chains it in a hook of its own, DDP taking
    one only); None where shared memory is not usable."""
    if not all_cpu_on_one_host(ctx):
        return None
    grad_bytes = sum(p.numel() * p.element_size() for p in ddp_model.parameters() if p.requires_grad)
    # Every local rank's buckets, twice while DDP rebuilds them after the first step.
    problem = sharing_problem(ctx, 2 * ctx.world_size * grad_bytes)
    if problem:
        log.warning("gradients go through gloo's TCP all-reduce, not shared memory: %s (raise shm_size, "
                    "or --shm-allreduce false to silence this)", problem)
        return None
    state = SharedMemoryAllReduce(ctx)
    if register:
        ddp_model.register_comm_hook(state, SharedMemoryAllReduce.hook)
    HOOKS[ddp_model] = state
    log.info("gradients are all-reduced through shared memory (all %d processes on this host)", ctx.world_size)
    return state, SharedMemoryAllReduce.hook

