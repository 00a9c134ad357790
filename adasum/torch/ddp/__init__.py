"""Adasum inside torch's ``DistributedDataParallel``, as a communication hook: an explicit state object and
a plain function, as torch's own hooks are. A model takes one hook (DDP's ``register_comm_hook`` can be
called once): one of the two below. ``examples/ddp_hook.py`` and ``examples/ddp_delta_hook.py`` are complete
scripts.

Gradients (any optimizer; Adasum of the gradients, or their sum or mean)::

    adasum.torch.init_process_group()                     # under mpiexec: torch.distributed from MPI
    model = torch.nn.parallel.DistributedDataParallel(model)
    model.register_comm_hook(AdasumState(), adasum_hook)

Weight deltas (Adasum of what each rank's optimizer *would do*, as :class:`DistributedOptimizer` does)::

    state = DeltaState(optimizer)
    model.register_comm_hook(state, adasum_delta_hook)
    ...
    loss.backward()          # the optimizer's step runs inside, bucket by bucket, on shadows of the
    optimizer.zero_grad()    # parameters; they change once, after the last bucket. Do not call
                             # optimizer.step(). Its step hooks run once per update.

The hooks reduce over MPI (on a duplicate of ``comm``), one layer per parameter, not over DDP's process
group: the collective's agreement makes a mismatch between ranks an error on every rank, and its stall
inspector names a rank that does not arrive.

Each hook returns at once a future that a communication thread of the state completes once the bucket is
reduced, so DDP goes on with backward meanwhile, as with its own allreduce hook; DDP waits for the futures
at the end of backward. The thread (one per state, started by the first hook call) takes the buckets in the
order DDP hands them over, the same on every rank, and its waits nap (the setting ``waiting``, see
:mod:`adasum.runtime.waiting`), leaving the core to backward. An error there (a mismatch, a stall, a failed
local step) completes the bucket's future with it, and ``backward()`` raises it, on every rank. The thread
ends with ``state.close()`` or when the state is collected (the DDP model that holds it deleted), without
waiting for a collective. ``overlap=False`` reduces inside the hook instead (the same results, bit for bit);
so do a single process and an MPI without ``MPI_THREAD_MULTIPLE``.
"""

from .delta_hook import DeltaState, adasum_delta_hook
from .gradient_hook import AdasumState, adasum_hook

__all__ = ["AdasumState", "adasum_hook", "DeltaState", "adasum_delta_hook"]
