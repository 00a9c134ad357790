"""A lane: the one kind of background communication the library runs. Overlap with backward, ``delay=1``'s
combine, the DDP hooks and Horovod's asynchronous calls each own one :class:`Lane`: a duplicate of the
user's communicator (the library's own, so its messages never meet the user's), one thread that runs the
jobs it is given in order, the :class:`~adasum.runtime.context.Context` flags of that communicator (set
here, from the constructor's arguments), and the two ways a lane ends:

- :meth:`Lane.close` (collective in effect): the jobs already given run, the thread ends, the communicator
  is freed. Every rank closes after handing over the same jobs.
- :meth:`Lane.drop` (the owner collected, or the interpreter exiting): never waits for a collective, since
  the other ranks may never enter the one a job is in. Jobs not begun end with an error; a job inside a
  collective has its communicator given up (``Context.broken``: a wait there raises within
  :data:`adasum.runtime.stall.GIVE_UP_EVERY`), and the thread frees the communicator last.

A job's wait (:meth:`Lane.wait`) returns its error rather than raising, and never outlives the thread: a
job whose thread ended without running it ends with an error. Any use after the lane ended raises at once.
The lane holds nothing of its owner: a job's function is dropped once it ran.
"""

from __future__ import annotations

import queue
import threading
import time
import traceback
from typing import Callable

from mpi4py import MPI

from .context import check_comm, context_for, library_comm
from .faults import is_revoked

__all__ = ["GIVE_UP_WAIT", "Job", "Lane", "LaneClosedError"]

# A dropped lane waits at most this long for a thread that was inside a collective to give it up (the stall
# inspector's GIVE_UP_EVERY, or the collective's own end where every rank entered it).
GIVE_UP_WAIT = 1.0
# How often a waiting owner checks that the lane's thread is still alive.
_ALIVE_EVERY = 0.5


class LaneClosedError(RuntimeError):
    """A lane was used after it was closed or dropped."""


class Job:
    """One job on a lane's thread; ``times``: when it was given, began and ended (``time.perf_counter()``)."""

    __slots__ = ("fn", "done", "error", "times")

    def __init__(self, fn: Callable[[], None] | None):
        self.fn = fn
        self.done = threading.Event()
        self.error: str | None = None
        self.times = [time.perf_counter(), 0.0, 0.0]

    def wait(self) -> None:
        self.done.wait()


def _finished(error: str | None = None) -> Job:
    job = Job(None)
    job.error = error
    job.times[1] = job.times[2] = time.perf_counter()
    job.done.set()
    return job


class _Serving:
    """What a thread and its lane share: whether the lane was dropped (jobs not begun are then skipped),
    whether a job runs, and what the thread runs last once dropped."""

    __slots__ = ("dropped", "running", "at_end")

    def __init__(self) -> None:
        self.dropped = False
        self.running = False
        self.at_end: Callable[[], None] | None = None


class _Thread:
    """A daemon thread that runs the jobs it is given, one at a time, in order; an exception stays on its
    job (:attr:`Job.error`, with the traceback) and the thread goes on."""

    def __init__(self, name: str):
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.serving = _Serving()
        self.thread = threading.Thread(target=_serve, args=(self.jobs, self.serving), name=name, daemon=True)
        self.thread.start()

    def submit(self, fn: Callable[[], None]) -> Job:
        job = Job(fn)
        self.jobs.put(job)
        return job

    def close(self) -> None:
        if self.thread.is_alive():
            self.jobs.put(None)
            if threading.current_thread() is not self.thread:
                self.thread.join()

    def drop(self, at_end: Callable[[], None] | None) -> tuple[bool, bool]:
        """End without running the jobs not begun, running ``at_end`` last; waits only where no job runs.
        Returns whether the thread has ended, and whether a job was running once no job could begin."""
        serving = self.serving
        serving.at_end = at_end
        serving.dropped = True  # before reading running: a job that starts after this is skipped
        running = serving.running
        self.jobs.put(None)
        if running or threading.current_thread() is self.thread:
            return False, running
        self.thread.join()
        return True, False


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
                    raise LaneClosedError("the lane was dropped before this job's turn")
                job.fn()
            except BaseException as e:  # noqa: BLE001 - the owner reads it on every rank
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


class Lane:
    """One owner's background communication (the module docstring).

    Args:
        comm: the user's communicator; the lane works on a duplicate of its own (``owned``), or, with
            ``owned=False``, on the library's shared duplicate of it (``None``: of ``MPI.COMM_WORLD``, looked
            up at first use, for owners made where no collective may run, such as an unpickled hook state).
        name: the thread's name (the rank is added).
        threaded: run jobs on a thread (None: where ``comm`` has several ranks and MPI gives
            ``MPI_THREAD_MULTIPLE``, decided at first use); otherwise :meth:`submit` runs them inline.
        worker: also start a second thread for work that is not communication (the overlap's local steps),
            so that one job's compute runs while the previous one's bytes are on the wire.
        on_end: run once when the lane ends (closed or dropped), before its communicator is freed.
        may_give_up: whether :meth:`drop` may give up a wait on the communicator (default: where owned);
            such waits look every ``GIVE_UP_EVERY`` seconds whether they were given up.
    """

    def __init__(self, comm: MPI.Intracomm | None, name: str, *, owned: bool = True, threaded: bool | None = None,
                 worker: bool = False, on_end: Callable[[], None] | None = None, may_give_up: bool | None = None):
        self.owned = owned
        self._may_give_up = owned if may_give_up is None else bool(may_give_up)
        self._user = comm
        if owned:
            comm = check_comm(comm)
            self._comm: MPI.Intracomm | None = comm.Dup()
            library_comm(self._comm)  # the library's state on it, made here on the owner's thread
        else:
            self._comm = None if comm is None else library_comm(comm)
        self.rank = MPI.COMM_WORLD.Get_rank() if comm is None else comm.Get_rank()
        self.name = f"{name}-{self.rank}"
        self._threaded = threaded
        self._worker_wanted = worker
        self._on_end = on_end
        self._thread: _Thread | None = None
        self._worker: _Thread | None = None
        self.closed = False
        if owned and threaded is not False:
            self._set_flags()  # a lane's own communicator is waited on beside the compute from the start

    def _set_flags(self) -> None:
        ctx = context_for(self.comm)
        ctx.beside_compute = True  # its waits nap under waiting="auto" (adasum.runtime.waiting)
        ctx.may_give_up = self._may_give_up  # drop() may give a wait there up (adasum.runtime.stall)

    @property
    def comm(self) -> MPI.Intracomm:
        """The communicator the lane's jobs communicate on."""
        if self._comm is None:
            self._check_open("its communicator")
            self._comm = library_comm(self._user)
        return self._comm

    @property
    def threaded(self) -> bool:
        if self._threaded is None:
            self._threaded = self.comm.Get_size() > 1 and MPI.Query_thread() == MPI.THREAD_MULTIPLE
        return self._threaded

    @property
    def busy(self) -> bool:
        """Whether a job runs on the lane's thread now."""
        return self._thread is not None and self._thread.serving.running

    def _check_open(self, what: str) -> None:
        if self.closed:
            raise LaneClosedError(f"rank {self.rank}: {what}: the lane {self.name} was closed (its owner was "
                                  "closed or dropped); make a new one")

    def _start(self) -> _Thread:
        if self._thread is None:
            self._set_flags()
            self._thread = _Thread(self.name)
            if self._worker_wanted:
                self._worker = _Thread(self.name + "-work")
        return self._thread

    def submit(self, fn: Callable[[], None], what: str = "a job") -> Job:
        """Run ``fn`` on the lane's thread, after the jobs given before (inline where not threaded; its
        error is then on the returned job too)."""
        self._check_open(what)
        if not self.threaded:
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - as on the thread
                return _finished(f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
            return _finished()
        return self._start().submit(fn)

    def submit_work(self, fn: Callable[[], None], what: str = "a job") -> Job:
        """Run ``fn`` on the worker thread (``worker=True``), in order with the other work given."""
        self._check_open(what)
        self._start()
        if self._worker is None:
            raise ValueError(f"the lane {self.name} has no worker thread (construct it with worker=True)")
        return self._worker.submit(fn)

    def wait(self, job: Job | None) -> str | None:
        """Wait for ``job`` (None: nothing); its error, or None. Never outlives the thread: a job whose
        thread ended before it ran ends with an error."""
        if job is None:
            return None
        while not job.done.wait(_ALIVE_EVERY):
            threads = [t for t in (self._thread, self._worker) if t is not None]
            if not any(t.thread.is_alive() for t in threads):
                if not job.done.is_set():
                    return f"the lane {self.name} ended before this job ran"
        return job.error

    def close(self) -> None:
        """Run the jobs given, end the threads, free the communicator (collective in effect: every rank
        closes after giving the same jobs). Idempotent."""
        if self.closed:
            return
        self.closed = True
        for t in (self._worker, self._thread):
            if t is not None:
                t.close()
        self._ended()

    def drop(self, why: str = "its owner was dropped") -> None:
        """The end of a lane nobody closed: never waits for a collective (the module docstring)."""
        if self.closed:
            return
        self.closed = True
        if self._worker is not None:
            self._worker.drop(None)
        thread = self._thread
        if thread is None or MPI.Is_finalized():
            if thread is not None:
                thread.drop(None)
            self._ended()
            return
        ended, running = thread.drop(self._ended)  # running: read once no job can begin any more
        if not ended:
            if running and self._may_give_up and self._comm is not None:
                ctx = context_for(self._comm)
                ctx.broken = ctx.broken or f"{why} while its lane {self.name} waited in a collective"
            # A wait there now ends within GIVE_UP_EVERY; a collective every rank entered ends on its own.
            # Either way the thread is out of the MPI library before the interpreter's exit finalizes it.
            if threading.current_thread() is not thread.thread:
                thread.thread.join(GIVE_UP_WAIT)

    def _ended(self) -> None:
        on_end, self._on_end = self._on_end, None
        if on_end is not None:
            on_end()
        comm, self._comm = self._comm, None
        if self.owned and comm is not None and not MPI.Is_finalized() and not is_revoked(comm):
            comm.Free()  # the library's state on it (and its own duplicate) goes with it
