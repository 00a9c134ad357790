"""The library's state per communicator: freed with the communicator, bounded memory, threads. None of it
depends on the number of ranks beyond one and more than one, so each test runs at one or two world sizes
(``world_size``), where the core's other tests run at every size."""

from __future__ import annotations

import ctypes
import gc
import threading
import time

import numpy as np
import pytest
from mpi4py import MPI

import adasum
from adasum.runtime.context import context_for
from adasum.rule.reference import reference_allreduce

pytestmark = pytest.mark.mpi


def _rss() -> int:
    """Resident bytes, after asking glibc to hand back the free memory it keeps (what is measured is what
    the library and Python hold, not the allocator's cache)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _values(rank: int, n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng([seed, rank])
    return [rng.standard_normal(n).astype(np.float32), rng.standard_normal(7)]


@pytest.mark.world_size(2)
def test_communicators_can_be_made_and_freed_again_and_again(comm):
    """Each communicator's context (and the library's duplicate of it) goes with the communicator: 5000
    times at 2 ranks (MPICH runs out of communicators at about 2045 if they are not freed); other sizes
    show nothing more (300 times where run at one by hand)."""
    rank = comm.Get_rank()
    x = [np.full(3, rank + 1.0)]
    for i in range(5000 if comm.Get_size() == 2 else 300):
        dup = comm.Dup()
        out = adasum.adasum_allreduce(x, comm=dup)
        dup.Free()
        if i % 1000 == 0:
            np.testing.assert_allclose(out[0], reference_allreduce([[np.full(3, r + 1.0)] for r in range(comm.Get_size())])[0])


@pytest.mark.world_size(2)
def test_release_buffers_gives_the_memory_back(comm):
    """64 calls of 4 MiB of different shapes (64 kept plans) and release_buffers(): resident memory returns
    to within 16 MiB of what it was before them."""
    rank = comm.Get_rank()
    base = np.random.default_rng(rank).standard_normal(1 << 20).astype(np.float32)  # 4 MiB
    adasum.adasum_allreduce([base[:10]])
    adasum.release_buffers()
    gc.collect()
    before = _rss()
    for i in range(64):
        cut = 1000 * (i + 1)
        layers = [base[:cut].copy(), base[cut:].copy()]
        out = adasum.adasum_allreduce(layers)
        adasum.adasum_allreduce_inplace(layers)
        del out, layers
    grown = _rss() - before
    adasum.release_buffers()
    gc.collect()
    after = _rss()
    assert after - before < 16 << 20, (f"rank {rank}: {(after - before) / 2**20:.1f} MiB more resident after "
                                       f"release_buffers() ({grown / 2**20:.1f} MiB before it)")


@pytest.mark.world_size(2)
def test_calls_on_two_communicators_run_in_two_threads(comm):
    rank, size = comm.Get_rank(), comm.Get_size()
    comms = [comm.Dup(), comm.Dup()]
    results: dict = {}
    errors: list = []

    def work(k: int) -> None:
        try:
            for step in range(20):
                n = 100 + 1000 * k + step  # both schedules' shapes differ per thread
                results[k, step] = adasum.adasum_allreduce(_values(rank, n, seed=step + 10 * k), comm=comms[k])
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, f"rank {rank}: {errors}"
    for (k, step), out in results.items():
        n = 100 + 1000 * k + step
        want = reference_allreduce([_values(r, n, seed=step + 10 * k) for r in range(size)])
        for got, w in zip(out, want):
            np.testing.assert_allclose(got, w, rtol=2e-5, atol=1e-6)
    assert len(results) == 40
    for c in comms:
        c.Free()


@pytest.mark.world_size(2)
def test_a_second_call_on_a_busy_communicator_raises_at_once(comm):
    """Two threads of one rank calling on one communicator would mix their messages: the second call
    raises RuntimeError at once, naming the communicator and the call in flight; the first one completes."""
    rank, size = comm.Get_rank(), comm.Get_size()
    if size == 1:
        pytest.skip("needs a call that waits for another rank")
    dup = comm.Dup()
    dup.Set_name("training")
    x = [np.full(4, rank + 1.0)]
    first: dict = {}

    def call() -> None:
        first["out"] = adasum.adasum_allreduce(x, comm=dup)

    if rank != 0:
        time.sleep(1.0)  # rank 0's first call waits for this rank meanwhile
    t = threading.Thread(target=call)
    t.start()
    if rank == 0:
        time.sleep(0.3)
        started = time.perf_counter()
        with pytest.raises(RuntimeError, match=r"rank 0: adasum_allreduce on communicator 'training' while "
                                               r"another thread's call is in flight there \(call #\d+"):
            adasum.adasum_allreduce(x, comm=dup)
        assert time.perf_counter() - started < 0.5
    t.join(timeout=60)
    want = reference_allreduce([[np.full(4, r + 1.0)] for r in range(size)])[0]
    np.testing.assert_allclose(first["out"][0], want)
    np.testing.assert_allclose(adasum.adasum_allreduce(x, comm=dup)[0], want)  # still usable
    dup.Free()


@pytest.mark.world_size(1, 2)  # nothing is sent at one rank
def test_traffic_is_counted_per_communicator(comm):
    rank, size = comm.Get_rank(), comm.Get_size()
    dup = comm.Dup()
    x = [np.ones(1000, np.float32)]
    with adasum.count_traffic(comm) as on_comm, adasum.count_traffic(dup) as on_dup:
        adasum.adasum_allreduce(x, comm=dup)
    assert on_comm.sent_bytes == 0 and on_comm.scalar_bytes == 0
    assert (on_dup.sent_bytes > 0) == (size > 1)
    dup.Free()


@pytest.mark.world_size(1)  # no communication
def test_settings_are_one_validated_value():
    old = adasum.configure(chunk_bytes=1024)
    try:
        assert adasum.current_settings().chunk_bytes == 1024
        with pytest.raises(ValueError, match="gpu transport must be one of"):
            adasum.configure(gpu_transport="nvlink")
        with pytest.raises(TypeError, match="unknown setting"):
            adasum.configure(chunk_size=3)
        assert adasum.current_settings().chunk_bytes == 1024  # a failed change changes nothing
    finally:
        adasum.configure(old)
    assert adasum.current_settings() == old


@pytest.mark.world_size(2)
def test_a_call_keeps_the_settings_it_started_with(comm):
    """The snapshot a call takes on entry is what its parts see until it ends, whatever configure() does
    meanwhile (another thread's change must not reach a call after the ranks agreed on its settings)."""
    ctx = context_for(comm)
    snapshot = adasum.current_settings()
    with ctx.call("a test call") as call:
        old = adasum.configure(chunk_bytes=snapshot.chunk_bytes + 1, kernels="numpy")
        try:
            assert call.settings is snapshot
            with pytest.raises(AttributeError):
                call.settings = adasum.current_settings()  # a call is immutable
        finally:
            adasum.configure(old)
    assert not hasattr(ctx, "settings")  # the context keeps no call's state
