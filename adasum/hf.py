"""The Hugging Face Trainer with Adasum: :class:`AdasumCallback` registers the DDP communication hook of
:mod:`adasum.torch.ddp` on the model the Trainer wraps in DDP::

    import adasum.torch as at
    from adasum.hf import AdasumCallback

    at.init_process_group()                       # under mpiexec: torch.distributed from MPI
    args = TrainingArguments(..., use_cpu=True, ddp_backend="gloo")  # use_cpu=True on a host without GPUs
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.add_callback(AdasumCallback(trainer))  # op="adasum" by default; "sum", "mean", compression=...
    trainer.train()

    mpiexec -n 4 python -m mpi4py train.py        # examples/hf_trainer.py is a complete script

The Trainer wraps the model in DDP inside ``train()`` and hands its callbacks the unwrapped model, so the
callback holds the Trainer and registers the hook on ``trainer.model_wrapped`` before the first step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from mpi4py import MPI
from torch.nn.parallel import DistributedDataParallel
from transformers import TrainerCallback
from transformers.training_args import ParallelMode

from .torch.ddp import AdasumState, adasum_hook

__all__ = ["AdasumCallback"]


class AdasumCallback(TrainerCallback):
    """Registers :func:`adasum.torch.ddp.adasum_hook` (with an :class:`~adasum.torch.ddp.AdasumState` of
    ``comm``, ``op`` and ``compression``) on the Trainer's DDP model, once, before the first step.
    ``state`` is that hook state once registered."""

    def __init__(self, trainer, *, comm: MPI.Intracomm | None = None, op: str = "adasum",
                 compression: str | None = None):
        self.trainer = trainer
        self.options = {"comm": comm, "op": op, "compression": compression}
        self.state: AdasumState | None = None

    def on_step_begin(self, args, state, control, **kwargs):
        model = self.trainer.model_wrapped
        if self.state is None:
            if not isinstance(model, DistributedDataParallel):
                raise RuntimeError(_not_wrapped(model, args))
            self.state = AdasumState(**self.options)
            model.register_comm_hook(self.state, adasum_hook)
        return control


def _not_wrapped(model, args) -> str:
    """Why the Trainer's model is not in DDP, for the error of :meth:`AdasumCallback.on_step_begin`.

    With torch.distributed running on several ranks, the Trainer wraps the model only where its arguments
    put it in distributed mode; on a host without a GPU that takes ``use_cpu=True`` (otherwise the Trainer
    runs each rank on its own, "not parallel")."""
    rank = MPI.COMM_WORLD.Get_rank()
    what = f"AdasumCallback (rank {rank}): the Trainer's model is a {type(model).__name__}, not DistributedDataParallel"
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return (f"{what}: start torch.distributed first (adasum.torch.init_process_group()) and launch with "
                "mpiexec on 2 or more ranks")
    mode = getattr(args, "parallel_mode", None)
    mode = getattr(mode, "value", mode)
    if mode != ParallelMode.DISTRIBUTED.value and not torch.cuda.is_available():
        return (f"{what}: the Trainer did not start distributed mode: pass use_cpu=True on a machine without a "
                f"GPU (TrainingArguments(..., use_cpu=True); torch.distributed has {dist.get_world_size()} ranks, "
                f"the Trainer's parallel_mode is {mode!r})")
    return (f"{what}: torch.distributed has {dist.get_world_size()} ranks but the Trainer's parallel_mode is "
            f"{mode!r}: give the Trainer arguments that start distributed mode (one GPU per rank, or use_cpu=True)")
