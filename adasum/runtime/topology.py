"""Where the ranks of a communicator sit: the node layout of the hierarchical mode (which ranks share a
node, and the node, cross-node and slice communicators made from it), built once per context.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

from . import stall

from .context import Call
from .exchange import allgather_in, failures_in, raise_found

__all__ = ["NodeLayout", "build_node_layout", "node_layout"]


@dataclass
class NodeLayout:
    """How the ranks of one communicator sit on nodes, and the communicators the hierarchical mode uses.

    ``nodes[i]`` lists the ranks of node ``i`` in rank order; nodes are ordered by their lowest rank.
    ``node_comm`` holds this rank's node (local rank = position in ``nodes[node]``). ``cross_comm`` joins
    the ranks with this rank's local rank, one per node in node order; it is ``MPI.COMM_NULL`` on local
    ranks ``slices`` and above, which hold no slice. ``slice_comm`` joins the slice holders of this node.
    """

    nodes: list[list[int]]
    node: int
    local_rank: int
    slices: int
    node_comm: MPI.Intracomm
    cross_comm: MPI.Intracomm
    slice_comm: MPI.Intracomm

    @property
    def counts(self) -> list[int]:
        """Ranks per node, in node order: the size weights of the tree over nodes."""
        return [len(ranks) for ranks in self.nodes]

    def free(self) -> None:
        """Free the communicators of the layout (when its context is freed)."""
        if MPI.Is_finalized():
            return
        for c in {id(c): c for c in (self.slice_comm, self.cross_comm, self.node_comm)}.values():
            if c != MPI.COMM_NULL:
                c.Free()


def build_node_layout(call: Call) -> NodeLayout:
    """The node layout of the communicator of ``call`` (collective, inside that call: every rank must call
    it). :func:`node_layout` builds it once per context and keeps it there."""
    comm = call.lcomm
    rank = comm.Get_rank()
    node_comm = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    local_rank = node_comm.Get_rank()
    # Local rank 0 is the node's lowest rank (key = rank), which names the node.
    lowest = np.array([rank], dtype=np.int64)
    stall.wait(call, node_comm.Ibcast([lowest, MPI.INT64_T], root=0), "exchange", 8, label="finding the node layout")
    lowest = int(lowest[0])
    firsts = allgather_in(call, lowest, "finding the node layout")
    leaders = sorted(set(firsts))
    nodes = [[r for r, f in enumerate(firsts) if f == leader] for leader in leaders]
    node = leaders.index(lowest)
    problem = None
    if nodes[node][local_rank] != rank or len(nodes[node]) != node_comm.Get_size():
        problem = (f"rank {rank}: the shared-memory split put it at local rank {local_rank} of a node of "
                   f"{node_comm.Get_size()} ranks, but the ranks naming that node are {nodes[node]}")
    # Checked together, so that a rank that fails cannot leave the others waiting in the next split.
    text = failures_in(call, problem, "checking the node layout")
    if text is not None:
        node_comm.Free()
        raise_found(rank, text, RuntimeError)
    slices = min(len(ranks) for ranks in nodes)
    holder = local_rank < slices
    cross_comm = comm.Split(local_rank if holder else MPI.UNDEFINED, key=node)
    if slices == node_comm.Get_size():
        slice_comm = node_comm
    else:
        slice_comm = node_comm.Split(0 if holder else MPI.UNDEFINED, key=local_rank)
    return NodeLayout(nodes, node, local_rank, slices, node_comm, cross_comm, slice_comm)


def node_layout(call: Call) -> NodeLayout:
    """The node layout of the communicator of ``call``, built (collectively, inside that call) on first use
    and kept by the call's context, which frees it with itself."""
    ctx = call.ctx
    if ctx.nodes is None:
        ctx.nodes = build_node_layout(call)
    return ctx.nodes
