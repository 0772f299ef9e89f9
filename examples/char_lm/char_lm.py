r"""A character-level language model (a small causal transformer) through the built-in training loop:
the stack is not image-only.

    cd examples/char_lm
    python char_lm.py data                 # writes data/input.txt, a generated text of ~200 KB
    trainer-launch --model char_lm:build_model --dataset char_lm:build_data --data-dir data \
        --optimizer adamw --lr 3e-3 --weight-decay 0.01 --epochs 2 --batch-size 32

Any text file works as data/input.txt. The model returns next-character logits of shape
[batch, block, vocabulary] for targets [batch, block]: the trainer's default loss (cross-entropy over
the last dimension) and its accuracy (of the next character) apply without a `compute_loss`.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import Dataset

from trainer import DataSpec

BLOCK = 32  # characters of context


class Chunks(Dataset):
    """Overlapping windows of the text: input characters [i, i+BLOCK), targets shifted by one."""

    def __init__(self, ids: torch.Tensor, stride: int):
        self.ids, self.stride = ids, stride

    def __len__(self) -> int:
        return (len(self.ids) - BLOCK - 1) // self.stride

    def __getitem__(self, index: int):
        start = index * self.stride
        window = self.ids[start:start + BLOCK + 1]
        return window[:-1], window[1:]


def build_data(cfg):
    text = (Path(cfg.data_dir) / "input.txt").read_text(encoding="utf-8")
    vocabulary = sorted(set(text))
    ids = torch.tensor([vocabulary.index(c) for c in text], dtype=torch.long)
    cut = len(ids) * 9 // 10
    spec = DataSpec(channels=1, num_classes=len(vocabulary), input_shape=(BLOCK,))
    return Chunks(ids[:cut], stride=BLOCK // 2), Chunks(ids[cut:], stride=BLOCK), spec


class TinyGPT(nn.Module):
    def __init__(self, spec: DataSpec, width: int = 64, layers: int = 2, heads: int = 4):
        super().__init__()
        self.embed = nn.Embedding(spec.num_classes, width)
        self.position = nn.Parameter(torch.zeros(1, BLOCK, width))
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, spec.num_classes)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(BLOCK), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) + self.position[:, :ids.shape[1]]
        n = ids.shape[1]
        return self.head(self.blocks(x, mask=self.causal[:n, :n], is_causal=True))


def build_model(spec: DataSpec) -> nn.Module:
    return TinyGPT(spec)


def write_text(folder: Path, sentences: int = 6000, seed: int = 0) -> Path:
    """A text with structure to learn: sentences from a small grammar."""
    rng = random.Random(seed)
    subjects = ["the cat", "a dog", "my friend", "the teacher", "our robot", "the old man"]
    verbs = ["sees", "likes", "finds", "draws", "follows", "paints"]
    objects = ["a red ball", "the blue door", "two small birds", "the tall tree", "a quiet river"]
    lines = [f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)}." for _ in range(sentences)]
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "input.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


if __name__ == "__main__":
    print(write_text(Path(sys.argv[1] if len(sys.argv) > 1 else "data")))
