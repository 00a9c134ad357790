"""Runs benchmarks/allreduce.py at several world sizes, merges the results and draws the plots.

    python benchmarks/sweep.py --world-sizes 2,4,8 --out benchmarks/results/allreduce

launches ``mpiexec -n P python benchmarks/allreduce.py`` for each P (with ``--hostfile`` and the
launcher options of your MPI where ranks span hosts or emulated nodes), then writes ``results.json``,
``results.csv`` and three PNGs into ``--out``: time against size, bus bandwidth against size, and the
ratio to the raw ``comm.Allreduce`` against size, one line per op and world size.
``--plot-only`` redraws from an existing ``results.json``. ``--launcher`` replaces mpiexec, for example to
run across the network namespaces of ``benchmarks/cluster/netns.sh``.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run_sweep(args) -> list[dict]:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    mpiexec = shutil_which("mpiexec")
    for p in [int(x) for x in args.world_sizes.split(",") if x]:
        json_path = out / f"np{p}.json"
        if args.launcher:
            cmd = shlex.split(args.launcher.format(P=p))
        else:
            cmd = [mpiexec, "-n", str(p)]
            if args.hostfile:
                cmd += ["-f", args.hostfile]
            cmd += shlex.split(args.mpiexec_args)
        cmd += [sys.executable, str(HERE / "allreduce.py"), "--sizes", args.sizes, "--ops", args.ops,
                "--json", str(json_path), "--layout", args.layout]
        if args.repeats:
            cmd += ["--repeats", str(args.repeats)]
        if args.hierarchical:
            cmd.append("--hierarchical")
        print("$ " + " ".join(cmd), flush=True)
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")
        subprocess.run(cmd, check=True, env=env)
        runs.append(json.loads(json_path.read_text()))
    merged = {"runs": runs, "label": args.label}
    (out / "results.json").write_text(json.dumps(merged, indent=1))
    return runs


def shutil_which(name: str) -> str:
    import shutil

    venv = Path(sys.executable).parent / name
    return str(venv) if venv.exists() else (shutil.which(name) or name)


def rows(runs: list[dict]) -> list[dict]:
    table = []
    for run in runs:
        for res in run["results"]:
            for op, r in res["results"].items():
                table.append({"world_size": res["world_size"], "bytes": res["bytes"], "op": op,
                              "median_ms": r["median_s"] * 1e3, "ratio_to_raw": r["ratio_to_raw"],
                              "algbw_GBps": r["algbw_GBps"], "busbw_GBps": r["busbw_GBps"],
                              "sent_bytes_max_rank": r["sent_bytes_max_rank"], "repeats": res["repeats"]})
    return table


def write_csv(table: list[dict], path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(table[0]))
        w.writeheader()
        w.writerows(table)


def plot(table: list[dict], out: Path, label: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({r["world_size"] for r in table})
    ops = sorted({r["op"] for r in table}, key=lambda o: (o != "raw", o))
    # One colour per op (raw in black), one line style and marker per world size.
    palette = {"raw": "black", "adasum": "tab:blue", "sum": "tab:orange", "mean": "tab:green",
               "adasum-hier": "tab:purple"}
    spare = iter(["tab:red", "tab:brown", "tab:pink", "tab:olive", "tab:cyan"])
    colors = {op: palette.get(op) or next(spare, "tab:gray") for op in ops}
    line_styles = ["-", "--", ":", "-."]
    marker_list = ["o", "s", "^", "D", "v"]
    styles = {p: line_styles[i % len(line_styles)] for i, p in enumerate(sizes)}
    markers = {p: marker_list[i % len(marker_list)] for i, p in enumerate(sizes)}
    ticks = sorted({r["bytes"] for r in table})

    def lines(ax, key, skip_raw=False):
        for p in sizes:
            for op in ops:
                if skip_raw and op == "raw":
                    continue
                pts = sorted((r["bytes"], r[key]) for r in table if r["world_size"] == p and r["op"] == op)
                if pts:
                    ax.plot([b for b, _ in pts], [v for _, v in pts], styles[p], marker=markers[p],
                            color=colors[op], label=f"{op}, P={p}", ms=4)
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [human_bytes(b) for b in ticks])
        ax.minorticks_off()
        ax.set_xlabel("bytes per call")
        ax.grid(True, which="both", alpha=0.3)

    for key, ylabel, name, logy, skip in (
            ("median_ms", "median time of the slowest rank (ms)", "time.png", True, False),
            ("busbw_GBps", "bus bandwidth (GB/s)", "busbw.png", False, False),
            ("ratio_to_raw", "time / raw comm.Allreduce", "ratio.png", False, True)):
        fig, ax = plt.subplots(figsize=(8, 5))
        lines(ax, key, skip_raw=skip)
        if logy:
            ax.set_yscale("log")
        if key == "ratio_to_raw":
            ax.axhline(1.0, color="black", lw=0.8)
            ax.axhline(1.3, color="red", lw=0.8, ls="--")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{ylabel} — {label}" if label else ylabel, fontsize=10)
        ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        fig.savefig(out / name, dpi=90)
        plt.close(fig)


def human_bytes(n: int) -> str:
    """4096 -> '4 KiB', 16777216 -> '16 MiB'."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} B"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-sizes", default="2,4,8")
    ap.add_argument("--sizes", default="4KiB,16KiB,64KiB,256KiB,1MiB,4MiB,16MiB,64MiB,256MiB")
    ap.add_argument("--ops", default="adasum,sum,mean")
    ap.add_argument("--layout", choices=["separate", "views"], default="separate")
    ap.add_argument("--repeats", type=int, default=0)
    ap.add_argument("--hierarchical", action="store_true", help="also time hierarchical Adasum")
    ap.add_argument("--hostfile", help="hostfile passed to mpiexec -f")
    ap.add_argument("--mpiexec-args", default="", help="further mpiexec options, e.g. '-launcher fork'")
    ap.add_argument("--launcher", default="",
                    help="a launch command to use instead of mpiexec, with {P} for the world size, e.g. "
                         "'bash benchmarks/cluster/netns.sh run {P} 1 --' (one rank on each of P emulated hosts)")
    ap.add_argument("--label", default="", help="a title for the plots (machine, network)")
    ap.add_argument("--out", default="benchmarks/out/allreduce")
    ap.add_argument("--plot-only", action="store_true", help="redraw from OUT/results.json")
    args = ap.parse_args(argv)

    out = Path(args.out)
    if args.plot_only:
        merged = json.loads((out / "results.json").read_text())
        runs, label = merged["runs"], merged.get("label", "")
    else:
        runs, label = run_sweep(args), args.label
    table = rows(runs)
    write_csv(table, out / "results.csv")
    plot(table, out, label)
    print(f"wrote {out}/results.json, results.csv, time.png, busbw.png, ratio.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
