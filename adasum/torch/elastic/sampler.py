"""Horovod's elastic sampler: the data sharded over the current world, re-sharded after a reset."""

from __future__ import annotations

import math
import random

import torch.utils.data

from ...runtime.membership import world

__all__ = ["ElasticSampler"]


class ElasticSampler(torch.utils.data.Sampler):
    """A sampler that shards ``dataset`` over the current world (:func:`world`) and, kept as an attribute
    of a :class:`State`, re-shards what is left of the epoch over the survivors after a reset: Horovod's
    ``hvd.elastic.ElasticSampler``.

    Every epoch's order is the same on every rank (shuffled with ``seed + epoch`` where ``shuffle``); of
    the samples not yet processed, rank ``r`` of ``n`` takes every ``n``-th from the ``r``-th, the last ones
    repeated so that every rank gets as many. After each batch call :meth:`record_batch` (or
    :meth:`record_indices`), and :meth:`set_epoch` at the end of an epoch (not at its start: a reset in the
    middle of an epoch must not start it over). Its :meth:`state_dict` (the epoch and the samples processed
    in it, counted over all ranks) is what a commit keeps and a restore or ``sync()`` loads, which re-shards
    the rest over the world as it is then.

    Args:
        dataset: anything with ``len()`` (its length must not change).
        shuffle: shuffle each epoch's order (the same on every rank).
        seed: the shuffle's seed, the same on every rank.
    """

    def __init__(self, dataset, shuffle: bool = True, seed: int = 0):
        self.dataset, self.shuffle, self.seed = dataset, shuffle, seed
        self.epoch = 0
        self.processed_num = 0
        self.num_replicas, self.rank = 1, 0
        self.remaining_indices: list[int] = []
        self.num_samples = self.total_size = 0
        self.indices: list[int] = []
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch``: nothing of it processed yet, its order drawn, sharded over the world."""
        self.epoch = epoch
        self.processed_num = 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Count a batch of ``batch_size`` samples processed on every rank (``batch_idx`` is not needed)."""
        self.processed_num += batch_size * self.num_replicas

    def record_indices(self, indices) -> None:
        """Count the samples ``indices`` processed here, and as many on every other rank."""
        self.processed_num += len(indices) * self.num_replicas

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "processed_num": self.processed_num}

    def load_state_dict(self, state_dict: dict) -> None:
        self.epoch = state_dict["epoch"]
        self.processed_num = state_dict["processed_num"]
        self.reset()

    def reset(self) -> None:
        """Shard what is left of the epoch over the current world (its size and this rank's place)."""
        self.num_replicas, self.rank = world().Get_size(), world().Get_rank()
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        self.remaining_indices = order[self.processed_num:]
        self.num_samples = math.ceil(len(self.remaining_indices) / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self):
        padded = list(self.remaining_indices)
        while padded and len(padded) < self.total_size:
            padded += padded[: self.total_size - len(padded)]
        self.indices = padded[self.rank:self.total_size:self.num_replicas]
        return iter(self.indices)

    def __len__(self) -> int:
        return self.num_samples
