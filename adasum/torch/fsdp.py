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
from .replicas import ReplicaTree
from .window.agreement import Layout, agree

__all__ = ["ReplicaDeltas", "ReplicaHooks", "adasum_replicas", "replica_comms"]

_NATIVE = ('the model is sharded on the 2-D mesh (native HSDP), whose own all-reduce averages the replicas '
           'before any hook runs. Shard it over the shard dimension instead: fully_shard(module, '
           'mesh=mesh["shard"]) for every module you shard, then adasum_replicas(model, mesh)')


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


# The attribute of an FSDP module that holds (weakly) the ReplicaHooks whose hook it runs.
_INSTALLED = "_adasum_replica_hooks"


def installed(module) -> "ReplicaHooks | None":
    """The open :class:`ReplicaHooks` whose hook ``module`` runs, or None."""
    ref = getattr(module, _INSTALLED, None)
    hooks = ref() if ref is not None else None
    return hooks if hooks is not None and not hooks.closed else None


def _free(*comms) -> None:
    if not MPI.Is_finalized():
        for c in comms:
            c.Free()


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
        modules, plan, self.tree = _setup(model, mesh, op, form="ReplicaDeltas", local_steps=local_steps)
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
    modules, plan, tree = _setup(model, mesh, op, form="adasum_replicas")
    for module, (name, params) in zip(modules, plan):
        sizes = tuple(p[4] for p in params)
        module.set_all_reduce_hook(_Hook(tree, name, sizes, [p for _, p in _managed(module)]))
    return ReplicaHooks(modules, tree)


def _setup(model: torch.nn.Module, mesh, op, form: str, local_steps: int = 1) -> tuple[list, list, ReplicaTree]:
    """Check the mesh and the model on every rank, compare the ranks, split the communicators. ``form``:
    ``"adasum_replicas"`` (the hook) or ``"ReplicaDeltas"``."""
    op = Op(op).value
    comm = MPI.COMM_WORLD
    problem, layout, modules, plan = None, None, [], []
    try:
        layout = _check_mesh(mesh)
        modules, plan = _plan(model, mesh["shard"])
        _check_modules(modules, plan, form)
    except ValueError as exc:
        problem = str(exc)
    exchange.raise_everywhere(comm, problem, ValueError, f"{form}: checking the model")
    mine = (layout, [(name, [p[:4] for p in params]) for name, params in plan], op, local_steps)
    seen = exchange.allgather(comm, mine, f"{form}: comparing the ranks")
    exchange.raise_everywhere(comm, _compare(seen, comm.Get_rank()), ValueError,
                              f"{form}: comparing the ranks")
    rows = layout[1]
    g, i = next((g, row.index(comm.Get_rank())) for g, row in enumerate(rows) if comm.Get_rank() in row)
    return modules, plan, ReplicaTree(*replica_comms(comm, rows, g, i), op)


def _check_modules(modules: list, plan: list, form: str) -> None:
    """What the form cannot take: hooks installed already (a second hook, or deltas on top of the
    gradients' combine), and for the hook, modules sharded together (``fully_shard([a, b])``: one buffer
    for both, which the hook of each cannot cut)."""
    from .internals import fsdp_group

    rank = MPI.COMM_WORLD.Get_rank()
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
        raise ValueError(f"rank {MPI.COMM_WORLD.Get_rank()}: adasum_replicas needs a 2-D (replicate, shard) "
                         f"DeviceMesh, got {getattr(mesh, 'ndim', type(mesh).__name__)} dimension(s)")
    if names is None or tuple(names) != ("replicate", "shard"):
        raise ValueError(f"rank {MPI.COMM_WORLD.Get_rank()}: adasum_replicas needs the mesh's dimensions "
                         f"named ('replicate', 'shard'), got {names}")
    import torch.distributed as dist

    if dist.get_rank() != MPI.COMM_WORLD.Get_rank():
        raise ValueError(f"rank {MPI.COMM_WORLD.Get_rank()}: torch.distributed calls this rank "
                         f"{dist.get_rank()}: start it with adasum.torch.init_process_group()")
    return tuple(names), mesh.mesh.tolist()


def _plan(model: torch.nn.Module, shard_mesh) -> tuple[list, list]:
    """The FSDP modules of ``model`` and, per module, (its name, one (parameter name, shape, dtype,
    placement, shard elements) per managed parameter, in FSDP's order)."""
    from torch.distributed.fsdp import FSDPModule

    rank = MPI.COMM_WORLD.Get_rank()
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
        raise ValueError(f"rank {MPI.COMM_WORLD.Get_rank()}: adasum_replicas: parameter {name} has "
                         f"placement {placement}, FSDP shards with Shard(dim)")
    shape = tuple(p.shape)
    if not shape:
        return 1 if n == 1 else 0
    rest = p.numel() // shape[0] if shape[0] else 0
    if placement.dim == 0:
        return -(-shape[0] // n) * rest
    return p.numel() // n


def _compare(seen: list, rank: int) -> str | None:
    """This rank's difference from rank 0 in the mesh, the modules, the parameters or the op (None if
    none)."""
    (layout0, plan0, op0, steps0), (layout, plan, op, steps) = seen[0], seen[rank]
    if op != op0:
        return f"rank {rank}: op {op!r}, rank 0 has {op0!r}"
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
