"""Checking a call's inputs, locally and across ranks, before any data moves.

Local problems (an unsupported array type or dtype, an op the dtype does not allow) and disagreements
between ranks (op, number of tensors, a shape, a dtype) both end in an exception on *every* rank: the
ranks always meet in one small collective first, so a rank that would raise alone cannot leave the others
waiting in the allreduce.
"""

from __future__ import annotations

import pickle
import zlib
from typing import Any, NamedTuple, Sequence

import numpy as np
from mpi4py import MPI

from . import stall, waiting
from .faults import mpi_error
from .stall import AdasumCollectiveError
from ..adapters import Adapter, Adapters
from ..rule.dtypes import FLOAT_DTYPES, INT_DTYPES, dtype_code, op_code
from ..kernels.native import compiled, mpi_bound, request

__all__ = ["AdasumMismatchError", "TensorDesc", "Companion", "agree", "with_companion", "agree_exchange", "agreed", "describe", "exchange_digest",
           "explain", "load", "resume", "signature"]


class AdasumMismatchError(ValueError, AdasumCollectiveError):
    """The ranks called a collective with inputs that do not match (op, tensor count, shape or dtype), or
    different collectives. A ``ValueError`` (the inputs) and an :class:`AdasumCollectiveError`, a
    ``RuntimeError`` (what Horovod raises for a mismatch between ranks: ``HorovodInternalError``)."""


# What to do where one of the calls that met is of this kind.
_HINTS = {"join": ("join() while other ranks still make collective calls (uneven data) is not supported: "
                   "there is no background thread to answer their calls. Give every rank the same number of "
                   "batches (for example DistributedSampler(..., drop_last=True)) so that every rank makes "
                   "the same calls before join()"),
          "adasum.horovod.join": ("a rank in adasum.horovod.join() answers only the other ranks' calls of "
                                  "adasum.horovod, not the library's own (DistributedOptimizer's reductions, "
                                  "broadcast_parameters): give every rank the same number of batches")}


def _hint(kinds: set) -> str:
    return "".join(f". {_HINTS[k]}" for k in sorted(kinds) if k in _HINTS)


class TensorDesc(NamedTuple):
    shape: tuple[int, ...]
    dtype: str
    device: str

    def __str__(self) -> str:
        return f"shape {self.shape} {self.dtype}"


def describe(tensors: Sequence[Any], op: str, rank: int, kinds: Adapters):
    """Adapters (from ``kinds``) and descriptions of ``tensors``; a TypeError (naming ``rank``) for anything
    unsupported."""
    adapters: list[Adapter] = []
    descs: list[TensorDesc] = []
    devices: dict[str, int] = {}
    for i, t in enumerate(tensors):
        adapter = kinds.for_array(t)
        if adapter is None:
            raise TypeError(f"rank {rank}: tensor {i} is a {type(t).__module__}.{type(t).__qualname__}; "
                            "adasum takes numpy arrays, torch tensors and cupy arrays")
        refused = adapter.refusal(t)
        if refused is not None:
            raise TypeError(f"rank {rank}: tensor {i} {refused}")
        dtype = adapter.dtype_name(t)
        if dtype not in _ALLOWED[op]:
            if dtype in INT_DTYPES:
                raise TypeError(f"rank {rank}: tensor {i} has integer dtype {dtype}, which op '{op}' does not "
                                "take; integers are allowed for op 'sum' only")
            raise TypeError(f"rank {rank}: tensor {i} has unsupported dtype {dtype}; supported are float16, "
                            "bfloat16 (torch), float32, float64, and integers for op 'sum'")
        if not getattr(t.dtype, "isnative", True):
            raise TypeError(f"rank {rank}: tensor {i} has non-native byte order ({t.dtype.str}); adasum takes "
                            "arrays in the machine's byte order (convert with .astype(t.dtype.newbyteorder('=')))")
        device = adapter.device(t)
        if device not in devices:
            devices[device] = i
            if len(devices) > 1:
                (d0, i0), (d1, i1) = list(devices.items())[:2]
                raise ValueError(f"rank {rank}: tensor {i1} is on {d1} but tensor {i0} is on {d0}; all "
                                 "tensors of one call must be on one device")
        adapters.append(adapter)
        descs.append(TensorDesc(tuple(t.shape), dtype, device))
    return adapters, descs


_ALLOWED = {"adasum": FLOAT_DTYPES, "mean": FLOAT_DTYPES, "sum": FLOAT_DTYPES | INT_DTYPES}


def signature(op: str, descs: Sequence[TensorDesc], extra: tuple) -> int:
    """A 62-bit digest of what must agree between ranks.

    Built from integers only: Python hashes ints and tuples of ints the same in every process (only
    strings are salted per process), and hashing them is far cheaper than a cryptographic digest.
    """
    key = (op_code(op), tuple(int(v) for _, v in extra),
           tuple((d.shape, dtype_code(d.dtype)) for d in descs))
    return hash(key) & ((1 << 62) - 1)


AGREE_BYTES = 4 * 8  # what one rank hands to the agreement allreduce: four int64


class Companion(NamedTuple):
    """A caller's own agreement, folded into the agreement of the call it makes next, so that one small
    collective carries both (the training layer's window ledger with the reduction of its gradients).
    ``salt`` (62 bits) is mixed into the call's digest, ``extra`` (``(name, int)`` pairs) is what it stands
    for, shown where the ranks differ, and ``error`` (this rank's failure, or None) fails the call on every
    rank before any data moves."""

    salt: int
    extra: tuple
    error: str | None = None


def with_companion(call, sig: int, error: Exception | None, extra: tuple) -> tuple:
    """The call's digest, error and extra settings with its companion's (if any) folded in."""
    comp = call.companion
    if comp is None:
        return sig, error, extra
    if error is None and comp.error is not None:
        error = RuntimeError(comp.error if comp.error.startswith("rank ") else f"rank {call.ctx.rank}: {comp.error}")
    return (sig ^ comp.salt) & _MASK or 1, error, tuple(extra) + tuple(comp.extra)


def agree(call, op: str, descs: Sequence[TensorDesc] | None, error: Exception | None,
          extra: tuple = (), digest: int | None = None, vote: int = 0, kind: str = "adasum_allreduce") -> int:
    """Meet the other ranks of the call ``call`` (:class:`adasum.runtime.context.Call`) once; raise the same exception on every rank if any
    rank failed or differs.

    ``descs`` is this rank's description of its tensors (None if ``error`` is set). ``extra`` holds further
    settings that must agree (for example the hierarchical flag). ``digest``, if given, is
    ``signature(op, descs, extra)`` computed earlier. ``vote`` (a non-negative int) rides along: the call
    returns the largest vote of all ranks, so that the ranks can settle a choice in the same collective.
    ``kind`` names the call for the explanation of a difference (the digest of an allreduce differs from
    that of every other kind of call: :func:`exchange_digest`).
    """
    ctx = call.ctx
    if ctx.size == 1:
        error = with_companion(call, 0, error, extra)[1]
        if error is not None:
            raise error
        return vote
    sig = 0 if error is not None else signature(op, descs, extra) if digest is None else digest
    sig, error, extra = with_companion(call, sig, error, extra)
    if error is not None:
        sig = 0
    scratch = ctx.agree_scratch
    load(scratch, sig, error is not None, vote)
    call.record("scalar_bytes", AGREE_BYTES)
    call.record("collectives", 1)
    s = call.settings
    patience = stall.patience(s, ctx)
    if s.native_mpi and mpi_bound():  # the wait without the GIL, as the compiled small call makes it
        rc = compiled.agree(scratch, *ctx.agree_handles, patience, *waiting.policy(call.waiting))
        if rc == 1:
            resume(call, op, descs, patience)
        elif rc:
            raise mpi_error(rc, call.what)
    else:
        stall.wait(call, call.lcomm.Iallreduce(scratch[0:4], scratch[4:8], op=MPI.MAX), op, descs)
    if agreed(scratch):
        return int(scratch[7])
    raise explain(call, op, descs, error, extra, kind)


# The kinds of call that are not reductions of tensors (adasum.runtime.exchange's calls) digest as tuples that start
# with this number; an allreduce's signature starts with its op's code, a non-negative number.
_EXCHANGE = -7
_EXPLAIN = -8
_MASK = (1 << 62) - 1


def exchange_digest(what: str, extra: tuple = ()) -> int:
    """The digest of an exchange ``what`` (its label: the kind of call, the same on every rank that makes
    it) with ``extra`` settings (``(name, int)`` pairs) that must agree."""
    return hash((_EXCHANGE, zlib.crc32(what.encode()), tuple(int(v) for _, v in extra))) & _MASK


def agree_exchange(call, what: str, error: Exception | None, vote: int = 0, extra: tuple = (),
                   label: str | None = None) -> int:
    """The first collective of an exchange ``what`` of :mod:`adasum.runtime.exchange` inside the call
    ``call``: the agreement's four integers (so that it meets an allreduce's agreement, or another kind of
    exchange, as a difference that every rank explains), watched by the stall inspector. Returns the largest
    ``vote``; raises on every rank where a rank has an ``error`` or is in another kind of call, naming this
    call ``label`` (default ``what``)."""
    if call.ctx.size == 1:
        if error is not None:
            raise error
        return vote
    scratch = np.zeros(8, dtype=np.int64)
    load(scratch, 0 if error is not None else exchange_digest(what, extra), error is not None, vote)
    call.record("scalar_bytes", AGREE_BYTES)
    call.record("collectives", 1)
    stall.wait(call, call.lcomm.Iallreduce(scratch[0:4], scratch[4:8], op=MPI.MAX), "exchange", AGREE_BYTES,
               label=what)
    if agreed(scratch):
        return int(scratch[7])
    raise explain(call, "exchange", None, error, extra, kind=what if label is None else label)


# The agreement's one encoding, which the compiled small call (adasum/kernels/_kernels_mpi.c) writes and reads the
# same way. scratch[0:4] is what this rank sends, [digest, -digest, failed, vote]; the allreduce's MAX of
# every rank's into scratch[4:8] shows one digest (max d == -max(-d) exactly when all ranks sent the same
# d), no failure, and the largest vote. scratch[8]: the request of an agreement still waiting.
def load(scratch, digest: int, failed: bool, vote: int) -> None:
    """What this rank sends, into ``scratch[0:4]``."""
    scratch[0], scratch[1], scratch[2], scratch[3] = digest, -digest, 1 if failed else 0, vote


def agreed(scratch) -> bool:
    """Whether every rank sent the same digest and none failed (``scratch[4:8]`` holds the MAX)."""
    return scratch[6] == 0 and scratch[4] == -scratch[5]


def resume(call, op: str, descs, waited: float) -> None:
    """Go on waiting, through the stall inspector, for the agreement of ``call`` the compiled kernels left
    waiting after ``waited`` seconds (its request in ``call.ctx.agree_scratch[8]``)."""
    stall.wait(call, request(int(call.ctx.agree_scratch[8])), op, descs, waited=waited)


def explain(call, op: str, descs: Sequence[TensorDesc] | None, error: Exception | None, extra: tuple = (),
            kind: str = "adasum_allreduce") -> Exception:
    """The exception every rank raises once the agreement found a failure or a difference (collective:
    every rank calls it after the same agreement): gathers everyone's view to say exactly what. Its two
    collectives are another agreement (of the reports' size) and a gather, both watched by the stall
    inspector, so a rank that does not come makes the others raise a stall error naming it."""
    report = (kind, op, extra, descs, None if error is None else (type(error), str(error)))
    everyone = _gather_reports(call, report)
    rank = call.ctx.rank
    if everyone is None:
        return AdasumMismatchError(
            f"(raised on rank {rank}) the ranks are not in the same call: rank {rank} is in {kind}"
            f"{_call_text(report)}, and some rank is neither in it nor explaining the difference")
    return _explain(everyone, rank)


def _gather_reports(call, report) -> list | None:
    """Every rank's ``report`` on every rank, or None where some rank is not explaining the same
    agreement (it is in another call)."""
    try:
        data = pickle.dumps(report, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # an exception type that does not pickle: its name and text, as a RuntimeError
        kind, op, extra, descs, (etype, msg) = report
        data = pickle.dumps((kind, op, extra, descs, (RuntimeError, f"{etype.__name__}: {msg}")))
    scratch = np.zeros(8, dtype=np.int64)
    load(scratch, hash((_EXPLAIN,)) & _MASK, False, len(data))
    what = "explaining a difference between the ranks"
    stall.wait(call, call.lcomm.Iallreduce(scratch[0:4], scratch[4:8], op=MPI.MAX), "exchange", AGREE_BYTES,
               label=what)
    if not agreed(scratch):
        return None
    size = call.ctx.size
    width = 8 + int(scratch[7])
    send = np.zeros(width, dtype=np.uint8)
    send[:8] = np.frombuffer(np.int64(len(data)).tobytes(), dtype=np.uint8)
    send[8:8 + len(data)] = np.frombuffer(data, dtype=np.uint8)
    out = np.empty(width * size, dtype=np.uint8)
    call.record("scalar_bytes", width)
    stall.wait(call, call.lcomm.Iallgather([send, MPI.BYTE], [out, MPI.BYTE]), "exchange", width, label=what)
    reports = []
    for r in range(size):
        row = out[r * width:(r + 1) * width]
        n = int(row[:8].view(np.int64)[0])
        reports.append(pickle.loads(row[8:8 + n].tobytes()))
    return reports


def _call_text(report) -> str:
    """What a report's call passed: `` (op 'adasum', 2 tensors: shape (4,) float32, ...)``, or nothing."""
    _, op, extra, descs, _ = report
    if op == "exchange":
        return f" ({dict(extra)})" if extra else ""
    if descs is None:
        return f" (op '{op}')"
    shown = ", ".join(map(str, descs[:3])) + (", ..." if len(descs) > 3 else "")
    return f" (op '{op}', {len(descs)} tensor{'s' * (len(descs) != 1)}: {shown})"


def _failure_text(r: int, err: tuple) -> str:
    """What rank ``r`` failed with, as "rank r: Kind: text"."""
    kind, msg = err
    msg = msg[len(f"rank {r}: "):] if msg.startswith(f"rank {r}: ") else msg
    return f"rank {r}: {kind.__name__}: {msg}"


def _explain(everyone, rank: int) -> Exception:
    kind0, op0, extra0, descs0, _ = everyone[0]
    here = f"(raised on rank {rank}) "
    kinds = {r: e[0] for r, e in enumerate(everyone)}
    if len(set(kinds.values())) > 1:  # two kinds of call met: the first thing to fix, whatever else failed
        odd = [r for r, k in kinds.items() if k != kind0]
        return AdasumMismatchError(here + "the ranks are in different calls: " + ", ".join(
            f"rank {r} is in {kinds[r]}{_call_text(everyone[r])}" for r in odd)
            + f", rank 0 is in {kind0}{_call_text(everyone[0])}" + _hint(set(kinds.values()))
            + "".join(f"; {_failure_text(r, e[4])}" for r, e in enumerate(everyone) if e[4] is not None))
    for r, (_, _, _, _, err) in enumerate(everyone):
        if err is not None:
            kind, msg = err
            if r != rank and not msg.startswith(f"rank {r}:"):
                msg = f"rank {r}: {msg}"
            try:
                return kind(msg)
            except Exception:  # an exception type that takes other arguments: its text, as a RuntimeError
                return RuntimeError(f"{kind.__name__}: {msg}")
    everyone = [e[1:] for e in everyone]
    ops = {r: e[0] for r, e in enumerate(everyone)}
    if len(set(ops.values())) > 1:
        odd = [r for r, o in ops.items() if o != op0]
        return AdasumMismatchError(here + "ranks disagree on the op: " + ", ".join(
            f"rank {r} has '{ops[r]}'" for r in odd) + f", rank 0 has '{op0}'")
    extras = {r: e[1] for r, e in enumerate(everyone)}
    if len(set(extras.values())) > 1:
        odd = [r for r, x in extras.items() if x != extra0]
        names = sorted({k for r in odd for k, v in extras[r] if dict(extra0).get(k) != v})
        return AdasumMismatchError(here + "ranks disagree on the settings: " + ", ".join(
            f"rank {r} has {dict(extras[r])}" for r in odd) + f", rank 0 has {dict(extra0)}; they differ in "
            + ", ".join(repr(n) for n in names))
    if any(e[2] is None for e in everyone):
        return AdasumMismatchError(here + f"the ranks' calls of {kind0} differ")
    counts = [len(e[2]) for e in everyone]
    for i in range(min(counts)):
        odd = [r for r, e in enumerate(everyone) if (e[2][i].shape, e[2][i].dtype) !=
               (descs0[i].shape, descs0[i].dtype)]
        if odd:
            return AdasumMismatchError(here + f"tensor {i} differs: " + ", ".join(
                f"rank {r} has {everyone[r][2][i]}" for r in odd) + f", rank 0 has {descs0[i]}")
    odd = [r for r, n in enumerate(counts) if n != counts[0]]
    return AdasumMismatchError(here + f"ranks disagree on the number of tensors (first differing tensor "
                               f"index {min(counts)}): " + ", ".join(f"rank {r} passes {counts[r]}" for r in odd)
                               + f", rank 0 passes {counts[0]}")
