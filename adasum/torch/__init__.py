"""Training with torch: :class:`DistributedOptimizer` (Adasum on weight deltas, or sum/mean of gradients,
with micro-batch accumulation), a scheduler that steps once per accumulation window, broadcasting from a
root rank, and checkpoints that resume bitwise; ``torch.distributed`` started from MPI (:func:`init_process_group`) and
DDP communication hooks (:mod:`adasum.torch.ddp`)."""

from . import elastic
from .distributed import init_process_group
from .optimizer import DistributedOptimizer
from .options import Options
from .state.broadcast import broadcast_optimizer_state, broadcast_parameters
from .state.checkpoint import load_checkpoint, read_checkpoint, save_checkpoint
from .window.accumulate import AccumulationWindow, BoundaryScheduler

__all__ = [
    "DistributedOptimizer",
    "Options",
    "AccumulationWindow",
    "BoundaryScheduler",
    "broadcast_parameters",
    "broadcast_optimizer_state",
    "save_checkpoint",
    "load_checkpoint",
    "read_checkpoint",
    "init_process_group",
    "elastic",
]
