"""A dataset and a model factory for `--dataset startup:data --model startup:model` that can hold the worker
at a known point of its start-up, before the training loop exists: with STARTUP_HOLD=data (or model) the
factory creates <that>.started in the working directory, then sleeps, and the test's Ctrl-C lands there."""

import os
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset


def _hold(where: str) -> None:
    if os.environ.get("STARTUP_HOLD") == where:
        Path(f"{where}.started").touch()
        time.sleep(600)  # the test interrupts it long before


def data(cfg):
    _hold("data")
    x = torch.randn(64, 2, 8, 8, generator=torch.Generator().manual_seed(cfg.seed))
    return TensorDataset(x, (x.mean(dim=(1, 2, 3)) > 0).long()), None, {"channels": 2, "image_size": 8,
                                                                        "num_classes": 2}


def model(spec):
    _hold("model")
    return nn.Sequential(nn.Flatten(), nn.Linear(spec.channels * spec.image_size ** 2, spec.num_classes))
