"""Who am I in the job: the rank and size of a communicator, and of this rank's node.

Training scripts need these before anything else: ``local_rank()`` picks the GPU
(``torch.cuda.set_device(adasum.local_rank())``), ``rank()`` and ``size()`` shard the data. A node is a
group of ``comm.Split_type(MPI.COMM_TYPE_SHARED)``: the ranks that share memory, as the hierarchical mode
sees them, with local ranks in rank order.
"""

from __future__ import annotations

from mpi4py import MPI

from .context import check_comm, context_for
from .errors import NOT_JOINED, AdasumNotJoinedError
from .topology import node_layout

__all__ = ["rank", "size", "local_rank", "local_size", "node_rank", "node_count"]


def rank(comm: MPI.Intracomm | None = None) -> int:
    """This process's rank in ``comm`` (default ``MPI.COMM_WORLD``)."""
    return check_comm(comm).Get_rank()


def size(comm: MPI.Intracomm | None = None) -> int:
    """The number of ranks in ``comm`` (default ``MPI.COMM_WORLD``)."""
    return check_comm(comm).Get_size()


def _layout(comm: MPI.Intracomm | None):
    ctx = context_for(comm)
    if ctx.nodes is not None:
        return ctx.nodes
    try:
        with ctx.call("finding the node layout") as call:  # collective: a numbered call, stall-watched
            return node_layout(call)
    except AdasumNotJoinedError:
        raise AdasumNotJoinedError(
            f"local_rank()/local_size() (hvd.local_rank(), the node's ranks, found together): {NOT_JOINED}. "
            "Every rank can call it once this process joined, in a reset callback "
            "(state.register_reset_callbacks); it then numbers the new world's ranks on the node, not the "
            "GPUs they hold: give a newcomer the device the dead rank freed") from None


def local_rank(comm: MPI.Intracomm | None = None) -> int:
    """This rank's position among the ranks of ``comm`` on its node: 0 for the node's lowest rank, then 1,
    2, … in rank order, up to ``local_size(comm) - 1``. One GPU per rank: ``torch.cuda.set_device(local_rank())``.

    Collective the first time on a communicator (every rank of ``comm`` must call it, or
    :func:`local_size`, or a hierarchical allreduce): the node layout is found then and kept with the
    communicator, so later calls do not communicate.
    """
    return _layout(comm).local_rank


def local_size(comm: MPI.Intracomm | None = None) -> int:
    """The number of ranks of ``comm`` on this rank's node (nodes may differ in size). Collective the first
    time on a communicator, as :func:`local_rank`."""
    layout = _layout(comm)
    return len(layout.nodes[layout.node])


def node_rank(comm: MPI.Intracomm | None = None) -> int:
    """The index of this rank's node among the nodes of ``comm`` (nodes ordered by their lowest rank).
    Collective the first time on a communicator, as :func:`local_rank`."""
    return _layout(comm).node


def node_count(comm: MPI.Intracomm | None = None) -> int:
    """The number of nodes ``comm`` spans. Collective the first time on a communicator, as
    :func:`local_rank`."""
    return len(_layout(comm).nodes)
