"""The communication threads of the training layer: a :class:`CommThread` runs the jobs it is given, one at a
time, in the order given, each a :class:`Job` that the giver waits on. The overlap engine runs two of them
(:mod:`.overlap`: a bucket's local part, its collective), ``delay=1`` one (:mod:`.delayed`), the Horovod
façade one for its asynchronous calls.

A thread holds only its queue and what it shares with its owner (:class:`_Serving`), and drops a job's
function once it ran: nothing keeps the owner alive, and :meth:`CommThread.drop` ends a thread without
waiting for a job that is inside a collective.
"""

from __future__ import annotations

import queue
import threading
import time
import traceback
from typing import Callable

__all__ = ["GIVE_UP_WAIT", "CommThread", "Job"]


# An owner's drop() (the overlap engine's, delay=1's) waits at most this long for a thread that was inside
# a collective to give it up (adasum.runtime.stall's GIVE_UP_EVERY, and the collective's own end where every
# rank entered it).
GIVE_UP_WAIT = 1.0


class Job:
    """One bucket's work on the thread; :meth:`wait` returns once it ran. ``times``: when it was given to
    the thread, began and ended (``time.perf_counter()``)."""

    __slots__ = ("fn", "done", "error", "times")

    def __init__(self, fn: Callable[[], None]):
        self.fn: Callable[[], None] | None = fn
        self.done = threading.Event()
        self.error: str | None = None
        self.times = [time.perf_counter(), 0.0, 0.0]

    def wait(self) -> None:
        self.done.wait()


class _Serving:
    """What a :class:`CommThread` and its owner share: whether the owner dropped it (jobs not begun are then
    skipped), whether a job is running, and what the thread runs last once dropped (``at_end``)."""

    __slots__ = ("dropped", "running", "at_end")

    def __init__(self) -> None:
        self.dropped = False
        self.running = False
        self.at_end: Callable[[], None] | None = None


class CommThread:
    """A daemon thread that runs the jobs it is given, one at a time, in the order given. An exception in
    a job is kept on the job (:attr:`Job.error`, with its traceback) and the thread goes on. A job's function
    is dropped once it ran, so the thread holds nothing of a finished job."""

    def __init__(self, name: str):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._serving = _Serving()
        self._thread = threading.Thread(target=_serve, args=(self._jobs, self._serving), name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], None]) -> Job:
        job = Job(fn)
        self._jobs.put(job)
        return job

    def close(self) -> None:
        """Run the jobs already given, then end the thread (and wait for it, unless called from it)."""
        if self._thread.is_alive():
            self._jobs.put(None)
            if threading.current_thread() is not self._thread:
                self._thread.join()

    def join(self, timeout: float) -> None:
        """Wait at most ``timeout`` seconds for the thread to end (unless called from it)."""
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def drop(self, at_end: Callable[[], None] | None = None) -> bool:
        """End the thread without running the jobs it has not begun (they end with an error), and run
        ``at_end`` on it last. Waits for the thread only where no job is running; a running job is left to
        finish (or to fail) on its own. Returns whether the thread has ended."""
        serving = self._serving
        serving.at_end = at_end
        serving.dropped = True  # before reading running: a job that starts after this sees it and is skipped
        running = serving.running
        self._jobs.put(None)
        if running or threading.current_thread() is self._thread:
            return False
        self._thread.join()
        return True


def _serve(jobs: queue.SimpleQueue, serving: _Serving) -> None:
    try:
        while True:
            job = jobs.get()
            if job is None:
                return
            serving.running = True
            job.times[1] = time.perf_counter()
            try:
                if serving.dropped:
                    raise RuntimeError("the optimizer was dropped before this bucket's turn")
                job.fn()
            except BaseException as e:  # noqa: BLE001 - reported in step() on every rank
                job.error = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
            finally:
                job.times[2] = time.perf_counter()
                job.fn = None
                job.done.set()
                del job
                serving.running = False
    finally:
        at_end, serving.at_end = serving.at_end, None
        if serving.dropped and at_end is not None:
            at_end()

