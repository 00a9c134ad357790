"""The public call: ``adasum_allreduce`` and its in-place variant (SPEC §4–6)."""

from __future__ import annotations

import enum
import os
from typing import Any, Sequence

import numpy as np
from mpi4py import MPI

from . import doubling as _doubling
from . import transport as _transport
from .arrays import _nonempty, adapter_for, kernels_backend
from .doubling import SmallCall, adasum_reduce_doubling
from .fusion import Group, layer_spans, make_groups, pooled
from .transport import Transport, library_comm
from .validate import agree, describe, explain, signature
from .vhdd import adasum_reduce

try:
    from . import _kernels
except ImportError:  # pragma: no cover - a build without a C compiler
    _kernels = None

__all__ = ["Op", "adasum_allreduce", "adasum_allreduce_inplace", "get_small_message_bytes",
           "set_small_message_bytes"]

# Calls whose fused buffers hold at most this many bytes in all use recursive doubling of whole vectors
# (log2 P rounds); larger ones recursive halving (bandwidth-optimal). None: chosen from P (see
# small_message_limit and benchmarks/README.md).
_AUTO_SMALL_MESSAGE_BYTES = 1 << 20
# ... but 3 MiB for P = 2 and 3, where both schedules send the same bytes (one pair after the fold).
_AUTO_PAIR_BYTES = 3 << 20


def _threshold_from_env() -> int | None:
    text = os.environ.get("ADASUM_SMALL_MESSAGE_BYTES", "auto").strip().lower()
    return None if text in ("", "auto") else int(text)


_small_message_bytes = _threshold_from_env()


def set_small_message_bytes(nbytes: int | None) -> None:
    """Adasum calls of at most ``nbytes`` (all tensors together) exchange whole vectors by recursive
    doubling, in log2(P) message rounds; larger calls use recursive halving, which sends about 2·N bytes
    per rank instead of log2(P)·N but makes about three times the rounds. ``0`` always uses halving.

    ``None`` (the default; ``ADASUM_SMALL_MESSAGE_BYTES=auto``) picks the threshold from the world size:
    3 MiB for 2 and 3 ranks (one pair after the fold, where both send N bytes per rank and doubling only
    computes on whole vectors instead of halves), 1 MiB for 4 to 7, and 1 MiB / (log2 P − 1) from 8 on,
    where doubling's extra bytes start to cost more than halving's extra rounds over a network. The
    environment variable ``ADASUM_SMALL_MESSAGE_BYTES`` sets it at start-up.

    Every rank must use the same setting: a call on ranks that differ raises AdasumMismatchError.
    """
    global _small_message_bytes
    if nbytes is not None and int(nbytes) < 0:
        raise ValueError(f"small message threshold must be >= 0 bytes, got {nbytes}")
    _small_message_bytes = None if nbytes is None else int(nbytes)
    _settings.update(_settings_for(_small_message_bytes))


def get_small_message_bytes() -> int | None:
    """The threshold set with :func:`set_small_message_bytes` (None: chosen from the world size)."""
    return _small_message_bytes


def small_message_limit(size: int) -> int:
    """The threshold in effect for a communicator of ``size`` ranks."""
    if _small_message_bytes is not None:
        return _small_message_bytes
    k = size.bit_length() - 1
    if k <= 1:
        return _AUTO_PAIR_BYTES
    return _AUTO_SMALL_MESSAGE_BYTES // (k - 1)


def _settings_for(small_message_bytes: int | None) -> dict[str, tuple]:
    """What the ranks must agree on besides the tensors, per kind of call (part of the digest; -1 stands
    for the automatic threshold)."""
    adasum = (("hierarchical", False),
              ("small-message bytes", -1 if small_message_bytes is None else small_message_bytes))
    return {"adasum": adasum, "hierarchical": (("hierarchical", True), adasum[1]),
            "sum": (("hierarchical", False),), "mean": (("hierarchical", False),)}


_settings = _settings_for(_small_message_bytes)


class Op(str, enum.Enum):
    """The reductions: ``ADASUM`` (SPEC §3), ``SUM`` and ``MEAN`` (MPI's own allreduce)."""

    ADASUM = "adasum"
    SUM = "sum"
    MEAN = "mean"

    def __str__(self) -> str:
        return self.value


def adasum_allreduce(tensors, *, op: str | Op = "adasum", comm: MPI.Intracomm | None = None,
                     hierarchical: bool = False):
    """Reduce ``tensors`` over the ranks of ``comm``; every rank gets the identical result.

    Collective: every rank of ``comm`` must call it, with tensors of the same shapes and dtypes in the same
    order, and the same ``op``.

    Args:
        tensors: one array, or a sequence of arrays: numpy arrays, torch tensors (CPU or CUDA) or cupy
            arrays, of dtype float16, bfloat16 (torch), float32 or float64, and integers for ``op="sum"``.
            Each array is one layer: Adasum computes its coefficients per array.
        op: ``"adasum"``, ``"sum"`` or ``"mean"`` (or an :class:`Op`).
        comm: an mpi4py intracommunicator; default ``MPI.COMM_WORLD``.
        hierarchical: ``op="adasum"`` only: the mean over the ranks of each node, then Adasum across nodes.

    Returns:
        New arrays of the same kind, shape, dtype and device, in the input's order (one array in, one out).
        The inputs are not modified. The outputs of one call may share one underlying buffer.

    Raises:
        TypeError: on every rank, if some rank passes an unsupported array type or dtype.
        AdasumMismatchError: on every rank, if the ranks disagree on the op, the number of tensors, a shape
            or a dtype. The message names the first differing tensor and the ranks.
    """
    return _allreduce(tensors, op, comm, hierarchical, inplace=False)


def adasum_allreduce_inplace(tensors, *, op: str | Op = "adasum", comm: MPI.Intracomm | None = None,
                             hierarchical: bool = False):
    """Like :func:`adasum_allreduce`, but writes the result into ``tensors`` and returns them.

    On an error nothing is written: all checks happen before any data moves.
    """
    return _allreduce(tensors, op, comm, hierarchical, inplace=True)


def _as_list(tensors) -> tuple[bool, list]:
    if type(tensors) is list:
        return False, tensors  # read only, never kept
    if adapter_for(tensors) is not None:
        return True, [tensors]
    if isinstance(tensors, (list, tuple)):
        return False, list(tensors)
    if isinstance(tensors, (str, bytes, dict)) or not isinstance(tensors, Sequence):
        raise TypeError(f"tensors must be an array or a sequence of arrays, got {type(tensors).__name__}")
    return False, list(tensors)


def _parse_op(op) -> str:
    if op in _OP_NAMES and type(op) is str:
        return op
    try:
        return Op(op).value
    except ValueError:
        raise ValueError(f"op must be one of 'adasum', 'sum', 'mean', got {op!r}") from None


def _allreduce(tensors, op, comm, hierarchical: bool, inplace: bool):
    comm = MPI.COMM_WORLD if comm is None else comm
    known = None  # the plan of this call, where the small-call path looked it up already
    if op == "adasum" and not hierarchical and type(tensors) is list and type(comm) is MPI.Intracomm:
        done, known = _small_adasum(tensors, comm, inplace)
        if done is not None:
            return done
    if not isinstance(comm, MPI.Intracomm):
        raise TypeError(f"comm must be an mpi4py intracommunicator, got {type(comm).__name__}")
    lcomm = library_comm(comm)
    rank = comm.Get_rank()
    opname, single, items, plan, groups, members, layouts, error = str(op), False, [], None, [], [], [], None
    try:
        single, items = _as_list(tensors)
        opname = _parse_op(op)
        if hierarchical and opname != "adasum":
            raise ValueError(f"hierarchical=True needs op 'adasum', got '{opname}'")
        settings = _settings[opname if not hierarchical else "hierarchical"]
        plan = known if known is not None else _plan(items, opname, rank, settings)
        groups = plan.groups()
        members = [items] if plan.one_group else [[items[i] for i in g.indices] for g in groups]
        if inplace:  # where the tensors lie decides how the result gets into them; read-only ones fail here
            layouts = [g.adapter.layout(mine, g.indices, rank) for g, mine in zip(groups, members)]
    except (TypeError, ValueError) as exc:
        if not str(exc).startswith("rank "):
            exc = type(exc)(f"rank {rank}: {exc}")
        error = exc
        settings = (("hierarchical", bool(hierarchical)),)
        groups, members = [], []

    size = comm.Get_size()
    flat = opname == "adasum" and not hierarchical and size > 1
    halving = flat and plan is not None and plan.nbytes > small_message_limit(size)
    # Flat Adasum may use the caller's tensors directly: an in-place call on tensors that lie apart is
    # combined in them, so that nothing is written back at the end (doubling at any size, halving from
    # DIRECT_MIN_BYTES, where it also reads them without packing them first: see vhdd.adasum_reduce).
    direct = flat and _transport._mode != "staged"
    big = plan is not None and plan.nbytes >= DIRECT_MIN_BYTES
    for g, mine, where in zip(groups, members, layouts if inplace else [None] * len(groups)):
        if inplace and where in (2, None):
            view = g.adapter.fused_view(mine, adjacent=where == 2)
            if view is not None and len(view) == g.size:
                g.buffer, g.aliased = view, True
                continue
        if direct and g.size > 0 and (not inplace or where in (1, 2)) and (not halving or big):
            g.parts = g.adapter.direct_parts(mine, g.dtype, contiguous=where in (1, 2))
        g.writes_parts = inplace and g.parts is not None
        g.packed = not (halving and g.parts is not None)
    # Halves sent straight from the caller's tensors go as one message per large layer piece (MPI's
    # fast path needs a contiguous send buffer): every rank must then cut its messages the same way.
    split = agree(lcomm, opname, None if plan is None else plan.descs, error, extra=settings,
                  digest=None if plan is None else plan.signature,
                  vote=int(plan is not None and plan.nbytes >= SPLIT_MIN_BYTES
                           and any(not g.packed for g in groups)))

    for g, mine in zip(groups, members):
        if g.aliased or (g.writes_parts and not g.packed):
            continue  # halving in the caller's tensors (in place) needs no fused buffer at all
        g.buffer = pooled(g, g.size, "fused") if inplace else g.adapter.empty(g.size, g.dtype, g.device)
        if g.packed:
            g.adapter.pack(mine, g.buffer, g.bounds, g.spans)
    active = plan.active if plan is not None else []

    if active and size > 1:
        if opname == "adasum" and hierarchical:
            from .hierarchical import hierarchical_reduce

            hierarchical_reduce(lcomm, active)
        elif opname == "adasum":
            transports = plan.transports(lcomm, active)
            if halving:
                adasum_reduce(lcomm, active, transports, split=bool(split))
            else:
                adasum_reduce_doubling(lcomm, active, transports)
        else:
            _plain_reduce(lcomm, active, mean=opname == "mean")

    if inplace:
        for g, mine in zip(groups, members):
            if g.writes_parts or (g.aliased and size > 1):
                g.adapter.wrote_parts(mine)  # written through other views of their memory
            elif g.size > 0 and not g.aliased:
                g.adapter.write_back(mine, g.buffer, g.bounds, g.spans)
        return tensors
    out: list[Any] = [None] * len(items)
    for g in groups:
        for i, view in zip(g.indices, g.adapter.views(g.buffer, g.bounds, g.shapes)):
            out[i] = view
    return out[0] if single else out


def _small_adasum(items: list, comm: MPI.Intracomm, inplace: bool):
    """Adasum of a doubling call on contiguous float32/float64 host arrays (numpy, or torch CPU tensors
    through numpy views of their memory) with the fewest Python steps: what the general path does for such
    a call (the same collective, messages and kernels, so ranks may take either path), where Python's own
    cost would dominate. Returns ``(result, plan)``: the result None when the call is not one of those (or
    some check fails: the general path then reports it), with the call's kept plan if it found one."""
    if _transport._mode == "staged" or not _use_compiled():
        return None, None
    try:
        plan = _plans.get(_plan_key(items, "adasum", comm.Get_rank(), _settings["adasum"]))
    except (AttributeError, TypeError):
        return None, None
    if plan is None or plan.small is None:
        return None, plan
    call = plan.small
    if call.comm is not comm:
        if comm.Get_size() == 1 or plan.nbytes > small_message_limit(comm.Get_size()):
            return None, plan
        call = plan.small = call.on(comm, library_comm(comm))
    live = call.live(items)
    g = call.group
    host = live if g.adapter.kind == "numpy" else g.adapter.host_views(live)  # torch: the same memory
    try:
        where = _kernels.layout(host, inplace)  # contiguous (and writable, in place), or it raises
    except (BufferError, ValueError):
        return None, plan
    if where == 0:
        return None, plan  # overlapping tensors: the general path writes each result back in turn
    out = None if inplace else g.adapter.empty(g.size, g.dtype, g.device)
    dst = host if inplace else out if type(out) is np.ndarray else out.numpy()
    if call.program is not None and _doubling._native:  # agreement, messages and kernels in one compiled call
        rc = call.compiled(host, dst, plan.signature)
        if rc == -1:
            raise explain(call.lcomm, "adasum", plan.descs, None, _settings["adasum"])
        if rc:
            raise MPI.Exception(rc)
    else:
        agree(call.lcomm, "adasum", plan.descs, None, extra=_settings["adasum"], digest=plan.signature)
        call(host, dst)
    if inplace:
        if host is not live:
            g.adapter.wrote_parts(items)
        return items, plan
    return g.adapter.views(out, g.bounds, g.shapes), plan


def _use_compiled() -> bool:
    return _kernels is not None and kernels_backend() == "c"


_OP_NAMES = frozenset(o.value for o in Op)
# Halving works on tensors that lie apart where they lie from this many bytes per call on (below, packing
# them and writing the result back costs less than the extra steps per layer piece)...
DIRECT_MIN_BYTES = 2 << 20
# ... and from this many on cuts its exchanges into messages per layer piece (below, each exchange is one
# message: what is sent from the tensors is packed first). At P = 2 on one host, separate tensors of 4-6 MiB
# took 1.8x MPI's allreduce with both from 2 MiB, against 2.2x with direct halving from 4 MiB and split
# messages from 8 MiB: the packed sends and the receive into scattered pieces cost more than the extra
# messages (benchmarks/schedules.py).
SPLIT_MIN_BYTES = 2 << 20
_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}


class _Plan:
    """What a call's tensors and settings determine: descriptions, the agreement signature, the groups
    and their layer tables. Kept for calls with the same shapes, dtypes and devices (a training loop's
    every step); a call resets the groups' per-call state (:meth:`groups`)."""

    __slots__ = ("adapters", "descs", "signature", "nbytes", "one_group", "active", "small", "_groups",
                 "_transports")

    def __init__(self, items, op: str, rank: int, settings: tuple):
        self.adapters, self.descs = describe(items, op, rank)
        self.signature = signature(op, self.descs, settings)
        self._groups = make_groups(items, self.adapters, self.descs)
        for g in self._groups:
            layer_spans(g)
        self.nbytes = sum(g.size * (_ITEMSIZE.get(g.dtype) or np.dtype(g.dtype).itemsize) for g in self._groups)
        # one group holding every tensor in order: the call's list is the group's members
        self.one_group = len(self._groups) == 1 and self._groups[0].indices == list(range(len(items)))
        self.active = [g for g in self._groups if g.size > 0]  # the groups with any elements
        # (group, non-empty layers, their spans) where _small_adasum may take the call
        self.small = None
        if (op == "adasum" and self.one_group
                and len(self.active) == 1 and self.active[0].dtype in ("float32", "float64")
                and (self.active[0].adapter.kind, self.active[0].device) in (("numpy", "cpu"), ("torch", "cpu"))):
            g = self.active[0]
            self.small = SmallCall(None, None, g, g.spans[0], g.spans[2], len(items))
        self._transports: tuple = (None, None, [])

    def groups(self) -> list[Group]:
        for g in self._groups:
            g.buffer, g.aliased, g.parts, g.packed, g.writes_parts = None, False, None, True, False
        return self._groups

    def transports(self, comm: MPI.Intracomm, groups: Sequence[Group]) -> list[Transport]:
        """One :class:`Transport` per group, kept while the communicator and the device transport mode
        stay the same (whether a group is staged depends on those and on its device only)."""
        mode = _transport.get_gpu_transport()
        if self._transports[0] is comm and self._transports[1] == mode:
            return self._transports[2]
        out = [_transport_for(comm, g) for g in groups]
        self._transports = (comm, mode, out)
        return out


_plans: dict[tuple, _Plan] = {}
_MAX_PLANS = 64


def _plan_key(items, op: str, rank: int, settings: tuple) -> tuple:
    if _kernels is not None:
        return op, settings, rank, _kernels.key(items)
    return op, settings, rank, tuple([(type(t), t.shape, t.dtype, getattr(t, "device", None)) for t in items])


def _plan(items, op: str, rank: int, settings: tuple) -> _Plan:
    try:
        key = _plan_key(items, op, rank, settings)
        plan = _plans.get(key)
    except (AttributeError, TypeError):  # not an array, or unhashable: describe() says what is wrong
        return _Plan(items, op, rank, settings)
    if plan is None:
        plan = _Plan(items, op, rank, settings)
        if len(_plans) >= _MAX_PLANS:
            _plans.pop(next(iter(_plans)))
        _plans[key] = plan
    return plan


def _transport_for(comm: MPI.Intracomm, g: Group) -> Transport:
    if g.buffer is None:  # combined in the caller's tensors: host memory (direct_parts gives no other)
        return Transport(comm, g.adapter, g.device, staged=False)
    return Transport(comm, g.adapter, g.device, staged=_transport.use_staging(g.adapter, g.buffer))


def _plain_reduce(comm: MPI.Intracomm, groups: Sequence[Group], mean: bool) -> None:
    """``sum`` and ``mean``: MPI's allreduce on each fused buffer; 16-bit floats travel as float32."""
    size = comm.Get_size()
    for g in groups:
        t = _transport_for(comm, g)
        if g.dtype in ("float16", "bfloat16"):
            wide = g.adapter.astype(g.buffer, "float32")
            t.allreduce_sum(wide)
            if mean:
                g.adapter.divide(wide, size)
            g.adapter.copy_(g.buffer, wide)
        else:
            t.allreduce_sum(g.buffer)
            if mean:
                g.adapter.divide(g.buffer, size)
