"""Device buffers: transport choice, host staging and device checks.

On machines without a GPU these run against the numpy-backed cupy stand-in (tests/cupy_standin.py), which
takes the same code paths as cupy on a GPU; with real cupy or CUDA they run on the device.
"""

from __future__ import annotations

import ctypes
import importlib.util
import itertools
import os
import sys

import numpy as np
import pytest
from helpers import torch  # imported at first use: the numpy tests run without torch
from mpi4py import MPI

import adasum
from adasum.rule.reference import reference_allreduce
from helpers import (CUDA, CUPY_IS_REAL, FLOATS, as_f64, assert_identical_across_ranks, cupy, gpu_transport, make,
                     raw_bytes, rel_l2)
from test_allreduce import _tolerance

TRITON = importlib.util.find_spec("triton") is not None
if not CUDA:
    # the segmented Triton kernels then run on CPU tensors, under triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytestmark = pytest.mark.mpi(min_size=1)


def _mpix_cuda_support() -> bool:
    """What the loaded MPI library itself answers to MPIX_Query_cuda_support (False where it has none)."""
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "libmpi" in line.rsplit("/", 1)[-1]}
    for path in sorted(paths):
        fn = getattr(ctypes.CDLL(path), "MPIX_Query_cuda_support", None)
        if fn is not None:
            fn.restype = ctypes.c_int
            return bool(fn())
    return False


def _layers(comm, rank, kind="cupy"):
    return [make(np.random.default_rng([41, rank, i]).standard_normal(n), kind, "float32")
            for i, n in enumerate((1000, 3, 4097))]


@pytest.mark.parametrize("mode", ["staged", "direct"])
def test_cupy_transports_agree_with_reference(comm, mode):
    size, rank = comm.Get_size(), comm.Get_rank()
    data = [[as_f64(t) for t in _layers(comm, r)] for r in range(size)]
    with gpu_transport(mode):
        out = adasum.adasum_allreduce(_layers(comm, rank))
    assert all(isinstance(o, cupy.ndarray) for o in out)
    for o, w in zip(out, reference_allreduce(data)):
        assert rel_l2(as_f64(o), w) <= 100 * 2.0 ** -23
    assert_identical_across_ranks(comm, out)


@pytest.mark.skipif(CUPY_IS_REAL, reason="counts calls of the stand-in module")
def test_staging_reuses_host_buffers_and_synchronises(comm):
    from cupy_standin import calls

    if comm.Get_size() == 1:
        pytest.skip("a single rank exchanges nothing")
    adasum.release_buffers()
    with gpu_transport("staged"):
        adasum.adasum_allreduce(_layers(comm, comm.Get_rank()))
        before = dict(calls)
        for _ in range(3):
            adasum.adasum_allreduce(_layers(comm, comm.Get_rank()))
    assert calls["pinned"] == before["pinned"], "staging buffers must be allocated once and reused"
    assert calls["get"] > before["get"] and calls["set"] > before["set"]
    with gpu_transport("direct"):
        before = dict(calls)
        adasum.adasum_allreduce(_layers(comm, comm.Get_rank()))
    assert calls["get"] == before["get"] and calls["set"] == before["set"], "direct mode must not stage"
    assert calls["synchronize"] > before["synchronize"], "the device must be synchronised before MPI reads"


@pytest.mark.skipif(not TRITON, reason="needs triton")
@pytest.mark.parametrize("kind", ["torch-cuda" if CUDA else "torch", "cupy"])
@pytest.mark.parametrize("schedule", ["doubling", "halving"])
def test_triton_kernels_match_the_per_layer_kernels(comm, kind, schedule):
    """The whole call through the segmented Triton kernels (device_kernels="triton"; torch CPU tensors and
    the cupy stand-in under triton's interpreter where no GPU exists) against the per-layer kernels and the
    float64 reference, for every dtype of the kind at once."""
    size, rank = comm.Get_size(), comm.Get_rank()
    shapes = [(1000,), (3,), (0,), (4097,), (17, 2), (20000,)]
    dtypes = list(itertools.islice(itertools.cycle(FLOATS[kind]), len(shapes)))

    def layers(r):
        rng = np.random.default_rng([43, r])
        return [make(rng.standard_normal(s), kind, d) for s, d in zip(shapes, dtypes)]

    data = [[as_f64(t) for t in layers(r)] for r in range(size)]
    old = adasum.configure(small_message_bytes=0 if schedule == "halving" else 1 << 30)
    try:
        adasum.configure(device_kernels="per-layer")
        per_layer = adasum.adasum_allreduce(layers(rank))
        adasum.configure(device_kernels="triton")
        fast = adasum.adasum_allreduce(layers(rank))
        inplace = layers(rank)
        adasum.adasum_allreduce_inplace(inplace)
    finally:
        adasum.configure(old)
    assert_identical_across_ranks(comm, fast)
    # a folded-out rank combines nothing: the ranks that combine load the kernels
    assert comm.allreduce(int("adasum.kernels._triton" in sys.modules), op=MPI.MAX), "the Triton kernels never ran"
    for f, i, p, w, d in zip(fast, inplace, per_layer, reference_allreduce(data), dtypes):
        assert f.dtype == p.dtype and f.shape == p.shape
        assert rel_l2(as_f64(f), w) <= _tolerance(d, size)
        assert rel_l2(as_f64(f), as_f64(p)) <= _tolerance(d, size)
        np.testing.assert_array_equal(as_f64(i), as_f64(f))


def test_device_kernels_setting_is_validated():
    before = adasum.current_settings()
    with pytest.raises(ValueError, match="device kernels must be one of"):
        adasum.configure(device_kernels="cuda")
    assert adasum.current_settings() is before  # a refused change changes nothing


@pytest.mark.skipif(CUPY_IS_REAL, reason="counts calls of the stand-in module")
@pytest.mark.parametrize("op", ["adasum", "sum", "mean"])
@pytest.mark.parametrize("small", [None, 0], ids=["doubling", "halving"])
def test_a_staged_call_is_one_host_round_trip(comm, small, op):
    """A staged call is the round trip a user would write: per call the tensors packed on the device, one
    copy to the host, one wait, the host call, one copy back and one wait; nothing made after the first
    call; the bits of the host call on host copies of the same values, whatever chunk_bytes says."""
    from cupy_standin import calls

    if comm.Get_size() == 1:
        pytest.skip("a single rank exchanges nothing")
    rank = comm.Get_rank()
    adasum.release_buffers()
    host = adasum.adasum_allreduce([as_f64(t).astype(np.float32) for t in _layers(comm, rank)], op=op)
    for chunk in (0, 1000):
        old = adasum.configure(chunk_bytes=chunk, small_message_bytes=small)
        try:
            with gpu_transport("staged"):
                adasum.adasum_allreduce(_layers(comm, rank), op=op)
                before = dict(calls)
                out = adasum.adasum_allreduce(_layers(comm, rank), op=op)
                mine = _layers(comm, rank)
                assert adasum.adasum_allreduce_inplace(mine, op=op) is mine
        finally:
            adasum.configure(old)
        made = {k: calls[k] - before[k] for k in calls}
        assert made["pinned"] == made["streams"] == made["events"] == 0, "made once and reused"
        assert made["get"] == made["set"] == 2, "one copy each way per call, packed on the device"
        assert made["event_synchronize"] == made["synchronize"] == 2, "one wait each way per call"
        for got, want in zip(out, host):
            assert isinstance(got, cupy.ndarray) and raw_bytes(got) == raw_bytes(want)
        for got, want in zip(mine, host):
            assert raw_bytes(got) == raw_bytes(want)
    assert_identical_across_ranks(comm, out)


@pytest.mark.skipif(CUPY_IS_REAL, reason="counts calls of the stand-in module")
def test_a_staged_call_of_mixed_dtypes_copies_each_tensor_once_each_way(comm):
    from cupy_standin import calls

    if comm.Get_size() == 1:
        pytest.skip("a single rank exchanges nothing")
    rank, size = comm.Get_rank(), comm.Get_size()
    mine = [make(np.full(5, rank + 1.0), "cupy", "float16"), make(np.arange(6.0) + rank, "cupy", "float64"),
            make(np.zeros(0), "cupy", "float32")]
    with gpu_transport("staged"):
        adasum.adasum_allreduce_inplace(mine, op="sum")
        before = dict(calls)
        out = adasum.adasum_allreduce(mine, op="mean")
    assert calls["get"] - before["get"] == calls["set"] - before["set"] == 2  # the empty one moves nothing
    assert calls["event_synchronize"] - before["event_synchronize"] == calls["synchronize"] - before["synchronize"] == 1
    # after the sum every rank holds the same values: their mean is those values
    np.testing.assert_array_equal(as_f64(out[0]), np.full(5, size * (size + 1) / 2))
    np.testing.assert_array_equal(as_f64(out[1]), np.arange(6.0) * size + size * (size - 1) / 2)
    assert out[2].shape == (0,)


def test_sum_and_mean_on_device_buffers(comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    for mode in ("staged", "direct"):
        with gpu_transport(mode):
            out = adasum.adasum_allreduce([make(np.full(5, rank + 1.0), "cupy", "float16"),
                                           make(np.arange(4.0), "cupy", "float64")], op="mean")
        np.testing.assert_allclose(as_f64(out[0]), np.full(5, (size + 1) / 2), rtol=1e-3)
        np.testing.assert_array_equal(as_f64(out[1]), np.arange(4.0))


def test_cpu_array_among_device_arrays_is_rejected(comm):
    with pytest.raises(ValueError, match=r"tensor 1 is on cpu but tensor 0 is on cuda:0; all tensors of one call "
                                         r"must be on one device"):
        adasum.adasum_allreduce([make(np.ones(3), "cupy", "float32"), np.ones(3, np.float32)])


def test_transport_mode_validation_and_cuda_aware_override():
    before = adasum.current_settings()
    with pytest.raises(ValueError, match="gpu transport must be one of"):
        adasum.set_gpu_transport("nvlink")
    assert adasum.current_settings() is before
    old = adasum.configure(cuda_aware=True)
    try:
        assert adasum.cuda_aware_mpi() is True
        adasum.configure(cuda_aware=False)
        assert adasum.cuda_aware_mpi() is False
        adasum.configure(cuda_aware=None)
        assert adasum.cuda_aware_mpi() is _mpix_cuda_support()  # asks the MPI library itself
    finally:
        adasum.configure(old)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_torch_cuda_matches_cpu_bitwise_per_rank(comm):
    rank = comm.Get_rank()
    cpu = _layers(comm, rank, "torch")
    gpu = [t.cuda() for t in cpu]
    for mode in ("staged", "direct") if adasum.cuda_aware_mpi() else ("staged",):
        with gpu_transport(mode):
            out = adasum.adasum_allreduce(gpu)
        assert all(o.is_cuda for o in out)
        want = adasum.adasum_allreduce(cpu)
        for o, w in zip(out, want):
            assert rel_l2(as_f64(o), as_f64(w)) <= 10 * 2.0 ** -23
        assert_identical_across_ranks(comm, out)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_torch_cuda_and_cpu_in_one_call_rejected(comm):
    with pytest.raises(ValueError, match="must be on one device"):
        adasum.adasum_allreduce([torch.ones(2, device="cuda"), torch.ones(2)])


@pytest.mark.parametrize("op", ["adasum", "sum"])
def test_a_staged_rank_among_host_ranks_computes_their_bits(comm, op):
    """A rank whose device tensors go through the host round trip computes on the host, as the ranks that
    pass host arrays do: every rank ends with the same bits."""
    rank = comm.Get_rank()
    values = [np.random.default_rng([7, rank, i]).standard_normal(n).astype(np.float32) for i, n in enumerate((900, 5))]
    if adasum.cuda_aware_mpi():
        pytest.skip("device buffers go to MPI directly here: they are not staged")
    mine = [make(v, "cupy", "float32") for v in values] if rank == 0 else values
    out = adasum.adasum_allreduce(mine, op=op)  # "auto": staged for the device arrays, direct for the host
    assert all(isinstance(o, cupy.ndarray) for o in out) or rank != 0
    assert_identical_across_ranks(comm, [as_f64(o) for o in out])
