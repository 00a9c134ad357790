"""Times adasum_allreduce against MPI's own allreduce on the same data, interleaved in one run.

Run under MPI, from the repository root, for example::

    mpiexec -n 4 python benchmarks/allreduce.py --json benchmarks/out/np4.json --plot benchmarks/out/np4

``--plot DIR`` draws time.png, busbw.png and ratio.png there, as ``sweep.py`` does for several world sizes.

Each size is a float32 model of ten layers of uneven sizes (in proportion 1, 2, 3, 5, …, 89). Each
repeat runs every method once, in a rotating order, between barriers; a method's time for a repeat is
that of its slowest rank, and the table shows the median over repeats. ``raw`` is ``comm.Allreduce(SUM)``
in place on one contiguous buffer of the same bytes: the strongest baseline, with no per-layer work at all.
Ratios are to ``raw`` of the same repeat. Bytes sent per rank are counted by ``adasum.count_traffic``.

``--dtypes float32,bfloat16,float16`` adds a dtype axis: the same values, as many elements as the size
holds in float32 (so a 16-bit call moves half the bytes), reduced in each dtype in the same rounds, named
``adasum-bfloat16`` and so on (bfloat16 needs ``--kind torch``); ``x/float32`` is then the median
per-repeat ratio of a dtype's time to the float32 call's. ``--equal-layers N`` uses N layers of equal size
instead of the ten uneven ones.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

import adasum

WEIGHTS = np.array([1, 2, 3, 5, 8, 13, 21, 34, 55, 89], dtype=np.float64)


def parse_size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    text = text.strip().lower().removesuffix("ib").removesuffix("b")
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def layer_sizes(nbytes: int, itemsize: int = 4, equal: int = 0) -> list[int]:
    """Elements per layer of a model of ``nbytes`` (in elements of ``itemsize``): ten layers in proportion
    1, 2, 3, 5, …, 89, or ``equal`` layers of one size."""
    weights = WEIGHTS if not equal else np.ones(equal)
    n = max(len(weights), nbytes // itemsize)
    sizes = np.floor(weights / weights.sum() * n).astype(int)
    sizes[-1] += n - sizes.sum()
    return sizes.tolist()


def _array(values: np.ndarray, pages: str) -> np.ndarray:
    """A copy of ``values`` in numpy's own memory (``default``: numpy advises transparent huge pages for
    arrays of 4 MiB and more), in memory advised against huge pages (``small``: 4 KiB pages only), or in
    private memory of its own that starts on a 2 MiB boundary and is advised for huge pages before it is
    first touched (``huge``: every array on 2 MiB pages, as far as the kernel has them)."""
    if pages == "default":
        return values.copy()
    huge = pages == "huge"
    # private memory: the kernel gives shared anonymous memory no transparent huge pages here
    m = mmap.mmap(-1, max(values.nbytes, 1) + (HUGE_PAGE if huge else 0),
                  flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(mmap.MADV_HUGEPAGE if huge else mmap.MADV_NOHUGEPAGE)
    raw = np.frombuffer(m, np.uint8)
    start = -raw.ctypes.data % HUGE_PAGE if huge else 0
    out = raw[start:start + values.nbytes].view(values.dtype)
    out[...] = values
    return out


PAGES = ("default", "small", "huge")  # --pages, here and in benchmarks/schedules.py
HUGE_PAGE = 2 << 20


def _methods(comm, ops, hierarchical, dtypes=("float32",)):
    names = ["raw"] + [f"{op}" for op in ops]
    if hierarchical:
        names.append("adasum-hier")
    names += [f"{op}-{d}" for d in dtypes if d != "float32" for op in ops]
    return names


def _as(values, kind: str, dtype: str):
    """A copy of float32 ``values`` (numpy) in ``dtype``, of ``kind``."""
    if kind == "torch":
        import torch

        return torch.from_numpy(values).to(getattr(torch, dtype))
    if dtype == "bfloat16":
        raise SystemExit("bfloat16 needs --kind torch (numpy has no bfloat16)")
    return values.astype(dtype)


def time_rounds(comm, names, call, refill, repeats: int, warmup: int, sync=lambda: None) -> dict:
    """Times of ``call(name)`` for every name, ``repeats`` rounds after ``warmup`` untimed ones: each
    round runs every method once, in an order rotated by one per round, each after ``refill(name)``,
    ``sync()`` and a barrier. A time is that of the slowest rank."""
    for _ in range(warmup):
        for name in names:
            call(name)
    times = {name: [] for name in names}
    for rep in range(repeats):
        order = names[rep % len(names):] + names[:rep % len(names)]
        for name in order:
            refill(name)
            sync()
            comm.Barrier()
            t0 = time.perf_counter()
            call(name)
            dt = time.perf_counter() - t0
            times[name].append(comm.allreduce(dt, op=MPI.MAX))
    return times


def model(rank: int, nbytes: int, layout: str, pages: str = "default", kind: str = "numpy", equal: int = 0):
    """A rank's ten-layer float32 data of ``nbytes``: ``(layers, flat, work, refill)``. ``layers`` keeps
    the values, ``flat`` is the raw allreduce's buffer, ``work`` the tensors Adasum reduces (separate
    arrays or views of one buffer), and ``refill()`` restores both before a timed call, so that values
    stay in range whatever the ops did to them. ``kind="torch"``: ``work`` and ``flat`` are CPU tensors
    in torch's own memory (``flat`` is handed to MPI as a numpy view of it), or with ``pages`` other than
    ``default``, tensors over memory of those pages.
    ``equal``: that many layers of one size."""
    rng = np.random.default_rng(rank)
    sizes = layer_sizes(nbytes, equal=equal)
    layers = [rng.standard_normal(n).astype(np.float32) for n in sizes]
    if kind == "torch" and pages == "default":
        import torch

        flat_t = torch.from_numpy(np.concatenate(layers)).clone()
        flat = flat_t.numpy()
        if layout == "views":
            work = list(flat_t.clone().split(sizes))
        else:
            work = [torch.from_numpy(x).clone() for x in layers]
        values = [w.numpy() for w in work]  # the same memory, for refill
    elif kind == "torch":  # tensors over memory of the pages asked for
        import torch

        flat = _array(np.concatenate(layers), pages)
        if layout == "views":
            values = np.split(_array(flat, pages), np.cumsum(sizes)[:-1])
        else:
            values = [_array(x, pages) for x in layers]
        work = [torch.from_numpy(v) for v in values]
    else:
        flat = _array(np.concatenate(layers), pages)
        if layout == "views":
            work = np.split(_array(flat, pages), np.cumsum(sizes)[:-1])
        else:
            work = [_array(x, pages) for x in layers]
        values = work

    def refill(name=None):
        for w, x in zip(values, layers):
            w[...] = x
        flat[...] = 0.5

    return layers, flat, work, refill


def run(comm, nbytes: int, ops, repeats: int, warmup: int, hierarchical: bool, layout: str,
        pages: str = "default", kind: str = "numpy", dtypes=("float32",), equal: int = 0) -> dict:
    size = comm.Get_size()
    layers, flat, work, refill_float32 = model(comm.Get_rank(), nbytes, layout, pages, kind, equal)
    sizes = [x.size for x in layers]
    names = _methods(comm, ops, hierarchical, dtypes)
    # the other dtypes: the same values, separate tensors (refilled from their own first copy)
    typed = {d: [_as(x, kind, d) for x in layers] for d in dtypes if d != "float32"}
    kept = {d: [_as(x, kind, d) for x in layers] for d in typed}

    def refill(name=None):
        d = (name or "").rsplit("-", 1)[-1]
        if d in typed:
            for w, x in zip(typed[d], kept[d]):
                w[...] = x
        else:
            refill_float32(name)

    def call(name):
        d = name.rsplit("-", 1)[-1]
        if d in typed:
            adasum.adasum_allreduce_inplace(typed[d], op=name.rsplit("-", 1)[0], comm=comm)
        elif name == "raw":
            comm.Allreduce(MPI.IN_PLACE, flat, op=MPI.SUM)
        elif name == "adasum-hier":
            adasum.adasum_allreduce_inplace(work, op="adasum", comm=comm, hierarchical=True)
        else:
            adasum.adasum_allreduce_inplace(work, op=name, comm=comm)

    sent = {}
    for name in names:
        with adasum.count_traffic() as t:
            call(name)
        # what the busiest rank handed to MPI: point-to-point bytes, or the buffer given to MPI_Allreduce
        mine = (t.sent_bytes + t.scalar_bytes + t.allreduce_bytes + t.node_bytes) if name != "raw" else flat.nbytes
        sent[name] = comm.allreduce(mine, op=MPI.MAX)

    times = time_rounds(comm, names, call, refill, repeats, warmup)
    total = int(sum(sizes)) * 4
    raw = np.array(times["raw"])
    out = {"bytes": total, "world_size": size, "layers": len(sizes), "dtypes": list(dtypes), "results": {}}
    for name in names:
        t = np.array(times[name])
        med = float(np.median(t))
        algbw = total / med
        out["results"][name] = {
            "median_s": med,
            "ratio_to_raw": float(np.median(t / raw)),
            "algbw_GBps": algbw / 1e9,
            "busbw_GBps": algbw * 2 * (size - 1) / size / 1e9,
            "sent_bytes_max_rank": sent[name],
        }
        if name == "adasum-hier" and "adasum" in times:
            out["results"][name]["ratio_to_adasum"] = float(np.median(t / np.array(times["adasum"])))
        op, _, d = name.rpartition("-")
        if d in typed and op in times:  # the same op in float32, in the same rounds
            out["results"][name]["ratio_to_float32"] = float(np.median(t / np.array(times[op])))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="4KiB,16KiB,64KiB,256KiB,1MiB,4MiB,16MiB,64MiB",
                    help="total bytes per call, comma-separated (KiB, MiB, GiB)")
    ap.add_argument("--ops", default="adasum,sum,mean", help="adasum ops to time next to the raw allreduce")
    ap.add_argument("--hierarchical", action="store_true", help="also time hierarchical Adasum")
    ap.add_argument("--layout", choices=["separate", "views"], default="separate",
                    help="the layers as separate arrays (combined where they lie, from 2 MiB per call) or as "
                         "consecutive views of one flat buffer (reduced in its memory, no copy)")
    ap.add_argument("--pages", choices=PAGES, default="default",
                    help="the memory of the layers and of the raw allreduce's buffer: numpy's (huge pages "
                         "for arrays of 4 MiB and more), 4 KiB pages only, or 2 MiB pages for every array")
    ap.add_argument("--kind", choices=["numpy", "torch"], default="numpy",
                    help="numpy arrays, or torch CPU tensors (the layers and the raw allreduce's buffer in "
                         "torch's memory; --pages does not apply)")
    ap.add_argument("--dtypes", default="float32",
                    help="dtypes of the same values to time, comma-separated (float32, bfloat16, float16): as "
                         "many elements as the size holds in float32")
    ap.add_argument("--equal-layers", type=int, default=0, metavar="N",
                    help="N layers of equal size instead of the ten uneven ones")
    ap.add_argument("--repeats", type=int, default=0, help="repeats per size (default: by size)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--json", help="write the results to this JSON file (rank 0)")
    ap.add_argument("--plot", metavar="DIR", help="draw time.png, busbw.png and ratio.png in this folder (rank 0)")
    args = ap.parse_args(argv)

    comm = MPI.COMM_WORLD
    ops = [o for o in args.ops.split(",") if o]
    results = []
    for s in args.sizes.split(","):
        nbytes = parse_size(s)
        repeats = args.repeats or int(np.clip(2e8 / max(nbytes, 1), 7, 51))
        dtypes = tuple(d for d in args.dtypes.split(",") if d)
        res = run(comm, nbytes, ops, repeats, args.warmup, args.hierarchical, args.layout, args.pages, args.kind,
                  dtypes, args.equal_layers)
        res["layout"], res["pages"], res["kind"] = args.layout, args.pages, args.kind
        res["repeats"] = repeats
        results.append(res)
        if comm.Get_rank() == 0:
            _print_row(res, first=len(results) == 1)
    if comm.Get_rank() == 0 and args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        meta = {"world_size": comm.Get_size(), "mpi": MPI.Get_library_version().splitlines()[0],
                "host": platform.node(), "cpus": os.cpu_count(), "python": sys.version.split()[0],
                "argv": sys.argv}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)
    if comm.Get_rank() == 0 and args.plot:
        plot(results, args.plot)
    return 0


def plot(results: list[dict], folder: str) -> None:
    """The plots of sweep.py for this one world size."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import sweep

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    r = results[0]
    label = f"P = {r['world_size']}, {r['kind']}, layout {r['layout']}, pages {r['pages']}"
    sweep.plot(sweep.rows([{"results": results}]), out, label)
    print(f"wrote {out}/time.png, busbw.png, ratio.png", flush=True)


def _print_row(res, first: bool) -> None:
    names = list(res["results"])
    if first:
        head = f"{'P':>3} {'bytes':>10} " + " ".join(f"{n + ' ms':>12}" for n in names) + " " + \
               " ".join(f"{n + '/raw':>12}" for n in names if n != "raw")
        print(head)
    r = res["results"]
    line = f"{res['world_size']:>3} {_human(res['bytes']):>10} " + " ".join(
        f"{r[n]['median_s'] * 1e3:>12.3f}" for n in names) + " " + " ".join(
        f"{r[n]['ratio_to_raw']:>12.2f}" for n in names if n != "raw")
    print(line, flush=True)
    for n in names:
        if "ratio_to_float32" in r[n]:
            print(f"{'':>14} {n}/float32: {r[n]['ratio_to_float32']:.2f}", flush=True)


def _human(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:g}{unit}"
    return f"{n}B"


if __name__ == "__main__":
    sys.exit(main())
