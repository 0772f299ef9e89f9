"""CIFAR-shaped random data for `--dataset straggler:build` whose samples come slowly on one rank: a
straggler made from outside the trainer, as a slow disk or a costly transform on one host makes one.
STRAGGLER="RANK:SECONDS" makes every batch of that rank (read in the training process, --num-workers 0)
take SECONDS longer; each of its samples sleeps its share."""

import os
import time

import torch
from torch.utils.data import Dataset


class Images(Dataset):
    def __init__(self, size: int, seed: int, sleep_s: float):
        gen = torch.Generator().manual_seed(seed)
        self.x = torch.randn(size, 3, 32, 32, generator=gen)
        self.y = torch.randint(0, 10, (size,), generator=gen)
        self.sleep_s = sleep_s

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        if self.sleep_s:
            time.sleep(self.sleep_s)
        return self.x[i], self.y[i]


def build(cfg):
    rank, _, seconds = os.environ.get("STRAGGLER", "").partition(":")
    slow = rank != "" and int(rank) == int(os.environ.get("RANK", "0"))
    per_sample = float(seconds) / cfg.batch_size if slow else 0.0
    return (Images(cfg.synthetic_size, cfg.seed, per_sample), None,
            {"channels": 3, "image_size": 32, "num_classes": 10})
