"""Per-rank step timing: where each rank's step time goes, and which rank the others wait for.

Each optimizer step is split into
  data_wait  waiting for the next batch (the input pipeline; on a GPU, the time the GPU idled for it),
  compute    forward and backward (DDP overlaps the gradient all-reduce with backward),
  comm_wait  waiting in collectives: DDP's buffer broadcast before the forward, the all-reduce's tail
             after this rank's last gradient is ready, and the shared-memory all-reduce (it runs inside
             backward); a rank that waits here waits for a slower peer or for the network,
  optimizer  the optimizer step.
Not counted: validation, checkpoints and the logging between steps.

Marks are perf_counter readings on CPUs and CUDA events on GPUs (recorded in the stream, read once
per --log-every window, right before the loss is read anyway: no extra host sync per step). They come
from hooks (the batch iterator, the model's forward pre-hook, the last gradient's hook, the optimizer's
step hooks), so the loop itself only wraps its batches. Each window's sums travel beside the loss in the
all-reduce the loop already makes every --log-every steps, one slot per rank: rank 0 learns every
rank's split without another collective.

A rank is the straggler when its busy time (all but comm_wait) exceeds the median rank's by more than
STRAGGLER_THRESHOLD in STRAGGLER_WINDOWS windows in a row: the others spend that time waiting for it.
"""

from __future__ import annotations

import logging
import socket
import statistics
import time
from typing import Any, Iterable, Iterator

from trainer.parallel import collectives, shm_allreduce

log = logging.getLogger("trainer")
FIELDS = ("data_wait_ms", "compute_ms", "comm_wait_ms", "optimizer_ms")
BUSY_FIELDS = ("data_wait_ms", "compute_ms", "optimizer_ms")  # a straggler is busy here while its peers wait
SLOT = ("steps", *FIELDS, "max_memory_mb", "utilization_pct")  # one rank's numbers in the window's all-reduce
STRAGGLER_THRESHOLD = 0.15  # busy time above the median rank's by more than this
STRAGGLER_WINDOWS = 3  # ... in this many --log-every windows in a row
_DATA, _COMM, _OPT, _SPAN = range(4)


class _CpuClock:
    @staticmethod
    def mark() -> float:
        return time.perf_counter()

    @staticmethod
    def ms(begin: float, end: float) -> float:
        return (end - begin) * 1000.0


class _CudaClock:
    def __init__(self):
        import torch

        self.event = torch.cuda.Event

    def mark(self):
        event = self.event(enable_timing=True)
        event.record()
        return event

    @staticmethod
    def ms(begin, end) -> float:
        return begin.elapsed_time(end)


class StepTiming:
    """Built after the optimizer and DDP; with --step-timing false it only passes the loss through."""

    def __init__(self, cfg, ctx, model, ddp_model, optimizer):
        self.ctx, self.enabled = ctx, cfg.step_timing
        self.hosts = [""] * ctx.world_size
        self.window: list[list[float]] | None = None  # every rank's SLOT, rank 0's view after a reduce
        self.totals = [[0.0] * 5 + [-1.0, -1.0] for _ in range(ctx.world_size)]  # over the run, but the 1st window
        self.first_window: list[list[float]] | None = None  # start-up (other ranks' tracker set-up, allocation)
        self.streak: tuple[int, int] = (-1, 0)  # (rank, windows in a row it was the straggler)
        self.flagged = [0] * ctx.world_size
        if not self.enabled:
            return
        self.cuda = ctx.device.type == "cuda"
        self.clock = _CudaClock() if self.cuda else _CpuClock()
        self.hosts = collectives.all_gather_objects(ctx, socket.gethostname())  # once, at start-up
        self.pending: list[tuple] = []  # (kind, begin mark, end mark) or (kind, ms) since the last reduce
        self.step_start = self.got_batch = self.last_grad = self.opt_start = None
        self.steps = 0
        self.utilization_readable = self.cuda
        # The shared-memory all-reduce (shm_allreduce.py) waits inside backward: its hook keeps its intervals.
        self.comm_hook_state = shm_allreduce.HOOKS.get(ddp_model)
        if not cfg.compile:  # compiled, the hook would be traced into the graph: the broadcast counts as compute
            model.register_forward_pre_hook(self._forward_starts)
        # Until the first optimizer step every parameter's gradient marks; then only the last one to arrive.
        self.grad_hooks = {p: p.register_post_accumulate_grad_hook(self._gradient_ready)
                           for p in model.parameters() if p.requires_grad}
        self.last_param = self.last_param_seen = None
        optimizer.register_step_pre_hook(self._optimizer_starts)
        optimizer.register_step_post_hook(self._optimizer_done)

    # ---------------------------------------------------------------- marks (hooks and the batch iterator)
    def batches(self, batches: Iterable) -> Iterator:
        if not self.enabled:
            yield from batches
            return
        iterator = iter(batches)
        while True:
            begin = self.clock.mark()
            if self.step_start is None:
                self.step_start = begin
            try:
                batch = next(iterator)
            except StopIteration:
                return
            self.got_batch = self.clock.mark()
            self.pending.append((_DATA, begin, self.got_batch))
            yield batch

    def _forward_starts(self, module, args) -> None:
        if self.got_batch is not None:  # a training forward (validation's have no batch mark)
            now = self.clock.mark()
            self.pending.append((_COMM, self.got_batch, now))  # DDP's buffer broadcast ran in between
            self.got_batch = None

    def _gradient_ready(self, param) -> None:
        if self.last_param is None or param is self.last_param:
            self.last_param_seen = param
            self.last_grad = self.clock.mark()

    def _optimizer_starts(self, optimizer, args, kwargs) -> None:
        now = self.clock.mark()
        if self.last_param is None and self.grad_hooks:  # the first step showed which gradient comes last
            self.last_param = self.last_param_seen
            for param, handle in self.grad_hooks.items():
                if param is not self.last_param:
                    handle.remove()
            self.grad_hooks = {}
        if self.last_grad is not None:
            self.pending.append((_COMM, self.last_grad, now))
        if self.comm_hook_state is not None:  # CPU only: the marks are perf_counter's
            # Hook time after the last gradient is already in the tail above.
            until = self.last_grad if self.last_grad is not None else now
            inside = sum(max(0.0, min(end, until) - begin) for begin, end in self.comm_hook_state.intervals)
            self.comm_hook_state.intervals.clear()
            self.pending.append((_COMM, inside * 1000.0))
        if self.step_start is not None:
            self.pending.append((_SPAN, self.step_start, now))
        self.opt_start, self.last_grad = now, None

    def _optimizer_done(self, optimizer, args, kwargs) -> None:
        if self.opt_start is not None:
            self.pending.append((_OPT, self.opt_start, self.clock.mark()))
            self.steps += 1
        self.step_start = self.opt_start = None

    # ---------------------------------------------------------------- the window, in the logging sync
    def _window_slot(self) -> list[float]:
        sums = [0.0] * 4
        if self.cuda and self.pending:
            self.pending[-1][-1].synchronize()  # the window's last mark; the loss is read right after anyway
        for kind, *marks in self.pending:
            sums[kind] += marks[0] if len(marks) == 1 else self.clock.ms(*marks)
        data, comm, opt, span = sums
        slot = [float(self.steps), data, max(0.0, span - data - comm), comm, opt, -1.0, -1.0]
        if self.cuda:
            import torch

            slot[5] = torch.cuda.max_memory_allocated(self.ctx.device) / 2**20
            slot[6] = self._utilization()
        self.pending, self.steps = [], 0
        return slot

    def _utilization(self) -> float:
        if self.utilization_readable:
            try:
                import torch

                return float(torch.cuda.utilization(self.ctx.device))
            except Exception:  # noqa: BLE001 (no NVML here: the number is left out, once and for all)
                self.utilization_readable = False
        return -1.0

    def reduce_loss(self, head) -> list[float]:
        """`head` (the loss, and any other per-rank values to sum: a 0-d or 1-d tensor) summed over ranks, with
        every rank's timing slot in the same all-reduce."""
        head = head.reshape(-1)
        if not self.enabled:
            return collectives.all_reduce_sum(self.ctx, head).tolist()
        import torch

        width, first = len(SLOT), len(head)
        packed = torch.zeros(first + width * self.ctx.world_size, dtype=head.dtype, device=head.device)
        packed[:first] = head
        begin = first + width * self.ctx.rank
        packed[begin:begin + width] = torch.tensor(self._window_slot(), dtype=head.dtype)
        values = collectives.all_reduce_sum(self.ctx, packed).tolist()
        self.window = [values[first + width * r:first + width * (r + 1)] for r in range(self.ctx.world_size)]
        return values[:first]

    def scalars(self) -> dict[str, float]:
        """The window's per-rank scalars (time/compute_ms/rank1, ...); logs the straggler on rank 0."""
        if not self.enabled or self.window is None:
            return {}
        window, self.window = self.window, None
        out: dict[str, float] = {}
        if self.first_window is None:
            self.first_window = window
        for rank, slot in enumerate(window):
            if window is not self.first_window:  # sums, but memory's peak and the latest utilization
                self.totals[rank] = [*(t + v for t, v in zip(self.totals[rank][:5], slot[:5])),
                                     max(self.totals[rank][5], slot[5]), slot[6]]
            if slot[0] <= 0:
                continue
            for i, name in enumerate(FIELDS, start=1):
                out[f"time/{name}/rank{rank}"] = slot[i] / slot[0]
            if slot[5] >= 0:
                out[f"gpu/max_memory_mb/rank{rank}"] = slot[5]
            if slot[6] >= 0:
                out[f"gpu/utilization_pct/rank{rank}"] = slot[6]
        found = straggler(per_rank_means(window), self.hosts)
        rank = found["rank"] if found else -1
        self.streak = (rank, self.streak[1] + 1 if rank == self.streak[0] else 1)
        if found and self.streak[1] >= STRAGGLER_WINDOWS:
            self.flagged[rank] += 1
            if self.ctx.is_main:
                log.warning("straggler: %s", describe(found))
        return out

    def summary(self) -> dict[str, Any]:
        """summary.json's per-rank table and the run's straggler (None: no rank stood out)."""
        if not self.enabled:
            return {}
        ranks = per_rank_means(self.totals if any(t[0] for t in self.totals) else self.first_window or self.totals)
        for row in ranks:
            row["host"] = self.hosts[row["rank"]]
            row["straggler_windows"] = self.flagged[row["rank"]]
        return {"ranks": ranks, "straggler": straggler(ranks, self.hosts)}


def per_rank_means(slots: list[list[float]]) -> list[dict[str, Any]]:
    rows = []
    for rank, slot in enumerate(slots):
        steps = slot[0]
        row: dict[str, Any] = {"rank": rank, "steps": int(steps)}
        row.update({name: round(slot[i] / steps, 3) if steps else None for i, name in enumerate(FIELDS, start=1)})
        if slot[5] >= 0:
            row["max_memory_mb"] = round(slot[5], 1)
        if slot[6] >= 0:
            row["utilization_pct"] = slot[6]
        rows.append(row)
    return rows


def straggler(ranks: list[dict[str, Any]], hosts: list[str]) -> dict[str, Any] | None:
    """The slowest rank, if its busy time exceeds the median of the other ranks' by more than
    STRAGGLER_THRESHOLD (the others': with two ranks, the median of both would halve the gap)."""
    timed = [r for r in ranks if r.get("steps")]
    if len(timed) < 2:
        return None
    busy = {r["rank"]: sum(r[f] for f in BUSY_FIELDS) for r in timed}
    slowest = max(busy, key=busy.get)
    others = [r for r in timed if r["rank"] != slowest]
    median = statistics.median(busy[r["rank"]] for r in others)
    if median <= 0 or busy[slowest] <= median * (1 + STRAGGLER_THRESHOLD):
        return None
    row = next(r for r in timed if r["rank"] == slowest)
    # The phase where it spends most more than the others do: what makes it slow.
    excess = {f: row[f] - statistics.median(r[f] for r in others) for f in BUSY_FIELDS}
    return {"rank": slowest, "host": hosts[slowest], "busy_ms": round(busy[slowest], 3),
            "median_busy_ms": round(median, 3), "slower_by": round(busy[slowest] / median - 1, 3),
            "phase": max(excess, key=excess.get)}


def describe(found: dict[str, Any]) -> str:
    phase = found["phase"].removesuffix("_ms").replace("_", " ")
    return (f"rank {found['rank']} on {found['host']} is {found['slower_by']:.0%} slower than the other ranks' "
            f"median ({found['busy_ms']:.1f} vs {found['median_busy_ms']:.1f} ms busy per step, mostly {phase}); "
            "the other ranks wait for it")
