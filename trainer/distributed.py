"""Who this process is, the process group, and named helpers for who does what.

Rank facts are read once from the environment by trainer.topology.resolve (role WORKER) into a frozen
Topology; everything else asks the DistContext instead of re-reading RANK.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import logging
import os
import re
import signal
import sys
from dataclasses import dataclass
from typing import Callable, Iterator, TypeVar

from trainer.errors import UsageError, first_line
from trainer.topology import Topology

T = TypeVar("T")
log = logging.getLogger("trainer")


@dataclass
class DistContext:
    topology: Topology
    backend: str  # "nccl", "gloo", or "none" for a single plain process
    device: "torch.device"  # noqa: F821 (torch is imported lazily to keep --help and errors fast)
    control_group: object = None  # a gloo group for CPU-side agreement (stop requests) without GPU syncs

    @property
    def rank(self) -> int:
        return self.topology.rank

    @property
    def world_size(self) -> int:
        return self.topology.world_size

    @property
    def is_main(self) -> bool:
        return self.topology.rank == 0

    @property
    def is_local_main(self) -> bool:
        return self.topology.local_rank == 0

    @property
    def distributed(self) -> bool:
        return self.backend != "none"


def check_gpu_options(backend: str, sync_bn: bool, cuda_available: bool, world_size: int) -> None:
    """Settings that need a GPU, refused where there is none (the launcher checks before torchrun starts
    ranks that would each fail)."""
    if backend == "nccl" and not cuda_available:
        raise UsageError("--backend", "nccl needs a CUDA GPU and none is visible",
                         "use --backend gloo (or auto) on CPU hosts, or give the container GPUs")
    if sync_bn and world_size > 1 and not cuda_available:
        raise UsageError("--sync-bn", "SyncBatchNorm runs on CUDA GPUs only and none is visible",
                         "drop --sync-bn on CPU hosts")


def resolve_backend(choice: str) -> str:
    import torch

    cuda_available = torch.cuda.is_available()
    check_gpu_options(choice, False, cuda_available, 1)
    if choice == "auto":
        return "nccl" if cuda_available else "gloo"
    return choice


def keep_freed_memory() -> None:
    """Training on the CPU: serve large allocations from the heap and keep freed memory for the next step.

    glibc gives every allocation over 32 MiB (fsdp's all-gathered blocks, a large batch's activations) a
    fresh mmap and unmaps it when freed, so every step touches those pages anew: a page fault and a
    zeroed page per 4 KiB (~2% of a 2-process ResNet-50 step on 32x32 images under ddp, more under
    fsdp, whose gathered blocks are that large; docs/benchmarks.md). Kept, they are reused as CUDA's caching allocator reuses device memory; the
    process's resident memory then stays at its peak. Left alone where the user chose an allocator
    (jemalloc or tcmalloc preloaded) or glibc's settings (MALLOC_*_ or GLIBC_TUNABLES)."""
    import ctypes
    import platform

    chosen = os.environ.get("GLIBC_TUNABLES") or any(key.startswith("MALLOC_") and key.endswith("_")
                                                     for key in os.environ)
    if chosen or "malloc" in os.environ.get("LD_PRELOAD", "") or platform.libc_ver()[0] != "glibc":
        return
    m_trim_threshold, m_mmap_max = -1, -4  # malloc.h
    mallopt = ctypes.CDLL(None).mallopt
    mallopt(m_mmap_max, 0)
    mallopt(m_trim_threshold, 2**31 - 1)


def setup(topology: Topology, backend_choice: str, timeout_s: float) -> DistContext:
    """Pin the device and form the process group (skipped for a single plain process)."""
    import torch
    import torch.distributed as dist

    backend = resolve_backend(backend_choice)
    if torch.cuda.is_available():
        if topology.local_rank >= torch.cuda.device_count():
            raise UsageError("LOCAL_RANK", f"{topology.local_rank} has no GPU ({torch.cuda.device_count()} visible)",
                             "start at most one process per GPU: NPROC_PER_NODE, torchrun --nproc-per-node or "
                             "srun --ntasks-per-node")
        torch.cuda.set_device(topology.local_rank)
        device = torch.device("cuda", topology.local_rank)
    else:
        device = torch.device("cpu")
        keep_freed_memory()
    if not topology.distributed:
        return DistContext(topology, "none", device)
    if topology.started_by in ("explicit", "pytorchjob"):
        # RANK and WORLD_SIZE given by hand or by the controller (a container per rank): no launcher says what
        # is going on.
        print(f"rank {topology.rank} of {topology.world_size}: joining the process group at {topology.master_addr}:"
              f"{topology.master_port} (waiting up to {timeout_s:g} s for every rank)", file=sys.stderr, flush=True)
    # env:// reads these; srun, and a container given only RANK and WORLD_SIZE, leave some unset.
    os.environ.update(MASTER_ADDR=topology.master_addr, MASTER_PORT=str(topology.master_port),
                      RANK=str(topology.rank), WORLD_SIZE=str(topology.world_size), LOCAL_RANK=str(topology.local_rank))
    timeout = datetime.timedelta(seconds=timeout_s)
    device_id = device if backend == "nccl" else None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and attempt is not None:
        # torchrun's static rendezvous keeps one store across restarts of the worker group, so the
        # killed group's gloo addresses are still in it: a restarted rank would dial a dead peer.
        # A key prefix per attempt gives each group a clean slate.
        store = dist.TCPStore(topology.master_addr, topology.master_port, is_master=False, timeout=timeout)
        dist.init_process_group(backend, store=dist.PrefixStore(f"trainer/attempt-{attempt}", store),
                                rank=topology.rank, world_size=topology.world_size, timeout=timeout,
                                device_id=device_id)
    else:
        dist.init_process_group(backend, init_method="env://", timeout=timeout, device_id=device_id)
    control = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else dist.group.WORLD
    return DistContext(topology, backend, device, control)


# gloo raises plain RuntimeErrors; these words tell a lost peer from a bug (whose traceback must show).
_PEER_LOST = re.compile(r"timed out|timeout|connection (closed|reset|refused)|broken pipe|closed by peer|"
                        r"socket|remote process exited|network error", re.IGNORECASE)


def collective_failure(err: BaseException) -> str | None:
    """One line saying how a collective or the process-group store failed; None for any other error."""
    import torch.distributed as dist

    first = first_line(err, limit=None)
    if not (isinstance(err, dist.DistError) or (isinstance(err, RuntimeError) and _PEER_LOST.search(first))):
        return None
    first = re.sub(r"^\[[^\]]*\]\s*", "", first)  # gloo's "[source.cc:78] " prefix
    return re.split(r"(?<=[.!?])\s+", first)[0][:300]  # gloo appends advice that ours replaces


def rendezvous_failure(topology: Topology, err: BaseException, timeout_setting: str, timeout_s: float) -> str | None:
    """The one line for a process group that could not form (None: err is some other error)."""
    what = collective_failure(err)
    if what is None:
        return None
    named = topology.variables("master_addr", "master_port", "world_size") or ["MASTER_ADDR", "MASTER_PORT"]
    return (f"rendezvous at {topology.master_addr}:{topology.master_port}: {what} (check {', '.join(named)}, "
            f"and that every rank started; {timeout_setting}, now {timeout_s:g} s, sets the wait)")


def teardown(ctx: DistContext) -> None:
    import torch.distributed as dist

    if ctx.distributed and dist.is_initialized():
        # Groups must die while Python is alive: one that lives on until interpreter exit (held by
        # DDP's reducer, which reference cycles keep, or by ctx) has its C++ worker threads torn
        # down during finalization, where one that needs the GIL aborts the process
        # ("terminate called without an active exception", SIGABRT) after a successful run.
        gc.collect()
        dist.destroy_process_group()
        ctx.control_group = None


def barrier(ctx: DistContext) -> None:
    import torch.distributed as dist

    if ctx.distributed:
        dist.barrier(group=ctx.control_group)


@contextlib.contextmanager
def leader_first(ctx: DistContext, leader: bool) -> Iterator[None]:
    """The processes with leader=True run the block before the others (every rank enters it)."""
    if not leader:
        barrier(ctx)
    yield
    if leader:
        barrier(ctx)


def local_main_first(ctx: DistContext):
    """The first process of each node runs the block (a download, say) before the others."""
    return leader_first(ctx, ctx.is_local_main)


def main_first(ctx: DistContext):
    """Rank 0 runs the block (writing a shared file, say) before every other rank."""
    return leader_first(ctx, ctx.is_main)


def all_reduce_sum(ctx: DistContext, tensor):
    """Sum a tensor over all ranks in place (a no-op for one plain process)."""
    import torch.distributed as dist

    if ctx.distributed:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


class GracefulStop:
    """SIGTERM (docker stop, torchrun shutdown) or SIGINT: finish the step, checkpoint, exit 0.

    The built-in trainer and trainer.api both stop through it, agreeing on the step with StopVote."""

    def __init__(self):
        self.requested = False
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._request)

    def close(self) -> None:
        """Training is over and saved: a late signal (our own agent's, see stop_host_agent) changes nothing."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)

    def _request(self, signum, _frame):
        self.requested = True
        log.warning("received %s: stopping within a step or two, with a checkpoint", signal.Signals(signum).name)

    @staticmethod
    def dataloader_worker_init(worker_id: int) -> None:
        """A DataLoader's worker_init_fn: its workers leave a stop to the training process. torchrun signals
        each worker's whole process group, DataLoader workers included, and torch's SIGTERM handler in a
        DataLoader worker dies of any SIGTERM but its parent's: the training process then failed on the
        dead worker instead of checkpointing. In a process group of its own, a worker gets neither that
        signal nor a terminal's Ctrl-C; its parent shuts it down (and it exits when its parent dies)."""
        os.setpgid(0, 0)


class StopVote:
    """Whether any rank wants to stop, agreed with one step of slack (CPU-side, no GPU sync).

    `vote(flag)` starts this step's MAX all-reduce and returns the previous step's outcome, so no
    rank waits for the others at every step: with local SGD no other collective runs in a step,
    and meeting every step would cost each step the slower rank's jitter. Every rank sees the
    same outcome at the same step, which is all that stopping together needs."""

    def __init__(self, ctx: DistContext):
        self.ctx = ctx
        self.pending: tuple | None = None

    def vote(self, flag: bool) -> bool:
        import torch
        import torch.distributed as dist

        if not self.ctx.distributed:
            return flag
        previous = self.finish()
        value = torch.tensor([1 if flag else 0], dtype=torch.int32)
        work = dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.ctx.control_group, async_op=True)
        self.pending = (value, work)
        return previous

    def finish(self) -> bool:
        """The outcome of the vote in flight (False if none); call once more before leaving the loop."""
        if self.pending is None:
            return False
        value, work = self.pending
        self.pending = None
        work.wait()
        return bool(value.item())


def broadcast_from_main(ctx: DistContext, obj):
    """Rank 0's Python object on every rank (checkpoints live on rank 0's disk only)."""
    import torch.distributed as dist

    if not ctx.distributed:
        return obj
    box = [obj if ctx.is_main else None]
    dist.broadcast_object_list(box, src=0, group=ctx.control_group)
    return box[0]


def all_or_none(ctx: DistContext, fn: Callable[[], T]) -> T:
    """Every rank runs fn. If it fails with a UsageError on any rank (a user's factory that raises, data
    that do not fit the model), every rank stops with that error, printed once by the first rank that
    failed, instead of the others going on into a collective that never completes."""
    from trainer.errors import EchoedUsageError

    error = None
    try:
        result = fn()
    except UsageError as err:
        error = err
    failures = all_gather_objects(ctx, None if error is None else error.parts)
    first = next((rank for rank, parts in enumerate(failures) if parts is not None), None)
    if first is None:
        return result
    if first == ctx.rank:
        raise error
    raise EchoedUsageError(*failures[first])


def all_gather_objects(ctx: DistContext, obj) -> list:
    import torch.distributed as dist

    if not ctx.distributed:
        return [obj]
    out = [None] * ctx.world_size
    dist.all_gather_object(out, obj, group=ctx.control_group)
    return out
