"""Adasum across the replicas of a sharded model (FSDP2 with HSDP's layout): in FSDP2's all-reduce hook
(:mod:`.hooks`), or on weight deltas (:mod:`.deltas`); the mesh and model checks in :mod:`.mesh`, the tree
over replica groups in :mod:`.tree`.

Shard the model over the shard dimension of a 2-D (replicate, shard) mesh and make one call::

    mesh = init_device_mesh("cuda", (replicas, shards), mesh_dim_names=("replicate", "shard"))
    for block in model.blocks:
        fully_shard(block, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    adasum.torch.fsdp.adasum_replicas(model, mesh)          # before the first backward

FSDP2 reduce-scatters each module's gradients over the shard group (the mean of its ranks) and hands the
shards to the hook; the hook combines the replicas' gradients of every parameter with the tree of
docs/design.md on the whole parameter (the dot products summed over the shard group, see
:mod:`adasum.torch.fsdp.tree`), over MPI. ``op="mean"`` gives what native HSDP (``fully_shard`` on the 2-D
mesh) gives, ``op="sum"`` the sum. Gradient accumulation: ``model.set_requires_gradient_sync(False)`` on the
micro-steps without a reduction (the hook runs on the step that reduces); mixed precision: the hook works in
the policy's ``reduce_dtype``.

:class:`ReplicaDeltas` is the weight-delta form: no hook, each replica's optimizer steps its shards, and the
deltas are combined across the replicas the same way.
"""

from .deltas import ReplicaDeltas
from .hooks import ReplicaHooks, adasum_replicas
from .mesh import replica_comms

__all__ = ["ReplicaDeltas", "ReplicaHooks", "adasum_replicas", "replica_comms"]
