"""Hierarchical Adasum (mean inside a node, Adasum across nodes) against ``reference_hierarchical``.

The node layout is read from ``Split_type(COMM_TYPE_SHARED)``, so every test is valid under any launch: a
plain ``mpiexec -n N`` puts all ranks on one node (the result is the mean); scripts/run_tests.py also
launches these tests on emulated nodes (hostfiles/emulated-*.txt) and then sets ``ADASUM_TEST_NODES`` to
the layout that launch must produce, e.g. ``"0,1,4;2,3"`` for nodes {0, 1, 4} and {2, 3}.
"""

from __future__ import annotations


import numpy as np
import pytest
from mpi4py import MPI

import adasum
from adasum.adapters import NumpyAdapter
from adasum.runtime.context import context_for
from adasum.runtime.topology import node_layout
from adasum.schedules.fusion import Group, Operand
from adasum.schedules.hierarchical import _slice_bounds, _slice_group, hierarchical_reduce
from adasum.rule.reference import reference_allreduce, reference_hierarchical

from helpers import (EPS, KIND_DTYPES, as_f64, assert_identical_across_ranks, cupy, expected_nodes, gpu_transport,
                     kind_context, make, rel_l2, world_nodes)

# Layer sizes 0, 1, odd, and one larger than all the others together, so that slicing a fused buffer
# between the ranks of a node cuts through layers.
SHAPES = [(0,), (1,), (7,), (3, 5), (2, 3, 21), (2,)]


def tolerance(dtype: str) -> float:
    """Relative L2 error allowed against the float64 reference.

    float32/float64: 100 eps. 16-bit floats: 16 eps, since the node mean and every level of the tree over
    (at most 8) nodes round the vector to the 16-bit dtype once, each adding up to half an eps per element.
    """
    return (16 if dtype in ("float16", "bfloat16") else 100) * EPS[dtype]


def rank_values(rank: int, seed: int, shapes=SHAPES) -> list[np.ndarray]:
    rng = np.random.default_rng([seed, rank])
    return [rng.standard_normal(s) for s in shapes]






def check(comm, got, want, dtypes) -> None:
    for i, (g, w, dt) in enumerate(zip(got, want, dtypes)):
        err = rel_l2(as_f64(g).ravel(), np.asarray(w).ravel())
        assert err <= tolerance(dt), (f"rank {comm.Get_rank()}: tensor {i} ({dt}, {w.size} elements) has "
                                      f"relative L2 error {err:.3g} > {tolerance(dt):.3g}")
    assert_identical_across_ranks(comm, got)


# --- serial ------------------------------------------------------------------------------------------------

def test_slices_cover_every_layer_exactly_once():
    shapes = [(5,), (0,), (1,), (40,), (3,)]
    a = NumpyAdapter()
    bounds = np.concatenate([[0], np.cumsum([int(np.prod(s)) for s in shapes])])
    g = Operand(Group(a, "cpu", "float64", list(range(len(shapes))), shapes, bounds),
                np.arange(bounds[-1], dtype=float))
    for m in (1, 2, 3, 4, 7, 60):
        edges = _slice_bounds(g.size, m)
        parts = [_slice_group(g, lo, hi) for lo, hi in zip(edges[:-1], edges[1:])]
        assert all(len(p.bounds) == len(bounds) for p in parts)
        for layer in range(len(shapes)):
            pieces = [p.buffer[p.bounds[layer]:p.bounds[layer + 1]] for p in parts]
            np.testing.assert_array_equal(np.concatenate(pieces), g.buffer[bounds[layer]:bounds[layer + 1]])


def test_single_process_returns_input_unchanged():
    x = [np.arange(5.0), np.ones((2, 3), dtype=np.float32)]
    out = adasum.adasum_allreduce(x, comm=MPI.COMM_SELF, hierarchical=True)
    for a, b in zip(out, x):
        np.testing.assert_array_equal(a, b)


# --- MPI ---------------------------------------------------------------------------------------------------

@pytest.mark.mpi
def test_layout_is_the_shared_memory_split(comm):
    with context_for(comm).call("finding the node layout") as call:
        layout = node_layout(call)
    nodes = world_nodes(comm)
    assert layout.nodes == nodes
    assert comm.Get_rank() in layout.nodes[layout.node]
    assert layout.slices == min(len(n) for n in nodes)
    assert layout.counts == [len(n) for n in nodes]
    with context_for(comm).call("finding the node layout") as call:
        assert node_layout(call) is layout  # kept, not rebuilt
    assert (adasum.local_rank(comm), adasum.local_size(comm)) == (layout.local_rank, len(layout.nodes[layout.node]))
    want = expected_nodes()
    if want is not None:
        assert nodes == want, f"this launch should make nodes {want}, Split_type(COMM_TYPE_SHARED) gives {nodes}"


@pytest.mark.mpi
@pytest.mark.parametrize("kind,dtype", KIND_DTYPES)
def test_matches_reference(comm, kind, dtype):
    size, rank = comm.Get_size(), comm.Get_rank()
    inputs = [[make(v, kind, dtype) for v in rank_values(r, 11)] for r in range(size)]
    mine = inputs[rank]
    before = [as_f64(t).copy() for t in mine]
    with kind_context(kind):
        out = adasum.adasum_allreduce(mine, hierarchical=True)
    want = reference_hierarchical([[as_f64(t) for t in ts] for ts in inputs], world_nodes(comm))
    check(comm, out, want, [dtype] * len(out))
    for i, (t, b) in enumerate(zip(mine, before)):
        np.testing.assert_array_equal(as_f64(t), b, err_msg=f"rank {rank}: input {i} was modified")
    for t, o in zip(mine, out):
        assert type(o) is type(t) and tuple(o.shape) == tuple(t.shape) and o.dtype == t.dtype


@pytest.mark.mpi
@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_mixed_float32_float64(comm, kind):
    size, rank = comm.Get_size(), comm.Get_rank()
    dtypes = ["float32", "float64", "float64", "float32", "float32", "float64"]
    inputs = [[make(v, kind, dt) for v, dt in zip(rank_values(r, 12), dtypes)] for r in range(size)]
    out = adasum.adasum_allreduce(inputs[rank], hierarchical=True)
    want = reference_hierarchical([[as_f64(t) for t in ts] for ts in inputs], world_nodes(comm))
    check(comm, out, want, dtypes)


@pytest.mark.mpi
def test_inplace_equals_out_of_place(comm):
    rank = comm.Get_rank()
    values = rank_values(rank, 13)
    out = adasum.adasum_allreduce([v.copy() for v in values], hierarchical=True)
    # The same fused buffer, so bitwise the same result; the Fortran-ordered tensors are non-contiguous.
    inplace = [np.asfortranarray(v) for v in values]
    adasum.adasum_allreduce_inplace(inplace, hierarchical=True)
    for i, (a, b) in enumerate(zip(inplace, out)):
        np.testing.assert_array_equal(as_f64(a), as_f64(b), err_msg=f"rank {rank}: tensor {i}")


@pytest.mark.mpi
def test_parallel_inputs_give_the_mean_over_all_ranks(comm):
    """Parallel vectors: the node means are parallel, and the tree weighted by ranks per node gives the mean
    over all ranks, not the mean of node means (they differ when nodes are unequal)."""
    size, rank = comm.Get_size(), comm.Get_rank()
    direction = np.linspace(1.0, 2.0, 37)
    out = adasum.adasum_allreduce((rank + 1.0) * direction, hierarchical=True)
    np.testing.assert_allclose(out, (size + 1) / 2 * direction, rtol=1e-13)


@pytest.mark.mpi
def test_orthogonal_nodes_give_the_sum_of_node_means(comm):
    nodes = world_nodes(comm)
    node = next(i for i, ranks in enumerate(nodes) if comm.Get_rank() in ranks)
    x = np.zeros(len(nodes) * 3)
    x[3 * node:3 * node + 3] = [comm.Get_rank() + 1.0, 2.0, -1.0]
    out = adasum.adasum_allreduce(x, hierarchical=True)
    want = np.zeros_like(x)
    for i, ranks in enumerate(nodes):
        want[3 * i:3 * i + 3] = [np.mean([r + 1.0 for r in ranks]), 2.0, -1.0]
    np.testing.assert_allclose(out, want, rtol=1e-14)


@pytest.mark.mpi
def test_one_rank_per_node_is_plain_adasum(comm):
    """On a communicator with one rank per node (each node's lowest rank) the hierarchical mode is the
    plain Adasum tree by recursive halving, bitwise."""
    lowest = [min(ranks) for ranks in world_nodes(comm)]
    leaders = comm.Split(0 if comm.Get_rank() in lowest else MPI.UNDEFINED, comm.Get_rank())
    if leaders == MPI.COMM_NULL:
        return
    threshold = adasum.get_small_message_bytes()
    adasum.set_small_message_bytes(0)  # plain Adasum by halving, as the hierarchical mode runs it
    try:
        for dtype in ("float32", "float64"):
            x = [make(v, "numpy", dtype) for v in rank_values(leaders.Get_rank(), 14)]
            hier = adasum.adasum_allreduce(x, comm=leaders, hierarchical=True)
            flat = adasum.adasum_allreduce(x, comm=leaders)
            for i, (a, b) in enumerate(zip(hier, flat)):
                np.testing.assert_array_equal(a, b, err_msg=f"rank {comm.Get_rank()}: tensor {i} ({dtype})")
    finally:
        adasum.set_small_message_bytes(threshold)
        leaders.Free()


@pytest.mark.mpi
@pytest.mark.parametrize("kind,dtype", [("numpy", "float64"), ("torch", "float32"), ("torch", "bfloat16")])
def test_one_node_is_the_mean(comm, kind, dtype):
    """On the communicator of one node the hierarchical mode is the mean over its ranks."""
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    try:
        size, rank = node.Get_size(), node.Get_rank()
        inputs = [[make(v, kind, dtype) for v in rank_values(r, 15)] for r in range(size)]
        out = adasum.adasum_allreduce(inputs[rank], comm=node, hierarchical=True)
        want = reference_allreduce([[as_f64(t) for t in ts] for ts in inputs], op="mean")
        check(node, out, want, [dtype] * len(out))
    finally:
        node.Free()


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["staged", "direct"])
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_device_buffers_both_transports(comm, mode, dtype):
    """cupy arrays (or the stand-in) with the node collectives on device memory and through host staging."""
    size, rank = comm.Get_size(), comm.Get_rank()
    inputs = [[make(v, "cupy", dtype) for v in rank_values(r, 16)] for r in range(size)]
    with gpu_transport(mode):
        out = adasum.adasum_allreduce(inputs[rank], hierarchical=True)
    assert all(isinstance(o, cupy.ndarray) for o in out)
    want = reference_hierarchical([[as_f64(t) for t in ts] for ts in inputs], world_nodes(comm))
    check(comm, out, want, [dtype] * len(out))


@pytest.mark.mpi
@pytest.mark.parametrize("kind,mode", [("numpy", "auto"), ("torch", "auto"), ("cupy", "staged"),
                                       ("cupy", "direct")])
def test_16bit_node_sum_does_not_overflow(comm, kind, mode):
    """40000 is a float16 number but twice it is not: the node sum must be taken in float32."""
    x = make(np.full(9, 40000.0), kind, "float16")
    with gpu_transport(mode):
        out = adasum.adasum_allreduce([x], hierarchical=True)[0]
    np.testing.assert_array_equal(as_f64(out), np.full(9, 40000.0))


@pytest.mark.mpi
def test_nan_on_one_rank_poisons_its_layer_everywhere(comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    values = rank_values(rank, 17)
    if rank == size - 1:
        values[4].flat[5] = np.nan
    out = adasum.adasum_allreduce(values, hierarchical=True)
    assert not np.isfinite(out[4]).all(), f"rank {rank}: the NaN of rank {size - 1} was lost"
    assert_identical_across_ranks(comm, out)


@pytest.mark.mpi
def test_hierarchical_needs_op_adasum(comm):
    with pytest.raises(ValueError, match="hierarchical"):
        adasum.adasum_allreduce(np.ones(3), op="sum", hierarchical=True)


@pytest.mark.mpi
def test_direct_call_skips_empty_groups(comm):
    """hierarchical_reduce on groups of which some are empty leaves those alone and reduces the rest."""
    ctx = context_for(comm)
    a = ctx.adapters.numpy
    empty = Operand(Group(a, "cpu", "float64", [0], [(0,)], np.array([0, 0])), np.zeros(0))
    full = Operand(Group(a, "cpu", "float64", [1], [(4,)], np.array([0, 4])), np.full(4, comm.Get_rank() + 1.0))
    with ctx.call("hierarchical_reduce") as call:  # a call in flight: its settings snapshot
        hierarchical_reduce(call, [empty, full])
    np.testing.assert_allclose(full.buffer, np.full(4, (comm.Get_size() + 1) / 2), rtol=1e-14)

