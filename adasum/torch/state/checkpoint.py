"""Checkpoints that resume bitwise: the model, every rank's optimizer state, and whatever the loop adds.

With ``op="adasum"`` each rank's optimizer state (momentum, Adam moments) is its own, and while an
accumulation window is open each rank holds its own partial gradients; both are needed to continue exactly
where the run stopped. So the root rank gathers every rank's ``optimizer.state_dict()`` and writes one file,
atomically (a temporary file in the same directory, then a rename), and loading hands each rank its own
part back. The root reads the file, so the other ranks need not share its filesystem.

The file is a header of :data:`HEADER_BYTES` ASCII bytes (the format line, then the payload's size and its
SHA-256) followed by the payload, which ``torch.save`` wrote. Loading checks the header, the size and the
checksum before it unpickles anything, so a corrupt, truncated or empty file raises one clear error on
every rank and changes nothing.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import re
import tempfile
import zlib
from typing import IO, Any

import torch
from mpi4py import MPI

from ...runtime import exchange
from ...runtime.context import check_comm, check_root
from ...runtime.exchange import raise_everywhere
from .broadcast import to_cpu

__all__ = ["save_checkpoint", "load_checkpoint", "read_checkpoint"]

_log = logging.getLogger("adasum")

# The payload's own format tag (files of the first format are nothing but such a payload).
_FORMAT = "adasum.torch checkpoint 1"
# The file's first line, and the fixed size of the header it starts.
_MAGIC = b"adasum.torch checkpoint 2\n"
HEADER_BYTES = 128
_FIELDS = re.compile(rb"payload ([0-9]{1,20}) bytes sha256 ([0-9a-f]{64}) *\n")
_ZIP = b"PK\x03\x04"  # how torch.save's files start: a file of the first format, without a checksum
_CHUNK = 1 << 24  # bytes hashed at a time when verifying


def save_checkpoint(path: str | os.PathLike, *, model: torch.nn.Module, optimizer=None,
                    extra: dict[str, Any] | None = None, comm: MPI.Intracomm | None = None,
                    root: int = 0) -> None:
    """Write ``path`` from the root rank; collective.

    The file holds the root's ``model.state_dict()``, every rank's ``optimizer.state_dict()`` in rank
    order, the world size, whether the model is combined, and ``extra``: plain data only (numbers,
    strings, lists, dicts, tensors: what ``torch.load(weights_only=True)`` reads), for example the epoch,
    the position in the data and the scheduler's and GradScaler's state dicts. The root holds all ranks'
    optimizer states in host memory while it writes. An error writing the file is raised on every rank.

    After a combine the parameters are identical on every rank and the model is the common one. Inside a
    window of local steps (or with ``delay=1`` before :meth:`~adasum.torch.DistributedOptimizer.flush`) each
    rank holds its own parameters (the save compares the ranks' parameters, one checksum each): the model
    saved is then the root's own, and each rank's own values travel in its optimizer state. Such a file resumes exactly at the world size it was saved at (model and
    optimizer); :func:`load_checkpoint` refuses to load its model alone. Call ``flush()`` before saving for a
    checkpoint whose model is the combined one.
    """
    comm, rank, size = _setup(comm, root)
    local = to_cpu(optimizer.state_dict()) if optimizer is not None else None
    combined = not getattr(optimizer, "holds_own_parameters", False) and _alike(comm, model)
    states = exchange.gather(comm, local, root=root, what="save_checkpoint's optimizer states")
    problem = None
    if rank == root:
        payload = {"format": _FORMAT, "world_size": size, "model": to_cpu(model.state_dict()),
                   "combined": combined,
                   "optimizer": states if optimizer is not None else None, "extra": extra}
        try:
            _atomic_save(payload, os.fspath(path))
        except Exception as exc:  # reported to every rank below
            problem = f"rank {rank}: writing checkpoint {os.fspath(path)!r} failed: {exc}"
    raise_everywhere(comm, problem)


def _alike(comm: MPI.Intracomm, model: torch.nn.Module) -> bool:
    """Collective: whether every rank holds the same parameters (one checksum per rank), so that the root's
    model is the common one, whichever optimizer (if any) was passed to the save."""
    digest = 0
    with torch.no_grad():
        for p in model.parameters():
            t = p.detach()
            t = t.to_local() if hasattr(t, "to_local") else t
            digest = zlib.crc32(t.cpu().contiguous().view(torch.uint8).numpy().tobytes(), digest)
    return len(set(exchange.allgather(comm, digest, what="save_checkpoint's comparison of the models"))) == 1


def load_checkpoint(path: str | os.PathLike, *, model: torch.nn.Module | None = None, optimizer=None,
                    comm: MPI.Intracomm | None = None, root: int = 0) -> dict[str, Any] | None:
    """Load ``path`` (written by :func:`save_checkpoint`) into ``model`` and ``optimizer`` on every rank;
    collective. Returns the ``extra`` it was saved with, or None, on every rank.

    The root checks the file's header, size and SHA-256 checksum, reads it with
    ``torch.load(weights_only=True)`` and sends each rank its part. Each rank gets the optimizer state of
    the rank it was when saved, so the world size must be the one saved; to move to another world size,
    load the model alone (``optimizer=None``). A file saved inside a window of local steps holds the root's
    own, uncombined model (the ranks' parameters differed): its model alone is refused (resume at the size
    it was saved at, ``flush()``, and save again).

    Raises ValueError on every rank, naming the file and what is wrong, if the file is missing, empty,
    truncated, longer than its header says, fails its checksum, or does not fit ``model`` (a missing or
    unexpected key, another shape) or ``optimizer`` on any rank. A failed load changes neither the model
    nor the optimizer on any rank. Files written before checkpoints carried a checksum still load, with a
    warning that they could not be verified.
    """
    comm, rank, size = _setup(comm, root)
    payload, problem = None, None
    if rank == root:
        try:
            payload = _read_for(os.fspath(path), model, optimizer, size, root)
        except Exception as exc:
            problem = f"rank {rank}: cannot load checkpoint {os.fspath(path)!r}: {exc}"
    raise_everywhere(comm, problem)
    header = exchange.bcast(comm, None if payload is None else
                            {"model": payload["model"] if model is not None else None, "extra": payload["extra"]},
                            root=root, what="load_checkpoint's model")
    states = exchange.scatter(comm, payload["optimizer"] if rank == root and optimizer is not None else
                              [None] * size if rank == root else None, root=root,
                              what="load_checkpoint's optimizer states")
    # Nothing is changed until every rank knows that its part fits.
    problem = None if model is None else _model_misfit(model, header["model"], rank, os.fspath(path))
    raise_everywhere(comm, problem)
    if optimizer is not None:
        _load_optimizer(comm, optimizer, states, rank, os.fspath(path))
    if model is not None:
        model.load_state_dict(header["model"])
        restore = getattr(optimizer, "_restore_window", None)
        if callable(restore):  # mid-window of local steps: each rank's own parameters, not the root's
            restore()
    return header["extra"]


def _read_for(path: str, model, optimizer, size: int, root: int) -> dict[str, Any]:
    """The root's read of ``path``, refused where it cannot load into what was asked (ValueError)."""
    payload = _read(path)
    if optimizer is not None and payload["optimizer"] is None:
        raise ValueError("it holds no optimizer state")
    if optimizer is None and model is not None and not payload.get("combined", True):
        raise ValueError(f"the ranks' parameters differed when it was saved (inside a window of local steps, "
                         f"say), so its model is rank {root}'s own and not the combined one; load it with the "
                         f"optimizer on {payload['world_size']} ranks, call flush(), and save again")
    if optimizer is not None and payload["world_size"] != size:
        raise ValueError(f"it was written by {payload['world_size']} ranks and this job has {size}; resume with "
                         "as many ranks, or load the model alone (optimizer=None)")
    return payload


def _load_optimizer(comm: MPI.Intracomm, optimizer, states, rank: int, path: str) -> None:
    """Load this rank's optimizer state; where it fails on any rank, every rank's optimizer (and gradients)
    goes back to how it was, and every rank raises."""
    before = optimizer.state_dict()
    grads = [(p, p.grad) for group in optimizer.param_groups for p in group["params"]]
    problem = None
    try:
        optimizer.load_state_dict(states)
    except Exception as exc:
        problem = f"rank {rank}: cannot load checkpoint {path!r} into the optimizer: {exc}"
    try:
        raise_everywhere(comm, problem)
    except ValueError:  # failed here or elsewhere: back to how it was
        optimizer.load_state_dict(before)
        for p, g in grads:
            p.grad = g
        raise


def read_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """The contents of a checkpoint file, read and verified by this process alone (no MPI call): a dict
    with ``"world_size"``, ``"model"`` (the state dict), ``"combined"`` (False where the model is the root's
    own, saved inside a window of local steps), ``"optimizer"`` (a list of every rank's optimizer state
    dict, or None) and ``"extra"``. For inspecting a checkpoint, or taking the model out of it for
    inference; the file is not a bare ``torch.save`` file, so ``torch.load`` does not read it.

    Raises ValueError naming the file and what is wrong, as :func:`load_checkpoint` does.
    """
    try:
        payload = _read(os.fspath(path))
    except Exception as exc:
        raise ValueError(f"cannot read checkpoint {os.fspath(path)!r}: {exc}") from None
    out = {k: payload[k] for k in ("world_size", "model", "optimizer", "extra")}
    return {**out, "combined": payload.get("combined", True)}


def _model_misfit(model: torch.nn.Module, saved: dict[str, Any], rank: int, path: str) -> str | None:
    """Why ``model.load_state_dict(saved)`` would fail (or half succeed), or None."""
    have = model.state_dict()
    missing = [k for k in have if k not in saved]
    unexpected = [k for k in saved if k not in have]
    where = f"rank {rank}: cannot load checkpoint {path!r} into the model:"
    if missing or unexpected:
        return (f"{where} the model has {len(missing)} key(s) the file lacks {missing[:5]} and the file has "
                f"{len(unexpected)} the model lacks {unexpected[:5]}")
    for k, t in have.items():
        s = saved[k]
        if isinstance(t, torch.Tensor) and (not isinstance(s, torch.Tensor) or s.shape != t.shape):
            got = f"shape {tuple(s.shape)}" if isinstance(s, torch.Tensor) else type(s).__name__
            return f"{where} {k!r} has shape {tuple(t.shape)} in the model and {got} in the file"
    return None


def _setup(comm, root: int):
    comm = check_comm(comm)
    check_root(comm, root)
    return comm, comm.Get_rank(), comm.Get_size()


def _header(nbytes: int, digest: str) -> bytes:
    fields = b"payload %d bytes sha256 %s" % (nbytes, digest.encode())
    return _MAGIC + fields.ljust(HEADER_BYTES - len(_MAGIC) - 1) + b"\n"


class _Hashing:
    """A writable file that passes what it is given on to ``f``, counting and hashing it."""

    def __init__(self, f: IO[bytes]):
        self.f, self.sha, self.nbytes = f, hashlib.sha256(), 0

    def write(self, data) -> int:
        view = memoryview(data)
        self.sha.update(view)
        self.nbytes += view.nbytes
        return self.f.write(view)

    def flush(self) -> None:
        self.f.flush()


def _atomic_save(payload: dict[str, Any], path: str) -> None:
    """The header and ``torch.save``'s payload to a temporary file beside ``path``, flushed to disk, then
    renamed over ``path``. The payload is hashed as it is written; its header is written last."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(b"\0" * HEADER_BYTES)
            out = _Hashing(f)
            torch.save(payload, out)
            f.seek(0)
            f.write(_header(out.nbytes, out.sha.hexdigest()))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


class _Payload(io.RawIOBase):
    """The part of an open file after its header, as a file of its own (what ``torch.load`` reads)."""

    def __init__(self, f: IO[bytes], start: int, nbytes: int):
        self.f, self.start, self.nbytes = f, start, nbytes
        f.seek(start)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        return self.f.readinto(buf)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: self.start, io.SEEK_CUR: self.f.tell(), io.SEEK_END: self.start + self.nbytes}
        return self.f.seek(base[whence] + offset) - self.start

    def tell(self) -> int:
        return self.f.tell() - self.start


def _read(path: str) -> dict[str, Any]:
    """The payload of the checkpoint at ``path``, once its header, size and checksum are found right.
    Raises ValueError saying what is wrong (a missing file too)."""
    payload = _unpickle(path)
    if not isinstance(payload, dict) or payload.get("format") != _FORMAT:
        raise ValueError("it was not written by adasum.torch.save_checkpoint")
    return payload


def _unpickle(path: str) -> Any:
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        raise ValueError("the file does not exist") from None
    with f:
        found = os.fstat(f.fileno()).st_size
        head = f.read(HEADER_BYTES)
        if found == 0:
            raise ValueError(f"the file is empty (0 bytes; a checkpoint is a {HEADER_BYTES}-byte header and "
                             "its payload)")
        if head.startswith(_ZIP):  # the first format: a bare torch.save file, with nothing to verify
            _log.warning("adasum: checkpoint %r has no checksum (written by an earlier adasum): loaded "
                         "without verification", path)
            f.seek(0)
            return torch.load(f, map_location="cpu", weights_only=True)
        if not head.startswith(_MAGIC):
            if _MAGIC.startswith(head):
                raise ValueError(f"the file is truncated: it has {found} bytes, less than its "
                                 f"{HEADER_BYTES}-byte header")
            raise ValueError(f"it is not an adasum.torch checkpoint: it starts with {head[:32]!r}")
        if len(head) < HEADER_BYTES:
            raise ValueError(f"the file is truncated: it has {found} bytes, less than its "
                             f"{HEADER_BYTES}-byte header")
        fields = _FIELDS.fullmatch(head, len(_MAGIC))
        if fields is None:
            raise ValueError(f"its header is damaged: after the format line it reads "
                             f"{head[len(_MAGIC):].rstrip()!r}, not b'payload N bytes sha256 HEX'")
        nbytes, expected = int(fields[1]), fields[2].decode()
        if found != HEADER_BYTES + nbytes:
            what = "truncated" if found < HEADER_BYTES + nbytes else "longer than it should be"
            raise ValueError(f"the file is {what}: its header promises {nbytes} payload bytes, "
                             f"{HEADER_BYTES + nbytes} bytes in all, and the file has {found}")
        sha = hashlib.sha256()
        chunk = bytearray(min(_CHUNK, max(nbytes, 1)))
        left = nbytes
        while left:
            n = f.readinto(memoryview(chunk)[:min(left, len(chunk))])
            if not n:
                raise ValueError(f"the file is truncated: it ended {left} bytes before the {nbytes} payload "
                                 "bytes its header promises")
            sha.update(memoryview(chunk)[:n])
            left -= n
        if sha.hexdigest() != expected:
            raise ValueError(f"its payload is corrupt: the header says sha256 {expected}, the "
                             f"{nbytes} payload bytes have sha256 {sha.hexdigest()}")
        return torch.load(_Payload(f, HEADER_BYTES, nbytes), map_location="cpu", weights_only=True)
