"""What a call costs beyond its bytes, and where it goes, beside the ratio to MPI's allreduce it explains.

Run under MPI, from the repository root, for example::

    mpiexec -n 2 python benchmarks/cost.py --kinds numpy,torch --sizes 64KiB,1MiB,16MiB

For each kind (numpy arrays, torch CPU tensors), size and op, on the ten uneven float32 layers of
``benchmarks/allreduce.py`` as separate tensors reduced in place, it prints:

- ``x raw``: the median per-repeat ratio of the call's time to ``comm.Allreduce(IN_PLACE, SUM)`` of one
  buffer of the same bytes, timed in the same rounds (interleaved, rotating order, slowest rank), and
  ``x numpy``: to the same op on numpy arrays of the same bytes, in the same rounds;
- ``x each``: to MPI's own allreduce of the same tensors where they lie (``Iallreduce`` of each, posted
  together, timed in the same rounds): what no call that leaves the tensors where they are can go below;
- ``us over``: the median per-repeat difference to ``raw``, the time the call spends beyond the bytes;
- ``coll``: collectives the call starts (the agreement included; MPI's own allreduce is one), and
  ``msgs``: point-to-point messages (Adasum's exchanges);
- ``copied``: bytes copied between the caller's tensors and the library's buffers, per byte of the call
  (a call that packs and writes back copies each byte twice);
- ``py calls`` and ``c calls``: Python functions and built-in functions entered per call (``sys.setprofile``
  on one call after the warm-up), the interpreter's share of a small call.

Counts are rank 0's; times the slowest rank's. ``--plain-direct-bytes 2MiB`` sets the threshold from which
a ``sum``/``mean`` tensor goes to MPI where it lies (one collective each) instead of being packed, to
compare the two at a size. ``--layout views`` reduces views of one buffer instead of separate tensors (the
form of a fused gradient or delta buffer). ``--pages huge`` puts every tensor and the raw buffer in
memory on 2 MiB pages (``small``: 4 KiB pages only; ``default``: where numpy or torch allocate it). MPI
moves large messages between ranks of one host far faster from huge pages, and numpy gives them only to
arrays of 4 MiB and more, torch to none unless ``THP_MEM_ALLOC_ENABLE=1``: the ratios at ``default`` mix
the call's cost with the pages' (docs/launching.md).

``--steps`` adds, for ``adasum`` calls that take the halving schedule (from ``small_message_bytes`` on),
where one call's time goes, in milliseconds (the call of the median total over the repeats, rank 0's): the
reduce-scatter's exchanges, the partial dot products, the exchange of their sums, the combine, the
allgather, and the rest of the call (agreement, planning, waiting for the slowest rank) beside its total.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import adasum  # noqa: E402
from allreduce import PAGES, layer_sizes, model, parse_size, time_rounds  # noqa: E402,F401

COLUMNS = ("x raw", "x each", "x numpy", "us over", "coll", "msgs", "copied", "py calls", "c calls")


def python_calls(fn) -> tuple[int, int]:
    """(Python functions, built-in functions) entered while ``fn()`` runs."""
    counts = {"call": 0, "c_call": 0}

    def count(frame, event, arg):
        if event in counts:
            counts[event] += 1

    sys.setprofile(count)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return counts["call"], counts["c_call"]


STEPS = ("reduce exchanges", "dot products", "scalar sums", "combine", "allgather", "rest", "total")


def step_times(comm, work, refill, repeats: int) -> dict:
    """Milliseconds of each of :data:`STEPS` in one in-place Adasum call of ``work``: of ``repeats`` calls,
    each after ``refill()`` and a barrier, the one whose total is the median. The halving schedule's
    functions are timed where the call enters them, and put back as they were afterwards."""
    from adasum.runtime.collectives import Collectives
    from adasum.runtime.transport import Transport
    from adasum.schedules import halving

    spent: dict = {}

    def timed(name, fn):
        def run(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - t0
        return run

    patches = [(halving, "_layer_partials", "dot products"), (halving, "_combine", "combine"),
               (halving, "_allgather", "allgather"), (Transport, "exchange", "exchanges"),
               (Collectives, "swap_scalars", "scalar sums")]
    saved = [(owner, attr, owner.__dict__[attr]) for owner, attr, _ in patches]
    rows, halving_ran = [], False
    try:
        for owner, attr, name in patches:
            setattr(owner, attr, timed(name, getattr(owner, attr)))
        for _ in range(repeats):
            refill()
            comm.Barrier()
            spent.clear()
            t0 = time.perf_counter()
            adasum.adasum_allreduce_inplace(work, comm=comm)
            total = time.perf_counter() - t0
            halving_ran = halving_ran or "allgather" in spent
            row = {"reduce exchanges": spent.get("exchanges", 0.0) - spent.get("allgather", 0.0),
                   "dot products": spent.get("dot products", 0.0), "scalar sums": spent.get("scalar sums", 0.0),
                   "combine": spent.get("combine", 0.0), "allgather": spent.get("allgather", 0.0), "total": total}
            row["rest"] = total - sum(v for k, v in row.items() if k != "total")
            rows.append(row)
    finally:
        for owner, attr, fn in saved:
            setattr(owner, attr, fn)
    # Every rank runs every repeat; whether the call took the halving schedule is decided together (a rank
    # folded out of the tree never gathers, and the small calls of the doubling schedule exchange too).
    if not comm.allreduce(halving_ran, op=MPI.LOR):
        return {}
    typical = sorted(rows, key=lambda r: r["total"])[len(rows) // 2]  # the call of the median total
    return {k: typical[k] * 1e3 for k in STEPS}


def measure(comm, kinds, nbytes: int, ops, repeats: int, warmup: int, layout: str = "separate",
            pages: str = "default") -> dict:
    """Per (kind, op), the row of :data:`COLUMNS` for ``nbytes``: every kind and op timed in the same
    rounds, so that ``x numpy`` (a kind's time over numpy's for the same op, per repeat) compares like
    with like."""
    models = {k: model(comm.Get_rank(), nbytes, layout, pages, kind=k) for k in kinds}
    flat = models[kinds[0]][1]
    each = [np.asarray(t) for t in models[kinds[0]][2]]  # numpy views of the first kind's tensors
    names = ["raw", "each"] + [f"{op}:{k}" for k in kinds for op in ops]

    def call(name):
        if name == "raw":
            comm.Allreduce(MPI.IN_PLACE, flat, op=MPI.SUM)
        elif name == "each":
            MPI.Request.Waitall([comm.Iallreduce(MPI.IN_PLACE, t, op=MPI.SUM) for t in each])
        else:
            op, kind = name.split(":")
            adasum.adasum_allreduce_inplace(models[kind][2], op=op, comm=comm)

    def refill(name):
        models[kinds[0] if name in ("raw", "each") else name.split(":")[1]][3]()

    times = {k: np.array(v) for k, v in time_rounds(comm, names, call, refill, repeats, warmup).items()}
    raw = times["raw"]
    rows = {}
    for name in names[2:]:
        refill(name)
        comm.Barrier()
        with adasum.count_traffic(comm) as t:
            call(name)
        refill(name)
        comm.Barrier()
        py, c = python_calls(lambda: call(name))
        op, kind = name.split(":")
        base = times[f"{op}:numpy"] if f"{op}:numpy" in times else times[name]
        rows[(kind, op)] = {"x raw": float(np.median(times[name] / raw)),
                            "x each": float(np.median(times[name] / times["each"])),
                            "us over": float(np.median(times[name] - raw)) * 1e6,
                            # counters an older checkout lacks (see benchmarks/versus.py) show as -1
                            "coll": getattr(t, "collectives", -1), "msgs": t.messages,
                            "copied": getattr(t, "copied_bytes", -flat.nbytes) / max(flat.nbytes, 1),
                            "py calls": py, "c calls": c,
                            "x numpy": float(np.median(times[name] / base)), "raw_us": float(np.median(raw)) * 1e6}
    return rows


def format_row(size: int, kind: str, nbytes: int, op: str, row: dict) -> str:
    return (f"{size:>3} {kind:>6} {_human(nbytes):>7} {op:>7} {row['x raw']:>7.2f} {row['x each']:>7.2f} "
            f"{row['x numpy']:>7.2f} "
            f"{row['us over']:>9.1f} "
            f"{row['coll']:>5d} {row['msgs']:>5d} {row['copied']:>7.2f} {row['py calls']:>9d} {row['c calls']:>8d}")


def header() -> str:
    return f"{'P':>3} {'kind':>6} {'bytes':>7} {'op':>7} " + " ".join(
        f"{c:>{w}}" for c, w in zip(COLUMNS, (7, 7, 7, 9, 5, 5, 7, 9, 8)))


def _human(n: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:g}{unit}"
    return f"{n}B"


def main(argv=None) -> list:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="64KiB,1MiB,16MiB")
    ap.add_argument("--ops", default="sum,mean,adasum")
    ap.add_argument("--kinds", default="numpy,torch")
    ap.add_argument("--repeats", type=int, default=0, help="repeats per size (default: by size)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--layout", choices=("separate", "views"), default="separate",
                    help="separate tensors (default) or views of one buffer")
    ap.add_argument("--pages", choices=PAGES, default="default",
                    help="the memory of the tensors and the raw buffer (see above)")
    ap.add_argument("--steps", action="store_true",
                    help="also time the halving schedule's steps of one adasum call (see above)")
    ap.add_argument("--plain-direct-bytes", default=None,
                    help="the setting plain_direct_bytes for sum and mean (default: the library's): tensors of at "
                         "least this size go to MPI where they lie, one collective each; the others are packed")
    args = ap.parse_args(argv)
    comm = MPI.COMM_WORLD
    ops = [o for o in args.ops.split(",") if o]
    out = []
    old = None if args.plain_direct_bytes is None else adasum.configure(
        plain_direct_bytes=parse_size(args.plain_direct_bytes))
    try:
        if comm.Get_rank() == 0:
            print(header(), flush=True)
        kinds = [k for k in args.kinds.split(",") if k]
        for text in args.sizes.split(","):
            nbytes = parse_size(text)
            repeats = args.repeats or int(np.clip(4e8 / max(nbytes, 1), 15, 301))
            rows = measure(comm, kinds, nbytes, ops, repeats, args.warmup, args.layout, args.pages)
            for (kind, op), row in rows.items():
                out.append({"kind": kind, "bytes": nbytes, "op": op, **row})
                if comm.Get_rank() == 0:
                    print(format_row(comm.Get_size(), kind, nbytes, op, row), flush=True)
            if args.steps and "adasum" in ops:
                for kind in kinds:
                    _, _, work, refill = model(comm.Get_rank(), nbytes, args.layout, args.pages, kind=kind)
                    steps = step_times(comm, work, refill, min(repeats, 51))
                    out.append({"kind": kind, "bytes": nbytes, "op": "adasum", "steps_ms": steps})
                    if comm.Get_rank() == 0:
                        text = ", ".join(f"{k} {v:.3f}" for k, v in steps.items()) or "not the halving schedule"
                        print(f"    steps of one adasum call ({kind}, {_human(nbytes)}), ms: {text}", flush=True)
    finally:
        if old is not None:
            adasum.configure(old)
    return out


if __name__ == "__main__":
    main()
