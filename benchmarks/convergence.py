"""Convergence of data-parallel training with Adasum, against the plain mean and sum of the gradients.

MNIST-1D (generated offline) and the 1-D CNN of ``examples/model.py``, trained with SGD (Nesterov momentum
0.9) wrapped in ``adasum.torch.DistributedOptimizer``. One MPI job runs the whole study::

    mpiexec -n 16 python -m mpi4py benchmarks/convergence.py            # the study: 104 runs of 40 epochs
    mpiexec -n 16 python -m mpi4py benchmarks/convergence.py --quick    # the same job, ×1 and ×8, 2 epochs
    mpiexec -n 10 python -m mpi4py benchmarks/convergence.py --tune     # the one-rank sweep behind --base-lr
    python benchmarks/convergence.py --replot benchmarks/results/convergence.json   # redraw, no training

On 2 cores with 16 ranks the study takes about 25 minutes and ``--quick`` under 3.

For each world size P the ranks of COMM_WORLD split into ``size // P`` groups of P ranks; the configurations
of that size (op × learning-rate multiplier × accumulation steps) are dealt out to the groups, which train
them side by side, each passing its group's communicator to the optimizer (world size 1 runs on COMM_SELF:
there the ops coincide, so it runs once, as op ``single``). Ranks without work sleep rather than spin.

Every configuration starts from the same weights and sees the same data order. Each rank takes micro-batches
of ``--batch-size`` from its shard of the training set, so the global batch is P × batch × accumulation, as
in data-parallel training; the number of epochs is fixed, and the learning rate is ``--base-lr`` × multiplier
at every P (×1 is the unscaled single-rank learning rate). SGD rather than Adam: with SGD the sum of the
gradients is the mean at P times the learning rate, which is what can diverge, whereas Adam normalises the
update's scale away and would make ``sum`` and ``mean`` the same run.

A configuration *diverges* when an update is non-finite (the optimizer skips it on every rank: training
stops there), when an epoch's mean training loss is non-finite or more than 10 % above ln 10, the loss of a
uniform guess (every run starts just below it, so the model has become worse than knowing nothing), or when
the test accuracy falls to chance (≤ 15 %) after having reached 30 %; these stop the run. A run that ends
at chance also counts as diverged if it had reached 20 % before, or if its training loss is no better than
a uniform guess and its test loss no lower than its untrained model's (slow runs creep away from both).
Either way the record says why and when, and the job goes on.

World sizes run in the order 1, then largest first, and the JSON and markdown are rewritten after each, so
an interrupted study keeps what it finished.

Rank 0 writes ``PREFIX.json`` (settings, machine, every configuration with its per-epoch history),
``PREFIX.md`` (the tables) and the figures ``PREFIX_accuracy.png`` (test accuracy against epoch at the
largest world size), ``PREFIX_lr.png`` (final accuracy against the multiplier, per op and world size) and
``PREFIX_epochs.png`` (epochs to each accuracy level at ×1 against the world size). PREFIX defaults to
``benchmarks/results/convergence`` (``_quick`` appended with ``--quick``); ``--tune`` writes
``PREFIX_tune.json`` and ``PREFIX_tune.md`` instead.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import platform
import random
import sys
import time
from typing import NamedTuple

import numpy as np
import torch
from mpi4py import MPI

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(_ROOT, "examples"))

import adasum.torch as at  # noqa: E402
from model import build_model, evaluate, make_data, shard_batches, sleeping_barrier  # noqa: E402

__all__ = ["Config", "configurations", "train", "run_study", "write_outputs", "markdown", "claims", "main"]

log = logging.getLogger("convergence")

SINGLE = "single"          # the op name of world size 1, where adasum, mean and sum coincide
OPS = ("adasum", "mean", "sum")
COLLAPSE_BELOW = 0.15      # accuracy that counts as back at chance (10 %: ten classes) ...
COLLAPSE_AFTER = 0.30      # ... once a run has reached this (it stops there), or
ENDED_FROM = 0.20          # ... at the end of a run that had reached this
LOSS_LIMIT = 1.1 * math.log(10)  # 10 % worse than a uniform guess over ten classes

FULL = {"world_sizes": [1, 2, 4, 8, 16], "multipliers": [1, 2, 4, 8], "accumulation": [1, 4], "epochs": 40}
QUICK = {"world_sizes": [1, 2, 4, 8, 16], "multipliers": [1, 8], "accumulation": [1, 4], "epochs": 2}
TUNE_LRS = [0.005, 0.01, 0.02, 0.03, 0.05, 0.07, 0.1, 0.15, 0.2, 0.3]
TUNE_EPOCHS = 20


class Config(NamedTuple):
    world_size: int
    op: str
    multiplier: float
    accumulation: int

    @property
    def name(self) -> str:
        return f"P{self.world_size}-{self.op}-x{self.multiplier:g}-k{self.accumulation}"


def configurations(world_sizes, ops, multipliers, accumulation) -> list[Config]:
    """Every (world size, op, multiplier, accumulation); world size 1 once per multiplier and accumulation."""
    out = []
    for p in world_sizes:
        for op in ([SINGLE] if p == 1 else ops):
            for k in accumulation:
                for m in multipliers:
                    out.append(Config(int(p), op, float(m), int(k)))
    return out


# --- one configuration --------------------------------------------------------------------------------------


def train(cfg: Config, data, comm: MPI.Intracomm, settings: dict) -> dict:
    """Train ``cfg`` on the ranks of ``comm`` (collective) and return its record (the same on every rank).

    The history starts at epoch 0, the untrained model.
    """
    rank, size = comm.Get_rank(), comm.Get_size()
    if size != cfg.world_size:
        raise ValueError(f"configuration {cfg.name} needs {cfg.world_size} ranks, the communicator has {size}")
    lr = settings["base_lr"] * cfg.multiplier
    model = build_model(settings["seed"], settings["channels"])
    momentum = settings["momentum"]
    inner = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, nesterov=momentum > 0)
    optimizer = at.DistributedOptimizer(inner, op="mean" if cfg.op == SINGLE else cfg.op,
                                        accumulation_steps=cfg.accumulation, comm=comm)
    test = slice(rank, None, size)
    history: list[dict] = []

    def measure(epoch: int, loss_sum: float, seen: int) -> dict:
        """Test loss and accuracy over the group's test shards, and the epoch's mean training loss."""
        test_loss, correct, count = evaluate(model, data.x_test[test], data.y_test[test])
        totals = np.array([test_loss, correct, count, loss_sum, seen], dtype=np.float64)
        comm.Allreduce(MPI.IN_PLACE, totals, op=MPI.SUM)
        h = {"epoch": epoch, "test_accuracy": float(totals[1] / totals[2]),
             "test_loss": float(totals[0] / totals[2]),
             "train_loss": float(totals[3] / totals[4]) if totals[4] else None, "updates": optimizer.boundaries}
        history.append(h)
        return h

    micro = len(shard_batches(len(data.y), settings["batch_size"], rank, size, 0, settings["seed"]))
    initial = measure(0, 0.0, 0)
    reason, best = None, initial["test_accuracy"]
    started = time.perf_counter()
    for epoch in range(1, settings["epochs"] + 1):
        batches = shard_batches(len(data.y), settings["batch_size"], rank, size, epoch - 1, settings["seed"])
        loss_sum, seen = 0.0, 0
        for i, idx in enumerate(batches):
            loss = torch.nn.functional.cross_entropy(model(data.x[idx]), data.y[idx])
            loss.backward()
            if i == len(batches) - 1:
                optimizer.force_boundary()  # every epoch ends with an update, its window averaged by its count
            optimizer.step()
            optimizer.zero_grad()
            loss_sum += float(loss.detach()) * len(idx)
            seen += len(idx)
            # The skip is decided on the reduced values, so every rank of the group stops at the same step.
            if optimizer.step_was_skipped:
                reason = "non-finite update"
                break
        h = measure(epoch, loss_sum, seen)
        if reason is None:
            if not math.isfinite(h["train_loss"]):
                reason = "non-finite loss"
            elif h["train_loss"] > LOSS_LIMIT:
                reason = "loss above a uniform guess"
            elif h["test_accuracy"] <= COLLAPSE_BELOW and best >= COLLAPSE_AFTER:
                reason = "collapsed to chance"
        best = max(best, h["test_accuracy"])
        if reason is not None:
            break
    last = history[-1]
    # Judged at the end only, as unstable runs can recover: a run that ends at chance after having learnt
    # something fell back; one that ends there no better than a uniform guess on its own training data and
    # no better on the test set than where it started learnt nothing (slow runs creep away from both).
    if reason is None and last["test_accuracy"] <= COLLAPSE_BELOW:
        if best >= ENDED_FROM:
            reason = "ended at chance"
        elif last["train_loss"] >= math.log(10) and last["test_loss"] >= initial["test_loss"]:
            reason = "stuck at chance"

    def first(level):
        return next((h for h in history if h["test_accuracy"] >= level), None)

    reached = first(settings["target"])
    levels = sorted({*settings.get("levels", []), settings["target"]})
    return {
        "name": cfg.name, "world_size": cfg.world_size, "op": cfg.op, "multiplier": cfg.multiplier,
        "accumulation": cfg.accumulation, "lr": lr, "global_batch": cfg.world_size * settings["batch_size"]
        * cfg.accumulation, "updates_per_epoch": math.ceil(micro / cfg.accumulation),
        "final_accuracy": last["test_accuracy"], "best_accuracy": max(h["test_accuracy"] for h in history),
        "epochs_to_target": reached["epoch"] if reached else None,
        "updates_to_target": reached["updates"] if reached else None,
        "epochs_to": {f"{v:g}": (first(v) or {}).get("epoch") for v in levels},
        "updates_to": {f"{v:g}": (first(v) or {}).get("updates") for v in levels},
        "diverged": reason is not None, "divergence": reason, "diverged_epoch": last["epoch"] if reason else None,
        "epochs_run": last["epoch"], "updates": optimizer.boundaries, "skipped_updates": optimizer.skipped_updates,
        "seconds": time.perf_counter() - started, "history": history,
    }


# --- the study over groups of ranks ---------------------------------------------------------------------------


def run_study(configs: list[Config], settings: dict, world: MPI.Intracomm = MPI.COMM_WORLD,
              data=None, on_phase=None) -> list[dict] | None:
    """Train every configuration, each world size on groups of ``world`` (collective). Returns the records on
    rank 0 (in the order of ``configs``), None elsewhere. ``on_phase(records)`` is called on rank 0 after each
    world size with the records so far."""
    rank, size = world.Get_rank(), world.Get_size()
    too_big = sorted({c.world_size for c in configs if c.world_size > size})
    if too_big:
        raise ValueError(f"world sizes {too_big} need more ranks than the {size} of this job; launch with "
                         f"mpiexec -n {max(too_big)} or leave them out with --world-sizes")
    if data is None:
        # One rank generates the dataset while the others sleep, then hands it out.
        data = make_data(settings["num_samples"], settings["data_seed"]) if rank == 0 else None
        sleeping_barrier(world)
        data = world.bcast(data, root=0)
    records: dict[str, dict] = {}
    # World size 1 (the baseline) first, then the largest, whose results matter most if time runs short.
    for p in sorted({c.world_size for c in configs}, key=lambda p: (p != 1, -p)):
        todo = [c for c in configs if c.world_size == p]
        groups = size // p
        # A fixed shuffle spreads the configurations that stop early (diverging ones) over the groups.
        random.Random(p).shuffle(todo)
        color = rank // p if rank < groups * p else MPI.UNDEFINED
        comm = MPI.COMM_SELF if p == 1 else world.Split(color, rank)
        t0 = time.perf_counter()
        mine = []
        if color != MPI.UNDEFINED:
            for cfg in todo[color::groups]:
                rec = train(cfg, data, comm, settings)
                if comm.Get_rank() == 0:
                    mine.append(rec)
                    log.info("  %-22s final %5.1f%%, target %s, %s, %.1f s", cfg.name,
                             100 * rec["final_accuracy"],
                             f"epoch {rec['epochs_to_target']}" if rec["epochs_to_target"] else "not reached",
                             f"diverged ({rec['divergence']}, epoch {rec['diverged_epoch']})" if rec["diverged"]
                             else "stable", rec["seconds"])
        if comm != MPI.COMM_SELF and comm != MPI.COMM_NULL:
            comm.Free()
        sleeping_barrier(world)
        gathered = world.gather(mine, root=0)
        if rank == 0:
            for part in gathered:
                for rec in part:
                    records[rec["name"]] = rec
            log.info("world size %d: %d configurations on %d groups in %.1f s", p, len(todo), groups,
                     time.perf_counter() - t0)
            if on_phase is not None:
                on_phase([records[c.name] for c in configs if c.name in records])
    if rank != 0:
        return None
    return [records[c.name] for c in configs]


# --- reading the results --------------------------------------------------------------------------------------


def _find(records, p, op, m, k):
    for r in records:
        if (r["world_size"], r["op"], r["multiplier"], r["accumulation"]) == (p, op, m, k):
            return r
    return None


def claims(records: list[dict], settings: dict) -> dict:
    """The paper's two claims, checked at the largest world size: epochs to the target with the unscaled
    learning rate (Adasum against mean; also at the lower ``levels``), and stability across multipliers
    (Adasum against sum)."""
    p = max((r["world_size"] for r in records), default=1)
    if p == 1:
        return {}
    epochs, target = settings["epochs"], settings["target"]
    levels = sorted({*settings.get("levels", []), target})
    out = {"world_size": p, "target": target, "epochs": epochs, "speed": [], "stability": []}
    for k in sorted({r["accumulation"] for r in records}):
        a, m = _find(records, p, "adasum", 1.0, k), _find(records, p, "mean", 1.0, k)
        if a is not None and m is not None:
            rows = []
            for level in levels:
                ea, em = a["epochs_to"].get(f"{level:g}"), m["epochs_to"].get(f"{level:g}")
                if ea is not None and em is not None:
                    ratio, bound = ea / em, "="
                elif ea is not None:  # mean did not get there: it would need epochs + 1 at least
                    ratio, bound = ea / (epochs + 1), "<"
                else:
                    ratio, bound = None, None
                rows.append({"level": level, "adasum_epochs": ea, "mean_epochs": em, "ratio": ratio,
                             "ratio_bound": bound})
            main_row = rows[levels.index(target)]
            out["speed"].append({"accumulation": k, "adasum_final": a["final_accuracy"],
                                 "mean_final": m["final_accuracy"], "levels": rows,
                                 "met": main_row["ratio"] is not None and main_row["ratio"] <= 0.7})
        for mult in sorted({r["multiplier"] for r in records}):
            row = {"accumulation": k, "multiplier": mult}
            for op in OPS:
                r = _find(records, p, op, mult, k)
                row[op] = None if r is None else ("diverged" if r["diverged"] else "stable")
            out["stability"].append(row)
    return out


def _cell(r: dict | None) -> str:
    if r is None:
        return ""
    if r["diverged"]:
        return f"div. @{r['diverged_epoch']} ({100 * r['best_accuracy']:.0f})"
    if r["epochs_to_target"] is None:
        return f"{100 * r['final_accuracy']:.1f} (–)"
    return f"{100 * r['final_accuracy']:.1f} ({r['epochs_to_target']} / {r['updates_to_target']})"


def markdown(records: list[dict], settings: dict, meta: dict | None = None) -> str:
    """The results as markdown: one row per (world size, op, accumulation), one column per multiplier."""
    mults = sorted({r["multiplier"] for r in records})
    target = 100 * settings["target"]
    lines = [
        f"Final test accuracy (%) after {settings['epochs']} epochs, and in parentheses the epochs / optimizer "
        f"updates to reach {target:g} % (– : not reached). `div. @E (B)`: diverged, found in epoch E (the "
        f"last, {settings['epochs']}, for runs that ended at chance), best accuracy B %. "
        f"Learning rate = {settings['base_lr']:g} × multiplier at every world size; {settings['batch_size']} "
        "samples per micro-batch and rank.",
        "",
        "| ranks | op | accum. | global batch | " + " | ".join(f"×{m:g}" for m in mults) + " |",
        "|---:|---|---:|---:|" + "---|" * len(mults),
    ]
    keys = []
    for r in records:
        key = (r["world_size"], r["op"], r["accumulation"])
        if key not in keys:
            keys.append(key)
    order = {SINGLE: 0, "adasum": 1, "mean": 2, "sum": 3}
    for p, op, k in sorted(keys, key=lambda t: (t[0], t[2], order.get(t[1], 9))):
        row = [_find(records, p, op, m, k) for m in mults]
        batch = next(r["global_batch"] for r in row if r is not None)
        lines.append(f"| {p} | {op} | {k} | {batch} | " + " | ".join(_cell(r) for r in row) + " |")
    lines += _levels_table(records, settings, keys, order)
    c = claims(records, settings)
    if c:
        lines += ["", f"At {c['world_size']} ranks, learning rate ×1 (the unscaled single-rank rate):", ""]
        for s in c["speed"]:
            parts = []
            for row in s["levels"]:
                ratio = "n/a" if row["ratio"] is None else \
                    f"{'< ' if row['ratio_bound'] == '<' else ''}{row['ratio']:.2f}×"
                parts.append(f"to {100 * row['level']:g} %: {row['adasum_epochs'] or '–'} vs "
                             f"{row['mean_epochs'] or '–'} ({ratio})")
            lines.append(f"- accumulation {s['accumulation']}: final accuracy Adasum {100 * s['adasum_final']:.1f} %, "
                         f"mean {100 * s['mean_final']:.1f} %; epochs Adasum vs mean " + "; ".join(parts)
                         + f". Goal ≤ 0.7× at {100 * c['target']:g} %: {'met' if s['met'] else 'not met'}.")
        for k in sorted({s["accumulation"] for s in c["stability"]}):
            rows = [s for s in c["stability"] if s["accumulation"] == k]
            parts = []
            for op in OPS:
                div = [f"×{s['multiplier']:g}" for s in rows if s[op] == "diverged"]
                parts.append(f"{op} diverged at {', '.join(div)}" if div else f"{op} stable throughout")
            lines.append(f"- accumulation {k}, multipliers " + ", ".join(f"×{s['multiplier']:g}" for s in rows)
                         + ": " + "; ".join(parts))
    if meta:
        lines += ["", f"{meta.get('machine', '')}; {meta.get('ranks')} MPI ranks; {meta.get('seconds', 0) / 60:.1f} "
                  "minutes."]
    return "\n".join(lines) + "\n"


def _levels_table(records, settings, keys, order) -> list[str]:
    """Epochs to each accuracy level at multiplier ×1: one row per (world size, accumulation), one column per op."""
    levels = sorted({*settings.get("levels", []), settings["target"]})
    if not any(r["multiplier"] == 1.0 for r in records):
        return []
    ops = sorted({op for _, op, _ in keys}, key=lambda o: order.get(o, 9))
    names = " / ".join(f"{100 * v:g} %" for v in levels)
    lines = ["", f"Epochs to reach {names} at ×1 (– : not reached in {settings['epochs']}; "
             "div.: diverged first):", "",
             "| ranks | accum. | " + " | ".join(ops) + " |", "|---:|---:|" + "---|" * len(ops)]
    for p, k in sorted({(p, k) for p, _, k in keys}):
        cells = []
        for op in ops:
            r = _find(records, p, op, 1.0, k)
            if r is None:
                cells.append("")
                continue
            cell = " / ".join(str(r["epochs_to"].get(f"{v:g}") or "–") for v in levels)
            cells.append(cell + (" div." if r["diverged"] else ""))
        lines.append(f"| {p} | {k} | " + " | ".join(cells) + " |")
    return lines


def tune_markdown(records: list[dict], settings: dict) -> str:
    lines = [f"Single-rank sweep of the learning rate: SGD, Nesterov momentum {settings['momentum']:g}, "
             f"batch {settings['batch_size']}, {settings['epochs']} epochs, target {100 * settings['target']:g} %.",
             "", "| lr | final % | best % | epochs to target | diverged |", "|---:|---:|---:|---:|---|"]
    for r in sorted(records, key=lambda r: r["lr"]):
        lines.append(f"| {r['lr']:g} | {100 * r['final_accuracy']:.1f} | {100 * r['best_accuracy']:.1f} | "
                     f"{r['epochs_to_target'] or '–'} | {r['divergence'] or 'no'} |")
    return "\n".join(lines) + "\n"


# --- figures --------------------------------------------------------------------------------------------------

_COLORS = {"adasum": "tab:blue", "mean": "tab:orange", "sum": "tab:green", SINGLE: "black"}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_accuracy(records: list[dict], settings: dict, path: str) -> None:
    """Test accuracy against epoch at the largest world size: one panel per (accumulation, multiplier)."""
    plt = _plt()
    p = max(r["world_size"] for r in records)
    mults = sorted({r["multiplier"] for r in records})
    ks = sorted({r["accumulation"] for r in records})
    fig, axes = plt.subplots(len(ks), len(mults), figsize=(3.2 * len(mults), 2.7 * len(ks)), sharex=True,
                             sharey=True, squeeze=False)
    for i, k in enumerate(ks):
        for j, m in enumerate(mults):
            ax = axes[i][j]
            for op, style in [(SINGLE, "--"), *[(o, "-") for o in OPS]]:
                r = _find(records, 1 if op == SINGLE else p, op, m, k)
                if r is None:
                    continue
                xs = [h["epoch"] for h in r["history"]]
                ys = [100 * h["test_accuracy"] for h in r["history"]]
                label = "1 rank" if op == SINGLE else op
                ax.plot(xs, ys, style, color=_COLORS[op], lw=1.4, label=label, marker="." if len(xs) < 4 else None)
                if r["diverged"]:
                    ax.plot(xs[-1:], ys[-1:], "x", color=_COLORS[op], ms=9, mew=2)
            ax.axhline(100 * settings["target"], color="gray", ls=":", lw=1)
            ax.set_title(f"×{m:g} (lr {settings['base_lr'] * m:g}), accum. {k}", fontsize=9)
            ax.set_ylim(0, 100)
    fig.suptitle(f"MNIST-1D: test accuracy at {p} ranks and at 1 rank, same learning rate; x: diverged; "
                 f"dotted: target {100 * settings['target']:g} %", fontsize=10)
    _finish(fig, axes, path, "epoch", "test accuracy (%)")


def plot_lr(records: list[dict], settings: dict, path: str) -> None:
    """Final accuracy against the learning-rate multiplier, per op: one panel per (accumulation, world size)."""
    plt = _plt()
    sizes = sorted({r["world_size"] for r in records if r["world_size"] > 1}) or [1]
    ks = sorted({r["accumulation"] for r in records})
    mults = sorted({r["multiplier"] for r in records})
    fig, axes = plt.subplots(len(ks), len(sizes), figsize=(3.0 * len(sizes), 2.7 * len(ks)), sharey=True,
                             squeeze=False)
    for i, k in enumerate(ks):
        for j, p in enumerate(sizes):
            ax = axes[i][j]
            for op in (SINGLE, *OPS):
                rs = [_find(records, 1 if op == SINGLE else p, op, m, k) for m in mults]
                pts = [(m, r) for m, r in zip(mults, rs) if r is not None]
                if not pts:
                    continue
                xs = [m for m, _ in pts]
                ys = [100 * r["final_accuracy"] for _, r in pts]
                ax.plot(xs, ys, "--" if op == SINGLE else "-o", color=_COLORS[op], lw=1.4, ms=4,
                        label="1 rank" if op == SINGLE else op)
                bad = [(m, 100 * r["final_accuracy"]) for m, r in pts if r["diverged"]]
                if bad:
                    ax.plot(*zip(*bad), "x", color=_COLORS[op], ms=10, mew=2)
            ax.axhline(100 * settings["target"], color="gray", ls=":", lw=1)
            ax.set_xscale("log", base=2)
            ax.set_xticks(mults)
            ax.set_xticklabels([f"×{m:g}" for m in mults])
            ax.set_ylim(0, 100)
            ax.set_title(f"{p} ranks, accum. {k}", fontsize=9)
    fig.suptitle(f"Final test accuracy after {settings['epochs']} epochs against the learning rate "
                 "(x: diverged, at its last accuracy)", fontsize=10)
    _finish(fig, axes, path, f"learning-rate multiplier (base {settings['base_lr']:g})",
            "final test accuracy (%)")


def plot_epochs(records: list[dict], settings: dict, path: str) -> None:
    """Epochs to each accuracy level against the world size at multiplier ×1, per op: one panel per
    (accumulation, level). Runs that never get there sit above the dotted line at the epoch budget."""
    plt = _plt()
    sizes = sorted({r["world_size"] for r in records})
    ks = sorted({r["accumulation"] for r in records})
    levels = sorted({*settings.get("levels", []), settings["target"]})
    epochs = settings["epochs"]
    top = epochs + 1.5
    fig, axes = plt.subplots(len(ks), len(levels), figsize=(3.2 * len(levels), 2.7 * len(ks)), sharey=True,
                             squeeze=False)
    for i, k in enumerate(ks):
        for j, level in enumerate(levels):
            ax = axes[i][j]
            for n, op in enumerate((SINGLE, *OPS)):
                pts = [(p, _find(records, p, SINGLE if p == 1 else op, 1.0, k)) for p in sizes
                       if (p == 1) == (op == SINGLE)]
                pts = [(p, r) for p, r in pts if r is not None]
                if not pts:
                    continue
                xs = [p * (1 + 0.05 * (n - 2)) for p, _ in pts]  # a small offset keeps the ops apart
                ys = [r["epochs_to"].get(f"{level:g}") or top for _, r in pts]
                if op != SINGLE:
                    base = _find(records, 1, SINGLE, 1.0, k)
                    if base is not None:  # join the curves to the one-rank point
                        xs = [1.0] + xs
                        ys = [base["epochs_to"].get(f"{level:g}") or top] + ys
                        pts = [(1, base)] + pts
                    ax.plot(xs, ys, "-", color=_COLORS[op], lw=1.2, label=op)
                for x, y, (p, r) in zip(xs, ys, pts):
                    if op != SINGLE and p == 1:
                        continue
                    color = _COLORS[op]
                    if r["diverged"] and y == top:
                        ax.plot([x], [y], "x", color=color, ms=8, mew=2, label="1 rank" if op == SINGLE else None)
                    else:
                        ax.plot([x], [y], "o", color=color, ms=5, mfc="none" if y == top else color,
                                label="1 rank" if op == SINGLE else None)
            ax.axhline(epochs + 0.5, color="gray", ls=":", lw=1)
            ax.text(sizes[0], top + 0.7, "not reached", fontsize=7, color="gray", va="bottom")
            ax.set_xscale("log", base=2)
            ax.set_xticks(sizes)
            ax.set_xticklabels([str(p) for p in sizes])
            ax.set_ylim(0, top + 0.05 * epochs + 2)
            ax.set_title(f"to {100 * level:g} %, accum. {k}", fontsize=9)
    fig.suptitle(f"Epochs to reach a test accuracy at the unscaled learning rate (×1 = {settings['base_lr']:g}); "
                 f"budget {epochs}; x: diverged", fontsize=10)
    _finish(fig, axes, path, "ranks", "epochs")


def _finish(fig, axes, path: str, xlabel: str, ylabel: str) -> None:
    """Grids, axis labels on the outer panels, one legend under the panels (the labels of all of them,
    once each), then save small and close."""
    for row in axes:
        row[0].set_ylabel(ylabel)
        for ax in row:
            ax.grid(alpha=0.3)
    for ax in axes[-1]:
        ax.set_xlabel(xlabel)
    seen: dict[str, object] = {}
    for ax in (a for row in axes for a in row):
        for h, label in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(label, h)
    order = ["1 rank", *OPS]
    labels = sorted(seen, key=lambda s: order.index(s) if s in order else 9)
    if labels:
        fig.legend([seen[s] for s in labels], labels, loc="lower center", ncol=len(labels), fontsize=9,
                   frameon=False)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=80)
    import matplotlib.pyplot as plt

    plt.close(fig)


def write_outputs(records: list[dict], settings: dict, prefix: str, meta: dict, figures: bool = True) -> list[str]:
    """Write PREFIX.json, PREFIX.md and (with ``figures``) the three PNGs; returns the paths written."""
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    paths = [prefix + ".json", prefix + ".md"]
    with open(paths[0], "w") as f:
        json.dump({"settings": settings, "meta": meta, "claims": claims(records, settings), "results": records},
                  f, indent=1)
    with open(paths[1], "w") as f:
        f.write(markdown(records, settings, meta))
    if figures and records:
        for suffix, plot in (("_accuracy.png", plot_accuracy), ("_lr.png", plot_lr), ("_epochs.png", plot_epochs)):
            plot(records, settings, prefix + suffix)
            paths.append(prefix + suffix)
    return paths


# --- the command line -----------------------------------------------------------------------------------------


def _numbers(kind):
    def parse(text: str):
        values = [kind(v) for v in text.split(",") if v.strip()]
        if not values or any(v <= 0 for v in values):
            raise argparse.ArgumentTypeError(f"expected positive numbers separated by commas, got {text!r}")
        return values
    return parse


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help=f"a smoke run: multipliers {QUICK['multipliers']}, {QUICK['epochs']} epochs")
    ap.add_argument("--tune", action="store_true",
                    help="instead of the study, sweep the learning rate on one rank (--lrs, one run per rank)")
    ap.add_argument("--world-sizes", type=_numbers(int), help=f"default {FULL['world_sizes']}")
    ap.add_argument("--ops", default=",".join(OPS), help="ops to compare at world sizes above 1")
    ap.add_argument("--multipliers", type=_numbers(float), help=f"of --base-lr; default {FULL['multipliers']}")
    ap.add_argument("--accumulation", type=_numbers(int), help=f"micro-batches per update; default "
                                                                f"{FULL['accumulation']}")
    ap.add_argument("--epochs", type=int, help=f"default {FULL['epochs']} ({QUICK['epochs']} with --quick, "
                                                f"{TUNE_EPOCHS} with --tune)")
    ap.add_argument("--base-lr", type=float, default=0.05, help="the single-rank learning rate (see --tune)")
    ap.add_argument("--lrs", type=_numbers(float), default=TUNE_LRS, help="learning rates for --tune")
    ap.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (Nesterov when above 0)")
    ap.add_argument("--batch-size", type=int, default=32, help="samples per micro-batch on each rank")
    ap.add_argument("--channels", type=int, default=32, help="width of the convolutions")
    ap.add_argument("--target", type=float, default=0.85, help="test accuracy to reach")
    ap.add_argument("--levels", type=_numbers(float), default=[0.5, 0.7],
                    help="lower accuracies whose epochs are reported too (the claims at the largest size)")
    ap.add_argument("--num-samples", type=int, default=5000, help="MNIST-1D signals (80%% for training)")
    ap.add_argument("--data-seed", type=int, default=42)
    ap.add_argument("--seed", type=int, default=0, help="initial weights and data order")
    ap.add_argument("--out", help="prefix of the output files, which rank 0 writes (default "
                                   "benchmarks/results/convergence, with _quick or _tune appended)")
    ap.add_argument("--no-figures", action="store_true")
    ap.add_argument("--replot", metavar="JSON", help="no training: rewrite the markdown and the figures of a "
                                                     "finished study from its JSON (at --out, default beside it)")
    args = ap.parse_args(argv)
    preset = QUICK if args.quick else FULL
    if args.tune and args.epochs is None:
        args.epochs = TUNE_EPOCHS
    for key in ("world_sizes", "multipliers", "accumulation", "epochs"):
        if getattr(args, key) is None:
            setattr(args, key, preset[key])
    if args.out is None:
        args.out = os.path.join(_ROOT, "benchmarks", "results", "convergence" + ("_quick" if args.quick else ""))
    args.ops = [o for o in args.ops.split(",") if o]
    bad = [o for o in args.ops if o not in OPS]
    if bad:
        ap.error(f"--ops takes {', '.join(OPS)}, got {', '.join(bad)}")
    if args.epochs < 1 or args.batch_size < 1 or args.channels < 1:
        ap.error("--epochs, --batch-size and --channels must be at least 1")
    if not 0 < args.target <= 1:
        ap.error(f"--target is a fraction in (0, 1], got {args.target}")
    return args


def main(argv=None, world: MPI.Intracomm = MPI.COMM_WORLD) -> list[dict] | None:
    """Run the study (or the sweep) and write the outputs; returns the records on rank 0, None elsewhere."""
    args = parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    if args.replot:
        return replot(args.replot, None if "--out" not in args.argv else args.out) if world.Get_rank() == 0 else None
    rank = world.Get_rank()
    # Rank 0 reports the phases, the first rank of each group the configurations it trained.
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s [{rank}] %(message)s", datefmt="%H:%M:%S",
                        stream=sys.stderr)
    quiet, threads = logging.getLogger("adasum"), torch.get_num_threads()
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # skipped updates are recorded as divergence instead
    torch.set_num_threads(1)
    try:
        return _main(args, world)
    finally:
        quiet.setLevel(level)
        torch.set_num_threads(threads)


def _main(args, world) -> list[dict] | None:
    rank = world.Get_rank()
    settings = {"epochs": args.epochs, "batch_size": args.batch_size, "base_lr": args.base_lr,
                "momentum": args.momentum, "optimizer": "SGD, Nesterov momentum" if args.momentum > 0 else "SGD",
                "channels": args.channels, "target": args.target, "levels": args.levels,
                "num_samples": args.num_samples, "data_seed": args.data_seed, "seed": args.seed}
    if args.tune:
        settings["base_lr"] = 1.0
        configs = [Config(1, SINGLE, lr, 1) for lr in args.lrs]
    else:
        configs = configurations(args.world_sizes, args.ops, args.multipliers, args.accumulation)
    meta = {"machine": _machine(), "host": platform.node(), "ranks": world.Get_size(),
            "mpi": MPI.Get_library_version().splitlines()[0].strip(), "torch": torch.__version__,
            "python": sys.version.split()[0], "argv": args.argv}
    prefix = args.out + ("_tune" if args.tune else "")
    started = time.perf_counter()
    if rank == 0:
        log.info("%d configurations, %d epochs each, on %d ranks", len(configs), args.epochs, world.Get_size())

    def partial(records):
        meta["seconds"] = time.perf_counter() - started
        meta["complete"] = False
        _write(records, settings, prefix, meta, args, figures=False)

    records = run_study(configs, settings, world, on_phase=partial)
    if rank != 0:
        return None
    meta["seconds"] = time.perf_counter() - started
    meta["complete"] = True
    paths = _write(records, settings, prefix, meta, args, figures=not args.no_figures)
    log.info("done in %.1f min: %s", meta["seconds"] / 60, ", ".join(os.path.relpath(p) for p in paths))
    return records


def replot(path: str, prefix: str | None = None) -> list[dict]:
    """Rewrite PREFIX.json, PREFIX.md and the figures from a finished study's JSON; returns its records."""
    with open(path) as f:
        saved = json.load(f)
    prefix = prefix or path.removesuffix(".json")
    write_outputs(saved["results"], saved["settings"], prefix, saved["meta"])
    return saved["results"]


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores"


def _write(records, settings, prefix, meta, args, figures):
    if args.tune:
        os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
        with open(prefix + ".json", "w") as f:
            json.dump({"settings": settings, "meta": meta, "results": records}, f, indent=1)
        with open(prefix + ".md", "w") as f:
            f.write(tune_markdown(records, settings))
        return [prefix + ".json", prefix + ".md"]
    return write_outputs(records, settings, prefix, meta, figures)


if __name__ == "__main__":
    main()
