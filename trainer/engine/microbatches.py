"""One optimizer step's micro-batches as run.steps() yields them (the restart path's loop and in-place recovery's)."""

from __future__ import annotations

from typing import Callable, Iterator


class Counted:
    """One optimizer step's micro-batches: the first (already fetched) and up to accum - 1 more from `source`, each
    inside the strategy's no-sync context but the last; counts the micro-batches and this rank's samples."""

    def __init__(self, first, source: Iterator, accum: int, no_sync: Callable):
        self.first, self.source, self.accum, self.no_sync = first, source, accum, no_sync
        self.micro = self.samples = 0

    def __iter__(self):
        batch = self.first
        for index in range(self.accum):
            if index:
                batch = next(self.source, None)
                if batch is None:
                    return
            self.micro += 1
            self.samples += batch_len(batch)
            with self.no_sync(index == self.accum - 1):
                yield batch


def batch_len(batch) -> int:
    first = batch[0] if isinstance(batch, (tuple, list)) and batch else batch
    return len(first) if hasattr(first, "__len__") else 0
