"""Checkpoints that resume bitwise: the model, every rank's optimizer state, and whatever the loop adds.

With ``op="adasum"`` each rank's optimizer state (momentum, Adam moments) is its own, and while an
accumulation window is open each rank holds its own partial gradients; both are needed to continue exactly
where the run stopped. So the root rank gathers every rank's ``optimizer.state_dict()`` and writes one file,
atomically (a temporary file in the same directory, then a rename), and loading hands each rank its own
part back. The root reads the file, so the other ranks need not share its filesystem.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch
from mpi4py import MPI

from ..context import library_comm
from .broadcast import _raise_everywhere, _to_cpu

__all__ = ["save_checkpoint", "load_checkpoint"]

_FORMAT = "adasum.torch checkpoint 1"


def save_checkpoint(path: str | os.PathLike, *, model: torch.nn.Module, optimizer=None,
                    extra: dict[str, Any] | None = None, comm: MPI.Intracomm | None = None,
                    root: int = 0) -> None:
    """Write ``path`` from the root rank; collective.

    The file holds the root's ``model.state_dict()`` (parameters are identical on every rank), every rank's
    ``optimizer.state_dict()`` in rank order, the world size, and ``extra``: plain data only (numbers,
    strings, lists, dicts, tensors: what ``torch.load(weights_only=True)`` reads), for example the epoch,
    the position in the data and the scheduler's and GradScaler's state dicts. The root holds all ranks'
    optimizer states in host memory while it writes. An error writing the file is raised on every rank.
    """
    comm, rank, size = _setup(comm, root)
    local = _to_cpu(optimizer.state_dict()) if optimizer is not None else None
    states = comm.gather(local, root=root)
    problem = None
    if rank == root:
        payload = {"format": _FORMAT, "world_size": size, "model": _to_cpu(model.state_dict()),
                   "optimizer": states if optimizer is not None else None, "extra": extra}
        try:
            _atomic_save(payload, os.fspath(path))
        except Exception as exc:  # reported to every rank below
            problem = f"rank {rank}: writing checkpoint {os.fspath(path)!r} failed: {exc}"
    _raise_everywhere(comm, problem)


def load_checkpoint(path: str | os.PathLike, *, model: torch.nn.Module | None = None, optimizer=None,
                    comm: MPI.Intracomm | None = None, root: int = 0) -> dict[str, Any] | None:
    """Load ``path`` (written by :func:`save_checkpoint`) into ``model`` and ``optimizer`` on every rank;
    collective. Returns the ``extra`` it was saved with, or None, on every rank.

    The root reads the file with ``torch.load(weights_only=True)`` and sends each rank its part. Each rank
    gets the optimizer state of the rank it was when saved, so the world size must be the one saved; to
    move to another world size, load the model alone (``optimizer=None``).
    """
    comm, rank, size = _setup(comm, root)
    payload, problem = None, None
    if rank == root:
        try:
            payload = torch.load(os.fspath(path), map_location="cpu", weights_only=True)
            if not isinstance(payload, dict) or payload.get("format") != _FORMAT:
                raise ValueError("it was not written by adasum.torch.save_checkpoint")
            if optimizer is not None and payload["optimizer"] is None:
                raise ValueError("it holds no optimizer state")
            if optimizer is not None and payload["world_size"] != size:
                raise ValueError(f"it was written by {payload['world_size']} ranks and this job has {size}; "
                                 "resume with as many ranks, or load the model alone (optimizer=None)")
        except Exception as exc:
            problem = f"rank {rank}: cannot load checkpoint {os.fspath(path)!r}: {exc}"
    _raise_everywhere(comm, problem)
    header = comm.bcast(None if payload is None else
                        {"model": payload["model"] if model is not None else None, "extra": payload["extra"]},
                        root=root)
    states = comm.scatter(payload["optimizer"] if rank == root and optimizer is not None else None, root=root)
    if model is not None:
        model.load_state_dict(header["model"])
    if optimizer is not None:
        optimizer.load_state_dict(states)
    return header["extra"]


def _setup(comm, root: int):
    comm = MPI.COMM_WORLD if comm is None else comm
    if not isinstance(comm, MPI.Intracomm):
        raise TypeError(f"comm must be an mpi4py intracommunicator, got {type(comm).__name__}")
    if isinstance(root, bool) or not isinstance(root, int) or not 0 <= root < comm.Get_size():
        raise ValueError(f"root must be a rank of comm (0 to {comm.Get_size() - 1}), got {root!r}")
    return library_comm(comm), comm.Get_rank(), comm.Get_size()


def _atomic_save(payload: dict[str, Any], path: str) -> None:
    """``torch.save`` to a temporary file beside ``path``, flushed to disk, then renamed over ``path``."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
