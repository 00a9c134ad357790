"""Which runs the study makes (the one-rank sweep of the learning rate, the base rate it picks, the grid at
that rate) and how one MPI job trains them: groups of P ranks on sub-communicators, the configurations of a
world size dealt to the groups longest first."""

from __future__ import annotations

import logging
import math
import statistics
import time

from model import sleeping_barrier
from mpi4py import MPI

from .summary import none_as_inf, spread
from .schedules import SCHEDULES, Config
from .tasks import TASKS
from .training import train

log = logging.getLogger("convergence")


def sweep_configs(task: str, s: dict, seeds: int) -> list[Config]:
    """One-rank runs at every learning rate of the sweep, every seed."""
    return [Config(task, 1, "single", 1, seed, float(lr)) for lr in s["lrs"] for seed in range(seeds)]


def grid_configs(task: str, s: dict, seeds: int, base_lr: float) -> list[Config]:
    """The grid at the chosen base rate, without the one-rank runs at k = 1 (the sweep has them)."""
    out = []
    for k, sizes, schedules in s["grid"]:
        if k != 1:
            out += [Config(task, 1, "single", int(k), seed, base_lr) for seed in range(seeds)]
        for p in sizes:
            for name in schedules:
                if name not in SCHEDULES or name == "single":
                    raise ValueError(f"unknown schedule {name!r} in the grid of {task}")
                out += [Config(task, int(p), name, int(k), seed, base_lr) for seed in range(seeds)]
    return out


def choose_base(records: list[dict]) -> tuple[float, list[dict]]:
    """The sweep's base rate: the best median final metric over seeds, a diverged run counting as the worst
    value (its last metric means nothing), ties to the smaller rate. Returns it and one row per rate."""
    task = TASKS[records[0]["task"]]
    worst = -math.inf if task.higher else math.inf
    rows = []
    for lr in sorted({r["base_lr"] for r in records}):
        runs = [r for r in records if r["base_lr"] == lr]
        rows.append({"lr": lr, "final": spread([r["final"] for r in runs]),
                     "score": statistics.median(worst if r["diverged"] else r["final"] for r in runs),
                     "epochs_to_target": spread([none_as_inf(r["epochs_to_target"]) for r in runs]),
                     "diverged": sum(r["diverged"] for r in runs), "runs": len(runs)})
    sign = -1 if task.higher else 1
    best = min(rows, key=lambda row: (sign * row["score"], row["lr"]))
    return best["lr"], rows


def _deal(configs: list[Config], groups: int, settings: dict) -> list[list[Config]]:
    """Configurations to groups, longest first to the least loaded group (a fixed, deterministic order)."""
    def cost(c):
        s = settings[c.task]
        return TASKS[c.task].cost(s) * s["epochs"]

    loads, out = [0.0] * groups, [[] for _ in range(groups)]
    for c in sorted(configs, key=lambda c: (-cost(c), c.name)):
        g = loads.index(min(loads))
        out[g].append(c)
        loads[g] += cost(c)
    return out


def run_phase(configs: list[Config], world: MPI.Intracomm, data: dict, settings: dict) -> list[dict] | None:
    """Train ``configs``, all of one world size, on groups of ``world`` (collective). Returns their records
    on rank 0, None elsewhere."""
    rank, size = world.Get_rank(), world.Get_size()
    p = configs[0].world_size
    groups = size // p
    color = rank // p if rank < groups * p else MPI.UNDEFINED
    comm = MPI.COMM_SELF if p == 1 else world.Split(color, rank)
    t0 = time.perf_counter()
    mine = []
    if color != MPI.UNDEFINED:
        todo = _deal(configs, groups, settings)[color]
        for i, cfg in enumerate(todo, 1):
            rec = train(cfg, data[cfg.task], comm, settings[cfg.task])
            if comm.Get_rank() == 0:
                mine.append(rec)
                log.info("  P=%d group %d, %d/%d: %s", p, color, i, len(todo), _progress(rec, settings[cfg.task]))
    if comm != MPI.COMM_SELF and comm != MPI.COMM_NULL:
        comm.Free()
    sleeping_barrier(world)
    gathered = world.gather(mine, root=0)
    if rank != 0:
        return None
    records = {r["name"]: r for part in gathered for r in part}
    log.info("world size %d: %d runs on %d groups in %.1f s", p, len(configs), groups, time.perf_counter() - t0)
    return [records[c.name] for c in configs]


def _progress(r: dict, s: dict) -> str:
    task = TASKS[r["task"]]
    reached = (f"target at epoch {r['epochs_to_target']:g} ({r['updates_to_target']} updates)"
               if r["epochs_to_target"] is not None else "target not reached")
    state = f"diverged ({r['divergence']}, epoch {r['diverged_epoch']:g})" if r["diverged"] else "stable"
    return f"{r['name']}: final {task.format(r['final'])}, {reached}, {state}, {r['seconds']:.1f} s"


def run_study(tasks: list[str], settings: dict, seeds: int, world: MPI.Intracomm, on_phase=None) -> dict | None:
    """The sweeps, then the grids (collective). Returns {"sweeps": ..., "results": [...]} on rank 0."""
    rank, size = world.Get_rank(), world.Get_size()
    need = max((p for t in tasks for _, sizes, _ in settings[t]["grid"] for p in sizes), default=1)
    if need > size:
        raise ValueError(f"world size {need} needs more ranks than the {size} of this job; launch with "
                         f"mpiexec -n {need} or leave it out of the grid (--set TASK.grid=...)")
    # One rank makes the data while the others sleep, then hands it out.
    data = {t: TASKS[t].load(settings[t]) for t in tasks} if rank == 0 else None
    sleeping_barrier(world)
    data = world.bcast(data, root=0)
    out = {"sweeps": {}, "base_lr": {}, "results": []}

    def finished(records):
        if rank == 0:
            out["results"] += records
            if on_phase is not None:
                on_phase(out)

    sweeps = run_phase([c for t in tasks for c in sweep_configs(t, settings[t], seeds)], world, data, settings)
    if rank == 0:
        for t in tasks:
            mine = [r for r in sweeps if r["task"] == t]
            base, rows = choose_base(mine)
            out["base_lr"][t], out["sweeps"][t] = base, rows
            log.info("%s: base learning rate %g (best median final %s over %d seeds)", t, base,
                     TASKS[t].metric, seeds)
        finished([r for r in sweeps if r["base_lr"] == out["base_lr"][r["task"]]])
    base = world.bcast(out["base_lr"] if rank == 0 else None, root=0)
    grid = [c for t in tasks for c in grid_configs(t, settings[t], seeds, base[t])]
    # One rank first (the references), then the largest world sizes, whose results matter most.
    for p in sorted({c.world_size for c in grid}, key=lambda p: (p != 1, -p)):
        finished(run_phase([c for c in grid if c.world_size == p], world, data, settings))
    if rank == 0:
        out["sweep_runs"] = sweeps
    return out if rank == 0 else None
