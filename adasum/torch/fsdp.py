"""Adasum across the replicas of a sharded model (FSDP2 with HSDP's layout), in FSDP2's all-reduce hook.

Shard the model over the shard dimension of a 2-D (replicate, shard) mesh and make one call::

    mesh = init_device_mesh("cuda", (replicas, shards), mesh_dim_names=("replicate", "shard"))
    for block in model.blocks:
        fully_shard(block, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    adasum.torch.fsdp.adasum_replicas(model, mesh)          # before the first backward

FSDP2 reduce-scatters each module's gradients over the shard group (the mean of its ranks) and hands the
shards to the hook; the hook combines the replicas' gradients of every parameter with the tree of
docs/design.md on the whole parameter (the dot products summed over the shard group, see
:mod:`adasum.torch.replicas`), over MPI. ``op="mean"`` gives what native HSDP (``fully_shard`` on the 2-D
mesh) gives, ``op="sum"`` the sum. Gradient accumulation: ``model.set_requires_gradient_sync(False)`` on the
micro-steps without a reduction (the hook runs on the step that reduces); mixed precision: the hook works in
the policy's ``reduce_dtype``.

:class:`ReplicaDeltas` is the weight-delta form: no hook, each replica's optimizer steps its shards, and the
deltas are combined across the replicas the same way.
"""

from __future__ import annotations

import weakref
import zlib

import torch
from mpi4py import MPI

from ..call.allreduce import Op
from ..runtime import exchange
from .fsdp_layout import _INSTALLED, _free, _managed, installed, replica_comms, setup
from .replicas import ReplicaTree
from .window.agreement import Layout, agree

__all__ = ["ReplicaDeltas", "ReplicaHooks", "adasum_replicas", "replica_comms"]


class ReplicaHooks:
    """What :func:`adasum_replicas` installed: the hooks of the model's FSDP modules and the two MPI
    communicators they reduce over (this rank's replicate group and shard group). :meth:`close` removes the
    hooks and frees the communicators; so does collecting this object's model."""

    def __init__(self, modules: list, tree: ReplicaTree):
        self.modules = [weakref.ref(m) for m in modules]
        self.tree = tree
        self._closed = False
        self._finalizer = weakref.finalize(modules[0], _free, tree.replicate, tree.shard)
        for m in modules:
            setattr(m, _INSTALLED, weakref.ref(self))

    @property
    def replicate(self) -> MPI.Intracomm:
        return self.tree.replicate

    @property
    def shard(self) -> MPI.Intracomm:
        return self.tree.shard

    def close(self) -> None:
        """Remove the hooks (FSDP then reduces over the shard group only) and free the communicators."""
        if self._closed:
            return
        self._closed = True
        for ref in self.modules:
            module = ref()
            if module is not None and installed(module) is self:
                module.set_all_reduce_hook(None)
                delattr(module, _INSTALLED)
        self._finalizer()

    @property
    def closed(self) -> bool:
        return self._closed



class ReplicaDeltas:
    """Adasum of weight deltas across the replicas of an FSDP2 model: each replica's optimizer steps its
    ranks' shards on the gradients FSDP reduced over the shard group alone (no hook), then the deltas of
    every parameter are combined across the replicas with the tree on the whole parameter (as
    :func:`adasum_replicas` combines gradients) and every replica continues from start + combined delta.
    Optimizer state (momentum, Adam's moments) stays with each replica, as with
    :class:`~adasum.torch.DistributedOptimizer`. ``op="mean"`` averages the deltas (model averaging).
    ``local_steps=H``: H optimizer steps between combines, the deltas taken since the window's start (local
    SGD); :meth:`flush` combines a window left open. At each combine the ranks agree on the window's number
    and its steps; a rank that took another number of steps makes every rank raise, naming the counts.

    Collective over MPI's world (the constructor and every :meth:`step`), after
    ``adasum.torch.init_process_group()``; the model sharded with ``fully_shard(..., mesh=mesh["shard"])``
    and no :func:`adasum_replicas` hook (it would combine the gradients first)."""

    def __init__(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module, mesh, *, op: str | Op = "adasum",
                 local_steps: int = 1):
        if type(local_steps) is not int or local_steps < 1:
            raise ValueError(f"local_steps must be a positive int, got {local_steps!r}")
        modules, plan, self.tree = setup(model, mesh, op, form="ReplicaDeltas", local_steps=local_steps)
        self.local_steps, self.windows, self._steps, self._start = local_steps, 0, 0, None
        self._checked = False  # whether the replicas were found to start alike (at the first step)
        self.params = [p for m in modules for _, p in _managed(m)]
        known = {id(p) for p in self.params}
        stray = [i for i, p in enumerate(q for g in optimizer.param_groups for q in g["params"]) if id(p) not in known]
        problem = (f"rank {MPI.COMM_WORLD.Get_rank()}: ReplicaDeltas: the optimizer's parameters {stray} are not "
                   "parameters of the model's FSDP modules") if stray else None
        exchange.raise_everywhere(MPI.COMM_WORLD, problem, ValueError, "ReplicaDeltas: checking the optimizer")
        self.optimizer = optimizer
        self._layout = Layout(optimizer)  # how the ranks compare the parameters of their windows
        self._finalizer = weakref.finalize(self, _free, self.tree.replicate, self.tree.shard)

    @property
    def param_groups(self) -> list:
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure=None):
        """The wrapped optimizer's step on this rank's shards; at the end of a window (every ``local_steps``
        steps) the deltas since its start combined across the replicas. Returns the closure's loss."""
        if not self._finalizer.alive:
            raise RuntimeError("ReplicaDeltas.step() after close()")
        if self._start is None:
            if not self._checked:
                self._check_alike()
            with torch.no_grad():
                self._start = [p.to_local().clone() for p in self.params]
        loss = self.optimizer.step() if closure is None else self.optimizer.step(closure)
        self._steps += 1
        if self._steps == self.local_steps:
            self._combine()
        return loss

    def _check_alike(self) -> None:
        """Before the first window: the replicas must hold the same parameters (each window continues from
        its start plus the combined delta, so replicas that start apart stay apart). One digest per rank's
        shards, compared over its replicate group; a difference raises on every rank."""
        digest = 0
        with torch.no_grad():
            for p in self.params:
                local = p.to_local().detach()
                digest = zlib.crc32(local.cpu().contiguous().view(torch.uint8).numpy().tobytes(), digest)
        seen = exchange.allgather(self.tree.replicate, digest, "ReplicaDeltas: comparing the replicas")
        problem = None
        if len(set(seen)) > 1:
            apart = [g for g, d in enumerate(seen) if d != seen[0]]
            problem = (f"rank {MPI.COMM_WORLD.Get_rank()}: ReplicaDeltas: the replicas start from different "
                       f"parameters (replicas {apart} differ from replica 0 in this rank's shards), and would "
                       "stay apart: load the same checkpoint on every replica (a checkpoint saved after "
                       "flush(), or one that keeps one copy of the model, as torch.distributed.checkpoint does)")
        exchange.raise_everywhere(MPI.COMM_WORLD, problem, ValueError, "ReplicaDeltas: comparing the replicas")
        self._checked = True

    def flush(self) -> None:
        """Combine the open window now, however many steps it holds. Collective even where no window is
        open: the ranks check that they took as many steps as each other."""
        if not self._finalizer.alive:
            raise RuntimeError("ReplicaDeltas.flush() after close()")
        self._combine()

    def _combine(self) -> None:
        """The window's agreement (:func:`adasum.torch.window.agreement.agree`: the combine's number, the
        steps it holds, the parameters), then the combine of the deltas across the replicas."""
        comm = MPI.COMM_WORLD
        ledger = {"combine": self.windows + 1, "local steps": self._steps}
        decision = agree(comm, ledger, self._layout, self.params, None)
        if decision.failed:
            with torch.no_grad():
                for p, s in zip(self.params, self._start or []):
                    p.to_local().copy_(s)
            self._steps, self._start = 0, None
            raise RuntimeError(f"(raised on rank {comm.Get_rank()}) ReplicaDeltas: the ranks' windows differ; the "
                               f"parameters are back at the window's start: {decision.failed}")
        if self._start is None:
            return
        with torch.no_grad():
            shards = [p.to_local() for p in self.params]
            sizes = tuple(t.numel() for t in shards)
            flat = torch.cat([(t - s).reshape(-1) for t, s in zip(shards, self._start)])
            self.tree.reduce_(flat, sizes, "weight deltas")
            for t, s, d in zip(shards, self._start, flat.split(sizes)):
                t.copy_(s + d.view_as(s))
        self.windows, self._steps, self._start = self.windows + 1, 0, None

    def close(self) -> None:
        """Free the communicators; any later :meth:`step` raises."""
        self._finalizer()


class _Hook:
    """The all-reduce hook of one FSDP module: its flat reduce-scatter output holds one padded shard per
    parameter that has a gradient, in the module's parameter order. Frozen parameters
    (``requires_grad=False``) have none; which ones are frozen is read at each call."""

    __slots__ = ("tree", "name", "sizes", "params")

    def __init__(self, tree: ReplicaTree, name: str, sizes: tuple[int, ...], params: list):
        self.tree, self.name, self.sizes, self.params = tree, name, sizes, params

    def __call__(self, output: torch.Tensor) -> None:
        sizes = self.sizes
        if output.numel() != sum(sizes):
            sizes = tuple(n for n, p in zip(self.sizes, self.params) if p.requires_grad)
        if output.numel() != sum(sizes) or output.dim() != 1:
            raise RuntimeError(
                f"rank {MPI.COMM_WORLD.Get_rank()}: adasum_replicas: FSDP module {self.name or '(root)'} "
                f"handed its hook shape {tuple(output.shape)}; its parameters' shards make {sum(self.sizes)} "
                f"elements, those that require gradients {sum(sizes)}. A parameter that forward did not use "
                "has no gradient and leaves the layers unknown: use every parameter, or freeze it")
        self.tree.reduce_(output, sizes, self.name or "root")


def adasum_replicas(model: torch.nn.Module, mesh, *, op: str | Op = "adasum") -> ReplicaHooks:
    """Make the reduction across replicas of ``model`` (sharded with ``fully_shard(..., mesh=mesh["shard"])``,
    every FSDP module of it) Adasum per parameter (or ``op="sum"``/``"mean"``), over MPI.

    Collective over MPI's world: every rank calls it with the same mesh and an identically sharded model,
    after ``adasum.torch.init_process_group()``. ``mesh``: a 2-D ``DeviceMesh`` with dimension names
    ``("replicate", "shard")``.

    Returns:
        A :class:`ReplicaHooks`: ``close()`` removes the hooks and frees the two communicators.

    Raises:
        ValueError: on every rank, where the mesh is not 2-D or lacks those names, where the model was
            sharded on another mesh than ``mesh["shard"]`` (on the 2-D mesh itself: native HSDP, the
            message shows the one-line change), or where the ranks differ in the mesh or in the
            parameters (names, shapes, dtypes, placements), naming the rank and the difference.
    """
    modules, plan, tree = setup(model, mesh, op, form="adasum_replicas")
    for module, (name, params) in zip(modules, plan):
        sizes = tuple(p[4] for p in params)
        module.set_all_reduce_hook(_Hook(tree, name, sizes, [p for _, p in _managed(module)]))
    return ReplicaHooks(modules, tree)
