"""Times this checkout's calls against another checkout's, interleaved in one job, beside MPI's allreduce.

Run under MPI, from the repository root, for example::

    git worktree add /tmp/base <commit>   # or: git archive <commit> | tar -x -C /tmp/base
    cp adasum/kernels/_kernels*.so /tmp/base/adasum/kernels/
    mpiexec -n 2 python benchmarks/versus.py --other /tmp/base --kind torch --ops sum,adasum

The other checkout's package is copied into a temporary folder as ``adasum_other`` (the package imports
itself relatively), so both versions run in the same processes, in the same rounds, on the same data:
each repeat runs ``raw`` (``comm.Allreduce`` in place on one buffer of the same bytes), then each op in
both versions, in a random order (:func:`shuffled_rounds`). The table shows each method's median
ratio to ``raw`` of the same repeat, and ``new/old``, the median per-repeat ratio of the two versions.
The data is the ten uneven float32 layers of ``benchmarks/allreduce.py``, as separate arrays, in place.
"""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import sys
import tempfile
import time

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import adasum  # noqa: E402
from allreduce import model, parse_size  # noqa: E402


def load_other(folder: str, comm):
    """``folder``'s ``adasum`` package, imported as ``adasum_other`` (copied by rank 0 of ``comm``)."""
    where = comm.bcast(tempfile.mkdtemp(prefix="adasum-other-") if comm.Get_rank() == 0 else None)
    if comm.Get_rank() == 0:
        shutil.copytree(os.path.join(folder, "adasum"), os.path.join(where, "adasum_other"),
                        ignore=shutil.ignore_patterns("__pycache__"))
    comm.Barrier()
    sys.path.insert(0, where)
    return importlib.import_module("adasum_other")


def shuffled_rounds(comm, names, call, refill, repeats: int, warmup: int) -> dict:
    """:func:`allreduce.time_rounds` with the methods in a fresh random order each round (the same on every
    rank): with a fixed cycle, each method always follows the same one, and the second of two versions
    of one op found the caches the first had warmed (3-5 % in an A/A run of one checkout against itself)."""
    for _ in range(warmup):
        for name in names:
            call(name)
    rng = np.random.default_rng(7)
    times = {name: [] for name in names}
    for _ in range(repeats):
        for k in rng.permutation(len(names)):
            refill(names[k])
            comm.Barrier()
            t0 = time.perf_counter()
            call(names[k])
            times[names[k]].append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
    return times


def run(comm, other, nbytes: int, ops, kind: str, repeats: int, warmup: int) -> dict:
    _, flat, work, refill = model(comm.Get_rank(), nbytes, "separate", kind=kind)
    names = ["raw"] + [f"{op}-{v}" for op in ops for v in ("new", "old")]
    libs = {"new": adasum, "old": other}

    def call(name):
        if name == "raw":
            comm.Allreduce(MPI.IN_PLACE, flat, op=MPI.SUM)
            return
        op, version = name.rsplit("-", 1)
        libs[version].adasum_allreduce_inplace(work, op=op, comm=comm)

    times = {k: np.array(v) for k, v in shuffled_rounds(comm, names, call, refill, repeats, warmup).items()}
    raw = times["raw"]
    out = {"raw_ms": float(np.median(raw)) * 1e3}
    for op in ops:
        new, old = times[f"{op}-new"], times[f"{op}-old"]
        out[op] = (float(np.median(new / raw)), float(np.median(old / raw)), float(np.median(new / old)))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--other", required=True, help="the root of the other checkout (holds adasum/)")
    ap.add_argument("--sizes", default="64KiB,1MiB,16MiB")
    ap.add_argument("--ops", default="sum,mean,adasum")
    ap.add_argument("--kind", choices=["numpy", "torch"], default="numpy")
    ap.add_argument("--repeats", type=int, default=0, help="repeats per size (default: by size)")
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args(argv)
    comm = MPI.COMM_WORLD
    other = load_other(args.other, comm)
    ops = [o for o in args.ops.split(",") if o]
    if comm.Get_rank() == 0:
        print(f"{'P':>3} {'kind':>6} {'bytes':>7} {'raw ms':>8} " +
              " ".join(f"{op + ' new/raw':>15} {op + ' old/raw':>15} {op + ' new/old':>15}" for op in ops))
    for text in args.sizes.split(","):
        nbytes = parse_size(text)
        repeats = args.repeats or int(np.clip(4e8 / max(nbytes, 1), 15, 301))
        r = run(comm, other, nbytes, ops, args.kind, repeats, args.warmup)
        if comm.Get_rank() == 0:
            print(f"{comm.Get_size():>3} {args.kind:>6} {text:>7} {r['raw_ms']:>8.3f} " +
                  " ".join(f"{r[op][0]:>15.2f} {r[op][1]:>15.2f} {r[op][2]:>15.2f}" for op in ops), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
