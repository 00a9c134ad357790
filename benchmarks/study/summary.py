"""The results read over seeds: median and range per configuration."""

from __future__ import annotations

import math
import statistics

from .schedules import SCHEDULES


def none_as_inf(v):
    """``v``, or infinity for None (a target not reached)."""
    return math.inf if v is None else v


def spread(values: list[float]) -> dict:
    """Median, min and max of the values that are not None (all infinite when none is left)."""
    vals = [v for v in values if v is not None]
    if not vals:
        return {"median": math.inf, "min": math.inf, "max": math.inf}
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}


def summarize(results: list[dict]) -> list[dict]:
    """One row per (task, world size, accumulation, schedule): median and range over seeds."""
    keys = []
    for r in results:
        key = (r["task"], r["world_size"], r["accumulation"], r["schedule"])
        if key not in keys:
            keys.append(key)
    order = list(SCHEDULES)
    rows = []
    for task, p, k, name in sorted(keys, key=lambda t: (t[0], t[2], t[1], order.index(t[3]))):
        runs = [r for r in results
                if (r["task"], r["world_size"], r["accumulation"], r["schedule"]) == (task, p, k, name)]
        rows.append({
            "task": task, "world_size": p, "accumulation": k, "schedule": name, "label": SCHEDULES[name].label,
            "lr": runs[0]["lr"], "global_batch": runs[0]["global_batch"],
            "updates_per_epoch": runs[0]["updates_per_epoch"],
            "seeds": sorted(r["seed"] for r in runs), "final": spread([r["final"] for r in runs]),
            "best": spread([r["best"] for r in runs]),
            "epochs_to_target": spread([none_as_inf(r["epochs_to_target"]) for r in runs]),
            "updates_to_target": spread([none_as_inf(r["updates_to_target"]) for r in runs]),
            "reached": sum(r["epochs_to_target"] is not None for r in runs),
            "diverged": sum(r["diverged"] for r in runs), "runs": len(runs),
            "divergence": sorted({r["divergence"] for r in runs if r["diverged"]}),
        })
    return rows
