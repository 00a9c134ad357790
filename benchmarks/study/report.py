"""The study's outputs: the tables (``study.md``), the JSON (``study.json``) and, through
:mod:`study.figures`, the figures; and their redrawing from a finished study's JSON."""

from __future__ import annotations

import json
import math
import os

from .figures import plot_curves, plot_epochs
from .schedules import HEADLINE, SCHEDULES
from .summary import summarize
from .tasks import TASKS


def _range(sp: dict, fmt) -> str:
    """"median [min, max]"; a value that is None or infinite (not reached) shows as –."""
    def one(v):
        return "–" if v is None or not math.isfinite(v) else fmt(v)

    return "–" if one(sp["median"]) == "–" else f"{one(sp['median'])} [{one(sp['min'])}, {one(sp['max'])}]"


def _count(v) -> str:
    return f"{v:.0f}"


def _epochs(v) -> str:
    return f"{v:.2f}".rstrip("0").rstrip(".")


def markdown(study: dict, settings: dict, meta: dict) -> str:
    rows = summarize(study["results"])
    lines = [f"Median over seeds and, in brackets, the range [min, max]; – : not reached within the budget "
             f"(a median of – means most seeds did not reach it). {meta.get('seeds', 3)} seeds per "
             "configuration (model initialisation and data order). Epochs to a target are counted at the "
             "evaluations (fractions of an epoch where a task evaluates more than once per epoch).", ""]
    for t in study["base_lr"]:
        task, s = TASKS[t], settings[t]
        fmt = task.format
        lines += [f"## {t}", "", task.describe(s) + f"; target {fmt(s['target'])} {task.metric}.", "",
                  f"### Single-rank learning-rate sweep (base rate: {study['base_lr'][t]:g})", "",
                  f"| lr | final {task.metric} | epochs to target | diverged |", "|---:|---|---|---:|"]
        for row in study["sweeps"][t]:
            mark = " **(base)**" if row["lr"] == study["base_lr"][t] else ""
            lines.append(f"| {row['lr']:g}{mark} | {_range(row['final'], fmt)} | "
                         f"{_range(row['epochs_to_target'], _epochs)} | {row['diverged']}/{row['runs']} |")
        lines += ["", "### All configurations", "",
                  "| P | k | schedule | lr | global batch | updates/epoch | final | best | epochs to target "
                  "| updates to target | reached | diverged |",
                  "|---:|---:|---|---:|---:|---:|---|---|---|---|---:|---|"]
        for r in (r for r in rows if r["task"] == t):
            div = f"{r['diverged']}/{r['runs']}" + (f" ({', '.join(r['divergence'])})" if r["divergence"] else "")
            lines.append(f"| {r['world_size']} | {r['accumulation']} | {r['label']} | {r['lr']:.4g} | "
                         f"{r['global_batch']} | {r['updates_per_epoch']} | {_range(r['final'], fmt)} | "
                         f"{_range(r['best'], fmt)} | {_range(r['epochs_to_target'], _epochs)} | "
                         f"{_range(r['updates_to_target'], _count)} | {r['reached']}/{r['runs']} | {div} |")
        lines += _headline(rows, t, fmt)
        lines.append("")
    if meta:
        lines.append(f"{meta.get('machine', '')}; {meta.get('ranks', '?')} MPI ranks; "
                     f"{meta.get('seconds', 0) / 60:.1f} minutes" + ("" if meta.get("complete") else " (incomplete)")
                     + ".")
    return "\n".join(lines) + "\n"


def _headline(rows: list[dict], t: str, fmt) -> list[str]:
    sizes = sorted({r["world_size"] for r in rows if r["task"] == t and r["world_size"] > 1})[-2:]
    out = []
    for k in sorted({r["accumulation"] for r in rows if r["task"] == t}):
        have = [r for r in rows if r["task"] == t and r["accumulation"] == k and r["world_size"] in sizes
                and r["schedule"] in HEADLINE]
        if not have:
            continue
        out += ["", f"### Headline, k = {k}: epochs (updates) to the target, final {TASKS[t].metric}", "",
                "| P | " + " | ".join(SCHEDULES[n].label for n in HEADLINE) + " |", "|---:|" + "---|" * len(HEADLINE)]
        for p in sizes:
            cells = []
            for n in HEADLINE:
                r = next((r for r in have if r["world_size"] == p and r["schedule"] == n), None)
                cells.append("" if r is None else f"{_range(r['epochs_to_target'], _epochs)} "
                             f"({_range(r['updates_to_target'], _count)}); {fmt(r['final']['median'])}")
            out.append(f"| {p} | " + " | ".join(cells) + " |")
    return out


def write_outputs(study: dict, settings: dict, out: str, meta: dict, figures: bool = True) -> list[str]:
    """Write study.json, study.md and (with ``figures``) the PNGs under ``out``; returns the paths."""
    os.makedirs(out, exist_ok=True)
    paths = [os.path.join(out, "study.json"), os.path.join(out, "study.md")]
    with open(paths[0], "w") as f:
        json.dump(_plain({"settings": settings, "meta": meta, "summary": summarize(study["results"]), **study}), f,
                  indent=1, allow_nan=False)
    with open(paths[1], "w") as f:
        f.write(markdown(study, settings, meta))
    if figures:
        for t in study["base_lr"]:
            for k in sorted({r["accumulation"] for r in study["results"] if r["task"] == t}):
                paths.append(os.path.join(out, f"{t}_curves_k{k}.png"))
                plot_curves(study["results"], settings, t, k, paths[-1])
            paths.append(os.path.join(out, f"{t}_epochs.png"))
            plot_epochs(study["results"], settings, t, paths[-1])
    return [p for p in paths if os.path.exists(p)]


def _plain(v):
    """``v`` with every non-finite float (a target not reached: infinitely many epochs) as None, so that
    the JSON is standard."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return v


def replot(path: str, out: str | None = None) -> dict:
    """Rewrite study.md and the figures from a finished study's JSON; returns the study."""
    with open(path) as f:
        saved = json.load(f)
    study = {k: saved[k] for k in ("sweeps", "base_lr", "results", "sweep_runs") if k in saved}
    write_outputs(study, saved["settings"], out or os.path.dirname(os.path.abspath(path)), saved["meta"])
    return study
