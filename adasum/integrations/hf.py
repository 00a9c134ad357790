"""The Hugging Face Trainer with Adasum: :class:`AdasumCallback` registers the DDP communication hook of
:mod:`adasum.torch.ddp` on the model the Trainer wraps in DDP::

    import adasum.torch as at
    from adasum.hf import AdasumCallback

    at.init_process_group()                       # under mpiexec: torch.distributed from MPI
    trainer = Trainer(model=model, args=TrainingArguments(..., ddp_backend="gloo"), train_dataset=data)
    trainer.add_callback(AdasumCallback(trainer))  # op="adasum" by default; "sum", "mean", compression=...
    trainer.train()

    mpiexec -n 4 python -m mpi4py train.py

The Trainer wraps the model in DDP inside ``train()`` and hands its callbacks the unwrapped model, so the
callback holds the Trainer and registers the hook on ``trainer.model_wrapped`` before the first step.
"""

from __future__ import annotations

from mpi4py import MPI
from torch.nn.parallel import DistributedDataParallel
from transformers import TrainerCallback

from ..torch.ddp import AdasumState, adasum_hook

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
                raise RuntimeError(f"AdasumCallback: the Trainer's model is a {type(model).__name__}, not "
                                   "DistributedDataParallel: start torch.distributed first "
                                   "(adasum.torch.init_process_group()) and launch with mpiexec on 2 or more ranks")
            self.state = AdasumState(**self.options)
            model.register_comm_hook(self.state, adasum_hook)
        return control
