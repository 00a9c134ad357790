"""PyTorch Lightning with Adasum: :class:`AdasumStrategy`, launched with ``mpiexec``::

    import lightning as L
    from adasum.lightning import AdasumStrategy

    trainer = L.Trainer(strategy=AdasumStrategy(), accelerator="cpu", max_epochs=10)   # or "gpu"
    trainer.fit(model, datamodule)

    mpiexec -n 8 python -m mpi4py train.py

The world (ranks, local ranks, nodes) comes from MPI: no ``devices`` or ``num_nodes`` to match. Each rank
trains on its own shard (Lightning's distributed sampler, with this strategy's ranks). The model is not
wrapped: every optimizer that ``configure_optimizers`` returns is wrapped in
:class:`adasum.torch.DistributedOptimizer` (Adasum of weight deltas; the options go through), and
parameters and buffers start from rank 0's. The module's buffers (BatchNorm's running statistics) are
kept alike by the first optimizer at the end of every window: by default their changes over the window are
averaged over the ranks (``buffers="average"``; ``"broadcast"`` takes rank 0's, None leaves them to each
rank; :mod:`adasum.torch.window.module_buffers` says why averaging is the default), so validation, checkpoints and
every later window see the same buffers on every rank. Lightning's ``accumulate_grad_batches`` maps onto the
optimizer's windows: the micro-batches before the last of a window run inside the optimizer's
``no_sync()``, and ``step()`` closes each window. ``precision="16-mixed"`` gives the optimizer Lightning's
``GradScaler``, whose scale the ranks then keep alike; ``"bf16-mixed"`` needs nothing. Metrics logged with
``sync_dist=True`` are reduced over MPI, and rank 0 writes the checkpoints (its optimizer state: with
Adasum each rank's differs, as docs/frameworks.md explains).

The Trainer's ``gradient_clip_val`` clips what the optimizer's ``clip_grad_norm_`` would: for
``op="sum"``/``"mean"`` the reduced gradient (as DDP), for ``op="adasum"`` and with local steps each rank's
own gradient before its local step (:meth:`AdasumStrategy.optimizer_step`). With local steps what a window
holds open is combined before validation, checkpoints and the end of ``fit()``, ahead of every callback and
module hook (:class:`_CombineFirst`).

Every MPI call waits through the stall inspector, so a rank that does not arrive is named, and the
settings check of each optimizer raises on every rank where the ranks disagree.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from mpi4py import MPI

from .runtime import exchange, world
from .torch.options import Options
from .call.allreduce import adasum_allreduce
from .runtime.context import check_comm
from .torch import DistributedOptimizer, broadcast_parameters
from .torch.elastic import inside_run

__all__ = ["AdasumStrategy", "MPIEnvironment"]


class MPIEnvironment(ClusterEnvironment):
    """The cluster as MPI sees it: the processes were started by ``mpiexec``."""

    def __init__(self, comm: MPI.Intracomm | None = None):
        super().__init__()
        self.comm = check_comm(comm)

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        return "127.0.0.1"

    @property
    def main_port(self) -> int:
        return 0

    @staticmethod
    def detect() -> bool:
        return True

    def world_size(self) -> int:
        return self.comm.Get_size()

    def set_world_size(self, size: int) -> None:
        """The size is MPI's."""

    def global_rank(self) -> int:
        return self.comm.Get_rank()

    def set_global_rank(self, rank: int) -> None:
        """The rank is MPI's."""

    def local_rank(self) -> int:
        return world.local_rank(self.comm)

    def node_rank(self) -> int:
        return world.node_rank(self.comm)


class AdasumStrategy(ParallelStrategy):
    """Data-parallel training over MPI with :class:`adasum.torch.DistributedOptimizer`.

    The settings (keywords, or ``options=``: the fields of :class:`adasum.torch.Options`, such as
    ``op``, ``overlap``, ``compression``, ``local_steps``, ``delay``) go to every wrapped optimizer; with local
    steps each of Lightning's optimizer steps is a local step. ``buffers`` (``"average"``, the default,
    ``"broadcast"`` or None) is how the first optimizer keeps the module's buffers alike at each window's
    end. ``comm`` (default ``MPI.COMM_WORLD``) is the world.
    """

    strategy_name = "adasum"

    def __init__(self, *, comm: MPI.Intracomm | None = None, accelerator=None, checkpoint_io=None,
                 precision_plugin=None, options: Options | None = None, **settings):
        self.options = Options.of(options, settings, "AdasumStrategy")
        env = MPIEnvironment(comm)
        self.options.raise_problems(env.comm, "AdasumStrategy")  # here, as DistributedOptimizer would in fit()
        super().__init__(accelerator=accelerator, parallel_devices=None, cluster_environment=env,
                         checkpoint_io=checkpoint_io, precision_plugin=precision_plugin)
        self.comm = env.comm

    # --- the world ----------------------------------------------------------------------------------------

    @property
    def root_device(self) -> torch.device:
        if self.parallel_devices and self.parallel_devices[0].type == "cuda":
            return torch.device("cuda", self.local_rank)
        return torch.device("cpu")

    @property
    def is_distributed(self) -> bool:
        """Tells Lightning to give each rank its own shard (a distributed sampler)."""
        return True

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def setup_environment(self) -> None:
        rank_zero_only.rank = self.global_rank
        if self.root_device.type == "cuda":
            torch.cuda.set_device(self.root_device)
        super().setup_environment()

    # --- model and optimizers -------------------------------------------------------------------------------

    def setup(self, trainer) -> None:
        if inside_run():
            raise RuntimeError(
                f"rank {self.comm.Get_rank()}: AdasumStrategy: Lightning's Trainer inside "
                "adasum.torch.elastic.run (or hvd.elastic.run) is not supported: after a rank's death the "
                "Trainer's loop, its optimizers and its progress would stay on the old world, and calling "
                "fit() again starts training over. For elastic training write the loop yourself inside "
                "elastic.run, with DistributedOptimizer or ElasticDDP; under Lightning a rank's death ends "
                "the job as it does without elastic training (docs/training.md)")
        self.model_to_device()
        super().setup(trainer)
        broadcast_parameters(self.lightning_module, root=0, comm=self.comm)
        self._install_combine(trainer)
        if trainer.state.fn == "fit":
            scaler = self._scaler()
            # the first optimizer keeps the module's buffers alike (one sum per window, not one per optimizer)
            self.optimizers = [o if isinstance(o, DistributedOptimizer) else
                               DistributedOptimizer(o, comm=self.comm, grad_scaler=scaler, options=self.options,
                                                    module=self.lightning_module if i == 0 else None)
                               for i, o in enumerate(self.optimizers)]

    def model_to_device(self) -> None:
        self.model.to(self.root_device)

    def optimizer_step(self, optimizer, closure, model=None, **kwargs):
        """Lightning's closure (forward and backward), then the optimizer's ``finalize_gradients()`` (for
        ``op="sum"``/``"mean"`` the gradients are reduced over the ranks here, ahead of ``step()``), then
        Lightning's ``on_before_optimizer_step`` hooks and gradient clipping, then the step. Clipping thus
        acts on the reduced gradient, the same on every rank, as under DDP; with ``op="adasum"`` (nothing is
        reduced before the step) and with local steps it acts on each rank's own gradient."""
        model = model or self.lightning_module
        if isinstance(optimizer, DistributedOptimizer) and self._finalizes(optimizer, model.trainer):
            closure = _Finalizing(closure, optimizer)
        if self._scaler() is None:
            return self.precision_plugin.optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        # 16-mixed: the optimizer unscales (in finalize_gradients, or at the boundary) and keeps the scale alike
        # on every rank, so MixedPrecision's own step (scaler.unscale_, scaler.step, scaler.update) is left
        # out: the base class's step runs the closure, the hooks and the clipping, then optimizer.step().
        # Lightning's clipping would refuse this optimizer (it unscales in step()), hence the error here.
        if model.trainer.gradient_clip_val:
            raise ValueError("AdasumStrategy with precision='16-mixed' does not clip gradients through the "
                             "Trainer; call optimizer.clip_grad_norm_ in on_before_optimizer_step instead")
        return Precision.optimizer_step(self.precision_plugin, optimizer, model=model, closure=closure, **kwargs)

    @staticmethod
    def _finalizes(optimizer: DistributedOptimizer, trainer) -> bool:
        """Whether the gradients are finalized before Lightning's hooks and clipping see them: always, except
        with ``op="adasum"`` and overlap where the Trainer does not clip. There finalizing would turn the
        overlap off for good (the local steps need every gradient first), and a rank's gradient is its own
        already (one micro-batch per window: Lightning accumulates under ``no_sync()``). Where it clips, the
        gradients must not change under the overlap's thread: finalized from the first step on, the
        optimizer never overlaps (DistributedOptimizer.finalize_gradients)."""
        return not (optimizer.op == "adasum" and optimizer.overlap and not trainer.gradient_clip_val)

    @contextlib.contextmanager
    def block_backward_sync(self):
        """Lightning's micro-batches before the last of an accumulation window: no reduction in them."""
        with contextlib.ExitStack() as stack:
            for opt in self.optimizers:
                if isinstance(opt, DistributedOptimizer):
                    stack.enter_context(opt.no_sync())
            yield

    def _scaler(self):
        plugin = self.precision_plugin
        return plugin.scaler if isinstance(plugin, MixedPrecision) else None

    # --- collectives ----------------------------------------------------------------------------------------

    def reduce(self, tensor, group=None, reduce_op="mean"):
        if not isinstance(tensor, torch.Tensor):
            return tensor
        op = str(getattr(reduce_op, "value", reduce_op) or "mean").lower()
        op = {"avg": "mean", "mean": "mean", "sum": "sum"}.get(op)
        if op is None:
            raise ValueError(f"AdasumStrategy reduces with 'mean' or 'sum', got {reduce_op!r}")
        out = adasum_allreduce(tensor.detach().to(torch.float64) if not tensor.is_floating_point() else tensor,
                               op=op, comm=self.comm)
        return out.to(tensor.dtype)

    def barrier(self, name: str | None = None) -> None:
        # Lightning's names are labels of the call site, not a contract between ranks (as in its own
        # strategies): every rank's barrier meets every other rank's, whatever name it passes.
        exchange.any_true(self.comm, False, what="Lightning's barrier")

    def broadcast(self, obj, src: int = 0):
        return exchange.bcast(self.comm, obj, root=src, what="Lightning's broadcast")

    def all_gather(self, tensor, group=None, sync_grads: bool = False):
        if sync_grads:
            raise NotImplementedError("AdasumStrategy.all_gather does not carry gradients (sync_grads=True)")
        parts = exchange.allgather(self.comm, tensor.detach().cpu(), what="Lightning's all_gather")
        return torch.stack(parts).to(tensor.device)

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        votes = exchange.allgather(self.comm, bool(decision), what="Lightning's decision")
        return all_(votes) if all else any(votes)

    # --- where fit() shows or ends the model: what is open is combined first ---------------------------------

    def _combine_open(self) -> None:
        """Collective: every optimizer combines its open window (``flush()``), so that every rank holds the
        same model; a rank that skipped or added a step makes every rank raise here."""
        for opt in self.optimizers:
            if isinstance(opt, DistributedOptimizer) and not opt.closed:
                opt.flush()

    def _install_combine(self, trainer) -> None:
        """Put a :class:`_CombineFirst` at the head of ``trainer.callbacks`` (once; Lightning may have
        reordered the list since an earlier fit)."""
        self._drop_combine()
        trainer.callbacks[:] = [c for c in trainer.callbacks if not isinstance(c, _CombineFirst)]
        trainer.callbacks.insert(0, _CombineFirst(self))
        self._combine_in = trainer.callbacks

    def _drop_combine(self) -> None:
        callbacks, self._combine_in = getattr(self, "_combine_in", None), None
        if callbacks is not None:
            callbacks[:] = [c for c in callbacks if not (isinstance(c, _CombineFirst) and c.strategy is self)]

    def lightning_module_state_dict(self) -> dict[str, Any]:
        self._combine_open()  # a checkpoint holds the common model (dumped on every rank)
        return super().lightning_module_state_dict()

    def teardown(self) -> None:
        # After on_train_end (or after an error, where no collective may be started): the lanes end.
        for opt in self.optimizers:
            if isinstance(opt, DistributedOptimizer):
                opt.close(combine=False)
        self._drop_combine()
        super().teardown()


class _Finalizing:
    """Lightning's closure, then the optimizer's ``finalize_gradients()``: the gradients that the hooks and
    the clipping after the closure see are those of the step (reduced, for sum/mean)."""

    def __init__(self, closure, optimizer: DistributedOptimizer):
        self.closure, self.optimizer = closure, optimizer

    def __call__(self, *args, **kwargs):
        result = self.closure(*args, **kwargs)
        self.optimizer.finalize_gradients()  # collective where the step closes a window (sum/mean)
        return result


class _CombineFirst(Callback):
    """With local steps (or ``delay=1``), combine the open window where ``fit()`` shows the model: at
    ``on_validation_start`` and ``on_train_end``.

    Lightning calls these hooks on the callbacks first (in list order), then on the LightningModule, and on
    the strategy last, so a strategy hook would combine only after every user callback and module hook had
    seen each rank's own model. Neither the evaluation loop nor the fit loop calls a strategy hook before
    them, so :class:`AdasumStrategy` puts this callback at the head of ``trainer.callbacks`` in ``setup()``
    (after Lightning ordered the list) and removes it in ``teardown()``: every callback and module hook then
    sees the combined model. It holds no state (nothing of it goes into checkpoints).
    """

    def __init__(self, strategy: AdasumStrategy):
        self.strategy = strategy

    def on_validation_start(self, trainer, pl_module) -> None:
        if trainer.strategy is self.strategy:
            self.strategy._combine_open()  # validation during fit sees the ranks' common model

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.strategy is self.strategy:
            self.strategy._combine_open()  # fit() ends with every rank's model combined


all_ = all
