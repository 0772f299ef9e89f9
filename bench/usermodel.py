"""A model brought through the factory door, `--model bench.usermodel:build`: torchvision's ResNet-18 built
by "user code", to measure that the door adds nothing to the training loop's hot path

    python -m bench --nproc 2 --stacks trainer handwritten --model bench.usermodel:build
"""

import torchvision


def build(spec):
    return torchvision.models.resnet18(num_classes=spec.num_classes)
