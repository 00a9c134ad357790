"""The overlap engine's bucket planning (:mod:`.engine`): :class:`BucketPlan`, the buckets every rank hands
to the threads in the same order, and :class:`Backward`, the progress of one closing backward against it.

A bucket is a run of parameters in the order backward finished them in the first observed boundary, as
rank 0 saw it (shared with every rank), cut where it holds at least ``bucket_bytes`` bytes; the first is
cut at ``FIRST_BUCKET_BYTES`` where that is smaller.
"""

from __future__ import annotations

import time

import torch

from ...runtime.lane import Job
from ..window.strategies import Bucket

__all__ = ["FIRST_BUCKET_BYTES", "Backward", "BucketPlan"]


FIRST_BUCKET_BYTES = 1 << 20


class BucketPlan:
    """The buckets (lists of parameter indices) and, per parameter, how many gradient accumulations one
    closing backward produces (seen on this rank in the observed boundary, at least one), for the trained
    parameters whose ids are ``ids`` (their positions: ``pos``).

    The first bucket is cut at ``FIRST_BUCKET_BYTES`` (or ``bucket_bytes``, where smaller), so that the
    wire starts with the first layers backward finishes rather than after a whole bucket of them; the
    others at ``bucket_bytes``."""

    def __init__(self, order: list[int], nbytes: list[int], expected: list[int], bucket_bytes: int,
                 ids: list[int] | None = None):
        self.ids = list(range(len(order))) if ids is None else list(ids)
        self.pos = {pid: i for i, pid in enumerate(self.ids)}
        self.buckets: list[list[int]] = []
        cur: list[int] = []
        size = 0
        for i in order:
            cur.append(i)
            size += nbytes[i]
            if size >= (bucket_bytes if self.buckets else min(bucket_bytes, FIRST_BUCKET_BYTES)):
                self.buckets.append(cur)
                cur, size = [], 0
        if cur:
            self.buckets.append(cur)
        self.bucket_of = [0] * len(order)
        for b, idx in enumerate(self.buckets):
            for i in idx:
                self.bucket_of[i] = b
        self.expected = list(expected)
        # Per bucket, how many of its parameters must report their last accumulation before it is ready.
        self.waiting = [sum(1 for i in idx if self.expected[i] > 0) for idx in self.buckets]


class Backward:
    """The progress of one closing backward."""

    __slots__ = ("params", "ids", "pos", "fired", "order", "observe", "count", "scale", "next", "buckets",
                 "jobs", "local_jobs", "waiting", "began", "late", "refused")

    def __init__(self, params: list[torch.Tensor], ids: list[int], pos: dict[int, int], plan: BucketPlan | None,
                 count: int, scale: float):
        self.params = params            # the trained parameters, in order
        self.ids = ids                  # their ids
        self.pos = pos                  # a parameter's id -> its position
        self.fired = [0] * len(params)  # gradient accumulations seen per parameter
        self.order: list[int] = []      # observed boundary: the order parameters first fired in
        self.observe = plan is None
        self.count = count              # micro-batches of the window
        self.scale = scale              # the loss scale of its gradients
        self.next = 0                   # the next bucket to hand to the thread
        self.buckets: list[Bucket] = []
        self.jobs: list[Job] = []        # the wire's, one per bucket
        self.local_jobs: list[Job] = []  # the local parts'
        self.waiting = None if plan is None else list(plan.waiting)
        self.began = time.perf_counter()  # the first gradient of this backward
        self.late: str | None = None    # a gradient that came after its bucket went to the thread
        self.refused: str | None = None  # the window's agreement failed: no bucket goes on the wire


def plan_from(order: list[int], bw: Backward, params: list[torch.Tensor], bucket_bytes: int) -> BucketPlan:
    """The plan for ``params`` from rank 0's observed ``order`` (parameters it saw no gradient for follow in
    reverse parameter order), expecting each parameter as often as ``bw`` (this rank's observed backward)
    saw it, at least once, so that a parameter without a gradient holds its bucket until ``step()``."""
    order = list(order)
    seen = set(order)
    order += [i for i in reversed(range(len(params))) if i not in seen]
    nbytes = [p.numel() * p.element_size() for p in params]
    return BucketPlan(order, nbytes, [max(1, n) for n in bw.fired], bucket_bytes, bw.ids)
