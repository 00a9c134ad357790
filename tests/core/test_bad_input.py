"""Bad input raises on every rank, names the rank, the tensor and the numbers, and loses nothing."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import torch  # imported at first use: the numpy tests run without torch

import adasum
from adasum import AdasumMismatchError
from adasum.rule.reference import tree_combine

pytestmark = pytest.mark.mpi(min_size=1)


def _last(comm) -> int:
    return comm.Get_size() - 1


def _still_works(comm):
    """The communicator is usable afterwards: a correct call gives the right answer on every rank."""
    size = comm.Get_size()
    out = adasum.adasum_allreduce(np.full(3, comm.Get_rank() + 1.0), op="sum")
    np.testing.assert_array_equal(out, np.full(3, size * (size + 1) / 2))


def _inputs(comm):
    return [np.ones((4, 3), np.float32) * (comm.Get_rank() + 1), np.arange(5.0), np.zeros(2, np.float32)]


@pytest.mark.mpi(min_size=2)
def test_shape_mismatch_names_tensor_and_ranks(comm):
    tensors = _inputs(comm)
    if comm.Get_rank() == _last(comm):
        tensors[1] = np.arange(6.0)
    keep = [t.copy() for t in tensors]
    with pytest.raises(AdasumMismatchError) as info:
        adasum.adasum_allreduce_inplace(tensors)
    msg = str(info.value)
    assert f"tensor 1 differs: rank {_last(comm)} has shape (6,) float64, rank 0 has shape (5,) float64" in msg
    for t, k in zip(tensors, keep):  # nothing was written
        np.testing.assert_array_equal(t, k)
    _still_works(comm)


@pytest.mark.mpi(min_size=2)
def test_dtype_mismatch(comm):
    tensors = _inputs(comm)
    if comm.Get_rank() == 1:
        tensors[2] = tensors[2].astype(np.float64)
    with pytest.raises(AdasumMismatchError, match=r"tensor 2 differs: rank 1 has shape \(2,\) float64, rank 0 "
                                                  r"has shape \(2,\) float32"):
        adasum.adasum_allreduce(tensors)
    _still_works(comm)


@pytest.mark.mpi(min_size=2)
def test_count_mismatch(comm):
    tensors = _inputs(comm)
    if comm.Get_rank() == _last(comm):
        tensors = tensors[:2]
    with pytest.raises(AdasumMismatchError, match=rf"number of tensors \(first differing tensor index 2\): "
                                                  rf"rank {_last(comm)} passes 2, rank 0 passes 3"):
        adasum.adasum_allreduce(tensors)
    _still_works(comm)


@pytest.mark.mpi(min_size=2)
def test_op_mismatch(comm):
    op = "mean" if comm.Get_rank() == 1 else adasum.Op.ADASUM
    with pytest.raises(AdasumMismatchError, match="ranks disagree on the op: rank 1 has 'mean', rank 0 has 'adasum'"):
        adasum.adasum_allreduce(_inputs(comm), op=op)
    _still_works(comm)


@pytest.mark.mpi(min_size=2)
def test_small_message_threshold_mismatch(comm):
    """Ranks set to different schedules would wait for messages that never come; they raise instead."""
    before = adasum.get_small_message_bytes()
    try:
        adasum.set_small_message_bytes(999 if comm.Get_rank() == 1 else 0)
        with pytest.raises(AdasumMismatchError, match=r"ranks disagree on the settings: rank 1 has "
                                                      r"\{.*'small-message bytes': 999.*\}, rank 0 has "):
            adasum.adasum_allreduce(_inputs(comm))
    finally:
        adasum.set_small_message_bytes(before)
    _still_works(comm)
    with pytest.raises(ValueError, match=">= 0 bytes, got -1"):
        adasum.set_small_message_bytes(-1)


@pytest.mark.mpi(min_size=2)
def test_device_kernels_mismatch(comm):
    """Ranks on different device kernels would round the combine differently and drift apart; they raise."""
    old = adasum.configure(device_kernels="per-layer" if comm.Get_rank() == 1 else "auto")
    try:
        with pytest.raises(AdasumMismatchError, match=r"ranks disagree on the settings: rank 1 has "
                                                      r"\{.*'device kernels': 2.*\}, rank 0 has "):
            adasum.adasum_allreduce(_inputs(comm))
    finally:
        adasum.configure(old)
    _still_works(comm)


def test_unsupported_dtype_on_one_rank_raises_type_error_everywhere(comm):
    tensors = _inputs(comm)
    if comm.Get_rank() == _last(comm):
        tensors[0] = np.ones((4, 3), np.complex64)
    with pytest.raises(TypeError, match=rf"rank {_last(comm)}: tensor 0 has unsupported dtype complex64"):
        adasum.adasum_allreduce(tensors)
    _still_works(comm)


@pytest.mark.parametrize("op", ["adasum", "sum"])
def test_read_only_tensor_in_place_raises_everywhere_and_writes_nothing(comm, op):
    tensors = _inputs(comm)
    before = [t.copy() for t in tensors]
    if comm.Get_rank() == _last(comm):
        tensors[1].flags.writeable = False
    with pytest.raises(ValueError, match=rf"rank {_last(comm)}: tensor 1 is read-only"):
        adasum.adasum_allreduce_inplace(tensors, op=op)
    for i, (t, b) in enumerate(zip(tensors, before)):
        np.testing.assert_array_equal(t, b, err_msg=f"tensor {i} was written")
    _still_works(comm)


def test_unsupported_type_raises_type_error_everywhere(comm):
    tensors = _inputs(comm)
    if comm.Get_rank() == 0:
        tensors[2] = [0.0, 0.0]
    with pytest.raises(TypeError, match=r"rank 0: tensor 2 is a builtins.list; adasum takes numpy arrays"):
        adasum.adasum_allreduce(tensors)
    _still_works(comm)


@pytest.mark.parametrize("op", ["adasum", "mean"])
def test_integers_only_for_sum(comm, op):
    with pytest.raises(TypeError, match=rf"tensor 0 has integer dtype int32, which op '{op}' does not take"):
        adasum.adasum_allreduce([torch.ones(3, dtype=torch.int32)], op=op)
    _still_works(comm)


def test_unknown_op(comm):
    with pytest.raises(ValueError, match=r"op must be one of 'adasum', 'sum', 'mean', got 'max'"):
        adasum.adasum_allreduce([np.ones(2)], op="max")
    _still_works(comm)


def test_mixed_devices_rejected(comm):
    # A host array among device arrays; on machines without a GPU cupy's stand-in is the device array.
    from helpers import cupy

    with pytest.raises(ValueError, match=r"tensor 1 is on cuda:0 but tensor 0 is on cpu"):
        adasum.adasum_allreduce([np.ones(2), cupy.asarray(np.ones(2))])
    _still_works(comm)


def test_not_a_communicator(comm):
    with pytest.raises(TypeError, match="comm must be an mpi4py intracommunicator, got str"):
        adasum.adasum_allreduce(np.ones(2), comm="world")


def test_nan_on_one_rank_is_seen_by_all(comm):
    x = np.ones(10) * (comm.Get_rank() + 1)
    if comm.Get_rank() == _last(comm):
        x[3] = np.nan
    for op in ("adasum", "sum", "mean"):
        out = adasum.adasum_allreduce(x, op=op)
        assert comm.allgather(bool(np.isnan(out).any())) == [True] * comm.Get_size()
    _still_works(comm)


# Tensors torch can make but the library cannot reduce. Each is refused in the agreement, before any data
# moves: every rank raises the TypeError of the rank that holds it, and the communicator stays usable.
def _sparse():
    return torch.ones(4).to_sparse()


def _meta():
    return torch.empty(4, device="meta")


def _nested():
    return torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])


def _quantized():
    return torch.quantize_per_tensor(torch.ones(4), 0.5, 0, torch.qint8)


_REFUSED = {
    "sparse": (_sparse, r"is a sparse tensor \(layout torch.sparse_coo\)"),
    "meta": (_meta, r"is on the meta device, which holds no data"),
    "nested": (_nested, r"is a nested tensor"),
    "quantized": (_quantized, r"is a quantized tensor \(dtype torch.qint8\)"),
}


def _still_reduces(comm):
    """A following good Adasum call on torch tensors gives the serial reference's result on every rank."""
    rank, size = comm.Get_rank(), comm.Get_size()
    vectors = [np.arange(1.0, 7.0) * (r + 1) + (r % 2) * np.array([1, -1, 0, 2, 0, -3.0]) for r in range(size)]
    out = adasum.adasum_allreduce([torch.from_numpy(vectors[rank].copy())])
    np.testing.assert_allclose(out[0].numpy(), tree_combine(vectors), rtol=1e-12)
    _still_works(comm)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("case", sorted(_REFUSED))
def test_unreducible_tensor_on_one_rank_is_refused_everywhere(comm, case, inplace):
    make, what = _REFUSED[case]
    bad = _last(comm)
    tensors = [torch.ones(3) * (comm.Get_rank() + 1), torch.ones(4), torch.zeros(2)]
    if comm.Get_rank() == bad:
        tensors[1] = make()
    call = adasum.adasum_allreduce_inplace if inplace else adasum.adasum_allreduce
    with pytest.raises(TypeError, match=rf"^rank {bad}: tensor 1 {what}"):
        call(tensors)
    assert float(tensors[0][0]) == comm.Get_rank() + 1  # nothing was written
    _still_reduces(comm)


@pytest.mark.parametrize("op", ["adasum", "sum"])
@pytest.mark.parametrize("case", sorted(_REFUSED))
def test_unreducible_tensor_on_every_rank_is_refused_everywhere(comm, case, op):
    make, what = _REFUSED[case]
    with pytest.raises(TypeError, match=rf"^rank 0: tensor 0 {what}"):
        adasum.adasum_allreduce([make()], op=op)
    _still_reduces(comm)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_host_kernels_mismatch_is_refused_on_every_rank(comm, dtype):
    """The compiled and the numpy kernels round differently: ranks on different ones are refused, naming the
    ranks and the setting, in the call's one agreement; the same call on one back end goes on working."""
    if adasum.kernels_backend() != "c":
        pytest.skip("the compiled kernels are not in use here")
    rank = comm.Get_rank()
    data = [np.linspace(-1, 1, 1000).astype(dtype) * (rank + 1) + rank, np.full(7, rank + 0.5, dtype)]
    old = adasum.configure(kernels="numpy" if rank == 1 else "c")
    try:
        for _ in range(2):  # the first call and a call of a kept plan
            with pytest.raises(AdasumMismatchError, match=r"ranks disagree on the settings: rank 1 has "
                                                          r"\{.*'host kernels': 0.*\}, rank 0 has \{.*'host "
                                                          r"kernels': 1.*\}; they differ in 'host kernels'"):
                adasum.adasum_allreduce(data)
    finally:
        adasum.configure(old)
    out = adasum.adasum_allreduce(data)  # one back end everywhere: every rank holds the same bits
    for got, theirs in zip(out, comm.bcast(out, root=0)):
        np.testing.assert_array_equal(got, theirs)
    _still_works(comm)


def test_forced_triton_refuses_cpu_tensors_before_any_data_moves(comm, monkeypatch):
    """device_kernels='triton' with CPU torch tensors: a TypeError on every rank that names the rank, the
    tensor and the fix (where triton is missing, an ImportError that says so); the inputs stay as they were."""
    from adasum.kernels import segmented

    rank = comm.Get_rank()
    x = [torch.full((5,), float(rank + 1)), torch.arange(3.0)]
    before = [t.clone() for t in x]
    old = adasum.configure(device_kernels="triton")
    try:
        if not segmented.available():
            with pytest.raises(ImportError, match=r"rank \d+: the setting device_kernels='triton' needs torch "
                                                  r"and triton"):
                adasum.adasum_allreduce_inplace(x)
        monkeypatch.setattr(segmented, "available", lambda: True)  # triton present, no interpreter
        with pytest.raises(TypeError, match=r"rank \d+: tensor 0 is a CPU tensor, and the setting "
                                            r"device_kernels='triton' .*TRITON_INTERPRET=1"):
            adasum.adasum_allreduce_inplace(x)
        # numpy arrays never take Triton's kernels: the setting leaves them alone
        out = adasum.adasum_allreduce(np.full(4, rank + 1.0), op="adasum")
        assert np.isfinite(out).all()
    finally:
        adasum.configure(old)
    for t, b in zip(x, before):
        assert torch.equal(t, b)
    _still_works(comm)
