r"""An MNIST auto-encoder (the Tampere tutorial's MLP) brought to the built-in training loop.

Two factories, no loop of your own: the trainer does DDP, checkpoints, exact resume, validation and
TensorBoard. From this folder, with MNIST's IDX files (as torchvision downloads them, .gz or not) in
a folder:

    trainer-launch --model mnist_ae:build_model --dataset mnist_ae:build_data --data-dir /path/to/mnist \
        --optimizer adamw --lr 1e-3 --weight-decay 0 --epochs 5 --batch-size 128

The model brings its own loss (`compute_loss`: reconstruct the input), so the labels are only
carried along. Without the 60,000 training digits (train-images-idx3-ubyte), the 10,000 test digits
are split 9:1 into training and validation.
"""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset

from trainer import DataSpec

MNIST = DataSpec(channels=1, image_size=28, num_classes=10, mean=(0.1307,), std=(0.3081,))


def _idx(path: Path) -> torch.Tensor:
    """An IDX file (MNIST's format): a magic number, the dimensions, then uint8 data."""
    opened = gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")
    with opened as f:
        data = f.read()
    dims = data[3]
    shape = struct.unpack(f">{dims}I", data[4:4 + 4 * dims])
    return torch.frombuffer(bytearray(data[4 + 4 * dims:]), dtype=torch.uint8).view(*shape)


def _split(root: Path, prefix: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    for suffix in ("", ".gz"):
        images, labels = root / f"{prefix}-images-idx3-ubyte{suffix}", root / f"{prefix}-labels-idx1-ubyte{suffix}"
        if images.is_file() and labels.is_file():
            return _idx(images).unsqueeze(1), _idx(labels).long()
    return None


def build_data(cfg):
    """(train, val, spec) from the IDX files in --data-dir: uint8 images, which the trainer normalises."""
    root = Path(cfg.data_dir)
    test = _split(root, "t10k")
    if test is None:
        raise FileNotFoundError(f"no t10k-images-idx3-ubyte(.gz) in {root}")
    train = _split(root, "train")
    if train is None:  # only the test digits: 9,000 to train on, 1,000 to validate with
        images, labels = test
        cut = len(labels) * 9 // 10
        train, test = (images[:cut], labels[:cut]), (images[cut:], labels[cut:])
    return TensorDataset(*train), TensorDataset(*test), MNIST


class AutoEncoder(nn.Module):
    def __init__(self, spec: DataSpec, code: int = 32):
        super().__init__()
        pixels = spec.channels * spec.image_size * spec.image_size
        self.shape = (spec.channels, spec.image_size, spec.image_size)
        self.encoder = nn.Sequential(nn.Flatten(), nn.Linear(pixels, 128), nn.ReLU(), nn.Linear(128, code))
        self.decoder = nn.Sequential(nn.ReLU(), nn.Linear(code, 128), nn.ReLU(), nn.Linear(128, pixels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.encoder(x)).view(-1, *self.shape)

    def compute_loss(self, output: torch.Tensor, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Per-sample mean squared reconstruction error (the trainer averages it, or sums it to validate)."""
        return (output.float() - inputs.float()).pow(2).flatten(1).mean(1)


def build_model(spec: DataSpec) -> nn.Module:
    return AutoEncoder(spec)
