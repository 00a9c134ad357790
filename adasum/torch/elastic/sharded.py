"""A sharded model in elastic training (FSDP2, HSDP with :func:`adasum.torch.fsdp.adasum_replicas` or
:class:`adasum.torch.fsdp.ReplicaDeltas`): a rank that dies takes its shards with it, and the survivors'
process groups and device mesh hold the dead rank. Elastic training does not go on with such a model: once
the survivors have shrunk the world, each raises :class:`ShardsLost` (:func:`shards_lost`), within the
seconds the shrink takes, and the job ends; restart it from a checkpoint."""

from __future__ import annotations

import torch

from ...runtime.membership import world

__all__ = ["ShardsLost", "shards_lost", "sharded_modules"]


class ShardsLost(RuntimeError):
    """Raised by :func:`~adasum.torch.elastic.run` on every survivor when a rank died while the state's
    model is sharded (FSDP2's ``fully_shard``, HSDP): the job ends. ``size_before`` and ``size_after`` are
    the world's sizes around the death."""

    def __init__(self, text: str, size_before: int, size_after: int):
        super().__init__(text)
        self.size_before, self.size_after = size_before, size_after


def sharded_modules(model) -> list[str]:
    """The names of ``model``'s modules sharded with ``fully_shard`` (FSDP2), the root as ``(root)``."""
    if not isinstance(model, torch.nn.Module):
        model = getattr(model, "module", None)  # an ElasticDDP holds its module
        if not isinstance(model, torch.nn.Module):
            return []
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2
        return []
    return [name or "(root)" for name, m in model.named_modules() if isinstance(m, FSDPModule)]


def shards_lost(model, size_before: int) -> ShardsLost | None:
    """After the shrink of a death (the world now smaller than ``size_before``): the exception to raise on
    this survivor where ``model`` is sharded, else None. Local; the same on every survivor."""
    sharded = sharded_modules(model)
    if not sharded:
        return None
    me, size = world().Get_rank(), world().Get_size()
    shown = ", ".join(sharded[:4]) + (f" and {len(sharded) - 4} more" if len(sharded) > 4 else "")
    return ShardsLost(
        f"rank {me}: a rank died and the world shrank from {size_before} to {size} ranks while training a "
        f"sharded model (FSDP modules {shown}: fully_shard, HSDP with adasum_replicas or ReplicaDeltas). "
        "Elastic training does not go on with a sharded model: the dead rank's shards are gone, and the "
        "process groups and the device mesh the model was sharded over hold it. The job ends on every "
        "survivor; restart it from the last checkpoint (torch.distributed.checkpoint)", size_before, size)
