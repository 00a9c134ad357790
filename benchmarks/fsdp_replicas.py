"""The cost of Adasum across HSDP replicas (``adasum.torch.fsdp.adasum_replicas``) against native HSDP::

    OMP_NUM_THREADS=1 mpiexec -n 4 python -m mpi4py benchmarks/fsdp_replicas.py            # a 2×2 mesh
    ... benchmarks/fsdp_replicas.py --quick      # a few steps of a tiny model, for the smoke test

One MLP (``--width`` wide, ``--layers`` hidden layers, each its own FSDP module), SGD, one batch per rank.
Three variants take turns, ``--steps`` steps each per round, for ``--rounds`` rounds: ``native`` (FSDP2 on
the 2-D mesh: reduce-scatter in the shard group, gloo's all-reduce across replicas), ``mean`` and
``adasum`` (FSDP2 on the shard dimension with the replicas hook, ``op="mean"`` or ``"adasum"``). A round's
time per step is the slowest rank's (a barrier before each turn). Printed: each variant's median over
rounds and the ratios ``adasum / native`` and ``mean / native`` (the median over rounds of each round's
ratio), the figures docs/frameworks.md quotes. ``--json PATH`` writes them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from mpi4py import MPI

VARIANTS = ("native", "mean", "adasum")


def _model(width: int, layers: int) -> torch.nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        blocks = [torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU()) for _ in range(layers)]
        return torch.nn.Sequential(*blocks, torch.nn.Linear(width, 10))


def _build(variant: str, mesh, width: int, layers: int):
    from torch.distributed.fsdp import fully_shard

    from adasum.torch.fsdp import adasum_replicas

    model = _model(width, layers)
    on = mesh if variant == "native" else mesh["shard"]
    for block in list(model)[:-1]:
        fully_shard(block, mesh=on)
    fully_shard(model, mesh=on)
    hooks = None if variant == "native" else adasum_replicas(model, mesh, op=variant)
    return model, torch.optim.SGD(model.parameters(), lr=1e-3), hooks


def _turn(model, opt, x, y, steps: int, comm) -> float:
    """Seconds per step of ``steps`` steps, the slowest rank's."""
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(steps):
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    mine = (time.perf_counter() - start) / steps
    return comm.allreduce(mine, op=MPI.MAX)


def run(args) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    import adasum.torch as at

    comm = MPI.COMM_WORLD
    at.init_process_group("gloo")
    size = comm.Get_size()
    replicas = args.replicas if size % args.replicas == 0 else size
    mesh = init_device_mesh("cpu", (replicas, size // replicas), mesh_dim_names=("replicate", "shard"))
    g = torch.Generator().manual_seed(comm.Get_rank())
    x, y = torch.randn(args.batch, args.width, generator=g), torch.randint(0, 10, (args.batch,), generator=g)
    built = {v: _build(v, mesh, args.width, args.layers) for v in VARIANTS}
    for model, opt, _ in built.values():  # warm-up: the first steps make buffers and communicators
        _turn(model, opt, x, y, 2, comm)
    rounds: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for _ in range(args.rounds):
        for v in VARIANTS:
            model, opt, _ = built[v]
            rounds[v].append(_turn(model, opt, x, y, args.steps, comm))
    for _, _, hooks in built.values():
        if hooks is not None:
            hooks.close()
    ratio = {v: statistics.median(a / b for a, b in zip(rounds[v], rounds["native"])) for v in ("mean", "adasum")}
    return {"mesh": [replicas, size // replicas], "width": args.width, "layers": args.layers,
            "batch": args.batch, "steps": args.steps, "rounds_s": rounds,
            "median_s": {v: statistics.median(r) for v, r in rounds.items()},
            "ratio_to_native": ratio}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", type=int, default=2, help="replicas (the mesh's first dimension)")
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=5, help="steps per variant per round")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="a tiny model, 2 rounds of 2 steps")
    ap.add_argument("--json", help="write the results here (rank 0)")
    args = ap.parse_args(argv)
    if args.quick:
        args.width, args.layers, args.batch, args.steps, args.rounds = 32, 2, 4, 2, 2
    results = run(args)
    if MPI.COMM_WORLD.Get_rank() == 0:
        r, s = results["mesh"]
        print(f"mesh {r}x{s}, MLP {args.layers}x{args.width}, batch {args.batch} per rank; "
              f"median over {args.rounds} rounds of {args.steps} steps")
        for v in VARIANTS:
            print(f"  {v:7s} {results['median_s'][v] * 1e3:9.2f} ms/step")
        for v, q in results["ratio_to_native"].items():
            print(f"  {v} / native: {q:.3f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
    import torch.distributed as dist

    dist.destroy_process_group()
