"""Which samples each rank trains on, in which order, from any batch on: the one sampler of the project.

Both the built-in trainer (data.Batches) and hand-written loops (trainer.api) read this order, so a
resumed run of either sees exactly the batches the uninterrupted run would have seen: the epoch's
shard is torch's DistributedSampler(shuffle=True, seed, drop_last=True) after set_epoch(epoch), and
a resumed epoch is that shard sliced from the next unseen batch.
"""

from __future__ import annotations

from typing import Iterator

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


def batch_range(indices: list[int], batch_size: int, start_batch: int, stop_batch: int | None = None) -> list[int]:
    """The indices of batches [start_batch, stop_batch) of a shard."""
    stop = None if stop_batch is None else stop_batch * batch_size
    return indices[start_batch * batch_size:stop]


class ResumableSampler(Sampler[int]):
    """A DataLoader sampler: this rank's shard of each epoch, starting at a given batch (reps > 1: repeated
    augmentation, epoch_shard's order of the samples' indices).

    Give the DataLoader the same batch_size and drop_last=True. `set_epoch(epoch, start_batch)` before
    each epoch; a resumed epoch starts at the first batch its checkpoint had not trained on.
    """

    def __init__(self, size: int, batch_size: int, rank: int = 0, world_size: int = 1, seed: int = 0, reps: int = 1):
        if size // world_size < batch_size:
            raise ValueError(f"{size} samples over {world_size} processes make no batch of {batch_size}")
        self.size, self.batch_size, self.rank, self.world_size, self.seed = size, batch_size, rank, world_size, seed
        self.reps = reps  # --ra-sampler's repeats (1: none); the DataLoader gets each copy's sample index
        self.epoch = self.start_batch = 0

    @property
    def batches_per_epoch(self) -> int:
        return (self.size // self.world_size) // self.batch_size

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        self.epoch, self.start_batch = epoch, start_batch

    def __iter__(self) -> Iterator[int]:
        shard = epoch_shard(self.size, self.rank, self.world_size, self.seed, self.epoch, self.reps)
        return iter(i % self.size for i in batch_range(shard, self.batch_size, self.start_batch,
                                                       self.batches_per_epoch))

    def __len__(self) -> int:
        return (self.batches_per_epoch - self.start_batch) * self.batch_size
