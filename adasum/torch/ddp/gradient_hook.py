"""The gradient form: :class:`AdasumState` and :func:`adasum_hook`, the bucket's gradients reduced over MPI
(Adasum, sum or mean) on the state's communication thread."""

# No ``from __future__ import annotations`` here: DDP checks the hooks' return annotation as an object.
import torch
from mpi4py import MPI

from ...call.allreduce import Op
from ..window.compress import Wire
from .comm_state import CommState

__all__ = ["AdasumState", "adasum_hook"]


class AdasumState(CommState):
    """The state of :func:`adasum_hook`: the communicator, the op (``"adasum"``, ``"sum"`` or ``"mean"``)
    and the wire (``compression`` None, ``"fp16"`` or ``"bf16"``). ``overlap``: reduce on the state's
    communication thread while backward goes on (default), or inside the hook (False)."""

    def __init__(self, comm: MPI.Intracomm | None = None, op: str = "adasum", compression: str | None = None,
                 overlap: bool = True):
        try:
            self.op = Op(op).value
        except ValueError:
            raise ValueError(f"op must be one of 'adasum', 'sum', 'mean', got {op!r}") from None
        self.wire = Wire(compression)
        super().__init__(comm, overlap)


def adasum_hook(state: AdasumState, bucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: the bucket's gradients reduced over MPI, per parameter, in place, on the
    state's communication thread; the future completes once they are (with the error, where one was
    raised)."""
    grads = bucket.gradients()

    def work() -> None:
        if state.op == "adasum":
            state.wire.adasum_(grads, state.comm)
        else:
            state.wire.sum_(grads, state.comm, mean=state.op == "mean")
    return state._submit(bucket.buffer(), work)
