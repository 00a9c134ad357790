"""Array kinds, dtypes and cross-rank checks shared by the tests. Nothing here imports torch: the core tests
(tests/core, tests/rule) run without it, their torch cases skipping (tests/conftest.py). What only the
torch tests use is in tests/torch_helpers.py."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

import adasum

from cupy_standin import cupy_or_standin

ROOT = Path(__file__).resolve().parent.parent

cupy = cupy_or_standin()
CUPY_IS_REAL = not getattr(cupy, "__adasum_standin__", False)
TORCH = importlib.util.find_spec("torch") is not None


def _torch_cuda() -> bool:
    """Whether torch sees a CUDA device; torch is imported to ask only where an NVIDIA driver is present."""
    if not TORCH or not os.path.exists("/proc/driver/nvidia"):
        return False
    import torch

    return torch.cuda.is_available()


def _torch():
    """torch where it was imported (no torch tensor exists before), else None."""
    return sys.modules.get("torch")


CUDA = _torch_cuda()


class _Torch:
    """torch, imported at its first use: ``from helpers import torch`` in a core test module, whose numpy
    tests then run where torch is not installed, while a test that uses torch is skipped there
    (``pytest.importorskip``)."""

    def __getattr__(self, name):
        if name.startswith("_") or name == "pytestmark":  # what pytest asks of a module's globals
            raise AttributeError(name)
        return getattr(pytest.importorskip("torch"), name)

    def __repr__(self):
        return "<torch, imported at first use>"


torch = _Torch()

# The world sizes of the training layer's tests under mpiexec (``world_size`` marks; the core's tests run at
# every size of scripts/run_tests.py, 1-8). Argument checks, refusals, API errors, lifecycles and
# checkpoints show nothing more at a second size: one size. A training run that is bitwise the plain or the
# hand-written one depends on P only through the core's allreduce: a power of two and a size that folds
# a pair first. Against a serial reference of the tree: one rank too, and the folds over trees of 2 and 4.
ONE_SIZE = pytest.mark.world_size(2)
TRAINING_SIZES = pytest.mark.world_size(2, 3)
REFERENCE_SIZES = pytest.mark.world_size(1, 2, 3, 5)

# Array kinds: numpy, torch on the CPU, cupy (on a GPU, or its numpy-backed stand-in, which runs the device
# code paths on the CPU), and torch on a GPU where one exists.
KINDS = ["numpy", "torch", "cupy"] + (["torch-cuda"] if CUDA else [])
FLOATS = {"numpy": ["float16", "float32", "float64"], "cupy": ["float16", "float32", "float64"],
          "torch": ["float16", "bfloat16", "float32", "float64"],
          "torch-cuda": ["float16", "bfloat16", "float32", "float64"]}
KIND_DTYPES = [(k, d) for k in KINDS for d in FLOATS[k]]

EPS = {"float16": 2.0 ** -10, "bfloat16": 2.0 ** -7, "float32": 2.0 ** -23, "float64": 2.0 ** -52}


def make(values: np.ndarray, kind: str, dtype: str):
    """``values`` as an array of ``kind`` and ``dtype``."""
    if kind.startswith("torch"):
        torch = pytest.importorskip("torch")
        t = torch.from_numpy(np.array(values, dtype=np.float64, copy=True)).to(getattr(torch, dtype))
        return t.cuda() if kind == "torch-cuda" else t
    host = np.asarray(values, dtype=np.float64).astype(dtype)
    return cupy.asarray(host) if kind == "cupy" else host


def as_f64(x) -> np.ndarray:
    """A float64 numpy copy of any array the library returns."""
    torch = _torch()
    if torch is not None and isinstance(x, torch.Tensor):
        return x.detach().to(torch.float64).cpu().numpy()
    if isinstance(x, cupy.ndarray):
        return cupy.asnumpy(x).astype(np.float64)
    return np.asarray(x, dtype=np.float64)


def raw_bytes(x) -> bytes:
    torch = _torch()
    if torch is not None and isinstance(x, torch.Tensor):
        x = x.detach().reshape(-1).contiguous().cpu()
        return x.view(torch.uint8).numpy().tobytes() if x.numel() else b""
    if isinstance(x, cupy.ndarray):
        return cupy.asnumpy(x).tobytes()
    return np.ascontiguousarray(x).tobytes()


@contextlib.contextmanager
def gpu_transport(mode: str):
    """Run the block with device buffers sent ``mode`` ("auto", "direct" or "staged").

    On a real GPU, "direct" needs a CUDA-aware MPI: elsewhere MPI cannot read device memory, so the test is
    skipped (the stand-in's "device" memory is host memory, so there it always runs)."""
    if mode == "direct" and (CUPY_IS_REAL or CUDA) and not adasum.cuda_aware_mpi():
        pytest.skip("MPI is not CUDA-aware: device memory cannot be handed to it directly")
    old = adasum.get_gpu_transport()
    adasum.set_gpu_transport(mode)
    try:
        yield
    finally:
        adasum.set_gpu_transport(old)


def kind_context(kind: str):
    """The transport a kind's tests use: the library's own choice."""
    return gpu_transport("auto")


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


def world_nodes(comm: MPI.Intracomm) -> list[list[int]]:
    """The ranks of each node of ``comm``, nodes ordered by their lowest rank, computed here independently
    of the library from the shared-memory split."""
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    lowest = node.allreduce(comm.Get_rank(), op=MPI.MIN)
    node.Free()
    firsts = comm.allgather(lowest)
    return [[r for r, f in enumerate(firsts) if f == leader] for leader in sorted(set(firsts))]


def expected_nodes() -> list[list[int]] | None:
    """The nodes this launch should make ("0,1;2,3" in ADASUM_TEST_NODES, set by the emulated-node runs)."""
    text = os.environ.get("ADASUM_TEST_NODES", "").strip()
    return [[int(r) for r in node.split(",")] for node in text.split(";")] if text else None



@functools.cache
def run_recipe(script: str) -> subprocess.CompletedProcess:
    """``mpiexec -n 2 python -m mpi4py examples/SCRIPT`` as a user runs it, from a scratch directory (what the
    frameworks write, lightning_logs/ and hf-out/, stays out of the checkout): the launcher next to this
    interpreter (.venv/bin/mpiexec), else the one on PATH. Run once per test process: the recipes' tests
    (tests/integrations/test_recipes.py) and the docs' accuracies (tests/docs/test_readme.py) check the
    same run, which trains for some seconds."""
    mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    assert mpiexec, "no mpiexec next to the interpreter or on PATH"
    env = dict(os.environ, OMP_NUM_THREADS="1", MPIEXEC_TIMEOUT="540",
               PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    scratch = tempfile.mkdtemp(prefix="adasum-recipe-")
    try:
        return subprocess.run([mpiexec, "-n", "2", sys.executable, "-m", "mpi4py", str(ROOT / "examples" / script)],
                              cwd=scratch, env=env, capture_output=True, text=True, timeout=570)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
