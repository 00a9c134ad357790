"""Adasum across the replicas of a sharded model in FSDP2's all-reduce hook: :func:`adasum_replicas` and
what it installs (:class:`ReplicaHooks`). FSDP2 reduce-scatters each module's gradients over the shard
group (the mean of its ranks) and hands the shards to the hook; the hook combines the replicas' gradients
of every parameter with the tree of :mod:`adasum.torch.fsdp.tree` on the whole parameter, over MPI."""

from __future__ import annotations

import weakref

import torch
from mpi4py import MPI

from ...call.allreduce import Op
from ...runtime import exchange
from ...runtime.agreement import agree_exchange
from ...runtime.faults import world
from .mesh import _INSTALLED, _free, _managed, installed, setup
from .tree import ReplicaTree

__all__ = ["ReplicaHooks", "adasum_replicas"]


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
            setattr(m, _INSTALLED, self)

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
            problem = (f"rank {world().Get_rank()}: adasum_replicas: FSDP module {self.name or '(root)'} "
                       f"handed its hook shape {tuple(output.shape)}; its parameters' shards make "
                       f"{sum(self.sizes)} elements, those that require gradients {sum(sizes)}. A parameter that "
                       "forward did not use has no gradient and leaves the layers unknown: use every parameter, "
                       "or freeze it")
            # The replica partners wait in this module's reduction: its agreement carries the error to them,
            # and every rank raises it.
            what = f"adasum_replicas ({self.name or 'root'})"
            with exchange.call_on(self.tree.replicate, what) as call:
                agree_exchange(call, what, RuntimeError(problem))
            raise RuntimeError(problem)  # a replicate group of one
        self.tree.reduce_(output, sizes)


def adasum_replicas(model: torch.nn.Module, mesh, *, op: str | Op = "adasum",
                    compression: str | None = None) -> ReplicaHooks:
    """Make the reduction across replicas of ``model`` (sharded with ``fully_shard(..., mesh=mesh["shard"])``,
    every FSDP module of it) Adasum per parameter (or ``op="sum"``/``"mean"``), over MPI. ``compression``:
    the shards travel as ``"bf16"`` or ``"fp16"`` (scaled per layer, as ``DistributedOptimizer``'s wire),
    halving the bytes between replicas; None (default) sends them as they are.

    Collective over MPI's world: every rank calls it with the same mesh and an identically sharded model,
    after ``adasum.torch.init_process_group()``. ``mesh``: a 2-D ``DeviceMesh`` with dimension names
    ``("replicate", "shard")``.

    Returns:
        A :class:`ReplicaHooks`: ``close()`` removes the hooks and frees the two communicators.

    Raises:
        ValueError: on every rank, where the mesh is not 2-D or lacks those names, where the model was
            sharded on another mesh than ``mesh["shard"]`` (on the 2-D mesh itself: native HSDP, the
            message shows the one-line change), where ``compression`` is not one of those, or where the
            ranks differ in the mesh, the op, the compression or the parameters (names, shapes, dtypes,
            placements), naming the rank and the difference.
    """
    modules, plan, tree = setup(model, mesh, op, form="adasum_replicas", compression=compression)
    for module, (name, params) in zip(modules, plan):
        sizes = tuple(p[4] for p in params)
        module.set_all_reduce_hook(_Hook(tree, name, sizes, [p for _, p in _managed(module)]))
    return ReplicaHooks(modules, tree)
