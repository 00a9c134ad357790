"""Training with torch: :class:`DistributedOptimizer` (Adasum on weight deltas, or sum/mean of gradients,
with micro-batch accumulation), a scheduler that steps once per accumulation window, broadcasting from a
root rank, and checkpoints that resume bitwise."""

from .accumulate import AccumulationWindow, BoundaryScheduler
from .broadcast import broadcast_optimizer_state, broadcast_parameters
from .checkpoint import load_checkpoint, read_checkpoint, save_checkpoint
from .optimizer import DistributedOptimizer

__all__ = [
    "DistributedOptimizer",
    "AccumulationWindow",
    "BoundaryScheduler",
    "broadcast_parameters",
    "broadcast_optimizer_state",
    "save_checkpoint",
    "load_checkpoint",
    "read_checkpoint",
]
