"""What the three stacks share: the workload, its data, the timing window and the result file.

Each stack is one script started by torchrun; rank 0 writes one JSON result for the runner.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

from trainer.cli.scale import STEPS_HELP, check_timed_steps
from trainer.core.errors import OneLineErrorParser, exit_on_usage_error
from trainer.data.datasets import make_synthetic
from trainer.data.images import synthetic_spec
from trainer.engine.models import build_model as _build_model
from trainer.observe.metrics import WARMUP_STEPS_EXCLUDED

UNTIMED_STEPS = WARMUP_STEPS_EXCLUDED  # every stack leaves the trainer's number of first steps out of the timing


def parse_args(description: str) -> argparse.Namespace:
    parser = OneLineErrorParser(description=description)
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--batch-size", type=int, default=64, help="samples per process per step")
    parser.add_argument("--steps", type=int, default=40, help=STEPS_HELP)
    parser.add_argument("--image-size", type=int, default=32, help="synthetic image side in pixels")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--result", required=True, help="JSON file rank 0 writes")
    with exit_on_usage_error():
        args = parser.parse_args()
        check_timed_steps(args.steps)  # StepTimer needs a step after the untimed ones
    return args


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def synthetic_dataset(args: argparse.Namespace) -> TensorDataset:
    """The trainer's synthetic images, normalised to float up front: enough for every step on every rank."""
    train, _ = make_synthetic(args.steps * args.batch_size * world_size(), seed=0, image_size=args.image_size)
    spec = synthetic_spec(args.image_size)
    mean = torch.tensor(spec.mean).view(1, -1, 1, 1)
    std = torch.tensor(spec.std).view(1, -1, 1, 1)
    return TensorDataset((train.images.float() / 255 - mean) / std, train.labels)


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    return _build_model(args.model, synthetic_spec(args.image_size))


class StepTimer:
    """Steady-state samples/s over all processes: the clock starts when step UNTIMED_STEPS ends."""

    def __init__(self, batch_size: int, total_steps: int, device: torch.device):
        self.samples_per_step = batch_size * world_size()
        self.total_steps, self.device = total_steps, device
        self.steps = 0
        self.start = self.end = 0.0

    def step(self) -> None:
        self.steps += 1
        if self.steps not in (UNTIMED_STEPS, self.total_steps):
            return
        if self.device.type == "cuda":  # only at the window's edges: a sync per step would slow the GPU
            torch.cuda.synchronize(self.device)
        self.end = time.perf_counter()
        if self.steps == UNTIMED_STEPS:
            self.start = self.end

    def samples_per_second(self) -> float:
        return (self.steps - UNTIMED_STEPS) * self.samples_per_step / (self.end - self.start)


def write_result(path: str, stack: str, args: argparse.Namespace, timer: StepTimer, device: torch.device) -> None:
    if int(os.environ.get("RANK", "0")) != 0:
        return
    result = {"stack": stack, "world_size": world_size(), "model": args.model, "batch_size": args.batch_size,
              "steps": timer.steps, "device": device.type, "samples_per_second": timer.samples_per_second()}
    Path(path).write_text(json.dumps(result) + "\n")


def imagenet_like_folder(root: Path, images: int, classes: int = 10, size: tuple[int, int] = (500, 375),
                         val_fraction: float = 0.2, seed: int = 0, workers: int = 1) -> Path:
    """root/train/<class>/*.jpg and root/val/<class>/*.jpg shaped like ImageNet's files: 500x375 photos of
    about 80 KiB (quality 90; smooth structure at four scales plus sensor-like noise, which JPEG compresses
    as it does photos). Each class has its own colour cast, so a model can learn the labels."""
    from multiprocessing import get_context

    val_images = max(classes, int(images * val_fraction))
    jobs = [(root, split, i, classes, size, seed) for split, count in (("train", images), ("val", val_images))
            for i in range(count)]
    for split in ("train", "val"):
        for label in range(classes):
            (root / split / f"class{label:02d}").mkdir(parents=True, exist_ok=True)
    if workers > 1:
        with get_context("fork").Pool(workers) as pool:
            pool.map(_write_photo, jobs, chunksize=16)
    else:
        for job in jobs:
            _write_photo(job)
    return root


def _write_photo(job: tuple) -> None:
    import numpy as np
    from PIL import Image

    root, split, i, classes, size, seed = job
    label = i % classes
    casts = np.random.default_rng(seed).normal(0, 25, (classes, 3))
    rng = np.random.default_rng((seed, split == "val", i))
    width, height = size
    pixels = casts[label] + rng.normal(0, 6, (height, width, 3))
    for cells, amplitude in ((4, 90), (16, 50), (64, 30), (250, 18)):
        coarse = rng.normal(0, amplitude, (max(2, cells * height // width), cells, 3)).astype(np.float32)
        pixels += np.stack([np.asarray(Image.fromarray(coarse[..., c]).resize(size, Image.BICUBIC))
                            for c in range(3)], axis=-1)
    image = Image.fromarray(np.clip(pixels + 128, 0, 255).astype(np.uint8))
    image.save(root / split / f"class{label:02d}" / f"{split}{i:06d}.jpg", quality=90)
