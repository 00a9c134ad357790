"""A character-level language model on real text that every machine has: the source files of Python's
standard library. The convergence study (``convergence.py``, its tasks in ``study/tasks.py``) trains it as
its second task.

The text is the top-level ``.py`` files of the running interpreter's standard library, in sorted order,
read as UTF-8 with every character outside ASCII replaced by ``?`` (128 symbols). The first 90 % of the
characters train, the last 10 % (other files) validate. Nothing is downloaded; the text differs between
Python versions, so the study records its size and SHA-256.
"""

from __future__ import annotations

import hashlib
import math
import os
import sysconfig
from typing import NamedTuple

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["VOCAB", "Text", "load_text", "CharTransformer", "build_model", "window_batch", "evaluate"]

VOCAB = 128


class Text(NamedTuple):
    train: torch.Tensor     # (n,) int64 symbols
    valid: torch.Tensor
    source: str             # where the text came from
    sha256: str


def load_text(max_chars: int, valid_fraction: float = 0.1, root: str | None = None) -> Text:
    """The first ``max_chars`` characters of the standard library's top-level sources, split into training
    and validation text (``valid_fraction`` at the end)."""
    root = root or sysconfig.get_paths()["stdlib"]
    parts, total = [], 0
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if not name.endswith(".py") or not os.path.isfile(path):
            continue
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        parts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    text = "".join(parts)[:max_chars]
    if len(text) < max_chars:
        raise ValueError(f"the standard library at {root} holds {len(text)} characters of top-level sources, "
                         f"fewer than the {max_chars} asked for")
    raw = text.encode("ascii", errors="replace")  # one byte per character, '?' for the rest
    symbols = torch.from_numpy(np.frombuffer(raw, dtype=np.uint8).astype(np.int64))
    cut = int(len(symbols) * (1 - valid_fraction))
    return Text(symbols[:cut], symbols[cut:], root, hashlib.sha256(raw).hexdigest())


def windows(n: int, context: int) -> int:
    """How many training windows of ``context`` + 1 symbols (input and next-symbol target) ``n`` symbols hold,
    taken end to end."""
    return (n - 1) // context


def window_batch(symbols: torch.Tensor, index: torch.Tensor, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets (``len(index)`` × ``context``) of the windows ``index``."""
    starts = index * context
    rows = starts.unsqueeze(1) + torch.arange(context + 1)
    chunk = symbols[rows]
    return chunk[:, :-1], chunk[:, 1:]


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then a GELU MLP four times as wide."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, w = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, w))
        return x + self.mlp(self.norm2(x))


class CharTransformer(nn.Module):
    """Symbol and position embeddings, ``layers`` blocks, a final norm and a linear read-out."""

    def __init__(self, width: int = 64, layers: int = 2, heads: int = 4, context: int = 64):
        super().__init__()
        if width % heads:
            raise ValueError(f"width {width} is not a multiple of heads {heads}")
        self.embed = nn.Embedding(VOCAB, width)
        self.position = nn.Parameter(torch.randn(context, width) * 0.02)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) + self.position[: x.shape[1]]
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def build_model(seed: int, width: int = 64, layers: int = 2, heads: int = 4, context: int = 64) -> CharTransformer:
    """The model with its initial weights drawn from ``seed`` (the global RNG is left untouched)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return CharTransformer(width, layers, heads, context)


def loss(model: nn.Module, symbols: torch.Tensor, index: torch.Tensor, context: int) -> torch.Tensor:
    """Mean cross-entropy (nats per character) of the next symbol over the windows ``index``."""
    x, y = window_batch(symbols, index, context)
    return F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))


@torch.no_grad()
def evaluate(model: nn.Module, symbols: torch.Tensor, index: torch.Tensor, context: int,
             batch: int = 64) -> tuple[float, int]:
    """(sum of the cross-entropies in nats, characters predicted) over the windows ``index``."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for lo in range(0, len(index), batch):
        x, y = window_batch(symbols, index[lo:lo + batch], context)
        total += float(F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1), reduction="sum"))
        count += y.numel()
    model.train(was_training)
    return total, count


def bits_per_char(nats: float) -> float:
    return nats / math.log(2)
