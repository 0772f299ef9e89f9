"""What every image path shares: the per-sample random keys, the torchvision reference transforms, the image
folder keyed by (index, epoch), and what becomes of a file that is no image.

Every random choice of augmentation is a pure function of (seed, epoch, sample index), so a sample looks the
same whichever rank, world size or input path reads it.

A file that does not decode (truncated, not an image, unreadable) does not end the run: every path gives a black
image of the file's label in its place, the same every time (so a resumed run sees what the uninterrupted one
saw), and says which file in the sample's third item ("" for a good one). The training process names each such
file once (BadFiles) and counts them; --max-bad-files bounds an epoch's, over every rank (trainer.engine.run)."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Iterable, Iterator

import torch
from torch.utils.data import Dataset

from trainer.config import catalog
from trainer.config.catalog import DataSpec
from trainer.config.settings import augment_policy
from trainer.core.errors import EchoedUsageError, UsageError, first_line

log = logging.getLogger(__name__)


def sample_keys(indices: torch.Tensor, epoch: int, seed: int) -> torch.Tensor:
    """A well-mixed 31-bit integer per (seed, epoch, index): the only source of augmentation randomness."""
    x = (indices.long() * 0x9E3779B1 + epoch * 0x85EBCA77 + seed * 0xC2B2AE3D) & 0xFFFFFFFF
    for _ in range(2):
        x = (((x >> 16) ^ x) * 0x45D9F3B) & 0xFFFFFFFF
    return ((x >> 16) ^ x) & 0x7FFFFFFF


def sample_key(index: int, epoch: int, seed: int) -> int:
    """sample_keys for one sample, in plain Python (a DataLoader worker's per-sample cost)."""
    x = (index * 0x9E3779B1 + epoch * 0x85EBCA77 + seed * 0xC2B2AE3D) & 0xFFFFFFFF
    for _ in range(2):
        x = (((x >> 16) ^ x) * 0x45D9F3B) & 0xFFFFFFFF
    return ((x >> 16) ^ x) & 0x7FFFFFFF


def builtin_spec(name: str, image_size: int, num_classes: int | None = None) -> DataSpec:
    entry = catalog.DATASETS[name]
    return DataSpec(entry.channels, image_size, num_classes or entry.num_classes, entry.mean, entry.std,
                    augment_on_device=entry.crop_flip)


def synthetic_spec(image_size: int) -> DataSpec:
    return builtin_spec("synthetic", image_size)


class UnreadableImage(Exception):
    """A file in the image folder that cannot be decoded. From a DataLoader worker it comes back with the
    worker's traceback as its message, whose last line is the original one."""

    def __init__(self, message: str, path: str = "", reason: str = ""):
        super().__init__(message)
        self.path, self.reason = path, reason

    @classmethod
    def of(cls, path: str, reason: str) -> "UnreadableImage":
        return cls(f"{path} ({reason})", path, reason)

    @property
    def what(self) -> str:
        return str(self).strip().splitlines()[-1].split(f"{type(self).__name__}: ", 1)[-1]

    @property
    def entry(self) -> str:
        """The sample's third item: the file and why, for the training process to name and count."""
        return f"{self.path}\0{self.reason}"


def replacement(side: int) -> torch.Tensor:
    """What a file that does not decode shows: a black image (uint8 3 x side x side), the same every time."""
    return torch.zeros(3, side, side, dtype=torch.uint8)


# Files the training process itself failed to decode (the GPU path's CPU decode of a file nvJPEG refused, on its
# decoding thread): the batches' reader takes them with the batch's own (Batches).
UNDECODED_HERE: list[str] = []


def take_undecoded() -> list[str]:
    """UNDECODED_HERE's entries, taken out (one added meanwhile by the decoding thread stays for the next call)."""
    taken = UNDECODED_HERE[:]
    del UNDECODED_HERE[:len(taken)]
    return taken


class BadFiles:
    """The files of one split that did not decode, as this rank's batches named them: one warning per file, the
    count of this epoch (what --max-bad-files bounds, summed over the ranks at each log step), and the files."""

    def __init__(self, bound: int | None):
        self.bound = bound  # files an epoch may skip over every rank; None: no bound (validation)
        self.named: dict[str, str] = {}  # path -> why, on this rank
        self.this_epoch = 0

    def start_epoch(self) -> None:
        self.this_epoch = 0

    def note(self, entries: Iterable[str]) -> None:
        for entry in entries:
            if not entry:
                continue
            self.this_epoch += 1
            path, _, why = entry.partition("\0")
            if path not in self.named:
                self.named[path] = why
                log.warning("%s does not decode (%s): skipped, a black image of its label in its place (the same "
                            "every epoch; --max-bad-files bounds how many an epoch may skip)", path, why)

    def too_many(self, count: int, is_main: bool) -> UsageError:
        """The one line of the run's stop, on every rank (the first of each host prints it)."""
        error = UsageError if is_main else EchoedUsageError
        return error("--max-bad-files", f"{count} image files of this epoch do not decode, more than the "
                     f"{self.bound} it allows", "repair or remove them (trainer-doctor --data DIR lists them all), "
                     "or raise --max-bad-files")


@contextlib.contextmanager
def seeded(index: int, epoch: int, seed: int) -> Iterator[None]:
    """torch's CPU generator seeded from (seed, epoch, index) for one sample's random transforms, restored
    afterwards (with --num-workers 0 it is the training process's; the CUDA generators are not touched)."""
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(int(sample_keys(torch.tensor([index]), epoch, seed)))
        yield


def image_transforms(train: bool, image_size: int, augment: str, resize: int = 0, interpolation: str = "bilinear"):
    """The torchvision transforms of an image folder, PIL image -> uint8 tensor; resize: the validation images'
    shorter side before the centre crop (0: 8/7 of the side for the imagenet policy, the side for the others)."""
    from torchvision import transforms

    mode = transforms.InterpolationMode(interpolation)
    augment = augment_policy(augment, image_size)
    if augment == "imagenet":
        steps = [transforms.RandomResizedCrop(image_size, interpolation=mode), transforms.RandomHorizontalFlip()] \
            if train else [transforms.Resize(resize or int(image_size * 8 / 7), interpolation=mode),
                           transforms.CenterCrop(image_size)]
    else:  # light and none keep the whole image, resized to the side
        steps = [transforms.Resize(resize if resize and not train else image_size, interpolation=mode),
                 transforms.CenterCrop(image_size)]
        if train and augment == "light":  # the CIFAR recipe: padding of 1/8 of the side (4 at 32 px)
            steps += [transforms.RandomCrop(image_size, padding=max(1, image_size // 8)),
                      transforms.RandomHorizontalFlip()]
    return transforms.Compose(steps + [transforms.PILToTensor()])


class ImageFolderWithKeys(Dataset):
    """ImageFolder whose random transforms are seeded per (seed, epoch, index). resize and interpolation: see
    image_transforms; samples: --auto-augment and --random-erase (augment.SampleAugment), applied to the training
    views in the loader's workers."""

    augments_samples = True  # applies `samples` itself (jpeg.GpuImageFolder leaves it to the device)

    def __init__(self, root: Path, train: bool, image_size: int, augment: str, seed: int, *, resize: int = 0,
                 interpolation: str = "bilinear", samples=None):
        from torchvision import datasets

        try:
            self.folder = datasets.ImageFolder(str(root))
        except OSError as err:  # no class folders, no images in them, or unreadable
            raise UsageError("--data-dir", f"{root}: {first_line(err, 200)}",
                             f"put images in {root}/<class>/ (.jpg, .png, ...) readable by this user") from None
        self.seed, self.train, self.side, self.augment = seed, train, image_size, augment
        self.resize, self.interpolation = resize, interpolation
        self.samples = samples if train else None
        self.transform = image_transforms(train, image_size, augment, resize, interpolation)

    def augmented(self, view: torch.Tensor, index: int, epoch: int) -> torch.Tensor:
        """The training view after --auto-augment and --random-erase, drawn from the sample's key."""
        return view if self.samples is None else self.samples(view, sample_key(index, epoch, self.seed))

    def __len__(self) -> int:
        return len(self.folder)

    def __getitem__(self, key: tuple[int, int]):
        index, epoch = key
        path, label = self.folder.samples[index]
        try:
            image = self.folder.loader(path)
        except OSError as err:  # a stray non-image file, a truncated copy, a file of another uid
            from PIL import UnidentifiedImageError

            reason = "not an image PIL can decode" if isinstance(err, UnidentifiedImageError) else first_line(err)
            return replacement(self.side), label, UnreadableImage.of(path, reason).entry
        with seeded(index, epoch, self.seed):
            view = self.transform(image)
        return self.augmented(view, index, epoch), label, ""
