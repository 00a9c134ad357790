"""How a model sharded with FSDP2 is checked and laid out for the reduction across its replicas
(:mod:`adasum.torch.fsdp`): the mesh, the FSDP modules and their parameters in FSDP's order, the
comparison between ranks, and the two communicators of each rank (its replicate and shard groups)."""

from __future__ import annotations

import torch
from mpi4py import MPI

from ...call.allreduce import Op
from ...runtime import exchange
from ...runtime.faults import world
from ..internals import fsdp_group
from ..window.compress import Wire
from .tree import ReplicaTree

__all__ = ["installed", "replica_comms", "setup"]


_NATIVE = ('the model is sharded on the 2-D mesh (native HSDP), whose own all-reduce averages the replicas '
           'before any hook runs. Shard it over the shard dimension instead: fully_shard(module, '
           'mesh=mesh["shard"]) for every module you shard, then adasum_replicas(model, mesh)')


# The attribute of an FSDP module that holds the ReplicaHooks whose hook it runs. The module keeps them alive:
# the hook runs whether or not the caller kept the handle, so the one-hook rule must hold either way.
_INSTALLED = "_adasum_replica_hooks"


def installed(module):
    """The open :class:`adasum.torch.fsdp.ReplicaHooks` whose hook ``module`` runs, or None."""
    hooks = getattr(module, _INSTALLED, None)
    return hooks if hooks is not None and not hooks.closed else None


def _free(*comms) -> None:
    if not MPI.Is_finalized():
        for c in comms:
            c.Free()


def setup(model: torch.nn.Module, mesh, op, form: str, local_steps: int = 1,
          compression=None) -> tuple[list, list, ReplicaTree]:
    """Check the mesh and the model on every rank, compare the ranks, split the communicators. ``form``:
    ``"adasum_replicas"`` (the hook) or ``"ReplicaDeltas"``; ``compression``: the wire (None, ``"fp16"``,
    ``"bf16"``). Collective over the current world
    (:func:`adasum.runtime.faults.world`: ``MPI.COMM_WORLD``, or the survivors' world after an elastic
    shrink)."""
    comm = world()
    problem, layout, modules, plan = None, None, [], []
    try:
        try:
            op = Op(op).value
        except ValueError:
            raise ValueError(f"rank {comm.Get_rank()}: {form}: op must be one of 'adasum', 'sum', 'mean', "
                             f"got {op!r}") from None
        if type(local_steps) is not int or local_steps < 1:
            raise ValueError(f"rank {comm.Get_rank()}: {form}: local_steps must be a positive int, got "
                             f"{local_steps!r}")
        try:
            wire = Wire(compression)
        except ValueError as exc:
            raise ValueError(f"rank {comm.Get_rank()}: {form}: {exc}") from None
        layout = _check_mesh(mesh)
        modules, plan = _plan(model, mesh["shard"])
        _check_modules(modules, plan, form)
    except ValueError as exc:
        problem = str(exc)
    exchange.raise_everywhere(comm, problem, ValueError, f"{form}: checking the model")
    mine = (layout, [(name, [p[:4] for p in params]) for name, params in plan], op, local_steps, wire.name)
    seen = exchange.allgather(comm, mine, f"{form}: comparing the ranks")
    exchange.raise_everywhere(comm, _compare(seen, comm.Get_rank()), ValueError,
                              f"{form}: comparing the ranks")
    rows = layout[1]
    g, i = next((g, row.index(comm.Get_rank())) for g, row in enumerate(rows) if comm.Get_rank() in row)
    return modules, plan, ReplicaTree(*replica_comms(comm, rows, g, i), op, wire)


def _check_modules(modules: list, plan: list, form: str) -> None:
    """What the form cannot take: hooks installed already (a second hook, or deltas on top of the
    gradients' combine), and for the hook, modules sharded together (``fully_shard([a, b])``: one buffer
    for both, which the hook of each cannot cut)."""
    rank = world().Get_rank()
    for module, (name, _) in zip(modules, plan):
        if installed(module) is not None:
            what = ("close() the ReplicaHooks it returned first" if form == "adasum_replicas" else
                    "the delta form takes a model without them: close() the ReplicaHooks first")
            raise ValueError(f"rank {rank}: {form}: FSDP module {name or '(root)'} already runs the hook of "
                             f"adasum_replicas: {what}")
        if form == "adasum_replicas" and len(fsdp_group(module)) > 1:
            raise ValueError(f"rank {rank}: adasum_replicas: FSDP module {name or '(root)'} was sharded together "
                             f"with {len(fsdp_group(module)) - 1} other module(s) (fully_shard([...])), whose "
                             "gradients FSDP hands the hook in one buffer: shard each module on its own "
                             "(fully_shard(module, ...)), or use ReplicaDeltas, which takes groups")


def replica_comms(comm: MPI.Intracomm, rows: list, g: int, i: int) -> tuple[MPI.Intracomm, MPI.Intracomm]:
    """This rank's replicate group (the ranks of column ``i`` of ``rows``, in replica order) and shard group
    (row ``g``, in shard order), split from ``comm``; named by their world ranks, as stall reports show them
    (the ranks those reports number are the group's own)."""
    shard = comm.Split(color=g, key=i)
    replicate = comm.Split(color=i, key=g)
    shard.Set_name(f"shard group {g}, world ranks {rows[g]}")
    replicate.Set_name(f"replicate group {i}, world ranks {[row[i] for row in rows]}")
    return replicate, shard


def _check_mesh(mesh) -> tuple:
    """The mesh as (dimension names, rows of global ranks: one row per replica, in shard order)."""
    names = getattr(mesh, "mesh_dim_names", None)
    if getattr(mesh, "ndim", None) != 2:
        raise ValueError(f"rank {world().Get_rank()}: adasum_replicas needs a 2-D (replicate, shard) "
                         f"DeviceMesh, got {getattr(mesh, 'ndim', type(mesh).__name__)} dimension(s)")
    if names is None or tuple(names) != ("replicate", "shard"):
        raise ValueError(f"rank {world().Get_rank()}: adasum_replicas needs the mesh's dimensions "
                         f"named ('replicate', 'shard'), got {names}")
    import torch.distributed as dist

    if dist.get_rank() != world().Get_rank():
        raise ValueError(f"rank {world().Get_rank()}: torch.distributed calls this rank "
                         f"{dist.get_rank()}: start it with adasum.torch.init_process_group()")
    return tuple(names), mesh.mesh.tolist()


def _plan(model: torch.nn.Module, shard_mesh) -> tuple[list, list]:
    """The FSDP modules of ``model`` and, per module, (its name, one (parameter name, shape, dtype,
    placement, shard elements) per managed parameter, in FSDP's order)."""
    from torch.distributed.fsdp import FSDPModule

    rank = world().Get_rank()
    found = [(name, m) for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    if not found:
        raise ValueError(f"rank {rank}: adasum_replicas: the model has no module sharded with fully_shard")
    want = shard_mesh.mesh.tolist()
    if not hasattr(found[0][1], "set_all_reduce_hook"):
        raise ValueError(f"rank {rank}: adasum_replicas needs FSDP2's set_all_reduce_hook (torch 2.7 or later), "
                         f"this is torch {torch.__version__}")
    plan = []
    for name, module in found:
        params = []
        for pname, p in _managed(module):
            full = f"{name}.{pname}" if name else pname
            mesh = getattr(p, "device_mesh", None)
            if mesh is None:
                raise ValueError(f"rank {rank}: adasum_replicas: parameter {full} is not sharded (no DTensor)")
            if mesh.ndim != 1:
                raise ValueError(f"rank {rank}: adasum_replicas: parameter {full}: {_NATIVE}")
            if mesh.mesh.tolist() != want:
                raise ValueError(f"rank {rank}: adasum_replicas: parameter {full} is sharded over ranks "
                                 f"{mesh.mesh.tolist()}, but mesh['shard'] of this rank holds ranks {want}: "
                                 "pass the mesh whose shard dimension the model was sharded over")
            params.append((pname, tuple(p.shape), str(p.dtype), str(p.placements), _shard_elements(p, full)))
        plan.append((name, params))
    return [m for _, m in found], plan


def _managed(module: torch.nn.Module):
    """The parameters FSDP manages in ``module``: those of its sub-modules that are not FSDP modules
    themselves (nor below one), each once, in the order FSDP flattens them."""
    from torch.distributed.fsdp import FSDPModule

    order, seen_modules = [], set()

    def visit(m: torch.nn.Module) -> None:
        if m is not module and isinstance(m, FSDPModule):
            return
        seen_modules.add(m)
        for child in m.children():
            if child not in seen_modules:
                visit(child)
        order.append(m)

    visit(module)
    names = {id(m): n for n, m in module.named_modules(remove_duplicate=False)}
    out, seen = [], set()
    for m in order:
        for pname, p in m.named_parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                prefix = names.get(id(m), "")
                out.append((f"{prefix}.{pname}" if prefix else pname, p))
    return out


def _shard_elements(p, name: str) -> int:
    """Elements of one rank's padded shard of ``p`` in the reduce-scatter output (FSDP pads dim 0 to a
    multiple of the shard group's size; a parameter sharded on another dimension must divide evenly)."""
    from torch.distributed.tensor import Shard

    (placement,) = p.placements
    n = p.device_mesh.size()
    if not isinstance(placement, Shard):
        raise ValueError(f"rank {world().Get_rank()}: adasum_replicas: parameter {name} has "
                         f"placement {placement}, FSDP shards with Shard(dim)")
    shape = tuple(p.shape)
    if not shape:
        return 1 if n == 1 else 0
    rest = p.numel() // shape[0] if shape[0] else 0
    if placement.dim == 0:
        return -(-shape[0] // n) * rest
    return p.numel() // n


def _compare(seen: list, rank: int) -> str | None:
    """This rank's difference from rank 0 in the mesh, the modules, the parameters, the op or the wire
    (None if none)."""
    (layout0, plan0, op0, steps0, wire0), (layout, plan, op, steps, wire) = seen[0], seen[rank]
    if op != op0:
        return f"rank {rank}: op {op!r}, rank 0 has {op0!r}"
    if wire != wire0:
        return f"rank {rank}: compression={wire!r}, rank 0 has compression={wire0!r}"
    if steps != steps0:
        return f"rank {rank}: local_steps={steps}, rank 0 has local_steps={steps0}"
    if layout != layout0:
        return f"rank {rank}: mesh {layout[0]} with ranks {layout[1]}, rank 0 has {layout0[0]} with {layout0[1]}"
    if len(plan) != len(plan0):
        return f"rank {rank}: {len(plan)} FSDP modules, rank 0 has {len(plan0)}"
    for (name, params), (name0, params0) in zip(plan, plan0):
        if name != name0 or len(params) != len(params0):
            return (f"rank {rank}: FSDP module {name or '(root)'} with {len(params)} parameters, rank 0 has "
                    f"{name0 or '(root)'} with {len(params0)}")
        for p, p0 in zip(params, params0):
            if p != p0:
                return (f"rank {rank}: module {name or '(root)'} parameter {p[0]} {p[1:]}, rank 0 has "
                        f"{p0[0]} {p0[1:]}")
    return None
