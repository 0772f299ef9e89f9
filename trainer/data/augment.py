"""torchvision's reference recipe on the data: the per-sample policies (--auto-augment, --random-erase) and the
per-batch mixes (--mixup-alpha, --cutmix-alpha), all torchvision.transforms.v2's own transforms.

Their randomness, as every other random choice of the data, is a pure function of keys, so a resumed run draws
what the uninterrupted one would have:
- a sample's policy and erasure draw from torch's CPU generator seeded by the sample's key (images.sample_key:
  seed, epoch, index), wherever they run: in a DataLoader worker after the crop and flip (the image folder's paths),
  or on the training device, sample by sample (the in-memory path and --decode gpu);
- a batch's mix draws from torch's CPU generator seeded by mix_key (seed, epoch, the batch's place in the epoch,
  rank): its parameters are a few numbers drawn on the CPU, the mixing itself runs where the batch is (the GPU
  for the GPU-resident input paths).
The generator is restored afterwards: torch's global random state (dropout, the user's own draws) is not
touched, and the CUDA generators never are.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch

from trainer.config.settings import TrainConfig


@contextlib.contextmanager
def cpu_seeded(key: int) -> Iterator[None]:
    """torch's default CPU generator seeded by `key` for a transform's draws, restored afterwards (torch.manual_seed
    would also reseed every CUDA generator)."""
    generator = torch.default_generator
    state = generator.get_state()
    generator.manual_seed(key)
    try:
        yield
    finally:
        generator.set_state(state)


def policy_transform(name: str, magnitude: int, severity: int, interpolation: str):
    """--auto-augment's torchvision.transforms.v2 policy, as the reference's ClassificationPresetTrain builds it
    (None for none). The reference passes its --interpolation (bilinear by default) to every policy, whose own
    default is nearest: followed here."""
    if not name:
        return None
    from torchvision.transforms import v2

    # torchvision's tensor kernels for the policies' rotations, shears and translations take nearest or bilinear
    # only (the reference's PIL images take bicubic too): bicubic crops get bilinear policies.
    mode = v2.InterpolationMode("nearest" if interpolation == "nearest" else "bilinear")
    if name == "ta_wide":
        return v2.TrivialAugmentWide(interpolation=mode)
    if name == "ra":
        return v2.RandAugment(interpolation=mode, magnitude=magnitude)
    if name == "augmix":
        return v2.AugMix(interpolation=mode, severity=severity)
    return v2.AutoAugment(v2.AutoAugmentPolicy(name), interpolation=mode)


class SampleAugment:
    """--auto-augment's policy, then --random-erase, on one uint8 C x H x W image, drawn from its key.

    The reference erases after normalising, with value 0 (RandomErasing's default): the mean colour. Erasing the
    uint8 image with the mean colour (mean * 255, rounded) is the same picture, and lets the erasure run where the
    policy runs, in the worker."""

    def __init__(self, policy, erase: float, mean: Sequence[float]):
        from torchvision.transforms import v2

        self.policy = policy
        self.erase = v2.RandomErasing(p=erase, value=[round(255 * m) for m in mean]) if erase else None

    def __call__(self, image: torch.Tensor, key: int) -> torch.Tensor:
        with cpu_seeded(key):
            if self.policy is not None:
                image = self.policy(image)
            if self.erase is not None:
                image = self.erase(image)
        return image

    def batch(self, images: torch.Tensor, keys: Sequence[int]) -> torch.Tensor:
        """A uint8 N x C x H x W batch, sample by sample (on the device it is on: the in-memory path, --decode gpu).
        The policies' operations apply one draw to a whole tensor: a batch at once would give every image the same
        one."""
        return torch.stack([self(image, key) for image, key in zip(images, keys)])


def sample_augment(cfg: TrainConfig, mean: Sequence[float], channels: int) -> SampleAugment | None:
    """The run's SampleAugment (None when --auto-augment and --random-erase are off)."""
    if not cfg.auto_augment and not cfg.random_erase:
        return None
    return SampleAugment(policy_transform(cfg.auto_augment, cfg.ra_magnitude, cfg.augmix_severity, cfg.interpolation),
                         cfg.random_erase, list(mean) if mean else [0.0] * channels)


# ------------------------------------------------------------------------------------------ mixup and cutmix

def mix_key(seed: int, epoch: int, batch: int, rank: int) -> int:
    """A well-mixed 31-bit key per (seed, epoch, micro-batch of the epoch, rank): each rank mixes its own batch
    with its own draw, as the reference's per-process collate does."""
    x = (batch * 0x9E3779B1 + epoch * 0x85EBCA77 + seed * 0xC2B2AE3D + rank * 0x27D4EB2F + 0x165667B1) & 0xFFFFFFFF
    for _ in range(2):
        x = (((x >> 16) ^ x) * 0x45D9F3B) & 0xFFFFFFFF
    return ((x >> 16) ^ x) & 0x7FFFFFFF


class MixUpCutMix:
    """--mixup-alpha and --cutmix-alpha: torchvision.transforms.v2.MixUp and CutMix, one of the two chosen at random
    per batch (v2.RandomChoice) when both are on, as the reference's collate does. The targets become
    probabilities over the classes (float, N x num_classes), which cross-entropy takes as they are."""

    def __init__(self, mixup_alpha: float, cutmix_alpha: float, num_classes: int):
        from torchvision.transforms import v2

        mixes = ([v2.MixUp(alpha=mixup_alpha, num_classes=num_classes)] if mixup_alpha else []) + \
                ([v2.CutMix(alpha=cutmix_alpha, num_classes=num_classes)] if cutmix_alpha else [])
        self.transform = v2.RandomChoice(mixes) if len(mixes) > 1 else mixes[0]
        self.num_classes = num_classes

    def __call__(self, inputs: torch.Tensor, targets: torch.Tensor, key: int) -> tuple[torch.Tensor, torch.Tensor]:
        with cpu_seeded(key):
            return self.transform(inputs, targets)
