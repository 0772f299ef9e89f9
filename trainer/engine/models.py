"""Models by name (built-in, torchvision, or the user's factory) and the loss that goes with each."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from trainer.config import catalog
from trainer.config.catalog import DataSpec
from trainer.core.errors import UsageError, first_line


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

    def compute_loss(self, output: torch.Tensor, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(output.float(), inputs.float(), reduction="none").flatten(1).mean(1)


def _torchvision(name: str, spec: DataSpec) -> nn.Module:
    def build() -> nn.Module:
        return catalog.torchvision_model(name, spec)

    try:
        with torch.device("meta"):
            probe = build()
    except Exception:  # noqa: BLE001 (a few, the RegNets, cannot be built there; their first step will tell)
        probe = None
    if probe is not None:
        # Inputs too small for a model fail only at its first forward, deep inside it: a forward on the
        # meta device (no memory, no arithmetic) tells now, in one line.
        try:
            with torch.device("meta"):
                probe.eval()(torch.empty(1, spec.channels, spec.image_size, spec.image_size))
        except Exception as err:  # noqa: BLE001
            raise UsageError("--model", f"torchvision's {name} cannot take {spec.channels}x{spec.image_size}x"
                             f"{spec.image_size} inputs ({first_line(err, 120)})",
                             "choose a model for images of this size, e.g. cifar_resnet18 for 32x32, or "
                             "a larger --image-size") from None
    try:
        return build()
    except (ValueError, TypeError, RuntimeError, AssertionError) as err:
        raise UsageError("--model", f"torchvision's {name} cannot be built for this data ({first_line(err, 120)})",
                         "choose another model, or another --image-size") from None


# The builders of the catalogue's built-in models (catalog.MODELS holds their facts; a test pins the two lists).
BUILT_IN: dict[str, Callable[[DataSpec], nn.Module]] = {
    "resnet18": lambda spec: _resnet("resnet18", spec, cifar_stem=False),
    "resnet50": lambda spec: _resnet("resnet50", spec, cifar_stem=False),
    "cifar_resnet18": lambda spec: _resnet("resnet18", spec, cifar_stem=True),
    "cnn": SmallCNN,
    "autoencoder": AutoEncoder,
}


def build_model(name: str, spec: DataSpec) -> nn.Module:
    """The model `--model` names, for data described by `spec`."""
    if name in BUILT_IN:
        return BUILT_IN[name](spec)
    if not catalog.is_import_path(name):
        return _torchvision(name, spec)
    model = catalog.call_factory(name, "--model", spec)
    if not isinstance(model, nn.Module):
        raise UsageError("--model", f"{name} returned {type(model).__name__}, not a torch.nn.Module",
                         "return the model (an nn.Module) from the factory")
    if not any(p.requires_grad for p in model.parameters()):
        raise UsageError("--model", f"{name} returned a model without trainable parameters",
                         "return a model with parameters that require gradients")
    return model


class Objective:
    """The loss of a model on its data, one value per sample (float32 even under autocast): the mean
    trains, the sum validates. A model's own `compute_loss(output, inputs, targets)` wins (per-sample
    losses or their mean); otherwise cross-entropy on logits whose last dimension is the class, with
    label_smoothing (the built-in loop trains with --label-smoothing and validates without), for class
    indices or for class probabilities (mixup's and cutmix's targets)."""

    def __init__(self, model: nn.Module, name: str, label_smoothing: float = 0.0):
        self.name, self.label_smoothing = name, label_smoothing
        self.custom = getattr(model, "compute_loss", None)

    @staticmethod
    def classifies(output: torch.Tensor, targets: torch.Tensor) -> bool:
        """Class logits for integer targets: [N, C] for [N] (or [N, T, C] for [N, T], e.g. next tokens)."""
        return not targets.is_floating_point() and tuple(output.shape[:-1]) == tuple(targets.shape)

    def per_sample(self, output: torch.Tensor, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        n = len(inputs)
        if self.custom is not None:
            loss = self.custom(output, inputs, targets).float()
            return loss.expand(n) if loss.ndim == 0 else loss.reshape(n, -1).mean(1)
        if targets.is_floating_point() and targets.shape == output.shape and output.ndim >= 2:  # probabilities
            losses = nn.functional.cross_entropy(output.float().flatten(0, -2), targets.float().flatten(0, -2),
                                                 reduction="none", label_smoothing=self.label_smoothing)
            return losses.view(n, -1).mean(1)
        if not self.classifies(output, targets):
            raise UsageError("--model", f"{self.name}'s output of shape {tuple(output.shape)} is no class logits for "
                             f"targets of shape {tuple(targets.shape)}",
                             "give the model a compute_loss(output, inputs, targets) method for its task")
        losses = nn.functional.cross_entropy(output.float().flatten(0, -2), targets.flatten(), reduction="none",
                                             label_smoothing=self.label_smoothing)
        return losses.view(n, -1).mean(1)
