"""The pieces of ``DistributedOptimizer(overlap=True)``: the bucket plan that every rank shares, and the
background thread that reduces buckets while backward goes on.

A bucket is a run of parameters in the order backward finished them in the first observed boundary, as
rank 0 saw it (broadcast to every rank), cut where it holds at least ``bucket_bytes`` bytes. Every rank
hands its buckets to the thread in that order, so the collectives follow the same order on every rank
whatever order its own backward produces the gradients in: a bucket whose parameters are ready waits until
every bucket before it has been handed over.
"""

from __future__ import annotations

import queue
import threading
import traceback
from typing import Callable

__all__ = ["BucketPlan", "CommThread", "Job"]


class BucketPlan:
    """The buckets (lists of parameter indices) and, per parameter, how many gradient accumulations one
    closing backward produces (seen on this rank in the observed boundary)."""

    def __init__(self, order: list[int], nbytes: list[int], expected: list[int], bucket_bytes: int):
        self.buckets: list[list[int]] = []
        cur: list[int] = []
        size = 0
        for i in order:
            cur.append(i)
            size += nbytes[i]
            if size >= bucket_bytes:
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


class Job:
    """One bucket's work on the thread; :meth:`wait` returns once it ran."""

    __slots__ = ("fn", "done", "error")

    def __init__(self, fn: Callable[[], None]):
        self.fn = fn
        self.done = threading.Event()
        self.error: str | None = None

    def wait(self) -> None:
        self.done.wait()


class CommThread:
    """A daemon thread that runs the jobs it is given, one at a time, in the order given.

    An exception in a job is kept on the job (:attr:`Job.error`, with its traceback) and the thread goes on
    with the next job; the optimizer raises it from ``step()`` after every rank has agreed on it.
    """

    def __init__(self, name: str):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], None]) -> Job:
        job = Job(fn)
        self._jobs.put(job)
        return job

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                job.fn()
            except BaseException as e:  # noqa: BLE001 - reported in step() on this rank
                job.error = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
            finally:
                job.done.set()

    def close(self) -> None:
        if self._thread.is_alive():
            self._jobs.put(None)
            if threading.current_thread() is not self._thread:
                self._thread.join()
