"""Adasum allreduce over MPI (Maleki et al., MLSys 2021) for numpy, torch and cupy buffers.

``adasum_allreduce(tensors)`` combines every rank's tensors with the Adasum rule, layer by layer, over a
binary tree of ranks, by recursive vector halving, so each rank sends about as many bytes as a
bandwidth-optimal allreduce. ``adasum.torch.DistributedOptimizer`` applies it to weight deltas in training.
"""

from .call.allreduce import Op, adasum_allreduce, adasum_allreduce_inplace
from .adapters import kernels_backend, set_kernels_backend
from .runtime.context import Traffic, count_traffic, release_buffers
from .runtime.stall import AdasumCollectiveError, AdasumStallError
from .settings import Settings, configure, get_small_message_bytes, set_small_message_bytes
from .settings import current as current_settings
from .runtime.gpu import cuda_aware_mpi, get_gpu_transport, set_gpu_transport
from .runtime.agreement import AdasumMismatchError
from .runtime.launch import AdasumLaunchError
from .runtime.world import local_rank, local_size, rank, size

__all__ = [
    "Op",
    "adasum_allreduce",
    "adasum_allreduce_inplace",
    "Settings",
    "configure",
    "current_settings",
    "get_small_message_bytes",
    "set_small_message_bytes",
    "kernels_backend",
    "set_kernels_backend",
    "AdasumCollectiveError",
    "AdasumMismatchError",
    "AdasumStallError",
    "AdasumLaunchError",
    "Traffic",
    "count_traffic",
    "cuda_aware_mpi",
    "get_gpu_transport",
    "set_gpu_transport",
    "release_buffers",
    "rank",
    "size",
    "local_rank",
    "local_size",
]

__version__ = "0.2.0"
