"""The replica group of in-place recovery (trainer.engine.inplace): torchft's reconfigurable process group across
the hosts, one generation per quorum, which also remembers the generation it was made for.

Which group (replica_group()): on CPUs torchft's ProcessGroupGloo; when the workers' device is CUDA torchft's
ProcessGroupBabyNCCL, NCCL run in a child process of each worker. Why the baby group and not torchft's in-process
ProcessGroupNCCL (torchft 0.2.0, both read): a peer lost in the middle of a collective leaves the survivor's NCCL
kernel waiting for it. In-process, getting out relies on ncclCommAbort of a non-blocking communicator (torchft
turns it on for NCCL >= 2.25 only, and its docstring warns that NCCL's error handling may still deadlock), while
torch's NCCL watchdog, on the same error, may tear the whole process down (what TORCH_NCCL_ASYNC_ERROR_HANDLING's
default does): the training process, its CUDA context, its compiled graphs and its DataLoader workers with it, which is what in
place is for keeping. The baby group keeps NCCL, its communicators, its kernels and its watchdog in the child, with
a CUDA context of its own: a lost peer ends or hangs the child, torchft's timeout gives up on it, and the next
quorum's configure() kills it and starts a new one; the worker's own CUDA context never ran an NCCL kernel. The
costs (torchft's docstring): about 1 GB of GPU memory for the child's context, a child started per new membership,
its kernels time-shared with the worker's rather than overlapped, and the CUDA tensors of an operation in flight
when a child is killed may leak (once per loss, the step's flat gradients); tensors cross to the child by CUDA IPC, so
everything sent over it must be on the device (CPU tensors it would move into shared memory, in place).

In place on GPUs has not run on a GPU yet: RECOVERY=in-place asks for it (trainer.cluster.launch.choose_recovery),
`bash bench/gpu.sh quick`'s inplace-nccl part measures it on the first GPU lent.

The classes are at module level: the baby group starts its child with multiprocessing's spawn, which pickles the
group's class by its import path (a class made inside a function does not pickle).
"""

from __future__ import annotations

import time

import torch
from torchft import ProcessGroupBabyNCCL, ProcessGroupGloo


class Generations:
    """The bookkeeping inplace.InPlace reads around torchft's configure() (the signature torchft 0.2.x calls,
    lighthouse.TORCHFT_TESTED)."""

    generation = 0  # the generation of the group formed last
    asked = 0       # the generation of the quorum's group asked for last (formed, or its rendezvous failed)
    configured_s = 0.0  # the last configure's seconds (the new group's rendezvous across the hosts)

    def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int, quorum_id: int | None = None,
                  group_rank: int | None = None, group_world_size: int | None = None,
                  global_ranks: list[int] | None = None) -> None:
        began, self.asked = time.perf_counter(), quorum_id or 0
        try:
            super().configure(store_addr, replica_id, rank, world_size, quorum_id, group_rank,  # type: ignore[misc]
                              group_world_size, global_ranks)
        finally:
            self.configured_s = time.perf_counter() - began
        self.generation = quorum_id or 0


class GlooReplicaGroup(Generations, ProcessGroupGloo):
    """torchft's reconfigurable gloo group: the replica group on CPUs (its tensors on the CPU)."""


class NcclReplicaGroup(Generations, ProcessGroupBabyNCCL):
    """torchft's NCCL group in a child process: the replica group when the workers train on CUDA (its tensors on
    the worker's device)."""


def replica_group(device: torch.device, timeout):
    """The replica group for workers training on `device` (see the module's docstring)."""
    if device.type == "cuda":
        return NcclReplicaGroup(timeout=timeout)
    return GlooReplicaGroup(timeout=timeout)


def tensors_device(device: torch.device) -> torch.device:
    """Where the tensors sent over the replica group of workers on `device` must be: the device for NCCL, the CPU
    for gloo."""
    return device if device.type == "cuda" else torch.device("cpu")
