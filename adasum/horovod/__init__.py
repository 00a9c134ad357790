"""Horovod's torch API, mapped onto this library, so that a script written for ``horovod.torch`` runs after
changing only its import::

    import adasum.horovod as hvd     # was: import horovod.torch as hvd

    hvd.init()
    torch.cuda.set_device(hvd.local_rank())
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), op=hvd.Adasum,
                                   backward_passes_per_step=2, compression=hvd.Compression.fp16)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)

The world is ``MPI.COMM_WORLD`` (the survivors' communicator after an elastic reset). ``init()`` is
collective; the synchronous calls work without it, the asynchronous calls, ``join()`` and process sets
raise ``ValueError`` until it was called. What the façade keeps between calls (the handles' thread and
communicator, the process sets, the pending handles, the 16-bit wires) is one object that ``init()`` makes
and ``shutdown()`` closes (:mod:`.facade`); importing this module calls no MPI.
Where the meaning differs from Horovod's:

- ``Adasum`` runs at any number of ranks (Horovod's needs a power of two), combining with the size-weighted
  tree described in docs/semantics.md; at a power of two it is the same tree.
- There is no background negotiation by name: every rank of a process set makes its calls in the same
  order, as in MPI. Each call starts with one small exchange in which the ranks compare what they passed
  (op, dtype, shape, root, whether they track gradients): where they differ every rank raises
  :class:`~adasum.AdasumMismatchError`, which is a ``ValueError`` and a ``HorovodInternalError`` (a
  ``RuntimeError``); a rank that does not come makes the others raise ``AdasumStallError`` (also a
  ``HorovodInternalError``) after the setting ``stall_timeout``.
- The asynchronous calls (``allreduce_async`` and the others, ``poll``, ``synchronize``) run on one
  communication thread of the library, over their own duplicate of the communicator, in the order they
  were made; the synchronous calls run on the calling thread. A pending call's ``name`` may not be reused
  until its handle is synchronized (``ValueError``).
- ``join()`` answers the other ranks' ``allreduce``/``grouped_allreduce`` (Sum, Average, Adasum) with zeros
  until every rank joined, as Horovod does; their other calls raise ``HorovodInternalError`` on them. It
  answers only this module's calls on the whole world (not ``DistributedOptimizer``'s reductions).
- Process sets (``ProcessSet``, ``add_process_set``, ``remove_process_set``, ``process_set=``) are MPI
  sub-communicators; adding and removing one is collective over the world.
- ``reducescatter`` reduces the whole tensor, then keeps this rank's rows.
- ``DistributedOptimizer`` is :class:`adasum.torch.DistributedOptimizer` with Horovod's ``synchronize()``
  and ``skip_synchronize()``. As in Horovod, the script calls ``step()`` once after
  ``backward_passes_per_step`` backward passes, whose gradients add up in ``.grad``. ``overlap=True`` (a
  keyword passed on to the library's optimizer) takes effect only when ``backward_passes_per_step`` is 1.
  ``gradient_predivide_factor`` and ``groups`` are not supported. Sparse gradients (``nn.Embedding(sparse=True)``)
  are reduced as Horovod reduces them, gathered or with ``sparse_as_dense`` (:mod:`.sparse`).
- ``Compression.fp16`` sends 16-bit values, scaled by a power of two that every rank agrees on, and
  combines them in float32: half the bytes of float32 on the wire.
- Elastic training (``hvd.elastic.run``, ``TorchState``, ``ObjectState``, ``ElasticSampler``; :mod:`.elastic_api`)
  needs an MPI with ULFM (Open MPI 5, ``mpiexec --with-ft ulfm``): ranks that die are dropped and the
  survivors go on from the last commit; with ``ADASUM_ELASTIC_REPLACE=1`` the world grows back to its launch
  size at the next commit (``HostsUpdatedInterrupt``, as Horovod's). The world is then the new
  communicator. An exception on one rank ends the job unless ``hvd.elastic.run(on_error="leave")``.
- Not provided (``NotImplementedError`` naming what to use): Gloo, the timeline and ``SyncBatchNorm``.
"""

from __future__ import annotations

from .basics import (Adasum, Average, BF16Compressor, Compression, FP16Compressor, HorovodInternalError, Max, Min,
                     NoneCompressor, Product, Sum, ccl_built, cross_rank, cross_size, cuda_built, ddl_built,
                     gloo_built, gloo_enabled, local_rank, local_size, mpi_built, mpi_enabled,
                     mpi_threads_supported, nccl_built, rank, rocm_built, size)
from .blocking import (allgather, allgather_object, allreduce, allreduce_, alltoall, barrier, broadcast, broadcast_,
                       broadcast_object, grouped_allgather, grouped_allreduce, grouped_allreduce_,
                       grouped_reducescatter, join, reducescatter)
from .handles import (allgather_async, allreduce_async, allreduce_async_, alltoall_async, broadcast_async,
                      broadcast_async_, grouped_allgather_async, grouped_allreduce_async, grouped_allreduce_async_,
                      grouped_reducescatter_async, poll, reducescatter_async, sparse_allreduce_async, synchronize)
from .optimizer_api import DistributedOptimizer, broadcast_optimizer_state, broadcast_parameters
from . import elastic_api as elastic
from .process_sets import (ProcessSet, add_process_set, global_process_set, init, is_initialized,
                           remove_process_set, shutdown)

__all__ = ["init", "shutdown", "is_initialized", "size", "rank", "local_size", "local_rank", "cross_rank",
           "cross_size", "Adasum", "Average", "Sum", "Min", "Max", "Product", "Compression", "NoneCompressor",
           "FP16Compressor", "BF16Compressor", "HorovodInternalError", "DistributedOptimizer",
           "broadcast_parameters", "broadcast_optimizer_state", "allreduce", "allreduce_", "allreduce_async",
           "allreduce_async_", "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async",
           "grouped_allreduce_async_", "allgather", "allgather_async", "grouped_allgather",
           "grouped_allgather_async", "broadcast", "broadcast_", "broadcast_async", "broadcast_async_", "alltoall",
           "alltoall_async", "reducescatter", "reducescatter_async", "grouped_reducescatter",
           "grouped_reducescatter_async", "sparse_allreduce_async", "poll", "synchronize", "broadcast_object",
           "allgather_object", "barrier", "join", "ProcessSet", "global_process_set", "add_process_set",
           "remove_process_set", "mpi_built", "gloo_built", "nccl_built", "ddl_built", "ccl_built", "cuda_built",
           "rocm_built", "mpi_threads_supported", "mpi_enabled", "gloo_enabled", "start_timeline",
           "stop_timeline", "SyncBatchNorm", "elastic"]


def _not_provided(name: str, why: str):
    def call(*args, **kwargs):
        raise NotImplementedError(f"adasum.horovod.{name} is not provided: {why}")

    call.__name__ = name
    call.__doc__ = f"Not provided: raises NotImplementedError ({why})."
    return call


_TIMELINE = "Horovod's timeline records its background negotiation, which this library has no equivalent of: " \
            "use torch.profiler, or adasum.count_traffic() for the bytes each call sends"
start_timeline = _not_provided("start_timeline", _TIMELINE)
stop_timeline = _not_provided("stop_timeline", _TIMELINE)
SyncBatchNorm = _not_provided("SyncBatchNorm", "use torch.nn.SyncBatchNorm after adasum.torch.init_process_group() "
                                               "(torch.distributed over the same ranks)")
