"""Datasets, per-rank sharding and the two input paths.

Every random choice of augmentation is a pure function of (seed, epoch, sample index). So a sample
looks the same whichever rank, world size or input path reads it, and a resumed run sees exactly
the batches the uninterrupted run would have seen.

Input paths:
- memory: datasets that fit in memory (synthetic, CIFAR-10, MNIST) are one uint8 tensor, on the GPU
  when there is one; a batch is one indexing op plus batched crop/flip, with no per-sample Python.
- dataloader: worker processes decode and collate per sample (ImageFolder, users' datasets, or on request).
"""

from __future__ import annotations

import collections
import logging
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler

from trainer.config import catalog
from trainer.config.catalog import DataSpec
from trainer.config.settings import TrainConfig, augment_policy, bad_file_bound, crop_sizes
from trainer.core.errors import EchoedUsageError, UsageError, first_line
from trainer.data.augment import sample_augment
from trainer.data.images import (BadFiles, ImageFolderWithKeys, UnreadableImage, builtin_spec, sample_key, sample_keys,
                                 seeded, take_undecoded)
from trainer.data.sampling import ResumableSampler, batch_range, sample_of
from trainer.parallel.collectives import local_main_first
from trainer.parallel.compat import private
from trainer.parallel.context import DistContext
from trainer.parallel.supervised import GracefulStop

log = logging.getLogger(__name__)

CROP_PADDING = 4
SYNTHETIC_CLASSES = catalog.DATASETS["synthetic"].num_classes
DOWNLOAD_STALL_TIMEOUT_S = 20  # seconds without a byte before a dataset download counts as failed


@dataclass
class InMemoryImages:
    images: torch.Tensor  # uint8, N x C x H x W
    labels: torch.Tensor  # int64, N

    def __len__(self) -> int:
        return len(self.labels)


# ---------------------------------------------------------------------------------------- datasets


def make_synthetic(size: int, seed: int, image_size: int = 32) -> tuple[InMemoryImages, InMemoryImages]:
    """Learnable images: each class is a smooth colour pattern, each sample a noisy, shifted copy."""
    gen = torch.Generator().manual_seed(seed)
    prototypes = torch.nn.functional.interpolate(
        torch.randn(SYNTHETIC_CLASSES, 3, 4, 4, generator=gen), size=(image_size, image_size),
        mode="bilinear", align_corners=False)

    def draw(n: int) -> InMemoryImages:
        labels = torch.randint(0, SYNTHETIC_CLASSES, (n,), generator=gen)
        images = torch.empty(n, 3, image_size, image_size, dtype=torch.uint8)
        rows = max(1, 2**24 // prototypes[0].numel())  # float scratch bounded (64 MB) at ImageNet sizes
        for begin in range(0, n, rows):
            chunk = labels[begin:begin + rows]
            noise = torch.randn(len(chunk), 3, image_size, image_size, generator=gen)
            images[begin:begin + rows] = (128 + 48 * prototypes[chunk] + 40 * noise).clamp_(0, 255)
        return InMemoryImages(images, labels)

    return draw(size), draw(max(1, size // 5))


def cifar10_class():
    """torchvision's CIFAR10, trusting the files that are there. Files rebuilt or re-packed on a cluster store
    rarely keep the published checksums; the loader itself validates shapes. The trust overrides two private
    methods of torchvision's class: where they are gone (or with TRAINER_PUBLIC_TORCH_ONLY=1), the public class,
    which checks the published checksums."""
    from torchvision import datasets

    hooks = private("torchvision CIFAR10._check_integrity and _load_meta",
                    lambda: (datasets.CIFAR10._check_integrity, datasets.CIFAR10._load_meta))
    if hooks is None:
        return datasets.CIFAR10

    class CIFAR10(datasets.CIFAR10):
        def _check_integrity(self) -> bool:
            root = Path(self.root) / self.base_folder
            return all((root / name).is_file() for name, _ in self.train_list + self.test_list)

        def _load_meta(self) -> None:  # the same trust for batches.meta (torchvision checks its md5)
            import pickle

            with open(Path(self.root) / self.base_folder / self.meta["filename"], "rb") as f:
                self.classes = pickle.load(f, encoding="latin1")[self.meta["key"]]
            self.class_to_idx = {name: i for i, name in enumerate(self.classes)}

    return CIFAR10


def _torchvision_dataset(cfg: TrainConfig, ctx: DistContext):
    from torchvision import datasets

    cls = {"cifar10": cifar10_class, "mnist": lambda: datasets.MNIST}[cfg.dataset]()
    failure = None
    with local_main_first(ctx):  # one download per node, the other processes wait for it
        if ctx.is_local_main:
            # torchvision opens URLs without a timeout: behind a firewall that drops packets the
            # download would wait forever (and the other ranks with it) instead of failing.
            previous_timeout = socket.getdefaulttimeout()
            socket.setdefaulttimeout(DOWNLOAD_STALL_TIMEOUT_S)
            created = not Path(cfg.data_dir).exists()
            try:
                cls(cfg.data_dir, train=True, download=True)
                cls(cfg.data_dir, train=False, download=True)
            except Exception as err:  # noqa: BLE001 (network, permissions, read-only mount: all mean the same to the user)
                failure = err
                if created:  # a mistyped --data-dir leaves no empty folders behind
                    shutil.rmtree(cfg.data_dir, ignore_errors=True)
            finally:
                socket.setdefaulttimeout(previous_timeout)
    try:
        train, val = cls(cfg.data_dir, train=True), cls(cfg.data_dir, train=False)
    except Exception as err:  # noqa: BLE001
        reason = failure or err
        # The node's first process tried the download and says why it failed; the others would only
        # repeat torchvision's "not found" (with its advice to pass download=True).
        error = UsageError if ctx.is_local_main else EchoedUsageError
        raise error("--data-dir", f"{cfg.dataset} could not be read from '{cfg.data_dir}' nor downloaded "
                    f"({type(reason).__name__}: {first_line(reason, 120)})",
                    "mount the dataset files at the data directory, or use --dataset synthetic") from None

    def to_memory(ds) -> InMemoryImages:
        images = torch.as_tensor(ds.data)
        images = images.unsqueeze(1) if images.ndim == 3 else images.permute(0, 3, 1, 2)
        return InMemoryImages(images.contiguous(), torch.as_tensor(ds.targets, dtype=torch.long))

    return to_memory(train), to_memory(val)


class _UserDataset(Dataset):
    """A user's map-style dataset, keyed like the built-in ones: its random transforms (torch's RNG) are
    seeded per (seed, epoch, index), so a resumed run sees the very samples the uninterrupted one would."""

    def __init__(self, dataset: Dataset, seed: int):
        self.dataset, self.seed = dataset, seed

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]):
        index, epoch = key
        with seeded(index, epoch, self.seed):
            return self.dataset[index]


class _MemoryAsDataset(Dataset):
    """In-memory images served sample by sample (the DataLoader path on request, and its benchmark)."""

    def __init__(self, data: InMemoryImages):
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, key: tuple[int, int]):
        index, _epoch = key
        return self.data.images[index], self.data.labels[index]


def build_datasets(cfg: TrainConfig, ctx: DistContext):
    """(train, val, spec); train and val are InMemoryImages or map-style datasets (val may be None)."""
    if catalog.is_import_path(cfg.dataset):
        return user_datasets(cfg)
    train_crop, _, val_crop = crop_sizes(cfg)  # in memory: the images' side, or a smaller crop (Batches)
    if cfg.dataset == "synthetic":
        train, val = make_synthetic(cfg.synthetic_size, cfg.seed, cfg.synthetic_image_size)
        return train, val, builtin_spec("synthetic", train_crop)
    if cfg.dataset in ("cifar10", "mnist"):
        train, val = _torchvision_dataset(cfg, ctx)
        return train, val, builtin_spec(cfg.dataset, train_crop)
    if cfg.dataset == "packed":
        from trainer.data.pack import packed_datasets

        return packed_datasets(cfg)
    root = Path(cfg.data_dir)
    folder = image_folder_class(cfg, ctx)
    entry = catalog.DATASETS["imagefolder"]
    train = folder(root / "train", True, train_crop, cfg.augment, cfg.seed, interpolation=cfg.interpolation,
                   samples=sample_augment(cfg, entry.mean, entry.channels))
    val = folder(root / "val", False, val_crop, cfg.augment, cfg.seed, resize=cfg.val_resize_size,
                 interpolation=cfg.interpolation) if (root / "val").is_dir() else None
    for split in (train, val):
        if isinstance(split, jpeg_module().GpuImageFolder):
            split.gpu_share = cfg.decode_gpu_share
    if val is None:
        log.warning("no val/ folder under %s: validation is skipped", root)
    elif val.folder.classes != train.folder.classes:  # labels are class indices: any difference mislabels val
        differ = sorted(set(val.folder.classes) ^ set(train.folder.classes))
        raise UsageError("--data-dir", f"train/ and val/ under {root} have different class folders "
                         f"({', '.join(differ[:5])}{' ...' if len(differ) > 5 else ''} in only one of them)",
                         "give val/ the same class folders as train/")
    return train, val, builtin_spec("imagefolder", train_crop, len(train.folder.classes))


def jpeg_module():
    from trainer.data import jpeg

    return jpeg


def image_folder_class(cfg: TrainConfig, ctx: DistContext):
    """The image folder's reader for --decode (trainer/data/jpeg.py): auto is the fast CPU path. The GPU path
    (nvJPEG) is opt-in: no GPU has run it yet, and a path no GPU has run is never a default
    (docs/benchmarks.md, "GPU (--decode gpu): not measured yet")."""
    from trainer.data import jpeg

    light = augment_policy(cfg.augment, crop_sizes(cfg)[0]) == "light"  # the training crops' policy
    decode = cfg.decode
    if decode == "auto":
        decode = "cpu"
    if decode == "gpu" and ctx.device.type != "cuda":
        raise UsageError("--decode", f"gpu, but this process trains on {ctx.device}",
                         "use --decode auto or cpu without a GPU")
    if decode == "gpu" and light:
        raise UsageError("--decode", "gpu does the imagenet policy's crops; the light policy's padded crops are "
                         "made on the CPU", "use --decode cpu, or --augment imagenet")
    return {"pil": ImageFolderWithKeys, "cpu": jpeg.FastImageFolder, "gpu": jpeg.GpuImageFolder}[decode]


def user_datasets(cfg: TrainConfig):
    """The user's dataset factory's (train, val, spec), checked where a mistake would otherwise surface
    steps later, or on one rank only, as a shape error deep inside the model."""
    path, setting = cfg.dataset, "--dataset"
    result = catalog.call_factory(path, setting, cfg)
    if not isinstance(result, (tuple, list)) or len(result) != 3:
        raise UsageError(setting, f"{path} returned {type(result).__name__}"
                         f"{f' of {len(result)} items' if isinstance(result, (tuple, list)) else ''}, "
                         "not (train, val, spec)", "return train and validation datasets (val may be None) and "
                         "a trainer.DataSpec")
    train, val, spec = result[0], result[1], catalog.data_spec(result[2], path, setting)
    for split, data in (("training", train), ("validation", val)):
        if data is None and split == "validation":
            continue
        if isinstance(data, IterableDataset):
            raise UsageError(setting, f"{path} returned an IterableDataset as its {split} data; the trainer shards "
                             "map-style datasets by index, which is what makes resume exact",
                             "return a Dataset with __len__ and __getitem__, or write your own loop "
                             "(trainer-launch your_script.py)")
        if not (hasattr(data, "__len__") and hasattr(data, "__getitem__")):
            raise UsageError(setting, f"{path} returned a {type(data).__name__} as its {split} data, not a "
                             "map-style dataset", "return a torch.utils.data.Dataset (__len__ and __getitem__)")
        if len(data) == 0:
            raise UsageError(setting, f"{path} returned an empty {split} dataset", "give it samples")
        _check_sample(data, spec, path, split)
    _check_recipe_fits(cfg, train, spec, path)
    if val is None:
        log.warning("%s returned no validation data: validation is skipped", path)
    return (_UserDataset(train, cfg.seed), _UserDataset(val, cfg.seed) if val is not None else None, spec)


def _check_recipe_fits(cfg: TrainConfig, train, spec: DataSpec, path: str) -> None:
    """The recipe's settings a user's dataset can take: the policies and the erasure change uint8 images (on the
    device, data.Batches), mixup and cutmix mix class indices; crops are the dataset's own business."""
    given = next((name for name in ("train_crop_size", "val_resize_size", "val_crop_size") if getattr(cfg, name)),
                 None)
    if given:
        raise UsageError("--" + given.replace("_", "-"), f"sizes the built-in datasets' crops, and {path} makes its "
                         "own samples", "drop it, and crop in your dataset's transform")
    inputs, target = train[0]
    augmenting = "--auto-augment" if cfg.auto_augment else "--random-erase" if cfg.random_erase else None
    if augmenting and not (inputs.dtype == torch.uint8 and inputs.ndim == 3):
        raise UsageError(augmenting, f"changes uint8 images (C x H x W), and {path}'s inputs are {inputs.dtype} of "
                         f"shape {tuple(inputs.shape)}", "return uint8 images from the dataset (the trainer "
                         "normalises them with the spec's mean and std), or drop it")
    mixing = "--mixup-alpha" if cfg.mixup_alpha else "--cutmix-alpha" if cfg.cutmix_alpha else None
    if mixing and inputs.ndim != 3:
        raise UsageError(mixing, f"mixes images (C x H x W), and {path}'s inputs have shape {tuple(inputs.shape)}",
                         "drop it for this dataset")
    labels = torch.as_tensor(target)
    if mixing and (labels.is_floating_point() or labels.ndim != 0 or not spec.num_classes):
        shown = f"{labels.dtype} of shape {tuple(labels.shape)}" if labels.ndim or labels.is_floating_point() else \
            "class indices without num_classes in its spec"
        raise UsageError(mixing, f"mixes class indices (one per sample), and {path}'s targets are {shown}",
                         "drop it for this dataset, or return a class index per sample and num_classes in the spec")


def _check_sample(data, spec: DataSpec, path: str, split: str) -> None:
    """The first sample against what the spec says: (input tensor of its shape, target of its classes)."""
    try:
        sample = data[0]
    except Exception as err:  # noqa: BLE001 (the user's __getitem__)
        raise catalog.user_code_error("--dataset", path, err, f"reading {split} sample 0") from None
    if not isinstance(sample, (tuple, list)) or len(sample) != 2:
        raise UsageError("--dataset", f"{path}'s {split} samples are {type(sample).__name__}, not (input, target)",
                         "return (input, target) pairs from __getitem__")
    inputs, target = sample
    if not isinstance(inputs, torch.Tensor):
        raise UsageError("--dataset", f"{path}'s {split} inputs are {type(inputs).__name__}, not tensors",
                         "convert them in the dataset (torchvision: transforms.PILToTensor or ToTensor)")
    if spec.sample_shape and tuple(inputs.shape) != spec.sample_shape:
        raise UsageError("--dataset", f"{path}'s {split} inputs have shape {tuple(inputs.shape)} but its spec "
                         f"describes {spec.sample_shape}", "make the DataSpec (channels, image_size or "
                         "input_shape) say what the data is")
    labels = torch.as_tensor(target)
    if spec.num_classes and not labels.is_floating_point() and labels.numel() and \
            not 0 <= int(labels.min()) <= int(labels.max()) < spec.num_classes:
        shown = str(labels.tolist())[:40]
        raise UsageError("--dataset", f"{path}'s {split} target {shown} is outside the {spec.num_classes} classes "
                         "its spec describes", "make num_classes cover every target (classes are 0 .. num_classes-1)")


# ---------------------------------------------------------------------------------------- batches

class _KeyedOrder(Sampler):
    """Yields (index, key epoch) keys in an order set before each epoch (the main process owns it); the key epoch is
    the epoch, or with --ra-sampler the epoch and the copy (sampling.sample_of)."""

    def __init__(self):
        self.keys: list[tuple[int, int]] = []

    def __iter__(self):
        return iter(list(self.keys))

    def __len__(self) -> int:
        return len(self.keys)


class Sized:
    """An iterator that knows its length."""

    def __init__(self, iterator: Iterator, length: int):
        self.iterator, self.length = iterator, length

    def __iter__(self) -> Iterator:
        return self.iterator

    def __len__(self) -> int:
        return self.length


class Batches:
    """One rank's batches of one split, on the training device, normalised and augmented. Training batches follow
    a ResumableSampler: the run's (run.sampler(), whose order in-place recovery changes as hosts come and go), or
    by default this rank's shard of the process group."""

    def __init__(self, data, spec: DataSpec, cfg: TrainConfig, ctx: DistContext, train: bool,
                 sampler: ResumableSampler | None = None):
        self.spec, self.train, self.ctx = spec, train, ctx
        self.batch_size, self.seed = cfg.batch_size, cfg.seed
        self.reps = cfg.ra_reps if cfg.ra_sampler and train else 1
        self.device = ctx.device
        in_memory = isinstance(data, InMemoryImages)
        # --auto-augment and --random-erase on uint8 images, sample by sample: image folders (and packs) apply them
        # in the loader's workers; here on the device for in-memory data, --decode gpu and users' datasets.
        self.samples = None
        if train and not getattr(data, "augments_samples", False):
            self.samples = sample_augment(cfg, spec.mean, spec.channels)
        # The built-in in-memory datasets: the images whole, or crops of them (--train-crop-size, --val-crop-size);
        # 0: none (image folders crop in the workers, users' datasets themselves).
        train_crop, _, val_crop = crop_sizes(cfg)
        self.crop = (train_crop if train else val_crop) if catalog.in_memory(cfg.dataset) else 0
        use_memory = in_memory and cfg.loader != "dataloader"  # config refuses memory for on-disk data
        self.size = len(data)
        # Files that do not decode (image folders, packs): named and counted; an epoch's bounded (training).
        self.bad_files = BadFiles(bad_file_bound(cfg.max_bad_files, self.size) if train else None)
        self.memory = data if use_memory else None
        if self.memory is not None:
            self.memory = InMemoryImages(data.images.to(self.device), data.labels.to(self.device))
        else:
            self.order = _KeyedOrder()
            workers = cfg.num_workers
            # A dataset may collate its own batches and finish them on the device (jpeg.GpuImageFolder).
            self.stage = getattr(data, "stage", lambda loader, device: loader)
            self.loader = DataLoader(
                data if not in_memory else _MemoryAsDataset(data), batch_size=self.batch_size,
                collate_fn=getattr(data, "collate", None),
                sampler=self.order, num_workers=workers, pin_memory=self.device.type == "cuda",
                # Validation's workers live only while it runs: between them they would hold memory for nothing.
                persistent_workers=train and workers > 0, drop_last=train, prefetch_factor=4 if workers else None,
                worker_init_fn=GracefulStop.dataloader_worker_init)
        # uint8 images are scaled to [0, 1] and normalised (where the spec gives mean and std), in
        # --channels-last layout on request; other inputs (floats, token ids) reach the model as they are.
        mean = torch.tensor(spec.mean or (0.0,), device=self.device).view(1, -1, 1, 1)
        std = torch.tensor(spec.std or (1.0,), device=self.device).view(1, -1, 1, 1)
        self.scale, self.shift = 1 / (255 * std), mean / std
        self.memory_format = torch.channels_last if cfg.channels_last else torch.contiguous_format
        if train:
            self.sampler = sampler or ResumableSampler(self.size, self.batch_size, ctx.rank, ctx.world_size, self.seed,
                                                       self.reps)
            self.num_batches = self.sampler.batches_per_epoch
        else:  # no padding: padded duplicates would be counted twice in the metrics
            # A replica's shard: a pipeline's stages all read it (the first takes the inputs, the last the targets).
            stages = cfg.pipeline_stages
            self.shard = list(range(self.ctx.rank // stages, self.size, self.ctx.world_size // stages))
            self.num_batches = -(-len(self.shard) // self.batch_size)

    def epoch(self, epoch: int, start_batch: int = 0, stop_batch: int | None = None) -> "Sized | Epoch":
        """Batches [start_batch, stop_batch) of this rank's part of the epoch, as (inputs, labels); len() is their
        count (run.steps() knows the epoch's last step by it). Training batches come as an Epoch, which
        run.steps() may iterate again from another batch (in-place recovery, after a host came or went)."""
        stop_batch = self.num_batches if stop_batch is None else stop_batch
        self.bad_files.start_epoch()
        if self.train:
            self.sampler.set_epoch(epoch, start_batch, stop_batch)
            return Epoch(self, self.sampler)
        indices = batch_range(self.shard, self.batch_size, start_batch, stop_batch)
        return Sized(self._batches(epoch, indices), -(-len(indices) // self.batch_size))

    def _batches(self, epoch: int, indices: list[int]) -> Iterator:
        """indices: this rank's (virtual, with --ra-sampler: sampling.epoch_shard) indices of the batches to give."""
        if self.memory is not None:
            order = torch.tensor(indices, dtype=torch.long, device=self.device)
            for begin in range(0, len(indices), self.batch_size):
                idx = order[begin:begin + self.batch_size]
                rows = idx if self.reps == 1 else idx % self.size
                yield self._prepare(self.memory.images[rows], self.memory.labels[rows], idx, epoch,
                                    indices[begin:begin + self.batch_size])
            return
        self.order.keys = [sample_of(i, self.size, self.reps, epoch) for i in indices]
        handed = collections.deque()  # a dataset's own batches (FileBatch) name their bad files; stage() reads ahead

        def from_loader():
            for batch in self.loader:
                handed.append(getattr(batch, "bad", None))
                yield batch

        try:
            for batch_number, batch in enumerate(self.stage(from_loader(), self.device)):
                images, labels = batch[0], batch[1]
                named = handed.popleft() if handed else None
                self.bad_files.note(batch[2] if len(batch) > 2 else named or ())
                self.bad_files.note(take_undecoded())
                first = batch_number * self.batch_size
                chosen = indices[first:first + len(labels)]
                idx = torch.tensor(chosen, dtype=torch.long)
                # non_blocking for idx too: a blocking host-to-GPU copy would wait for the queued steps
                yield self._prepare(images.to(self.device, non_blocking=True),
                                    labels.to(self.device, non_blocking=True),
                                    idx.to(self.device, non_blocking=True), epoch, chosen)
        except UnreadableImage as err:
            raise UsageError("--data-dir", f"cannot read the image {err.what}", "remove or replace the file") from None

    def _prepare(self, inputs: torch.Tensor, labels: torch.Tensor, idx: torch.Tensor, epoch: int, chosen: list[int]):
        """idx: the batch's (virtual) indices on the device; chosen: the same on the host (the per-sample keys of
        --auto-augment and --random-erase are read there: no host sync)."""
        if inputs.dtype != torch.uint8 or inputs.ndim != 4:  # not a batch of uint8 images
            return inputs, labels
        if self.samples is not None:
            inputs = self.samples.batch(inputs, [sample_key(*sample_of(i, self.size, self.reps, epoch), self.seed)
                                                 for i in chosen])
        x = inputs.float().mul_(self.scale).sub_(self.shift)
        side = x.shape[-1]
        cropped = 0 < self.crop < side
        if self.train and (self.spec.augment_on_device or cropped):
            keys = sample_keys(idx, epoch, self.seed) if self.reps == 1 else \
                sample_keys(idx % self.size, epoch * self.reps + idx // self.size, self.seed)
            flips = self.spec.augment_on_device
            x = random_crop_flip(x, keys, self.crop or side, CROP_PADDING if flips else 0, flips)
        elif not self.train and cropped:
            x = center_crop(x, self.crop)
        return x.contiguous(memory_format=self.memory_format), labels


class Epoch:
    """One epoch's training batches in the order of a ResumableSampler, from its start batch; each iteration reads
    the sampler anew (its epoch, start batch and shards)."""

    def __init__(self, batches: Batches, sampler: ResumableSampler):
        self.batches, self.sampler = batches, sampler

    def __iter__(self) -> Iterator:
        return self.batches._batches(self.sampler.epoch, list(self.sampler.virtual()))

    def __len__(self) -> int:
        return len(self.sampler) // self.batches.batch_size


def random_crop_flip(x: torch.Tensor, keys: torch.Tensor, size: int | None = None, padding: int = CROP_PADDING,
                     flip: bool = True) -> torch.Tensor:
    """Per-sample random crop of size x size (default: the images' side) out of the images zero-padded by
    `padding`, and a horizontal flip (if `flip`), batched, decided by the keys."""
    n, _, h, w = x.shape
    size = size or h
    span_y, span_x = 2 * padding + 1 + h - size, 2 * padding + 1 + w - size
    dy, dx = keys % span_y, (keys // span_y) % span_x
    padded = torch.nn.functional.pad(x, (padding,) * 4) if padding else x
    rows = (dy[:, None] + torch.arange(size, device=x.device))[:, :, None]
    cols = (dx[:, None] + torch.arange(size, device=x.device))[:, None, :]
    if flip:
        flips = (keys // (span_y * span_x)) % 2 == 1
        cols = torch.where(flips[:, None, None], cols.flip(2), cols)
    batch = torch.arange(n, device=x.device)[:, None, None]
    return padded.permute(0, 2, 3, 1)[batch, rows, cols].permute(0, 3, 1, 2).contiguous()


def center_crop(x: torch.Tensor, size: int) -> torch.Tensor:
    """The centre size x size of every image of the batch (torchvision's CenterCrop: the offset rounded)."""
    h, w = x.shape[-2:]
    top, left = int(round((h - size) / 2.0)), int(round((w - size) / 2.0))
    return x[..., top:top + size, left:left + size]
