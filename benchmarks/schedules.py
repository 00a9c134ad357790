"""Times Adasum under different schedule settings against MPI's allreduce, interleaved in one run.

Run under MPI, for example::

    mpiexec -n 2 python benchmarks/schedules.py --sizes 1.5MiB,2MiB,3MiB,4MiB --settings auto,halving,doubling

Settings:

- ``auto``: the defaults.
- ``halving`` / ``doubling``: one schedule at every size (``adasum.set_small_message_bytes`` 0 / 1 TiB).
- ``direct=A,split=B``-style settings are written ``dA-sB`` in MiB, for example ``d4-s8``: halving reads
  separate tensors where they lie from A MiB per call and cuts its messages per layer piece from B MiB
  (the settings ``direct_min_bytes`` and ``split_min_bytes``), with the default schedule threshold.

The data are those of ``benchmarks/allreduce.py`` (its ``model``). Each repeat runs every setting once, in a rotating
order, each right after a raw allreduce of the same bytes (``comm.Allreduce(SUM)`` on one flat buffer):
a call that follows another on the same buffers finds them in cache, which at 4 MiB made it 13 % faster
than one that follows the raw allreduce. A time is that of the slowest rank; the table shows the median of
each call's ratio to the raw allreduce just before it. Every setting is applied before its own call and
undone after it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
from mpi4py import MPI

import adasum

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from allreduce import PAGES, model, parse_size  # noqa: E402


def _apply(setting: str):
    """Applies ``setting`` (with :func:`adasum.configure`); returns the function that undoes it."""
    if setting == "halving":
        old = adasum.configure(small_message_bytes=0)
    elif setting == "doubling":
        old = adasum.configure(small_message_bytes=1 << 40)
    elif setting.startswith("d") and "-s" in setting:
        direct, split = setting[1:].split("-s")
        old = adasum.configure(direct_min_bytes=int(float(direct) * (1 << 20)),
                               split_min_bytes=int(float(split) * (1 << 20)))
    elif setting == "auto":
        old = adasum.current_settings()
    else:
        raise ValueError(f"unknown setting {setting!r}")
    return lambda: adasum.configure(old)


def _timed(comm, call, refill, name: str) -> float:
    refill(name)
    comm.Barrier()
    t0 = time.perf_counter()
    call(name)
    return comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1MiB,2MiB,3MiB,4MiB,6MiB,8MiB")
    ap.add_argument("--settings", default="auto,halving,doubling")
    ap.add_argument("--layout", choices=["separate", "views"], default="separate")
    ap.add_argument("--pages", choices=PAGES, default="default",
                    help="as for benchmarks/allreduce.py")
    ap.add_argument("--kind", choices=["numpy", "torch"], default="numpy", help="as for benchmarks/allreduce.py")
    ap.add_argument("--repeats", type=int, default=25)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args(argv)
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    settings = [s for s in args.settings.split(",") if s]
    if len(set(settings)) != len(settings):
        ap.error(f"--settings names a setting twice: {args.settings}")
    for s in settings:  # a bad name fails here, on every rank, before anything is timed
        _apply(s)()
    if rank == 0:
        print(f"{'P':>3} {'bytes':>10} {'raw ms':>9} " + " ".join(f"{s + '/raw':>14}" for s in settings))
    for text in args.sizes.split(","):
        _, flat, work, refill = model(rank, parse_size(text), args.layout, args.pages, args.kind)

        def call(name):
            if name == "raw":
                comm.Allreduce(MPI.IN_PLACE, flat, op=MPI.SUM)
                return
            undo = _apply(name)
            try:
                adasum.adasum_allreduce_inplace(work, comm=comm)
            finally:
                undo()

        ratios, raws = {name: [] for name in settings}, []
        for rep in range(args.warmup + args.repeats):
            for name in settings[rep % len(settings):] + settings[:rep % len(settings)]:
                # each setting right after a raw allreduce, so that none finds the cache as another left it
                raw_t, t = (_timed(comm, call, refill, n) for n in ("raw", name))
                if rep >= args.warmup:
                    ratios[name].append(t / raw_t)
                    raws.append(raw_t)
        if rank == 0:
            cells = " ".join(f"{np.median(ratios[s]):>14.2f}" for s in settings)
            print(f"{comm.Get_size():>3} {text:>10} {np.median(raws) * 1e3:>9.3f} {cells}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
