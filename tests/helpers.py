"""Array kinds, dtypes and cross-rank checks shared by the tests."""

from __future__ import annotations

import contextlib
import hashlib

import numpy as np
import torch
from mpi4py import MPI

import adasum

# (kind, dtype) pairs that the library accepts. "staged" is numpy with every exchange forced through the
# host staging path that device buffers take, standing in for cupy on machines without a GPU.
KINDS = ["numpy", "torch", "staged"]
FLOATS = {"numpy": ["float16", "float32", "float64"], "staged": ["float16", "float32", "float64"],
          "torch": ["float16", "bfloat16", "float32", "float64"]}
KIND_DTYPES = [(k, d) for k in KINDS for d in FLOATS[k]]

EPS = {"float16": 2.0 ** -10, "bfloat16": 2.0 ** -7, "float32": 2.0 ** -23, "float64": 2.0 ** -52}


def make(values: np.ndarray, kind: str, dtype: str):
    """``values`` as an array of ``kind`` and ``dtype``."""
    if kind == "torch":
        return torch.from_numpy(np.array(values, dtype=np.float64, copy=True)).to(getattr(torch, dtype))
    return np.asarray(values, dtype=np.float64).astype(dtype)


def as_f64(x) -> np.ndarray:
    """A float64 numpy copy of any array the library returns."""
    if isinstance(x, torch.Tensor):
        return x.detach().to(torch.float64).cpu().numpy()
    return np.asarray(x, dtype=np.float64)


def raw_bytes(x) -> bytes:
    if isinstance(x, torch.Tensor):
        x = x.detach().contiguous()
        return x.view(torch.uint8).numpy().tobytes() if x.numel() else b""
    return np.ascontiguousarray(x).tobytes()


@contextlib.contextmanager
def kind_context(kind: str):
    """Switch on the staging path for the 'staged' stand-in."""
    if kind != "staged":
        yield
        return
    old = adasum.get_gpu_transport()
    adasum.set_gpu_transport("staged")
    try:
        yield
    finally:
        adasum.set_gpu_transport(old)


def assert_identical_across_ranks(comm: MPI.Intracomm, arrays) -> None:
    """Every rank holds bitwise the same arrays."""
    mine = b"".join(raw_bytes(a) for a in arrays)
    digests = comm.allgather(hashlib.sha256(mine).hexdigest()[:16])
    assert len(set(digests)) == 1, f"results differ between ranks: {digests}"


def rel_l2(got: np.ndarray, want: np.ndarray) -> float:
    denom = np.linalg.norm(want)
    return float(np.linalg.norm(got - want) / denom) if denom > 0 else float(np.linalg.norm(got))


def all_ranks_data(comm: MPI.Intracomm, make_rank):
    """``[make_rank(r) for every rank r]``: each rank builds every rank's inputs from a shared seed."""
    return [make_rank(r) for r in range(comm.Get_size())]
