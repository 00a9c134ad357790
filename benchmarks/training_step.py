"""Time per training step with DistributedOptimizer against a local step and torch DDP (gloo).

    OMP_NUM_THREADS=1 mpiexec -n 2 python -m mpi4py benchmarks/training_step.py --json benchmarks/out/np2.json
    OMP_NUM_THREADS=1 mpiexec -n 4 python -m mpi4py benchmarks/training_step.py --json benchmarks/out/np4.json
    python benchmarks/training_step.py --report benchmarks/out/np2.json benchmarks/out/np4.json \\
        --png benchmarks/out/training_step.png
    ... training_step.py --quick      # a few steps of a tiny model, for the smoke test

Two models: an MLP of 8.4M parameters (1024-2048-2048-1024-10, batch 64 per rank) and a transformer
encoder of 23M (6 layers of width 512, vocabulary 4096, 4 sequences of 16 tokens per rank). SGD with
momentum. Every variant trains its own copy of the model; within one job the variants take turns,
``--steps`` steps each per round, for ``--rounds`` rounds. A round's time per step is that of the slowest
rank (a barrier before each turn); the table shows the median over rounds, and the overhead: the
median minus the local step's median (the same model and optimizer without communication, run by every
rank at the same time, so they share the cores alike), and where the time goes: forward, backward and
step + zero_grad, each the slowest rank's, median over rounds.

Variants: ``local``; ``adasum`` or ``mean`` with ``-overlap``, ``-bf16`` or ``-fp16`` (the 16-bit wire) and
``-spin`` or ``-nap`` (the library's setting ``waiting`` during that variant's turns; default ``"auto"``)
and ``-b<N>m`` (``bucket_bytes`` of N MiB for that variant); with local steps, ``-H<N>`` (``local_steps=N``: N local
steps between combines) and ``-delay`` (``delay=1``: the combine runs behind the next window), e.g.
``adasum-H4``, ``mean-H4-delay``. Such a variant's turn is a whole number of windows (``--steps`` and ``--warmup``
rounded up to a multiple of N, the combine included), and its time per step the mean over them; with ``-delay``
an untimed lead-in window comes first (so each timed window waits for its predecessor's combine, as in steady
state) and an untimed ``flush()`` last (so no combine is on the wire during the other variants' turns);
``ddp`` (torch DDP over gloo), ``ddp-fp16`` (with torch's ``fp16_compress_hook``), ``ddp-adasum`` (with
``adasum.torch.ddp.adasum_hook``, reducing on its thread during backward) and ``ddp-adasum-sync`` (the
same hook with ``overlap=False``: reducing inside each hook call); ``hvd``, ``hvd-fp16`` and ``hvd-adasum``: Horovod's DistributedOptimizer
(Average, Average with its fp16 compression, Adasum), where Horovod is installed beside this checkout (it
is never needed otherwise; run it with ``HOROVOD_CYCLE_TIME=0.1``). Each round also times MPI's own
allreduce of the model's bytes (float32, and half of them for 16-bit wires), which gives the **limit** of a
step: forward + max(backward, that allreduce) + the local update, from the local variant's phases. The table shows each step over the limit
(the 16-bit one for 16-bit wires) and over DDP's step (``ddp-fp16``'s for 16-bit wires). Across emulated
hosts, run it through ``cluster/netns.sh`` (``scaling.py`` does, for several host counts and link rates).

``--base DIR`` (another checkout, its extension built in place, as for ``benchmarks/compare.py``) adds,
for every DistributedOptimizer variant V, ``V@base``: the same variant with that version's ``adasum``,
imported next to this checkout's under another name, taking turns with the others in the same job; and
``V@twin``, the base version once more under a third name: the same code twice, whose ratio to ``V@base``
is the noise of the measurement. The table then shows, per variant, the median over rounds of the ratio of
its round time to its ``@base`` twin's::

    OMP_NUM_THREADS=1 mpiexec -n 2 python -m mpi4py benchmarks/training_step.py --base /tmp/base \
        --variants adasum,adasum-overlap,mean,mean-overlap-bf16 --json benchmarks/out/vs-base.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import adasum

VARIANTS = ["local", "adasum", "adasum-overlap", "adasum-overlap-bf16", "mean", "mean-overlap",
            "mean-overlap-bf16", "ddp", "ddp-fp16", "ddp-adasum"]
WIRES16 = ("bf16", "fp16")


class MLP(torch.nn.Sequential):
    def __init__(self, width: int = 2048, inputs: int = 1024):
        super().__init__(torch.nn.Linear(inputs, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
                         torch.nn.ReLU(), torch.nn.Linear(width, 1024), torch.nn.ReLU(),
                         torch.nn.Linear(1024, 10))


class Transformer(torch.nn.Module):
    def __init__(self, vocab: int = 4096, width: int = 512, layers: int = 6):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        layer = torch.nn.TransformerEncoderLayer(width, 8, 4 * width, dropout=0.0, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, tokens):
        return self.head(self.encoder(self.embed(tokens)))


def model_and_batch(name: str, rank: int, quick: bool):
    g = torch.Generator().manual_seed(rank)
    if name == "mlp":
        model = MLP(64, 32) if quick else MLP()
        x = torch.randn(64, 32 if quick else 1024, generator=g)
        y = torch.randint(0, 10, (64,), generator=g)
        return model, x, y, lambda out, y: torch.nn.functional.cross_entropy(out, y)
    vocab = 64 if quick else 4096
    model = Transformer(vocab, 32, 2) if quick else Transformer(vocab)
    tokens = torch.randint(0, vocab, (4, 17), generator=g)
    return model, tokens[:, :-1], tokens[:, 1:], \
        lambda out, y: torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def build(variant: str, name: str, rank: int, quick: bool, bucket_bytes: int):
    variant, _, version = variant.partition("@")
    at = __import__(f"adasum_{version}.torch" if version else "adasum.torch", fromlist=["torch"])
    torch.manual_seed(0)
    model, x, y, loss_fn = model_and_batch(name, rank, quick)
    inner = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    if variant == "local":
        return model, inner, x, y, loss_fn
    if variant.startswith("hvd"):  # Horovod, where it is installed: Average (-fp16: its fp16 compression), Adasum
        import horovod.torch as hvd

        hvd.init()
        op = hvd.Adasum if variant == "hvd-adasum" else hvd.Average
        compression = hvd.Compression.fp16 if variant == "hvd-fp16" else hvd.Compression.none
        opt = hvd.DistributedOptimizer(inner, named_parameters=model.named_parameters(), op=op,
                                       compression=compression)
        return model, opt, x, y, loss_fn
    if variant.startswith("ddp"):  # torch DDP over gloo; with adasum_hook, Adasum of the gradients
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        if variant in ("ddp-adasum", "ddp-adasum-sync"):
            from adasum.torch.ddp import AdasumState, adasum_hook

            ddp.register_comm_hook(AdasumState(overlap=variant == "ddp-adasum"), adasum_hook)
        elif variant == "ddp-fp16":  # torch's own hook: gradients cast to fp16 for the allreduce
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

            ddp.register_comm_hook(None, fp16_compress_hook)
        return ddp, torch.optim.SGD(ddp.parameters(), lr=1e-3, momentum=0.9), x, y, loss_fn
    parts = variant.split("-")
    wire = [w for w in WIRES16 if w in parts]
    sized = [int(q[1:-1]) << 20 for q in parts if q[:1] == "b" and q[-1:] == "m" and q[1:-1].isdigit()]
    bucket_bytes = sized[0] if sized else bucket_bytes  # "-b4m": 4 MiB buckets for this variant
    extra = {} if bucket_bytes is None else {"bucket_bytes": bucket_bytes}
    h, delay = windows_of(variant)
    if h > 1 or delay:  # "-H4": 4 local steps between combines; "-delay": the combine hidden behind the next window
        extra.update(local_steps=h, delay=delay)
    opt = at.DistributedOptimizer(inner, op=parts[0], overlap="overlap" in parts,
                                  compression=wire[0] if wire else None, **extra)
    return model, opt, x, y, loss_fn


def windows_of(variant: str) -> tuple[int, int]:
    """A variant's local steps between combines ("-H<N>", default 1) and its ``delay`` ("-delay": 1)."""
    parts = variant.split("@")[0].split("-")
    hs = [int(q[1:]) for q in parts if q[:1] == "H" and q[1:].isdigit()]
    return (hs[0] if hs else 1), int("delay" in parts)


def turn_steps(variant: str, n: int) -> int:
    """``n`` rounded up to a whole number of the variant's windows (H local steps, the combine included)."""
    h = windows_of(variant)[0]
    return -(-n // h) * h


def steps(setup, n: int) -> list[float]:
    """``n`` training steps; returns the seconds spent in forward, backward and step + zero_grad."""
    model, opt, x, y, loss_fn = setup
    phases = [0.0, 0.0, 0.0]
    for _ in range(n):
        t0 = time.perf_counter()
        loss = loss_fn(model(x), y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        t3 = time.perf_counter()
        phases[0] += t1 - t0
        phases[1] += t2 - t1
        phases[2] += t3 - t2
    return phases


def init_gloo(comm) -> None:
    import torch.distributed as dist

    port = None
    if comm.Get_rank() == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(comm.bcast(port, root=0))
    dist.init_process_group("gloo", rank=comm.Get_rank(), world_size=comm.Get_size())


def run(args) -> dict:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    torch.set_num_threads(1)
    variants = args.variants.split(",")
    where = None
    if args.base:
        where = tempfile.mkdtemp(prefix="adasum-training-step-")  # each rank its own copies
        sys.path.insert(0, where)
        for version in ("base", "twin"):
            shutil.copytree(Path(args.base) / "adasum", Path(where) / f"adasum_{version}")
        variants += [f"{v}@{version}" for version in ("base", "twin") for v in list(variants)
                     if not v.startswith(("local", "ddp"))]
    if any(v.startswith("ddp") for v in variants):
        init_gloo(comm)
    results = {"size": size, "steps": args.steps, "rounds": args.rounds, "bucket_bytes": args.bucket_bytes,
               # per variant with local steps: [H, delay] and the steps of its timed turn (whole windows)
               "local_steps": {v: list(windows_of(v)) for v in variants if windows_of(v) != (1, 0)},
               "turn_steps": {v: turn_steps(v, args.steps) for v in variants}, "models": {}}
    for name in args.models.split(","):
        setups = {v: build(v, name, rank, args.quick, args.bucket_bytes) for v in variants}
        params = sum(p.numel() for p in setups[variants[0]][0].parameters())
        for v in variants:
            steps(setups[v], turn_steps(v, args.warmup))
            if windows_of(v)[1]:
                setups[v][1].flush()
        # MPI's own allreduce of the model's bytes (as float32, and half of them: a 16-bit wire's bytes)
        wires = {"fp32": np.ones(params or 1, np.float32), "16bit": np.ones((params or 2) // 2, np.float32)}
        times = {v: [] for v in variants}
        phases = {v: [] for v in variants}
        mpi = {w: [] for w in wires}
        for _ in range(args.rounds):
            for v in variants:
                # "-spin", "-nap": the library's setting ``waiting`` for this variant (default "auto")
                parts = v.split("@")[0].split("-")
                adasum.configure(waiting="spin" if "spin" in parts else "nap" if "nap" in parts else "auto")
                h, delay = windows_of(v)
                n = turn_steps(v, args.steps)
                if delay:  # an untimed lead-in window: the timed windows each wait for their predecessor's combine
                    steps(setups[v], h)
                comm.Barrier()
                t0 = time.perf_counter()
                ph = steps(setups[v], n)
                dt = (time.perf_counter() - t0) / n
                times[v].append(comm.allreduce(dt, op=MPI.MAX))
                phases[v].append([comm.allreduce(t / n, op=MPI.MAX) for t in ph])
                if delay:  # untimed: the last window's combine arrives before the next variant's turn
                    setups[v][1].flush()
            for w, buf in wires.items():
                comm.Barrier()
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
                mpi[w].append(comm.allreduce((time.perf_counter() - t0) / args.steps, op=MPI.MAX))
        med = {v: statistics.median(ts) for v, ts in times.items()}
        base = med.get("local")
        vs_base = {v: statistics.median(a / b for a, b in zip(times[v], times[v.split("@")[0] + "@base"]))
                   for v in variants if f"{v.split('@')[0]}@base" in times and not v.endswith("@base")}
        mpi_med = {w: statistics.median(ts) for w, ts in mpi.items()}
        limit = None
        if "local" in phases:  # forward + max(backward, MPI's allreduce of the bytes) + local update
            fwd, bwd, upd = [statistics.median(r[i] for r in phases["local"]) for i in range(3)]
            limit = {w: fwd + max(bwd, t if size > 1 else 0.0) + upd for w, t in mpi_med.items()}
        results["models"][name] = {
            "parameters": params,
            "vs_base": vs_base,
            "median_s": med,
            "overhead_s": {v: med[v] - base for v in variants} if base is not None else None,
            "mpi_allreduce_s": mpi_med,
            "limit_s": limit,
            "rounds_s": times,
            # Per variant: median over rounds of forward, backward, step + zero_grad (each the slowest rank's).
            "phases_s": {v: [statistics.median(r[i] for r in ph) for i in range(3)] for v, ph in phases.items()},
        }
        for s in setups.values():
            if hasattr(s[1], "close"):
                s[1].close()
        if rank == 0:
            print(table({"P": size, **results["models"][name]}, name), flush=True)
    if any(v.startswith("ddp") for v in variants):
        torch.distributed.destroy_process_group()
    if where:
        shutil.rmtree(where, ignore_errors=True)
    return results


def wire_of(variant: str) -> str:
    """Which wire a variant's bytes travel on: "16bit" for bf16/fp16 variants, else "fp32"."""
    parts = variant.split("@")[0].split("-")
    return "16bit" if any(w in parts for w in WIRES16) else "fp32"


def reference_ddp(variant: str, med: dict) -> str | None:
    """The DDP variant a variant is compared with: DDP's fp16 hook for 16-bit wires, else plain DDP."""
    want = "ddp-fp16" if wire_of(variant) == "16bit" else "ddp"
    return want if want in med else None


def table(r: dict, name: str) -> str:
    med, over = r["median_s"], r["overhead_s"] or {}
    limit = r.get("limit_s") or {}
    lines = [f"{name} ({r['parameters'] / 1e6:.1f}M parameters), P = {r['P']}: median time per step, slowest rank"]
    if limit:
        lines[0] += (f"; limit {1e3 * limit['fp32']:.1f} ms (16-bit wire: {1e3 * limit['16bit']:.1f}) with MPI's "
                     f"allreduce of the bytes {1e3 * r['mpi_allreduce_s']['fp32']:.1f} "
                     f"({1e3 * r['mpi_allreduce_s']['16bit']:.1f}) ms")
    lines.append(f"{'variant':22s} {'step ms':>9s} {'overhead ms':>12s} {'/ limit':>8s} {'/ DDP':>7s}")
    phases = r.get("phases_s") or {}
    vs_base = r.get("vs_base") or {}
    lines[-1] += " / base" if vs_base else ""
    lines[-1] += "   forward / backward / step ms" if phases else ""
    for v, t in med.items():
        o = over.get(v)
        ref = reference_ddp(v, med)
        rel = f"{t / limit[wire_of(v)]:8.2f}" if limit else " " * 8
        rel += f"{t / med[ref]:7.2f}" if ref and ref != v and v != "local" else " " * 7
        rel += (f"{vs_base[v]:7.3f}" if v in vs_base else " " * 7) if vs_base else ""
        ph = "   " + " / ".join(f"{1e3 * x:.1f}" for x in phases[v]) if v in phases else ""
        lines.append(f"{v:22s} {1e3 * t:9.1f} {'' if o is None else f'{1e3 * o:12.1f}'} {rel}{ph}")
    return "\n".join(lines)


def report(paths: list[str], png: str | None) -> None:
    runs = [json.load(open(p)) for p in paths]
    for r in runs:
        for name, m in r["models"].items():
            print(table({"P": r["size"], **m}, name))
            print()
    if png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        cells = [(r["size"], name, m) for r in runs for name, m in r["models"].items()]
        fig, axes = plt.subplots(1, len(cells), figsize=(4.5 * len(cells), 4), squeeze=False)
        for ax, (size, name, m) in zip(axes[0], cells):
            over = {v: 1e3 * o for v, o in m["overhead_s"].items() if v != "local"}
            ax.barh(list(over), list(over.values()),
                    color=["tab:red" if v == "ddp" else "tab:blue" for v in over])
            ax.set_title(f"{name}, P = {size}")
            ax.set_xlabel("overhead per step over the local step (ms)")
            ax.invert_yaxis()
        fig.tight_layout()
        fig.savefig(png, dpi=110)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="mlp,transformer")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--steps", type=int, default=5, help="steps per variant per round")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--bucket-bytes", type=int, help="DistributedOptimizer's bucket_bytes (default: its own)")
    p.add_argument("--base", help="another checkout of adasum (extension built in place) to compare with")
    p.add_argument("--quick", action="store_true", help="tiny models, 2 rounds of 2 steps")
    p.add_argument("--json", help="write the results here (rank 0)")
    p.add_argument("--report", nargs="+", metavar="JSON", help="print the tables of earlier runs")
    p.add_argument("--png", help="with --report: bar chart of the overheads")
    args = p.parse_args(argv)
    if args.report:
        report(args.report, args.png)
        return
    if args.quick:
        args.steps, args.rounds, args.warmup = 2, 2, 2
    results = run(args)
    from mpi4py import MPI

    if args.json and MPI.COMM_WORLD.Get_rank() == 0:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
