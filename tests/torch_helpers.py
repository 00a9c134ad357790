"""What the training tests share, all of it torch: a small float64 model and each rank's batches for it, its
loss, the torch optimizers the tests wrap, a loop of accumulation windows, and DDP's GradBucket as the
hooks read it. (tests/helpers.py holds what the core tests share too, without torch.)"""

from __future__ import annotations

import torch


def tiny_model(seed: int = 0, dtype=torch.float64) -> torch.nn.Module:
    """5 → 4 → 3 with a tanh between, its start drawn from ``seed`` (the global generator is left as it was)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3)).to(dtype)


def batch(rank: int, step: int, micro: int, n: int = 6, dtype=torch.float64):
    """Rank ``rank``'s micro-batch ``micro`` of step ``step`` for :func:`tiny_model`: inputs and targets."""
    g = torch.Generator().manual_seed(1000 * rank + 37 * step + micro + 1)
    return torch.randn(n, 5, generator=g, dtype=dtype), torch.randn(n, 3, generator=g, dtype=dtype)


def loss_of(model, x, y):
    return torch.nn.functional.mse_loss(model(x), y)


def inner(name: str, params):
    """The torch optimizer a test wraps: "sgd" (with momentum), "adam" or "adamw" (with weight decay)."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    if name == "adam":
        return torch.optim.Adam(params, lr=0.01)
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


def train(model, opt, rank: int, steps, k: int, dtype=torch.float64) -> list[bool]:
    """Windows ``steps`` (a count from 0, or a range) of ``k`` micro-batches each in Accelerate's calling
    convention (``step()`` after every backward); returns ``opt.is_boundary`` after each window."""
    out = []
    for s in range(steps) if isinstance(steps, int) else steps:
        for j in range(k):
            loss_of(model, *batch(rank, s, j, dtype=dtype)).backward()
            opt.step()
            opt.zero_grad()
        out.append(opt.is_boundary)
    return out


class GradBucket:
    """What the DDP hooks read of DDP's GradBucket: the gradients and their flat buffer."""

    def __init__(self, grads):
        self._grads = grads
        self._flat = torch.cat([g.reshape(-1) for g in grads])

    def gradients(self):
        return self._grads

    def buffer(self):
        return self._flat
