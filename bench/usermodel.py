"""A model brought through the factory door, `--model bench.usermodel:build`: torchvision's ResNet-18 built
by "user code", to measure that the door adds nothing to the training loop's hot path

    python -m bench --nproc 2 --stacks trainer handwritten --model bench.usermodel:build

and ViTs beyond torchvision's sizes (vit_1b .. vit_12b, 224x224, patch 14; about 12 x layers x width^2
parameters), for the largest model that trains on one GPU under fsdp and not under ddp (bench/gpu.sh).
"""

import torchvision

# name: (layers, width, heads)
VIT_SIZES = {"vit_1b": (36, 1536, 16), "vit_2b": (40, 2048, 16), "vit_4b": (52, 2560, 20),
             "vit_8b": (64, 3200, 25), "vit_12b": (60, 4096, 32)}


def _vit(name):
    def build_vit(spec):
        layers, width, heads = VIT_SIZES[name]
        return torchvision.models.VisionTransformer(image_size=spec.image_size, patch_size=14, num_layers=layers,
                                                    num_heads=heads, hidden_dim=width, mlp_dim=4 * width,
                                                    num_classes=spec.num_classes)
    return build_vit


globals().update({name: _vit(name) for name in VIT_SIZES})


def build(spec):
    return torchvision.models.resnet18(num_classes=spec.num_classes)
