"""Models with realistic layer-size mixes for the training benchmarks (torch).

- ``resnet``: a ResNet-18-style CNN (basic blocks, batch norm, 4 stages).
- ``transformer``: a Transformer encoder over token ids (embedding, layers, head).
- ``mlp``: an MLP dominated by one huge layer (a wide embedding-like projection).
- ``digits_cnn``: a CNN for scikit-learn's 8x8 digits, width-scalable past 1M parameters.

Example:
    >>> model, make_batch, unit = build("resnet", width=32, image=16)
    >>> x, y = make_batch(8, seed=0)
    >>> model(x).shape
    torch.Size([8, 10])
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.short = nn.Sequential()
        if stride != 1 or cin != cout:
            self.short = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.short(x))


class ResNet(nn.Module):
    """ResNet-18 layout (2 basic blocks per stage) with stage widths ``width * (1, 2, 4, 8)``."""

    def __init__(self, width: int = 64, classes: int = 10, in_ch: int = 3):
        super().__init__()
        w = [width, 2 * width, 4 * width, 8 * width]
        self.stem = nn.Sequential(nn.Conv2d(in_ch, w[0], 3, 1, 1, bias=False), nn.BatchNorm2d(w[0]),
                                  nn.ReLU())
        layers, cin = [], w[0]
        for i, c in enumerate(w):
            layers += [BasicBlock(cin, c, 1 if i == 0 else 2), BasicBlock(c, c, 1)]
            cin = c
        self.layers = nn.Sequential(*layers)
        self.head = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(self.stem(x))
        return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


class Encoder(nn.Module):
    def __init__(self, vocab: int = 8000, d: int = 256, layers: int = 4, heads: int = 4, seq: int = 64):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(seq, d))
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(x) + self.pos[: x.shape[1]]))


class DigitsCNN(nn.Module):
    """For 8x8 digits: two conv layers and a wide hidden layer (``hidden`` sets the size)."""

    def __init__(self, channels: int = 64, hidden: int = 256):
        super().__init__()
        self.conv1 = nn.Conv2d(1, channels, 3, padding=1)
        self.conv2 = nn.Conv2d(channels, 2 * channels, 3, padding=1)
        self.fc1 = nn.Linear(2 * channels * 16, hidden)
        self.fc2 = nn.Linear(hidden, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv1(x))
        x = nn.functional.max_pool2d(torch.relu(self.conv2(x)), 2)
        return self.fc2(torch.relu(self.fc1(torch.flatten(x, 1))))


Batch = Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]


def build(name: str, **kw: Any) -> tuple[nn.Module, Batch, str]:
    """``(model, make_batch(n, seed) -> (x, y), unit)`` for a benchmark model name."""
    if name == "resnet":
        image = kw.get("image", 32)
        model = ResNet(kw.get("width", 64))

        def make_batch(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
            g = torch.Generator().manual_seed(seed)
            return torch.randn(n, 3, image, image, generator=g), torch.randint(0, 10, (n,), generator=g)
        return model, make_batch, "images"
    if name == "transformer":
        seq, vocab = kw.get("seq", 64), kw.get("vocab", 8000)
        model = Encoder(vocab, kw.get("d", 256), kw.get("layers", 4), seq=seq)

        def make_batch(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
            g = torch.Generator().manual_seed(seed)
            x = torch.randint(0, vocab, (n, seq), generator=g)
            return x, torch.roll(x, -1, 1)
        return model, make_batch, "tokens"
    if name == "mlp":
        d_in, wide = kw.get("d_in", 512), kw.get("wide", 16384)
        model = nn.Sequential(nn.Linear(d_in, wide), nn.ReLU(), nn.Linear(wide, 256), nn.ReLU(),
                              nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))

        def make_batch(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
            g = torch.Generator().manual_seed(seed)
            return torch.randn(n, d_in, generator=g), torch.randint(0, 10, (n,), generator=g)
        return model, make_batch, "samples"
    raise ValueError(f"model {name!r}: expected one of resnet, transformer, mlp")


def loss_of(name: str, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if name == "transformer":
        return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
    return nn.functional.cross_entropy(out, y)


def count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
