"""Who this process is, the process group, and named helpers for who does what.

Rank facts are read once from the environment by trainer.topology.resolve (role WORKER) into a frozen
Topology; everything else asks the DistContext instead of re-reading RANK.
"""

from __future__ import annotations

import datetime
import gc
import logging
import os
import re
import sys
from dataclasses import dataclass
from typing import TypeVar

from trainer.cluster.topology import Topology
from trainer.config.settings import LIGHTHOUSE_ENV, check_gpu_options
from trainer.core.errors import UsageError, first_line
from trainer.parallel import at_exit, known_warnings
from trainer.parallel.supervised import group_store_prefix

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
    if os.environ.get(LIGHTHOUSE_ENV, "").strip():  # in place: two C++ warnings known harmless there
        known_warnings.said_quietly(topology.master_addr)
    prefix = group_store_prefix(lambda: dist.TCPStore(topology.master_addr, topology.master_port, is_master=False,
                                                      timeout=timeout))
    if prefix is not None:
        # A store kept across restarts of the worker group (the agent's) still holds the killed group's gloo
        # addresses: a restarted rank would dial a dead peer. A key prefix per attempt gives each group a clean slate.
        store = dist.TCPStore(topology.master_addr, topology.master_port, is_master=False, timeout=timeout)
        dist.init_process_group(backend, store=dist.PrefixStore(prefix, store), rank=topology.rank,
                                world_size=topology.world_size, timeout=timeout, device_id=device_id)
    else:
        dist.init_process_group(backend, init_method="env://", timeout=timeout, device_id=device_id)
    # Whatever starts this process (plain torchrun, srun, a container per rank; trainer-launch's bootstrap collects
    # too): a model that still holds the group through its cycles once the program is done is freed at exit while
    # the interpreter is whole, not in its teardown, where the group's threads aborted a finished run (CI: rank 1 of
    # a local-SGD resume under plain torchrun, "terminate called without an active exception" after its last step).
    at_exit.collect_at_exit()
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


