"""Times this checkout's adasum against another version of it, side by side in one MPI job.

Run under MPI, with the other version's checkout (its compiled extension built in place, e.g.
``git worktree add /tmp/base <commit> && (cd /tmp/base && python setup.py build_ext --inplace)``)::

    mpiexec -n 2 python benchmarks/compare.py --base /tmp/base

The other version's ``adasum`` package is copied under the name ``adasum_base`` (its imports are relative,
so it runs as it is) and imported next to this checkout's. Every repeat times, between barriers and in an
order that alternates, ``comm.Allreduce`` on one buffer of the same bytes (``raw``), the base version, the
base version once more under a second name (the same code twice: what the ratio of two identical
contenders spreads by is the noise of the measurement), and this checkout: in-place Adasum (``--ops``:
each op given, e.g. ``sum,mean,adasum``) of a float32 model of ten layers (sizes in proportion 1, 2, 3, 5,
…, 89; ``--equal-layers N``: N layers of one size).
A contender's time for a repeat is its slowest rank's. The table shows medians over repeats of per-repeat
ratios.

``--dtypes float32,bfloat16,float16`` times every contender on the same values in each dtype (as many
elements as the size holds in float32), all in the same repeats; ``/f32`` is then the median ratio of a
version's time in that dtype to its own float32 time in the same repeat. ``--kind torch`` reduces torch CPU
tensors (bfloat16 needs it) instead of numpy arrays. The milliseconds shown are medians of the slowest
rank's time.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's adasum first

import adasum  # noqa: E402
from allreduce import _as, layer_sizes, parse_size  # noqa: E402


def _import_copy(src: Path, name: str, where: str):
    """The package at ``src`` imported as ``name`` (a copy under ``where``)."""
    shutil.copytree(src, Path(where) / name)
    if where not in sys.path:
        sys.path.insert(0, where)
    return __import__(name)


def _layers(nbytes: int, seed: int, rank: int, equal: int = 0, kind: str = "numpy", dtype: str = "float32"):
    rng = np.random.default_rng([seed, rank])
    return [_as(rng.standard_normal(n).astype(np.float32), kind, dtype) for n in layer_sizes(nbytes, equal=equal)]


def _time(comm, fns: dict, seconds: float) -> tuple[int, dict]:
    """Repeats (about ``seconds`` in all) of every function of ``fns`` between barriers, in an order that
    alternates; each time the slowest rank's. Returns the number of repeats and the times per key."""
    for f in fns.values():
        f()
        f()
    comm.Barrier()
    started = time.perf_counter()
    for f in fns.values():
        f()
    each = comm.allreduce(time.perf_counter() - started, op=MPI.MAX)
    repeats = max(5, min(3000, int(seconds / max(each, 1e-6))))
    times: dict = {k: [] for k in fns}
    for r in range(repeats):
        for k in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
            comm.Barrier()
            t = time.perf_counter()
            fns[k]()
            times[k].append(comm.allreduce(time.perf_counter() - t, op=MPI.MAX))
    return repeats, {k: np.array(v) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="checkout of the version to compare with (extension built)")
    ap.add_argument("--sizes", default="64KiB,2MiB,16MiB,64MiB")
    ap.add_argument("--seconds", type=float, default=6.0, help="about how long to spend per size")
    ap.add_argument("--dtypes", default="float32", help="dtypes to time, comma-separated (float32 first)")
    ap.add_argument("--kind", choices=["numpy", "torch"], default="numpy")
    ap.add_argument("--ops", default="adasum", help="ops to time, comma-separated (adasum, sum, mean)")
    ap.add_argument("--equal-layers", type=int, default=0, metavar="N")
    args = ap.parse_args()
    dtypes = [d for d in args.dtypes.split(",") if d]
    ops = [o for o in args.ops.split(",") if o]
    comm = MPI.COMM_WORLD
    where = tempfile.mkdtemp(prefix="adasum-compare-")  # each rank its own copies
    src = Path(args.base) / "adasum"
    base, twin = _import_copy(src, "adasum_base", where), _import_copy(src, "adasum_twin", where)
    rows = []
    for text in args.sizes.split(","):
        nbytes = parse_size(text)
        raw = np.zeros(sum(layer_sizes(nbytes, equal=args.equal_layers)), np.float32)
        fns = {"raw": lambda: comm.Allreduce(MPI.IN_PLACE, raw, op=MPI.SUM)}
        for op in ops:
            for d in dtypes:
                for k, lib in (("base", base), ("twin", twin), ("new", adasum)):
                    data = _layers(nbytes, 1, comm.Get_rank(), args.equal_layers, args.kind, d)
                    fns[k, op, d] = lambda lib=lib, data=data, op=op: lib.adasum_allreduce_inplace(data, op=op)
        repeats, t = _time(comm, fns, args.seconds)

        def ratio(a, b):
            return float(np.median(t[a] / t[b]))

        f32 = dtypes[0]
        for op in ops:
            for d in dtypes:
                b, n = ("base", op, d), ("new", op, d)
                rows.append((text, op, d, repeats, 1e3 * float(np.median(t[b])), 1e3 * float(np.median(t[n])),
                             ratio(b, "raw"), ratio(n, "raw"), ratio(n, b), ratio(("twin", op, d), b),
                             ratio(b, ("base", op, f32)), ratio(n, ("new", op, f32))))
    if comm.Get_rank() == 0:
        print(f"P = {comm.Get_size()}; {args.kind}; medians of per-repeat ratios; base: {args.base}")
        print(f"{'size':>8} {'op':>7} {'dtype':>9} {'repeats':>8} {'base ms':>8} {'new ms':>8} {'base/raw':>9} "
              f"{'new/raw':>8} {'new/base':>9} {'twin/base':>10} {'base/f32':>9} {'new/f32':>8}")
        for text, op, d, repeats, bms, nms, a, b, c, tw, bf, nf in rows:
            print(f"{text:>8} {op:>7} {d:>9} {repeats:>8} {bms:8.3f} {nms:8.3f} {a:9.2f} {b:8.2f} {c:9.2f} {tw:10.2f} "
                  f"{bf:9.2f} {nf:8.2f}", flush=True)
    shutil.rmtree(where, ignore_errors=True)


if __name__ == "__main__":
    main()
