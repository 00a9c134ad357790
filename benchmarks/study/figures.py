"""The study's figures: per task and accumulation, the metric against epochs (one panel per world size and
op, a median line and a min–max band per schedule, one rank dashed); per task, epochs to the target against
the world size (one panel per op)."""

from __future__ import annotations

import math
import statistics

import charlm

from .schedules import OPS, SCHEDULES
from .summary import summarize
from .tasks import TASKS


_COLORS = {"adasum-x1": "tab:blue", "adasum-x1-warmup": "tab:cyan", "adasum-x2": "navy",
           "mean-x1": "tab:orange", "mean-sqrtP": "tab:red", "mean-linear-warmup": "tab:brown",
           "sum-x1": "tab:green", "adasum-grad-x1": "tab:purple", "single": "gray",
           "adasum-x1-H4": "dodgerblue", "adasum-x1-H4-diloco": "steelblue", "adasum-x1-H16": "slateblue",
           "adasum-x1-H16-diloco": "darkslateblue", "mean-x1-H4": "orange", "mean-x1-H4-diloco": "darkorange",
           "mean-x1-H16": "goldenrod", "mean-x1-H16-diloco": "peru", "adasum-x1-H4-delay": "darkblue",
           "adasum-x1-H16-delay": "midnightblue", "mean-x1-H4-delay": "chocolate", "mean-x1-H16-delay": "sienna"}


def _color(name: str) -> str:
    """The schedule's own colour; a schedule without one: the colour of its op's family (blues for
    adasum, oranges for mean)."""
    if name in _COLORS:
        return _COLORS[name]
    return "cornflowerblue" if name.startswith("adasum") else "sandybrown" if name.startswith("mean") else "gray"


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _band(runs: list[dict]):
    """Median and min–max of the metric over seeds at each evaluation (runs that stopped early count up to
    where they stopped)."""
    epochs = sorted({h["epoch"] for r in runs for h in r["history"]})
    med, lo, hi = [], [], []
    for e in epochs:
        vals = [h["metric"] for r in runs for h in r["history"] if h["epoch"] == e and math.isfinite(h["metric"])]
        med.append(statistics.median(vals) if vals else math.nan)
        lo.append(min(vals) if vals else math.nan)
        hi.append(max(vals) if vals else math.nan)
    return epochs, med, lo, hi


def plot_curves(results: list[dict], settings: dict, t: str, k: int, path: str) -> None:
    plt = _plt()
    task, s = TASKS[t], settings[t]
    runs = [r for r in results if r["task"] == t and r["accumulation"] == k]
    sizes = sorted({r["world_size"] for r in runs if r["schedule"] != "single"})
    ops = [op for op in OPS if any(r["op"] == op and r["schedule"] != "single" for r in runs)]
    if not sizes or not ops:
        return
    fig, axes = plt.subplots(len(sizes), len(ops), figsize=(max(7.0, 3.6 * len(ops)), 2.5 * len(sizes) + 0.6),
                             sharex=True, sharey=True, squeeze=False)
    single = [r for r in runs if r["world_size"] == 1]
    scale = 100 if task.higher else 1
    for i, p in enumerate(sizes):
        for j, op in enumerate(ops):
            ax = axes[i][j]
            if single:
                e, m, _, _ = _band(single)
                ax.plot(e, [scale * v for v in m], "--", color="gray", lw=1.2, label="1 rank")
            for name in SCHEDULES:
                mine = [r for r in runs if r["world_size"] == p and r["schedule"] == name and r["op"] == op
                        and name != "single"]
                if not mine:
                    continue
                e, m, lo, hi = _band(mine)
                ax.fill_between(e, [scale * v for v in lo], [scale * v for v in hi], color=_color(name), alpha=0.2,
                                lw=0)
                ax.plot(e, [scale * v for v in m], "-", color=_color(name), lw=1.4, label=SCHEDULES[name].label)
                for r in mine:
                    if r["diverged"]:
                        h = r["history"][-1]
                        if math.isfinite(h["metric"]):
                            ax.plot([h["epoch"]], [scale * h["metric"]], "x", color=_color(name), ms=7, mew=2)
            ax.axhline(scale * s["target"], color="gray", ls=":", lw=1)
            ax.set_title(f"{p} ranks, {op}", fontsize=9)
            if task.higher:
                ax.set_ylim(0, 100)
            else:
                ax.set_ylim(max(0.0, s["target"] - 1.0), charlm.bits_per_char(task.uniform_loss) + 0.3)
    fig.suptitle(f"{t}: {task.metric}{' (%)' if task.higher else ''}, accumulation {k};\nmedian over "
                 f"{len({r['seed'] for r in runs})} seeds, band min–max; x: diverged; dotted: target", fontsize=9)
    _finish(fig, axes, path, "epoch", task.metric)


def plot_epochs(results: list[dict], settings: dict, t: str, path: str) -> None:
    plt = _plt()
    s = settings[t]
    rows = [r for r in summarize(results) if r["task"] == t]
    ks = sorted({r["accumulation"] for r in rows})
    ops = [op for op in OPS if any(SCHEDULES[r["schedule"]].op == op and r["schedule"] != "single" for r in rows)]
    if not ops:
        return
    top = s["epochs"] + 1
    fig, axes = plt.subplots(len(ks), len(ops), figsize=(max(7.0, 3.6 * len(ops)), 2.8 * len(ks) + 0.6),
                             sharey=True, squeeze=False)
    for i, k in enumerate(ks):
        base = next((r for r in rows if r["accumulation"] == k and r["world_size"] == 1), None)
        for j, op in enumerate(ops):
            ax = axes[i][j]
            for name, sch in SCHEDULES.items():
                mine = sorted((r for r in rows if r["accumulation"] == k and r["schedule"] == name and sch.op == op
                               and name != "single"), key=lambda r: r["world_size"])
                if not mine:
                    continue
                if base is not None:
                    mine = [base] + mine
                xs = [r["world_size"] for r in mine]
                ys = [min(top, r["epochs_to_target"]["median"]) for r in mine]
                lo = [y - min(top, r["epochs_to_target"]["min"]) for y, r in zip(ys, mine)]
                hi = [min(top, r["epochs_to_target"]["max"]) - y for y, r in zip(ys, mine)]
                ax.errorbar(xs, ys, yerr=[lo, hi], fmt="-o", color=_color(name), ms=4, lw=1.2, capsize=2,
                            label=sch.label)
            if not ax.lines:
                ax.text(0.5, 0.5, "not in the grid", transform=ax.transAxes, ha="center", color="gray")
            ax.axhline(s["epochs"] + 0.5, color="gray", ls=":", lw=1)
            ax.set_xscale("log", base=2)
            sizes = sorted({r["world_size"] for r in rows})
            ax.set_xticks(sizes)
            ax.set_xticklabels([str(p) for p in sizes])
            ax.set_ylim(0, top + 0.5)
            ax.set_title(f"{op}, accumulation {k}", fontsize=9)
    fig.suptitle(f"{t}: epochs to the target ({TASKS[t].format(s['target'])}); median, bars min–max over seeds;\n"
                 f"above the dotted line: not reached in {s['epochs']}", fontsize=9)
    _finish(fig, axes, path, "ranks", "epochs")


def _finish(fig, axes, path: str, xlabel: str, ylabel: str) -> None:
    """Grids, outer axis labels, one legend under the panels (each label once), then save small and close."""
    for row in axes:
        row[0].set_ylabel(ylabel, fontsize=8)
        for ax in row:
            ax.grid(alpha=0.3)
    for ax in axes[-1]:
        ax.set_xlabel(xlabel)
    seen: dict[str, object] = {}
    for ax in (a for row in axes for a in row):
        for h, label in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(label, h)
    if seen:
        fig.legend(list(seen.values()), list(seen), loc="lower center", ncol=min(4, len(seen)), fontsize=8,
                   frameon=False)
    rows = math.ceil(len(seen) / 4)
    fig.tight_layout(rect=(0, 0.035 * rows + 0.02, 1, 1))
    fig.savefig(path, dpi=80)
    _plt().close(fig)
