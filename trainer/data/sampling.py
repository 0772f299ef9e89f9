"""Which samples each rank trains on, in which order, from any batch on: the one sampler of the project.

Both the built-in trainer (data.Batches) and hand-written loops (trainer.api) read this order, so a
resumed run of either sees exactly the batches the uninterrupted run would have seen: the epoch's
shard is torch's DistributedSampler(shuffle=True, seed, drop_last=True) after set_epoch(epoch), and
a resumed epoch is that shard sliced from the next unseen batch.

In-place recovery (trainer/engine/inplace.py) keeps the order of the job's largest world at every size: each
rank of that world is a *share* (its epoch_shard), and whoever is present trains the shares of whoever is not,
as extra micro-batches of the same size (`ResumableSampler.train_shares`). Every micro-batch is then the very
one the full world would train, whatever the membership, and a position is the same number at every size.
"""

from __future__ import annotations

from typing import Iterator, Sequence

import torch
from torch.utils.data import DistributedSampler, Sampler


def epoch_shard(size: int, rank: int, world_size: int, seed: int, epoch: int, reps: int = 1) -> list[int]:
    """This rank's sample indices of one epoch, in training order (every rank gets as many).

    reps > 1 (--ra-sampler, repeated augmentation, as the reference's RASampler): the epoch's shuffled order with
    each sample repeated reps times in a row, dealt out to the ranks in turn (so the copies of a sample land on
    different ranks), cut to the length of an epoch without repeats: size // world_size per rank, 1/reps of the
    distinct samples. The reference cuts to a multiple of 256 samples (ImageNet's batches); this stack's epochs
    end where DistributedSampler's drop_last ends them, whatever the repeats. The indices are *virtual*:
    copy * size + sample, so each copy has a key of its own (sample_of) and is augmented its own way."""
    if reps == 1:
        sampler = DistributedSampler(range(size), num_replicas=world_size, rank=rank, shuffle=True, seed=seed,
                                     drop_last=True)
        sampler.set_epoch(epoch)
        return list(sampler)
    generator = torch.Generator()
    generator.manual_seed(seed + epoch)  # DistributedSampler's shuffle: the same order of distinct samples
    order = torch.randperm(size, generator=generator).tolist()
    repeated = [copy * size + sample for sample in order for copy in range(reps)]
    return repeated[rank:size // world_size * world_size:world_size]


def sample_of(virtual: int, size: int, reps: int, epoch: int) -> tuple[int, int]:
    """(sample index, key epoch) of a virtual index of epoch_shard: the key epoch, which the sample's augmentation
    key (data.sample_key) takes, is epoch * reps + copy, so that each copy looks different; it is the epoch itself
    without repeats."""
    return virtual % size, epoch * reps + virtual // size


def shares_of(rank: int, world_size: int, largest: int) -> list[int]:
    """The shares of the largest world (its ranks) that `rank` trains at `world_size`: every world_size-th."""
    return list(range(rank, largest, world_size))


def batch_range(indices: list[int], batch_size: int, start_batch: int, stop_batch: int | None = None) -> list[int]:
    """The indices of batches [start_batch, stop_batch) of a shard."""
    stop = None if stop_batch is None else stop_batch * batch_size
    return indices[start_batch * batch_size:stop]


class ResumableSampler(Sampler[int]):
    """A DataLoader sampler: this rank's shard of each epoch, starting at a given batch (reps > 1: repeated
    augmentation, epoch_shard's order of the samples' indices).

    Give the DataLoader the same batch_size and drop_last=True. `set_epoch(epoch, start_batch)` before
    each epoch; a resumed epoch starts at the first batch its checkpoint had not trained on.
    Under in-place recovery `world_size` is the job's largest and `train_shares` says which of its shards this
    rank trains: each step, every share's micro-batches in turn (a batch number counts micro-batches of the
    largest world: a step of grad_accum of them whatever the membership).
    """

    def __init__(self, size: int, batch_size: int, rank: int = 0, world_size: int = 1, seed: int = 0, reps: int = 1):
        if size // world_size < batch_size:
            raise ValueError(f"{size} samples over {world_size} processes make no batch of {batch_size}")
        self.size, self.batch_size, self.rank, self.world_size, self.seed = size, batch_size, rank, world_size, seed
        self.reps = reps  # --ra-sampler's repeats (1: none); the DataLoader gets each copy's sample index
        self.epoch = self.start_batch = 0
        self.stop_batch: int | None = None
        self.shares: list[int] | None = None  # in-place recovery: the shards this rank trains
        self.accum = 1

    @property
    def batches_per_epoch(self) -> int:
        return (self.size // self.world_size) // self.batch_size

    def set_epoch(self, epoch: int, start_batch: int = 0, stop_batch: int | None = None) -> None:
        self.epoch, self.start_batch, self.stop_batch = epoch, start_batch, stop_batch

    def train_shares(self, shares: Sequence[int], accum: int) -> None:
        """In-place recovery: from now on yield, step by step (accum micro-batches of each share), the shards
        `shares` of the largest world, in that order."""
        self.shares, self.accum = list(shares), accum

    def _stop(self) -> int:
        return self.batches_per_epoch if self.stop_batch is None else min(self.stop_batch, self.batches_per_epoch)

    def __iter__(self) -> Iterator[int]:
        return iter(i % self.size for i in self.virtual())  # the DataLoader's dataset knows no copies

    def virtual(self) -> Iterator[int]:
        """The indices as epoch_shard gives them: with --ra-sampler virtual ones, each copy its own (sample_of)."""
        if self.shares is None:
            shard = epoch_shard(self.size, self.rank, self.world_size, self.seed, self.epoch, self.reps)
            return iter(batch_range(shard, self.batch_size, self.start_batch, self._stop()))
        return self._shared()

    def _shared(self) -> Iterator[int]:
        shards = {v: epoch_shard(self.size, v, self.world_size, self.seed, self.epoch, self.reps) for v in self.shares}
        stop = self._stop() - self._stop() % self.accum  # a last partial step is dropped, as steps() drops it
        for first in range(self.start_batch, stop, self.accum):
            for v in self.shares:
                yield from batch_range(shards[v], self.batch_size, first, first + self.accum)

    def __len__(self) -> int:
        steps = max(0, self._stop() - self.start_batch)
        if self.shares is None:
            return steps * self.batch_size
        return (steps // self.accum) * self.accum * len(self.shares) * self.batch_size
