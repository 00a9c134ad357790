"""adasum.rank, size, local_rank and local_size against MPI's own answers.

The node layout is computed here from ``Split_type(COMM_TYPE_SHARED)`` independently of the library. Under a
plain ``mpiexec -n N`` every rank is on one node, so local_rank equals rank; scripts/run_tests.py also runs
this file on emulated nodes (hostfiles/emulated-*.txt) and sets ``ADASUM_TEST_NODES`` to the layout that
launch must produce (e.g. ``"0,2,4;1,3"``), where local_rank differs from rank.
"""

from __future__ import annotations

import pytest
from mpi4py import MPI

import adasum
from helpers import expected_nodes, world_nodes


def check_helpers(comm: MPI.Intracomm, nodes: list[list[int]]) -> None:
    me = comm.Get_rank()
    mine = next(n for n in nodes if me in n)
    got = (adasum.rank(comm), adasum.size(comm), adasum.local_rank(comm), adasum.local_size(comm))
    want = (me, comm.Get_size(), mine.index(me), len(mine))
    assert got == want, f"rank {me}: (rank, size, local_rank, local_size) is {got}, want {want} for nodes {nodes}"


def test_one_process():
    assert (adasum.rank(MPI.COMM_SELF), adasum.size(MPI.COMM_SELF)) == (0, 1)
    assert (adasum.local_rank(MPI.COMM_SELF), adasum.local_size(MPI.COMM_SELF)) == (0, 1)


@pytest.mark.mpi
def test_defaults_are_comm_world(comm):
    world = MPI.COMM_WORLD
    assert (adasum.rank(), adasum.size()) == (world.Get_rank(), world.Get_size())
    assert (adasum.local_rank(), adasum.local_size()) == (adasum.local_rank(world), adasum.local_size(world))


@pytest.mark.mpi
def test_world_matches_the_shared_memory_split(comm):
    nodes = world_nodes(comm)
    check_helpers(comm, nodes)
    check_helpers(comm, nodes)  # the kept layout gives the same answer
    want = expected_nodes()
    if want is not None:
        assert nodes == want, f"this launch should make nodes {want}, Split_type(COMM_TYPE_SHARED) gives {nodes}"
        # On more than one node some rank's position on its node differs from its rank in the job.
        if len(want) > 1:
            differs = comm.allreduce(int(adasum.local_rank(comm) != comm.Get_rank()), op=MPI.SUM)
            assert differs > 0, f"nodes {want}: local_rank equals rank on every rank"
    else:
        # One node: a plain mpiexec on this machine.
        assert nodes == [list(range(comm.Get_size()))]
        assert adasum.local_rank(comm) == comm.Get_rank() and adasum.local_size(comm) == comm.Get_size()


@pytest.mark.mpi
def test_sub_communicator_counts_its_own_ranks(comm):
    """The helpers answer for the communicator passed: here the ranks split by parity, in reverse order."""
    sub = comm.Split(comm.Get_rank() % 2, key=-comm.Get_rank())
    try:
        check_helpers(sub, world_nodes(sub))
        assert adasum.size(sub) == len(range(comm.Get_rank() % 2, comm.Get_size(), 2))
    finally:
        sub.Free()


@pytest.mark.mpi
def test_local_ranks_on_a_node_are_0_to_local_size(comm):
    """The local ranks of one node are 0, 1, …, local_size - 1, one each, what torch.cuda.set_device needs."""
    pairs = comm.allgather((adasum.local_rank(comm), adasum.local_size(comm)))
    for node in world_nodes(comm):
        assert sorted(pairs[r][0] for r in node) == list(range(len(node)))
        assert {pairs[r][1] for r in node} == {len(node)}


@pytest.mark.mpi
def test_across_hosts_adasum_sends_no_more_than_a_bandwidth_optimal_allreduce(comm):
    """Across hosts, under the automatic threshold, a call small enough for doubling puts no more bytes on
    the link than halving (bandwidth-optimal: 2·N·(P'-1)/P' per rank after the fold to P' ranks), and a set
    threshold still chooses; on one host the threshold decides as before."""
    import numpy as np

    from adasum.runtime.context import context_for

    size = comm.Get_size()
    across = len(world_nodes(comm)) > 1
    ctx = context_for(comm)
    adasum.adasum_allreduce(np.ones(4), comm=comm)  # makes the library's duplicate
    assert ctx.across_hosts is across
    x = [np.random.default_rng([comm.Get_rank(), i]).standard_normal(n) for i, n in enumerate((1000, 24, 3001))]
    nbytes = sum(a.nbytes for a in x)
    folded = 1 << (size.bit_length() - 1)
    with adasum.count_traffic(comm) as t:
        adasum.adasum_allreduce(x, comm=comm)
    sent = comm.allreduce(t.sent_bytes, op=MPI.MAX)
    if across and folded > 2:
        fold = nbytes if size > folded else 0  # a folded-out rank's vector, and its result sent back
        assert sent <= 2 * nbytes * (folded - 1) // folded + fold + 64 * len(x)
    elif size > 1:
        assert sent >= nbytes * (folded.bit_length() - 1)  # doubling: whole vectors at every level
    old = adasum.configure(small_message_bytes=1 << 30)  # a set threshold overrides the topology
    try:
        with adasum.count_traffic(comm) as t:
            adasum.adasum_allreduce(x, comm=comm)
    finally:
        adasum.configure(old)
    if size > 1:
        assert comm.allreduce(t.sent_bytes, op=MPI.MAX) >= nbytes * (folded.bit_length() - 1)
