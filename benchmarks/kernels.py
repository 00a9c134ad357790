"""Nanoseconds per element of the compiled kernels' two passes, per dtype, coefficients and instruction set.

One process, no MPI::

    python benchmarks/kernels.py                       # 2 Mi elements, every ISA this CPU has
    python benchmarks/kernels.py --isa avx2 --json benchmarks/out/kernels.json

``dots`` is the pass that reads a span of ``a`` and ``b`` once for a·b, a·a and b·b (float64 sums);
``combine`` is ``dst = ca·a + cb·b`` into a third buffer, rounded once to the dtype. The combine is timed with
three pairs of coefficients, because a 16-bit combine's cost may depend on how often a float64 result lands
on (or next to) a midpoint of the 16-bit grid:

- ``adasum``: coefficients as Adasum makes them for two nearly orthogonal vectors (near 1, every bit used);
- ``mean``: 0.5 and 0.5 (parallel vectors, or ``op="mean"``): most results are exact, many are midpoints;
- ``short``: 0.7 and 0.4 (decimal coefficients whose binary expansions repeat: many results end in zeros).

The data is standard normal, rounded to the dtype; each figure is the best of ``--repeats`` calls over
``--elements`` elements (operands and destination out of cache at the default size), in ns per element.
``--isa`` caps the instruction set (``auto``: the widest this CPU has; all give the same bits).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's adasum first

import adasum  # noqa: E402
from adasum.kernels import native  # noqa: E402
from adasum.rule.sixteen import narrow  # noqa: E402

COEFFICIENTS = {"adasum": (0.99931234567, 1.0004987654321), "mean": (0.5, 0.5), "short": (0.7, 0.4)}
DTYPES = ("float32", "bfloat16", "float16")


def operands(dtype: str, n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Two standard normal vectors of ``n`` elements in ``dtype`` (bfloat16 as its uint16 bits)."""
    rng = np.random.default_rng(seed)
    a, b = rng.standard_normal(n), rng.standard_normal(n)
    if dtype == "float32":
        return a.astype(np.float32), b.astype(np.float32)
    return narrow(a, dtype), narrow(b, dtype)


def best_ns(call, n: int, repeats: int) -> float:
    """The fastest of ``repeats`` calls, in ns per element."""
    call()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - t)
    return best / n * 1e9


def measure(isa: str, dtypes, n: int, repeats: int) -> dict:
    """``{dtype: {"dots": ns, "combine/<coefficients>": ns, ...}}`` under the instruction set cap ``isa``."""
    from adasum.kernels import _kernels as K

    used = native.use_isa(isa)
    spans = np.array([[0, n]], dtype=np.int64)
    out = np.zeros((1, 3))
    result = {"isa": used, "dtypes": {}}
    for dtype in dtypes:
        a, b = operands(dtype, n)
        dst = np.empty_like(a)
        row = {"dots": best_ns(lambda: K.dots(a, b, spans, out), n, repeats)}
        for name, (ca, cb) in COEFFICIENTS.items():
            c1, c2 = np.array([ca]), np.array([cb])
            row[f"combine/{name}"] = best_ns(lambda: K.scaled_add(dst, a, b, spans, c1, c2), n, repeats)
        result["dtypes"][dtype] = row
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--elements", type=int, default=1 << 21)
    ap.add_argument("--repeats", type=int, default=25)
    ap.add_argument("--isa", default="every", choices=["every", "auto", "avx2", "portable"],
                    help="the instruction set cap; every: each cap this CPU has")
    ap.add_argument("--dtypes", default=",".join(DTYPES))
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    dtypes = [d for d in args.dtypes.split(",") if d]
    for d in dtypes:
        if d not in DTYPES:
            ap.error(f"--dtypes takes {', '.join(DTYPES)}; got {d!r}")
    caps = ["auto", "avx2", "portable"] if args.isa == "every" else [args.isa]
    configured = adasum.current_settings().kernels_isa
    runs, seen = [], set()
    try:
        for cap in caps:
            used = native.use_isa(cap)
            if used in seen:  # a cap above the CPU's runs the widest it has: measured already
                continue
            seen.add(used)
            runs.append(measure(cap, dtypes, args.elements, args.repeats))
    finally:
        native.use_isa(configured)
    columns = ["dots"] + [f"combine/{c}" for c in COEFFICIENTS]
    print(f"ns per element, best of {args.repeats}, {args.elements} elements, {platform.processor() or platform.machine()}")
    print(f"{'isa':>9} {'dtype':>9} " + " ".join(f"{c:>15}" for c in columns))
    for run in runs:
        for dtype, row in run["dtypes"].items():
            print(f"{run['isa']:>9} {dtype:>9} " + " ".join(f"{row[c]:15.2f}" for c in columns))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"elements": args.elements, "repeats": args.repeats, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
