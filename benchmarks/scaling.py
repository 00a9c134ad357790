"""Training steps across emulated hosts: step time against the number of hosts, per link rate, with the
limit drawn in (the scaling picture of ``training_step.py``).

    sudo python benchmarks/scaling.py --hosts 1,2,4 --rates 1gbit,2500mbit --out benchmarks/results/scaling
    python benchmarks/scaling.py --plot-only --out benchmarks/results/scaling

For each link rate, ``cluster/netns.sh`` builds as many hosts as the largest count asks for (one rank per
host, TCP between hosts through links rate-limited with tc), and ``training_step.py`` runs across 2, 4, ...
of them; one host is one rank without communication, run once. Each run writes its JSON beside the
others (``{rate}-{hosts}h.json``, ``1h.json``); ``results.json`` merges them, ``scaling.png`` plots the step
times per model and wire (fp32, 16-bit) and ``tables.md`` holds, per model, wire, rate and hosts, the step of
each contender over the limit, over torch DDP's step (DDP's fp16 hook for 16-bit wires) and over the local step
(no communication; the measure for local-steps variants such as ``adasum-H4-delay``, see ``training_step.py``),
then every step over the local step's and DDP's as the median over rounds of their ratio within a round. The limit is
forward + max(backward, MPI's own allreduce of the wire's bytes) + the local update, all measured in the
same job (see ``training_step.py``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from training_step import reference_ddp, wire_of  # noqa: E402

CONTENDERS = "local,adasum,adasum-overlap,adasum-overlap-bf16,mean,mean-overlap,mean-overlap-bf16,ddp,ddp-fp16"


def run(args) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    hosts = [int(h) for h in args.hosts.split(",")]
    python = str(ROOT / ".venv" / "bin" / "python")
    step = [python, "-m", "mpi4py", str(HERE / "training_step.py"), "--models", args.models, "--variants",
            args.variants, "--rounds", str(args.rounds), "--steps", str(args.steps)]
    if args.bucket_bytes:
        step += ["--bucket-bytes", str(args.bucket_bytes)]
    netns = ["bash", str(HERE / "cluster" / "netns.sh")]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if 1 in hosts:
        subprocess.run([str(ROOT / ".venv" / "bin" / "mpiexec"), "-n", "1", *step, "--json", str(out / "1h.json")],
                       check=True, env=env)
    for rate in args.rates.split(","):
        subprocess.run([*netns, "down"], check=True)
        subprocess.run([*netns, "up", str(max(hosts)), rate], check=True)
        try:
            for n in (h for h in hosts if h > 1):
                print(f"== {n} hosts at {rate}", flush=True)
                subprocess.run([*netns, "run", str(n), "1", "--", *step, "--json", str(out / f"{rate}-{n}h.json")],
                               check=True, env=env)
        finally:
            subprocess.run([*netns, "down"], check=True)


def merge(out: Path) -> dict:
    """Every run's results, keyed by rate (``"1 host"`` for the single host) and host count."""
    merged: dict = {}
    for path in sorted(out.glob("*h.json")):
        stem = path.stem
        rate, _, n = stem.rpartition("-") if "-" in stem else ("", "", stem)
        merged.setdefault(rate or "local", {})[n[:-1]] = json.load(open(path))
    with open(out / "results.json", "w") as f:
        json.dump(merged, f, indent=1)
    return merged


def tables(merged: dict) -> str:
    lines = []
    rates = [r for r in merged if r != "local"]
    for rate in rates:
        for n, res in sorted(merged[rate].items(), key=lambda kv: int(kv[0])):
            for name, m in res["models"].items():
                med, limit = m["median_s"], m.get("limit_s") or {}
                lines.append(f"\n{name}, {n} hosts at {rate}: limit {1e3 * limit['fp32']:.0f} ms "
                             f"(16-bit {1e3 * limit['16bit']:.0f} ms)\n")
                lines.append("| variant | step ms | step / limit | step / DDP | step / local |")
                lines.append("|---|---|---|---|---|")
                for v, t in med.items():
                    ref = reference_ddp(v, med)
                    vs = f"{t / med[ref]:.2f}" if ref and ref != v and v != "local" else ""
                    local = f"{t / med['local']:.2f}" if med.get("local") and v != "local" else ""
                    lines.append(f"| {v} | {1e3 * t:.0f} | {t / limit[wire_of(v)]:.2f} | {vs} | {local} |")
    return "\n".join(lines).lstrip("\n") + "\n"


def round_ratios(merged: dict, ref: str) -> str:
    """Per rate, model and host count: each variant's step over ``ref``'s (``"local"``, ``"ddp"``), the median over
    rounds of the ratio within a round (the two measured side by side), with its range over rounds."""
    lines = []
    for rate in (r for r in merged if r != "local"):
        for n, res in sorted(merged[rate].items(), key=lambda kv: int(kv[0])):
            for name, m in res["models"].items():
                rounds = m["rounds_s"]
                if ref not in rounds:
                    continue
                if not lines:
                    lines += [f"\nstep / {ref} step: median over rounds of the ratio in one round [min, max]\n",
                              "| model | rate | hosts | variant | ratio |", "|---|---|---|---|---|"]
                for v, ts in rounds.items():
                    if v != ref:
                        r = sorted(a / b for a, b in zip(ts, rounds[ref]))
                        med = (r[(len(r) - 1) // 2] + r[len(r) // 2]) / 2
                        lines.append(f"| {name} | {rate} | {n} | {v} | {med:.2f} [{r[0]:.2f}, {r[-1]:.2f}] |")
    return "\n".join(lines) + "\n" if lines else ""


def plot(merged: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = [r for r in merged if r != "local"]
    one = merged.get("local", {}).get("1")
    models = list(next(iter(merged[rates[0]].values()))["models"])
    wires = ["fp32", "16bit"]
    fig, axes = plt.subplots(len(models), len(rates) * len(wires), figsize=(4.2 * len(rates) * len(wires),
                             3.6 * len(models)), squeeze=False)
    for row, name in enumerate(models):
        for col, (rate, wire) in enumerate((r, w) for r in rates for w in wires):
            ax = axes[row][col]
            runs = {1: one} if one else {}
            runs.update({int(n): res for n, res in merged[rate].items()})
            xs = sorted(runs)
            variants = [v for v in runs[xs[-1]]["models"][name]["median_s"]
                        if v == "local" or wire_of(v) == wire and v != "ddp-adasum"]
            palette = itertools.cycle(["tab:gray", "tab:blue", "tab:cyan", "tab:green", "tab:olive", "tab:purple",
                                       "tab:orange", "tab:brown", "tab:pink"])
            for v in variants:
                pts = [(x, 1e3 * runs[x]["models"][name]["median_s"][v]) for x in xs
                       if v in runs[x]["models"][name]["median_s"]]
                color = "tab:red" if v.startswith("ddp") else next(palette)
                ax.plot(*zip(*pts), marker="o", label=v, color=color,
                        linestyle="--" if "overlap" not in v and v != "local" and not v.startswith("ddp") else "-")
            lim = [(x, 1e3 * runs[x]["models"][name]["limit_s"][wire]) for x in xs]
            ax.plot(*zip(*lim), "k--", label="limit")
            ax.set_title(f"{name}, {wire} wire, {rate}")
            ax.set_xlabel("hosts (one rank each)")
            ax.set_ylabel("step (ms, slowest rank)")
            ax.set_xticks(xs)
            ax.set_ylim(bottom=0)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=100)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hosts", default="1,2,4")
    p.add_argument("--rates", default="1gbit,2500mbit")
    p.add_argument("--models", default="mlp,transformer")
    p.add_argument("--variants", default=CONTENDERS)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--bucket-bytes", type=int)
    p.add_argument("--out", default="benchmarks/out/scaling")
    p.add_argument("--plot-only", action="store_true", help="merge, tabulate and plot the runs in --out")
    args = p.parse_args(argv)
    if not args.plot_only:
        run(args)
    out = Path(args.out)
    merged = merge(out)
    (out / "tables.md").write_text(tables(merged) + round_ratios(merged, "local") + round_ratios(merged, "ddp"))
    plot(merged, out / "scaling.png")
    print((out / "tables.md").read_text())


if __name__ == "__main__":
    main()
