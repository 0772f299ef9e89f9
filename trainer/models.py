"""Model zoo and the loss that goes with each model's task."""

from __future__ import annotations

import torch
from torch import nn

from trainer.config import RECONSTRUCTION_MODELS
from trainer.data import DataSpec


def _resnet(name: str, spec: DataSpec, cifar_stem: bool) -> nn.Module:
    import torchvision

    model = getattr(torchvision.models, name)(weights=None, num_classes=spec.num_classes)
    if cifar_stem:
        # A 32x32 image loses 3/4 of its resolution to the ImageNet stem (7x7 stride 2 + max-pool);
        # the CIFAR ResNets start with a 3x3 stride-1 convolution and no pooling instead.
        model.conv1 = nn.Conv2d(spec.channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
        model.maxpool = nn.Identity()
    elif spec.channels != 3:
        model.conv1 = nn.Conv2d(spec.channels, 64, kernel_size=7, stride=2, padding=3, bias=False)
    return model


class SmallCNN(nn.Module):
    """A quick, BatchNorm-free convnet: its result does not depend on how a batch is split over ranks."""

    def __init__(self, spec: DataSpec, width: int = 32):
        super().__init__()
        layers, channels = [], spec.channels
        for out in (width, 2 * width, 4 * width):
            layers += [nn.Conv2d(channels, out, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2)]
            channels = out
        self.features = nn.Sequential(*layers)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, spec.num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


class AutoEncoder(nn.Module):
    """MLP auto-encoder (MNIST-sized by default); trained to reconstruct its normalised input."""

    def __init__(self, spec: DataSpec, hidden: int = 256, code: int = 32):
        super().__init__()
        self.shape = (spec.channels, spec.image_size, spec.image_size)
        features = spec.channels * spec.image_size * spec.image_size
        self.encoder = nn.Sequential(nn.Flatten(), nn.Linear(features, hidden), nn.ReLU(inplace=True),
                                     nn.Linear(hidden, code))
        self.decoder = nn.Sequential(nn.ReLU(inplace=True), nn.Linear(code, hidden), nn.ReLU(inplace=True),
                                     nn.Linear(hidden, features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.encoder(x)).view(-1, *self.shape)


def build_model(name: str, spec: DataSpec) -> nn.Module:
    if name in ("resnet18", "resnet50"):
        return _resnet(name, spec, cifar_stem=False)
    if name == "cifar_resnet18":
        return _resnet("resnet18", spec, cifar_stem=True)
    if name == "cnn":
        return SmallCNN(spec)
    return AutoEncoder(spec)


def is_reconstruction(name: str) -> bool:
    return name in RECONSTRUCTION_MODELS


def per_sample_loss(model_name: str, output: torch.Tensor, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """One loss per sample (float32 even under autocast): the mean trains, the sum validates."""
    if is_reconstruction(model_name):
        return nn.functional.mse_loss(output.float(), inputs, reduction="none").flatten(1).mean(1)
    return nn.functional.cross_entropy(output.float(), labels, reduction="none")
