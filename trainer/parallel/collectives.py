"""Named helpers for who does what over the process group: barriers, leader-first blocks, sums, and the
agreement patterns (every rank or none; rank 0 computes, every rank learns the outcome or the same error)."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, TypeVar

from trainer.core.errors import EchoedUsageError, UsageError, first_line
from trainer.parallel.context import DistContext

T = TypeVar("T")


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
    from trainer.core.errors import EchoedUsageError

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


class MainRankFailed(Exception):
    """Rank 0 failed in work it did for every rank; rank 0 itself shows why."""


def on_main_then_share(ctx: DistContext, fn: Callable[[], Any]) -> Any:
    """Rank 0 computes (it owns the checkpoint disk); every rank gets the result, or the same error."""
    outcome: tuple[str, Any] = ("ok", None)
    failure = None
    if ctx.is_main:
        try:
            outcome = ("ok", fn())
        except UsageError as err:
            outcome = ("error", err.parts)
        except Exception as err:  # noqa: BLE001 (told to the other ranks, then raised here)
            outcome, failure = ("failed", f"{type(err).__name__}: {first_line(err)}"), err
    kind, value = broadcast_from_main(ctx, outcome)
    if failure is not None:
        raise failure
    if kind == "error":
        raise UsageError(*value) if ctx.is_main else EchoedUsageError(*value)
    if kind == "failed":
        raise MainRankFailed(f"rank 0 failed ({value}); its log has the details")
    return value
