"""The catalogue: every model and dataset `--model` / `--dataset` can name, and the doors for users' own.

A name is one of three kinds:
- built-in: the entries below (their facts live here and nowhere else);
- torchvision (models only): any classification model `torchvision.models.list_models` lists;
- import path: `module:callable`, the user's own factory, importable from the working directory,
  PYTHONPATH or the containers' mounted source folder.

Torch-free on purpose: the config, the launcher and the doctor read it before (or without) importing
torch. Only a torchvision name or a user factory imports anything, and only when it is used.

The factory protocols (docs/your-code.md):
- model:   `build(spec: DataSpec) -> torch.nn.Module`. A model may define
           `compute_loss(output, inputs, targets)` returning per-sample losses (shape [N]) or their
           mean; without it the task's loss applies (cross-entropy on class logits).
- dataset: `build(cfg: TrainConfig) -> (train, val, spec)`: map-style datasets of (input, target)
           (val may be None) and a DataSpec (or a dict of its fields) describing them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import importlib
import os
import re
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from trainer.core.errors import UsageError, UserCodeError

IMPORT_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


@dataclass(frozen=True)
class DataSpec:
    """What a model factory is told about the data (and what a dataset factory says about its data).

    Images: `channels` x `image_size` x `image_size` inputs; uint8 inputs are scaled to [0, 1] and,
    with `mean` and `std`, normalised per channel (as the built-in datasets are). Other inputs
    (token ids, features) reach the model as they are; `input_shape` then describes one sample.
    """
    channels: int = 3
    image_size: int = 0            # side of the square images; 0: the inputs are not images
    num_classes: int = 0           # classes of the targets (vocabulary size for a language model; 0: none)
    mean: tuple[float, ...] = ()   # per-channel mean and std of the images scaled to [0, 1]
    std: tuple[float, ...] = ()
    augment_on_device: bool = False  # built-in in-memory data: random crop + flip batched on the device
    input_shape: tuple[int, ...] = ()  # one input's shape, for inputs that are not images

    @property
    def sample_shape(self) -> tuple[int, ...]:
        """The shape every input must have (empty: not checked)."""
        if self.image_size:
            return (self.channels, self.image_size, self.image_size)
        return tuple(self.input_shape)


# ------------------------------------------------------------------------------------------ models

def _cnn_parameters(channels: int, side: int, classes: int) -> int:
    widths = (channels, 32, 64, 128)  # three 3x3 convolutions with biases, then the classifier
    return sum(9 * a * b + b for a, b in zip(widths, widths[1:])) + (widths[-1] + 1) * classes


def _autoencoder_parameters(channels: int, side: int, classes: int) -> int:
    features = channels * side * side  # features -> 256 -> 32 -> 256 -> features, all linear with biases
    return (256 + 1) * features + 256 + (256 + 1) * 32 + (32 + 1) * 256 + 256 * features


def _resnet_parameters(body: int, width: int, stem_kernel: int) -> Callable[[int, int, int], int]:
    """torchvision's ResNets: `body` parameters besides the stem convolution and the classifier."""
    return lambda channels, side, classes: body + 64 * channels * stem_kernel ** 2 + (width + 1) * classes


@dataclass(frozen=True)
class ModelEntry:
    help: str
    # Parameters for (channels, image side, classes), without building the model (the doctor sizes the
    # shared-memory all-reduce with it); tests/test_doctor.py pins each against the built model.
    parameters: Callable[[int, int, int], int]
    reconstructs: bool = False  # trained to reproduce its input (no classes, no accuracy)


MODELS: dict[str, ModelEntry] = {
    "resnet18": ModelEntry("torchvision ResNet-18, classifier sized to the data",
                           _resnet_parameters(11_167_104, 512, 7)),
    "resnet50": ModelEntry("torchvision ResNet-50, classifier sized to the data",
                           _resnet_parameters(23_498_624, 2048, 7)),
    "cifar_resnet18": ModelEntry("ResNet-18 with a 3x3 stem and no max-pool: what 32x32 inputs need",
                                 _resnet_parameters(11_167_104, 512, 3)),
    "cnn": ModelEntry("small BatchNorm-free convnet (quick; the CPU demo)", _cnn_parameters),
    "autoencoder": ModelEntry("MLP auto-encoder (MNIST-sized), reconstruction loss", _autoencoder_parameters,
                              reconstructs=True),
}


def torchvision_models() -> list[str]:
    """torchvision's classification models (imports torchvision: seconds)."""
    import torchvision

    return sorted(torchvision.models.list_models(module=torchvision.models))


def torchvision_model(name: str, spec: DataSpec):
    """torchvision's classification model `name` sized to the data: its classifier to spec.num_classes, its
    first convolution to spec.channels (imports torch and torchvision). The trainer builds it, and the doctor
    counts its parameters, through this one function."""
    import torchvision

    kwargs = {"weights": None, "num_classes": spec.num_classes}
    if name.startswith("vit_"):  # the position embedding is sized for one image side
        kwargs["image_size"] = spec.image_size
    if name in ("googlenet", "inception_v3"):  # auxiliary heads return tuples in training
        kwargs.update(aux_logits=False, init_weights=True)
    model = torchvision.models.get_model(name, **kwargs)
    if spec.channels != 3:
        _adapt_input_channels(model, spec.channels)
    return model


def _adapt_input_channels(model, channels: int) -> None:
    """Replace the first convolution (the one that reads the RGB image) by one reading `channels`."""
    from torch import nn

    for parent in model.modules():
        for child_name, child in parent.named_children():
            if isinstance(child, nn.Conv2d) and child.groups == 1:
                setattr(parent, child_name, nn.Conv2d(
                    channels, child.out_channels, child.kernel_size, child.stride, child.padding, child.dilation,
                    bias=child.bias is not None, padding_mode=child.padding_mode))
                return


# ---------------------------------------------------------------------------------------- datasets

@dataclass(frozen=True)
class DatasetEntry:
    help: str
    in_memory: bool  # one uint8 tensor per process (the memory input path), else read per sample from disk
    channels: int
    image_size: int | None   # None: an option sets it (synthetic_image_size, image_size)
    num_classes: int | None  # None: the class folders decide
    mean: tuple[float, ...] = IMAGENET_MEAN
    std: tuple[float, ...] = IMAGENET_STD
    downloads: bool = False  # torchvision fetches it into --data-dir when it is not there
    crop_flip: bool = False  # in memory: random crop (padding 4) + horizontal flip, batched on the device


DATASETS: dict[str, DatasetEntry] = {
    "synthetic": DatasetEntry("learnable images made from the seed; needs no files", True, 3, None, 10,
                              (0.5, 0.5, 0.5), (0.25, 0.25, 0.25), crop_flip=True),
    "cifar10": DatasetEntry("CIFAR-10 through torchvision", True, 3, 32, 10,
                            (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616), downloads=True, crop_flip=True),
    "mnist": DatasetEntry("MNIST through torchvision", True, 1, 28, 10, (0.1307,), (0.3081,), downloads=True),
    "imagefolder": DatasetEntry("folders train/<class>/* and val/<class>/* (--image-size, --augment)", False, 3,
                                None, None),
    "packed": DatasetEntry("an image folder packed by trainer-pack (--data-dir; --image-size, --augment)", False, 3,
                           None, None),
}


# torchvision.datasets.folder.IMG_EXTENSIONS: the files ImageFolder takes, here so that the option check reads the
# folders before torchvision is imported (seconds later); tests/test_data.py pins the copy to torchvision's.
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def class_folders(split: Path) -> tuple[list[str], list[str]]:
    """(the class folders of an image folder's split, those holding no file ImageFolder takes at any depth): what
    ImageFolder would refuse, found by looking for one image per class, not by listing them all."""
    classes = sorted(entry.name for entry in os.scandir(split) if entry.is_dir())
    empty = []
    for name in classes:
        found = any(f.lower().endswith(IMAGE_EXTENSIONS) for _, _, files in os.walk(split / name, followlinks=True)
                    for f in files)
        if not found:
            empty.append(name)
    return classes, empty


def in_memory(name: str) -> bool:
    """Whether --dataset NAME is held in memory (the memory input path); users' datasets are read per sample."""
    return name in DATASETS and DATASETS[name].in_memory


def dataset_image_size(name: str, synthetic_image_size: int, image_size: int) -> int:
    entry = DATASETS[name]
    if entry.image_size is not None:
        return entry.image_size
    return synthetic_image_size if name == "synthetic" else image_size


# ------------------------------------------------------------------------------------ user factories

def is_import_path(name: str) -> bool:
    return bool(IMPORT_PATH.match(name))


def check_model_name(name: str, setting: str) -> str:
    """'builtin', 'torchvision' or 'import'; a UsageError for anything else. A user factory is imported
    here, so that a typo fails before any process starts (the factory itself runs in the workers)."""
    if name in MODELS:
        return "builtin"
    if is_import_path(name):
        load_factory(name, setting)
        return "import"
    if ":" not in name:
        known = torchvision_models()
        if name in known:
            return "torchvision"
        close = difflib.get_close_matches(name, [*MODELS, *known], n=1)
        hint = f"did you mean {close[0]}? " if close else ""
    else:
        hint = ""
    raise UsageError(setting, f"'{name}' is neither a known model nor module:callable",
                     f"{hint}`trainer --list-models` lists the names; your own model is module:function")


def check_dataset_name(name: str, setting: str) -> str:
    """'builtin' or 'import' (the factory's module imported now); a UsageError otherwise."""
    if name in DATASETS:
        return "builtin"
    if is_import_path(name):
        load_factory(name, setting)
        return "import"
    close = difflib.get_close_matches(name, list(DATASETS), n=1)
    hint = f"did you mean {close[0]}? " if close else ""
    raise UsageError(setting, f"'{name}' is neither a known dataset ({', '.join(DATASETS)}) nor module:callable",
                     f"{hint}your own data is module:function returning (train, val, spec)")


@contextlib.contextmanager
def importable_as_python_m() -> Iterator[None]:
    """The working directory first on sys.path, as `python -m` and torchrun's workers have it, while the
    block imports or looks up the user's code: a console script (trainer-launch, trainer-doctor) starts
    without it, and the same name must resolve in both."""
    cwd = os.getcwd()
    sys.path.insert(0, cwd)
    try:
        yield
    finally:
        sys.path.remove(cwd)


def load_factory(path: str, setting: str) -> Callable:
    """The callable `module:attr.attr` names. Import problems are one line; an exception raised while the
    user's module runs keeps its traceback (it is their code) before that line."""
    module_name, _, attribute = path.partition(":")
    try:
        with importable_as_python_m():
            module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name and (module_name == err.name or module_name.startswith(err.name + ".")):
            raise UsageError(setting, f"cannot import '{module_name}' for {path} ({err})",
                             "put its folder on PYTHONPATH or run from the folder that holds it; in the "
                             "containers, put it in SRC_DIR") from None
        raise user_code_error(setting, path, err, "while importing") from None
    except Exception as err:  # noqa: BLE001 (anything the user's module raises at import)
        raise user_code_error(setting, path, err, "while importing") from None
    target: Any = module
    for part in attribute.split("."):
        if not hasattr(target, part):
            public = sorted(n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n)))
            close = difflib.get_close_matches(part, public, n=1)
            hint = f"did you mean {module_name}:{close[0]}? " if close else ""
            raise UsageError(setting, f"{module_name} has no attribute '{attribute}'",
                             f"{hint}name a function or class of {module_name} ({module.__file__})")
        target = getattr(target, part)
    if not callable(target):
        raise UsageError(setting, f"{path} is {type(target).__name__}, not a callable",
                         "name a function or class that builds it")
    return target


def user_code_error(setting: str, path: str, err: BaseException, when: str) -> UserCodeError:
    """A one-line error for an exception in the user's code, carrying the user's traceback."""
    from trainer.core.errors import first_line

    tb = err.__traceback__  # from the user's first frame: ours and importlib's are no help to them
    while tb is not None and tb.tb_next is not None and (
            tb.tb_frame.f_code.co_filename == __file__ or "importlib" in tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    text = "".join(traceback.format_exception(type(err), err, tb))
    return UserCodeError(setting, f"{path} raised {type(err).__name__} {when}: {first_line(err)}",
                         "fix the code; its traceback is above", text)


def call_factory(path: str, setting: str, *args: Any) -> Any:
    factory = load_factory(path, setting)
    try:
        return factory(*args)
    except UsageError:
        raise
    except Exception as err:  # noqa: BLE001 (the user's code: their traceback, our line)
        raise user_code_error(setting, path, err, "when called") from None


def data_spec(value: Any, path: str, setting: str) -> DataSpec:
    """The spec a dataset factory returned (a DataSpec or a dict of its fields)."""
    if isinstance(value, DataSpec):
        return value
    if isinstance(value, dict):
        names = {f.name for f in dataclasses.fields(DataSpec)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise UsageError(setting, f"{path} described its data with unknown keys {', '.join(unknown)}",
                             f"use the DataSpec fields: {', '.join(sorted(names))}")
        value = {k: tuple(v) if isinstance(v, list) else v for k, v in value.items()}
        return DataSpec(**value)
    raise UsageError(setting, f"{path} returned a {type(value).__name__} as the third item, not a description "
                     "of the data", "return (train, val, trainer.DataSpec(num_classes=..., ...)) or a dict")


def listing() -> str:
    """What `trainer --list-models` prints."""
    lines = ["Built-in models:"]
    lines += [f"  {name:16} {entry.help}" for name, entry in MODELS.items()]
    lines += ["", "torchvision classification models (classifier sized to the data, input channels adapted):"]
    names = [n for n in torchvision_models() if n not in MODELS]
    width = max(map(len, names)) + 2
    per_line = max(1, 96 // width)
    lines += ["  " + "".join(n.ljust(width) for n in names[i:i + per_line]).rstrip()
              for i in range(0, len(names), per_line)]
    lines += ["", "Datasets:"]
    lines += [f"  {name:16} {entry.help}" for name, entry in DATASETS.items()]
    lines += ["", "Your own: --model module:function (called with a DataSpec, returns an nn.Module),",
              "          --dataset module:function (called with the config, returns (train, val, spec))."]
    return "\n".join(lines)
