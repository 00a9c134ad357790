"""Times adasum_allreduce on GPU buffers against the same data on the host, interleaved in one run.

Run under MPI on a machine with a CUDA device (the ranks may share one GPU), for example::

    mpiexec -n 4 python benchmarks/device.py --kind torch --json benchmarks/out/device-np4.json

Each size is the float32 model of ``benchmarks/allreduce.py`` (ten layers of uneven sizes). The methods,
each timed from the barrier to the moment its result is ready where it lives:

- ``raw``: ``comm.Allreduce(SUM)`` in place on one host buffer of the same bytes;
- ``host``: ``adasum_allreduce_inplace`` on the layers as numpy arrays (``--kind torch``: torch CPU tensors);
- ``staged``: the same call on the layers in device memory, sent through reused page-locked host buffers;
- ``direct``: the same, with device memory handed to MPI (only where MPI is CUDA-aware, or ``--direct``);
- ``roundtrip``: what a user would write by hand: each layer copied into its own page-locked host buffer
  (made once), the device synchronised, ``host``'s call on those buffers, each layer copied back, the
  device synchronised. A staged call should never cost more.

``--ops adasum,sum,mean`` times each op in turn. ``--kind cupy-standin`` runs the cupy path on the numpy
stand-in of ``tests/cupy_standin.py`` (no GPU: a check that the script runs, not a timing of a device).

Each repeat runs every method once, in a rotating order; a method's time is that of its slowest rank, and
the table shows the median over repeats and the median ratios to ``host`` and ``raw`` of the same repeat.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys

import numpy as np
from mpi4py import MPI

import adasum
from allreduce import _human, layer_sizes, parse_size, time_rounds


class _Torch:
    def __init__(self):
        import torch

        self.torch = torch

    def host(self, a):
        return self.torch.from_numpy(a.copy())

    def device(self, a):
        return self.torch.from_numpy(a).cuda()

    def copy(self, dst, src):
        dst.copy_(src)

    def refill_host(self, dst, src):
        dst.copy_(self.torch.from_numpy(src))

    def pinned(self, a):
        return self.torch.empty(a.shape, dtype=self.torch.float32, pin_memory=True)

    def to_pinned(self, dst, src):
        dst.copy_(src, non_blocking=True)

    def from_pinned(self, dst, src):
        dst.copy_(src, non_blocking=True)

    def sync(self):
        self.torch.cuda.synchronize()

    def name(self):
        return self.torch.cuda.get_device_name()


class _Cupy:
    def __init__(self):
        import cupy

        self.cp = cupy

    def host(self, a):
        return a.copy()

    def device(self, a):
        return self.cp.asarray(a)

    def copy(self, dst, src):
        dst[...] = src

    def refill_host(self, dst, src):
        dst[...] = src

    def pinned(self, a):
        import cupyx

        return cupyx.empty_pinned(a.shape, dtype=np.float32)

    def to_pinned(self, dst, src):
        src.get(out=dst, blocking=False)

    def from_pinned(self, dst, src):
        dst.set(src)

    def sync(self):
        self.cp.cuda.get_current_stream().synchronize()

    def name(self):
        return self.cp.cuda.runtime.getDeviceProperties(self.cp.cuda.Device().id)["name"].decode()


def run(comm, kind, nbytes: int, op: str, repeats: int, warmup: int, names: list[str]) -> dict:
    rank, size = comm.Get_rank(), comm.Get_size()
    rng = np.random.default_rng(rank)
    sizes = layer_sizes(nbytes)
    layers = [rng.standard_normal(n).astype(np.float32) for n in sizes]
    flat = np.concatenate(layers)
    host = [kind.host(x) for x in layers]
    source = [kind.device(x) for x in layers]  # pristine device copies, to refill from
    dev = [kind.device(x) for x in layers]
    pinned = [kind.pinned(x) for x in layers]  # the round trip's host buffers, made once

    def call(name):
        if name == "raw":
            comm.Allreduce(MPI.IN_PLACE, flat, op=MPI.SUM)
        elif name == "host":
            adasum.set_gpu_transport("auto")  # "staged" would copy host buffers through staging too
            adasum.adasum_allreduce_inplace(host, op=op, comm=comm)
        elif name == "roundtrip":
            adasum.set_gpu_transport("auto")
            for p, d in zip(pinned, dev):
                kind.to_pinned(p, d)
            kind.sync()
            adasum.adasum_allreduce_inplace(pinned, op=op, comm=comm)
            for d, p in zip(dev, pinned):
                kind.from_pinned(d, p)
            kind.sync()
        else:
            adasum.set_gpu_transport(name)
            adasum.adasum_allreduce_inplace(dev, op=op, comm=comm)
            kind.sync()

    def refill(name):
        # what this method reduces, so that values stay in range whatever the ops did to them
        for h, d, x, s in zip(host, dev, layers, source):
            if name == "host":
                kind.refill_host(h, x)
            elif name != "raw":  # staged, direct and roundtrip reduce the device copies
                kind.copy(d, s)
        flat[...] = 0.5

    times = time_rounds(comm, names, call, refill, repeats, warmup, sync=kind.sync)
    adasum.set_gpu_transport("auto")
    out = {"bytes": int(sum(sizes)) * 4, "world_size": size, "op": op, "repeats": repeats, "results": {}}
    for name in names:
        t = np.array(times[name])
        out["results"][name] = {"median_s": float(np.median(t)),
                                "ratio_to_host": float(np.median(t / np.array(times["host"]))),
                                "ratio_to_raw": float(np.median(t / np.array(times["raw"])))}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kind", choices=["torch", "cupy", "cupy-standin"], default="torch",
                    help="the device array library (cupy-standin: tests/cupy_standin.py, no GPU needed)")
    ap.add_argument("--sizes", default="1MiB,4MiB,16MiB,64MiB,256MiB", help="total bytes per call")
    ap.add_argument("--ops", default="adasum,sum,mean", help="the reductions timed, comma-separated")
    ap.add_argument("--repeats", type=int, default=0, help="repeats per size (default: by size)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--direct", action="store_true",
                    help="also time device memory handed to MPI even where CUDA-awareness is not detected")
    ap.add_argument("--methods", default="raw,host,staged,roundtrip,direct",
                    help="methods to time (raw and host are always timed); direct only where it can run")
    ap.add_argument("--kernels", choices=["auto", "triton", "per-layer"], default="auto",
                    help="the device dot products and combine (the setting device_kernels): compare the Triton "
                         "kernels with the per-layer ones")
    ap.add_argument("--json", help="write the results to this JSON file (rank 0)")
    args = ap.parse_args(argv)
    adasum.configure(device_kernels=args.kernels)

    comm = MPI.COMM_WORLD
    if args.kind == "cupy-standin":
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
        from cupy_standin import cupy_or_standin

        cupy_or_standin()
    kind = _Torch() if args.kind == "torch" else _Cupy()
    direct = args.direct or adasum.cuda_aware_mpi()
    names = ["raw", "host"] + [m for m in args.methods.split(",") if m in ("staged", "roundtrip", "direct")
                               and (m != "direct" or direct)]
    results = []
    for i, (op, s) in enumerate((op, s) for op in args.ops.split(",") for s in args.sizes.split(",")):
        nbytes = parse_size(s)
        repeats = args.repeats or int(np.clip(1e9 / max(nbytes, 1), 7, 31))
        res = run(comm, kind, nbytes, op, repeats, args.warmup, names)
        results.append(res)
        if comm.Get_rank() == 0:
            _print(res, first=i == 0)
    if comm.Get_rank() == 0 and args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        meta = {"world_size": comm.Get_size(), "mpi": MPI.Get_library_version().splitlines()[0],
                "cuda_aware": adasum.cuda_aware_mpi(),
                "device": kind.name() if args.kind != "cupy-standin" else "cupy stand-in", "kind": args.kind,
                "kernels": args.kernels, "host": platform.node(), "cpus": os.cpu_count(), "python": sys.version.split()[0],
                "argv": sys.argv}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)
    return 0


def _print(res, first: bool) -> None:
    r = res["results"]
    names = list(r)
    if first:
        print(f"{'P':>3} {'bytes':>10} {'op':>7} " + " ".join(f"{n + ' ms':>12}" for n in names) + " " +
              " ".join(f"{n + '/host':>14}" for n in names if n not in ("host", "raw")) + f" {'host/raw':>9}")
    print(f"{size_str(res):>14} {res['op']:>7} " + " ".join(f"{r[n]['median_s'] * 1e3:>12.3f}" for n in names)
          + " " + " ".join(f"{r[n]['ratio_to_host']:>14.2f}" for n in names if n not in ("host", "raw")) +
          f" {r['host']['ratio_to_raw']:>9.2f}", flush=True)


def size_str(res) -> str:
    return f"{res['world_size']:>3} {_human(res['bytes']):>10}"


if __name__ == "__main__":
    sys.exit(main())
