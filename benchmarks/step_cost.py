"""What ``DistributedOptimizer.step()`` costs over the library's own call that it makes, per step, on a
small model (where the per-step overhead shows)::

    OMP_NUM_THREADS=1 mpiexec -n 2 python -m mpi4py benchmarks/step_cost.py
    OMP_NUM_THREADS=1 mpiexec -n 2 python -m mpi4py benchmarks/step_cost.py --json benchmarks/out/step_cost.json
    python benchmarks/step_cost.py --base /tmp/base      # not under mpiexec: it starts the two jobs

Every rank trains its own copy of a small MLP (``--width``, three layers) with SGD and momentum. Only the
part after ``backward()`` is timed (the communication, the optimizer's step and what wraps it). Variants:

- ``mean-call``: ``adasum_allreduce_inplace(grads, op="mean")`` then the optimizer's own ``step()``: what a
  user writes by hand;
- ``mean``: ``DistributedOptimizer(op="mean").step()`` (one call besides the window's agreement, which
  rides on the call's own);
- ``adasum-call``: by hand, the weight-delta form: keep the parameters, the optimizer's ``step()``, the
  deltas, ``adasum_allreduce_inplace(deltas)``, start + combined delta;
- ``adasum``: ``DistributedOptimizer(op="adasum").step()``.

The variants take turns, ``--steps`` steps each per round, for ``--rounds`` rounds, with a barrier before
each turn; a round's time per step is the slowest rank's. The table shows the median over rounds of each
variant, and of each ``DistributedOptimizer`` variant its ratio to its by-hand twin (the per-round ratio's
median) and the microseconds it adds. ``--base DIR`` runs the same job with ``DIR``'s ``adasum`` first
(another checkout, its extension built in place), then this one's, and prints both tables: the ratios are
then comparable, as each is measured against its own version's call in the same job.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

VARIANTS = ("mean-call", "mean", "adasum-call", "adasum")


def build(variant: str, width: int, seed: int):
    import torch
    from adasum import adasum_allreduce_inplace
    from adasum.torch import DistributedOptimizer

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
                                torch.nn.ReLU(), torch.nn.Linear(width, 10))
    params = list(model.parameters())
    inner = torch.optim.SGD(params, lr=1e-3, momentum=0.9)
    if variant in ("mean", "adasum"):
        opt = DistributedOptimizer(inner, op=variant)
        return model, opt.step, opt.zero_grad
    if variant == "mean-call":
        def step():
            adasum_allreduce_inplace([p.grad for p in params], op="mean")
            inner.step()
        return model, step, inner.zero_grad

    def adasum_step():
        with torch.no_grad():
            start = [p.detach().clone() for p in params]
            inner.step()
            deltas = [p.detach() - s for p, s in zip(params, start)]
            adasum_allreduce_inplace(deltas, op="adasum")
            for p, s, d in zip(params, start, deltas):
                p.copy_(s + d)
    return model, adasum_step, inner.zero_grad


def run(args) -> dict:
    import torch
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    torch.manual_seed(100 + rank)
    x, y = torch.randn(8, args.width), torch.randint(0, 10, (8,))
    setups = {v: build(v, args.width, 0) for v in VARIANTS}
    per_round: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in range(args.rounds + 1):
        for v in VARIANTS:
            model, step, zero = setups[v]
            spent = 0.0
            comm.Barrier()
            for _ in range(args.steps):
                zero()
                torch.nn.functional.cross_entropy(model(x), y).backward()
                t = time.perf_counter()
                step()
                spent += time.perf_counter() - t
            slowest = comm.allreduce(spent / args.steps, op=MPI.MAX)
            if r:  # round 0 warms up
                per_round[v].append(slowest)
    out = {"size": comm.Get_size(), "width": args.width, "rounds": per_round}
    return out


def table(result: dict, label: str) -> str:
    rounds = result["rounds"]
    lines = [f"{label}: {result['size']} ranks, width {result['width']}, median over {len(rounds['mean'])} rounds",
             f"{'variant':<12} {'us/step':>9} {'vs by hand':>11} {'added us':>9}"]
    for v in VARIANTS:
        med = statistics.median(rounds[v]) * 1e6
        if v.endswith("-call"):
            lines.append(f"{v:<12} {med:>9.0f}")
            continue
        twin = rounds[v + "-call"]
        ratio = statistics.median(a / b for a, b in zip(rounds[v], twin))
        added = statistics.median(a - b for a, b in zip(rounds[v], twin)) * 1e6
        lines.append(f"{v:<12} {med:>9.0f} {ratio:>10.2f}x {added:>9.0f}")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--json", help="write the result here (rank 0)")
    p.add_argument("--base", help="another checkout of adasum: run the same job with it first")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.base and not args.child:
        _compare(args)
        return
    result = run(args)
    from mpi4py import MPI

    if MPI.COMM_WORLD.Get_rank() == 0:
        if args.child:
            print("RESULT " + json.dumps(result))
            return
        print(table(result, "this checkout"))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)


def _compare(args) -> None:
    """The driver of ``--base`` (run without mpiexec): one job with the base checkout's ``adasum``, one
    with this one's (``ADASUM_STEP_COST_RANKS`` ranks each, default 2), each table printed."""
    size = os.environ.get("ADASUM_STEP_COST_RANKS", "2")
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    common = [mpiexec, "-n", size, sys.executable, "-m", "mpi4py", os.path.abspath(__file__), "--child",
              "--width", str(args.width), "--steps", str(args.steps), "--rounds", str(args.rounds)]
    for label, root in (("base", os.path.abspath(args.base)), ("this checkout", here)):
        env = dict(os.environ, PYTHONPATH=root, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        out = subprocess.run(common, env=env, capture_output=True, text=True, check=True).stdout
        result = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])
        print(table(result, f"{label} ({root})"))


if __name__ == "__main__":
    main()
