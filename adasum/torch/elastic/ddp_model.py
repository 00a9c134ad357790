"""A ``DistributedDataParallel`` model with one of adasum's communication hooks that follows the world in
elastic training: :class:`ElasticDDP`."""

from __future__ import annotations

import inspect
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from ...runtime import newcomer
from ...runtime.membership import world
from .process_group import restart_process_group

__all__ = ["ElasticDDP"]


class ElasticDDP:
    """``torch.nn.parallel.DistributedDataParallel`` around ``module`` with a communication hook, made again
    on the new world whenever the world changes inside :func:`~adasum.torch.elastic.run`::

        model = ElasticDDP(net, lambda: (AdasumState(), adasum_hook))                 # gradients
        model = ElasticDDP(net, lambda: (DeltaState(optimizer), adasum_delta_hook))   # weight deltas
        state = adasum.torch.elastic.State(model, optimizer, epoch=0, batch=0)

    ``comm_hook()`` returns a new hook state (on the current world: ``comm=None``) and its hook; it is
    called at construction and after every change of the world, once the old state was ended.
    ``ddp_kwargs`` go to ``DistributedDataParallel`` each time. Collective over the current world (the
    constructor and :meth:`rejoin`): the default ``torch.distributed`` process group is started on it where
    it is not (:func:`~adasum.torch.elastic.restart_process_group`, with ``backend`` and ``timeout``).

    Given to :class:`~adasum.torch.elastic.State` as its model, it is rebuilt by the state at every reset
    (:meth:`rejoin`: the old hook state's lane dropped without a collective, the old DDP's reducer
    released, the process group started again on the survivors, a new DDP and hook state), before the
    last commit is loaded; ``state_dict()`` and ``load_state_dict()`` are the module's own (no ``module.``
    prefix), so the state keeps and syncs the module. Call the model, ``no_sync()``, ``train()`` and
    ``eval()`` on it as on the DDP model; :attr:`ddp` and :attr:`hook_state` are the current ones (do not
    keep them across a reset). In a process started in place of a dead rank (growing back) the DDP model is
    made when the process joins the world."""

    def __init__(self, module: torch.nn.Module, comm_hook: Callable[[], tuple[Any, Callable]], *,
                 backend: str | None = None, timeout: timedelta | None = None, **ddp_kwargs: Any):
        _check_comm_hook(comm_hook)
        if "process_group" in ddp_kwargs:
            raise TypeError("ElasticDDP makes DDP on the default process group, which it starts again on every new "
                            "world; a process_group of your own would hold the old one: leave it out")
        self.module, self._comm_hook, self._kwargs = module, comm_hook, ddp_kwargs
        self._backend, self._timeout = backend, timeout
        self.ddp: torch.nn.parallel.DistributedDataParallel | None = None
        self.hook_state = None
        if newcomer.pending() is None:  # a newcomer builds once it joined (rejoin)
            self._build()

    def _build(self) -> None:
        restart_process_group(self._backend, timeout=self._timeout)
        self._backend = self._backend or str(dist.get_backend())  # the same again after a failure
        made = self._comm_hook()
        if not (isinstance(made, tuple) and len(made) == 2 and callable(made[1])):
            raise TypeError(f"rank {world().Get_rank()}: ElasticDDP: comm_hook() must return (hook state, hook), "
                            f"got {type(made).__name__}")
        state, hook = made
        ddp = torch.nn.parallel.DistributedDataParallel(self.module, **self._kwargs)
        ddp.register_comm_hook(state, hook)
        self.ddp, self.hook_state = ddp, state

    def rejoin(self, comm=None) -> None:
        """Collective over the current world (``comm``, which :class:`State` passes, must be it): end the
        old DDP model and hook state without a collective, then make new ones on the world."""
        if comm is not None and comm != world():
            raise ValueError(f"rank {world().Get_rank()}: ElasticDDP follows the current world "
                             "(adasum.torch.elastic.world()); it cannot rejoin another communicator")
        self._release("the world changed; ElasticDDP made a new hook state")
        self._build()

    def _release(self, why: str) -> None:
        old, state = self.ddp, self.hook_state
        self.ddp = self.hook_state = None
        abandon = getattr(state, "abandon", None)
        if callable(abandon):
            abandon(why)
        if old is not None:
            # The reducer's autograd hooks stay on the parameters while it lives (a failed backward may have
            # left it expecting gradients): released now, not whenever the old model is collected.
            for name in ("logger", "reducer"):
                old.__dict__.pop(name, None)

    def close(self) -> None:
        """End the DDP model and its hook state (without a collective); the module stays as it is."""
        self._release("ElasticDDP was closed")

    def _current(self) -> torch.nn.parallel.DistributedDataParallel:
        if self.ddp is None:
            raise RuntimeError(f"rank {world().Get_rank()}: ElasticDDP has no DDP model: it was closed, or this "
                               "process has not joined the world yet (use it inside adasum.torch.elastic.run)")
        return self.ddp

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._current()(*args, **kwargs)

    def no_sync(self):
        return self._current().no_sync()

    def train(self, mode: bool = True) -> "ElasticDDP":
        self.module.train(mode)
        return self

    def eval(self) -> "ElasticDDP":
        return self.train(False)

    def parameters(self, recurse: bool = True):
        return self.module.parameters(recurse)

    def named_parameters(self, *args: Any, **kwargs: Any):
        return self.module.named_parameters(*args, **kwargs)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict:
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: dict, strict: bool = True):
        return self.module.load_state_dict(state_dict, strict=strict)


def _check_comm_hook(comm_hook) -> None:
    """``comm_hook`` must be a function of no arguments (not a hook itself, which takes state and bucket)."""
    fix = "a function of no arguments returning (hook state, hook), such as lambda: (AdasumState(), adasum_hook)"
    if not callable(comm_hook):
        raise TypeError(f"comm_hook must be {fix}; got {type(comm_hook).__name__}")
    try:
        params = inspect.signature(comm_hook).parameters.values()
    except (TypeError, ValueError):  # a callable whose signature Python cannot read: its call will tell
        return
    required = [p.name for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY,
                                                                             p.POSITIONAL_OR_KEYWORD)]
    if required:
        raise TypeError(f"comm_hook must be {fix}; {getattr(comm_hook, '__name__', comm_hook)!s} takes "
                        f"{', '.join(required)}")
