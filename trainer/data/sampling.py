"""Which samples each rank trains on, in which order, from any batch on: the one sampler of the project.

Both the built-in trainer (data.Batches) and hand-written loops (trainer.api) read this order, so a
resumed run of either sees exactly the batches the uninterrupted run would have seen: the epoch's
shard is torch's DistributedSampler(shuffle=True, seed, drop_last=True) after set_epoch(epoch), and
a resumed epoch is that shard sliced from the next unseen batch.
"""

from __future__ import annotations

from typing import Iterator

from torch.utils.data import DistributedSampler, Sampler


def epoch_shard(size: int, rank: int, world_size: int, seed: int, epoch: int) -> list[int]:
    """This rank's sample indices of one epoch, in training order (every rank gets as many)."""
    sampler = DistributedSampler(range(size), num_replicas=world_size, rank=rank, shuffle=True, seed=seed,
                                 drop_last=True)
    sampler.set_epoch(epoch)
    return list(sampler)


def batch_range(indices: list[int], batch_size: int, start_batch: int, stop_batch: int | None = None) -> list[int]:
    """The indices of batches [start_batch, stop_batch) of a shard."""
    stop = None if stop_batch is None else stop_batch * batch_size
    return indices[start_batch * batch_size:stop]


class ResumableSampler(Sampler[int]):
    """A DataLoader sampler: this rank's shard of each epoch, starting at a given batch.

    Give the DataLoader the same batch_size and drop_last=True. `set_epoch(epoch, start_batch)` before
    each epoch; a resumed epoch starts at the first batch its checkpoint had not trained on.
    """

    def __init__(self, size: int, batch_size: int, rank: int = 0, world_size: int = 1, seed: int = 0):
        if size // world_size < batch_size:
            raise ValueError(f"{size} samples over {world_size} processes make no batch of {batch_size}")
        self.size, self.batch_size, self.rank, self.world_size, self.seed = size, batch_size, rank, world_size, seed
        self.epoch = self.start_batch = 0

    @property
    def batches_per_epoch(self) -> int:
        return (self.size // self.world_size) // self.batch_size

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        self.epoch, self.start_batch = epoch, start_batch

    def __iter__(self) -> Iterator[int]:
        shard = epoch_shard(self.size, self.rank, self.world_size, self.seed, self.epoch)
        return iter(batch_range(shard, self.batch_size, self.start_batch, self.batches_per_epoch))

    def __len__(self) -> int:
        return (self.batches_per_epoch - self.start_batch) * self.batch_size
