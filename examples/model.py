"""MNIST-1D and the small 1-D CNN that examples/train.py trains (a convergence benchmark imports them too).

MNIST-1D (Greydanus, 2020) is generated offline by the ``mnist1d`` package from its ten templates: 40-sample
signals, ten classes; nothing is downloaded. Every function here is deterministic given its seed, so all
ranks agree on the data, its order and the initial model without exchanging anything but the dataset.
"""

from __future__ import annotations

import os
import tempfile
import time
from typing import NamedTuple

import numpy as np
import torch
from torch import nn

__all__ = ["Data", "make_data", "load_or_make_data", "shard_batches", "ConvNet", "build_model", "evaluate",
           "sleeping_barrier", "recipe_data", "report"]


class Data(NamedTuple):
    x: torch.Tensor       # (N, 1, 40) float32
    y: torch.Tensor       # (N,) int64
    x_test: torch.Tensor
    y_test: torch.Tensor


def make_data(num_samples: int = 5000, seed: int = 42) -> Data:
    """Generate MNIST-1D with the package's standard arguments (``num_samples`` signals, 80 % for training).

    The defaults give the standard dataset: 4000 training and 1000 test signals. Takes about a second per
    thousand signals.
    """
    import mnist1d.data

    args = mnist1d.data.get_dataset_args()
    args.num_samples = int(num_samples)
    args.seed = int(seed)
    d = mnist1d.data.make_dataset(args)

    def signals(a):
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)).unsqueeze(1)

    def labels(a):
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))

    return Data(signals(d["x"]), labels(d["y"]), signals(d["x_test"]), labels(d["y_test"]))


def load_or_make_data(num_samples: int = 5000, seed: int = 42, cache: str | None = None) -> Data:
    """:func:`make_data`, kept in the ``.npz`` file ``cache`` if given: read from it when it holds the same
    ``num_samples`` and ``seed``, else generated and written there (atomically) for the next run."""
    if cache and os.path.exists(cache):
        with np.load(cache) as f:
            if int(f["num_samples"]) == num_samples and int(f["seed"]) == seed:
                return Data(*(torch.from_numpy(f[k]) for k in Data._fields))
    data = make_data(num_samples, seed)
    if cache:
        directory = os.path.dirname(os.path.abspath(cache))
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".npz", dir=directory)
        with os.fdopen(fd, "wb") as f:
            np.savez(f, num_samples=num_samples, seed=seed, **{k: v.numpy() for k, v in data._asdict().items()})
        os.replace(tmp, cache)
    return data


def shard_batches(n: int, batch_size: int, rank: int, size: int, epoch: int, seed: int) -> list[torch.Tensor]:
    """This rank's micro-batches (index tensors) for one epoch.

    One permutation of the ``n`` samples per (seed, epoch), the same on every rank; rank ``r`` takes every
    ``size``-th sample from ``r``, after dropping the ``n % size`` last so that every rank gets as many
    samples, hence as many micro-batches (the last may be short).
    """
    g = torch.Generator().manual_seed(seed * 100_003 + epoch)
    order = torch.randperm(n, generator=g)[: n - n % size]
    mine = order[rank::size]
    return list(torch.split(mine, batch_size))


class ConvNet(nn.Module):
    """A 1-D convolution, three strided ones and a linear classifier: 41 k parameters at 64 channels.

    No batch normalisation: its running statistics would differ between ranks.
    """

    def __init__(self, channels: int = 64, length: int = 40, classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv1d(1, channels, 5, padding=2), nn.GELU(),
            nn.Conv1d(channels, channels, 3, stride=2, padding=1), nn.GELU(),
            nn.Conv1d(channels, channels, 3, stride=2, padding=1), nn.GELU(),
            nn.Conv1d(channels, channels, 3, stride=2, padding=1), nn.GELU(),
        )
        out = length
        for _ in range(3):
            out = (out - 1) // 2 + 1
        self.classifier = nn.Linear(channels * out, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x).flatten(1))


def build_model(seed: int = 0, channels: int = 64) -> ConvNet:
    """The network with its initial weights drawn from ``seed`` (the global RNG is left untouched)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return ConvNet(channels)


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 1000) -> tuple[float, int, int]:
    """(sum of the cross-entropy losses, correct predictions, samples) over ``x``, ``y``."""
    was_training = model.training
    model.eval()
    loss, correct = 0.0, 0
    for lo in range(0, len(y), batch_size):
        out = model(x[lo:lo + batch_size])
        loss += float(nn.functional.cross_entropy(out, y[lo:lo + batch_size], reduction="sum"))
        correct += int((out.argmax(1) == y[lo:lo + batch_size]).sum())
    model.train(was_training)
    return loss, correct, len(y)


def sleeping_barrier(comm, interval: float = 0.01) -> None:
    """A barrier whose waiting ranks sleep instead of spinning in MPI, leaving the cores to the ranks still
    working (matters when ranks outnumber cores)."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(interval)


def recipe_data(num_samples: int = 2000) -> Data:
    """MNIST-1D for the short recipe scripts under ``examples/``: rank 0 of ``MPI.COMM_WORLD`` reads it from a
    cache file in the temporary directory (generating it there the first time, a few seconds) while the
    other ranks sleep, then sends it to them."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    cache = os.path.join(tempfile.gettempdir(), f"adasum-examples-mnist1d-{int(num_samples)}.npz")
    data = load_or_make_data(num_samples, cache=cache) if comm.Get_rank() == 0 else None
    sleeping_barrier(comm)
    return comm.bcast(data, root=0)


def report(model: nn.Module, data: Data, rank: int) -> float:
    """Print this rank's final test accuracy and a checksum of its parameters (every rank of a data-parallel
    run holds the same model, so every rank prints the same line but for its rank); returns the accuracy."""
    _, correct, n = evaluate(model, data.x_test, data.y_test)
    checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
    print(f"rank {rank}: final test accuracy {correct / n:.4f}, parameter checksum {checksum!r}", flush=True)
    return correct / n
