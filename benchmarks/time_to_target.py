"""Wall-clock time to a target quality across emulated hosts: torch DDP against per-step Adasum and local steps
(with and without ``delay=1``), training one task of the convergence study to its target.

    python benchmarks/time_to_target.py --task mnist1d --hosts 2,4 --rates 1gbit \\
        --out benchmarks/results/local-steps/time-to-target          # as root: builds the hosts (cluster/netns.sh)
    python benchmarks/time_to_target.py --plot-only --out benchmarks/results/local-steps/time-to-target
    mpiexec -n 2 python -m mpi4py benchmarks/time_to_target.py --worker --task mnist1d --json out.json
                                                                     # one job, no emulated hosts (the test's mode)

The task, its model, data, optimizer, evaluation and settings are the study's (``benchmarks/study``: MNIST-1D
with the 1-D CNN and SGD, target 85 % test accuracy; the char transformer with AdamW, target 2.8 validation bits
per character), changed with ``--set KEY=VALUE`` (VALUE as JSON, e.g. ``--set epochs=6``, ``--set channels=128``).
For each rate, ``cluster/netns.sh`` builds as many hosts as the largest count asks for (one rank per host, TCP
between hosts through links rate-limited with tc) and one job per host count trains every contender in turn,
``--seeds`` seeds each, every one for the task's whole ``epochs`` (so each has a final quality):

- ``ddp``: torch DDP over gloo (``MASTER_ADDR`` the first host), the mean of the gradients at the study's
  ``mean`` rate (the base rate, unscaled), then the inner optimizer's step on every rank;
- any schedule of the study (``study/schedules.py``), e.g. ``adasum-x1`` (per-step Adasum of the updates),
  ``adasum-x1-H4`` (4 local steps between combines), ``adasum-x1-H4-delay`` (the same with ``delay=1``),
  ``mean-x1-H4`` (model averaging every 4 local steps);
- ``local``: the same model and inner optimizer on each rank's shard without any communication, for
  ``--local-steps`` steps (after 10 untimed ones), all ranks at once (so they share the cores as in the others):
  the local step.

All contenders evaluate alike (the study's ``Run.measure``: every rank its share of the test data, then an
allreduce of the sums), ``evals_per_epoch`` times per epoch. **Evaluation is excluded from the clock**: each
evaluation starts with a barrier, the clock stops there and restarts after the evaluation, so a contender's
time is its training only, the waits for the slowest rank included. Per contender and seed the JSON holds the
curve (quality and training seconds at each evaluation), the seconds to the target (at the first evaluation at
or beyond it; none if never reached), the final quality, the mean step (training seconds over micro-batch steps)
and its ratio to the local step, the combines (the optimizer's boundaries; DDP: one allreduce per step), the bytes
one rank sends by that count (combines × the model's float32 bytes, what one allreduce of the model carries) and
the bytes counted on the host's link (``tx_bytes`` of the emulated host's interface, every packet on the wire:
the evaluation's small allreduce and the protocols' overhead too; none without emulated hosts), and the load
average (``os.getloadavg()``) before and after.

The driver merges the runs (``{task}-{rate}-{hosts}h.json``) into ``results.json``, ``tables.md`` (per task, rate
and hosts: each contender's time to target, its ratio to DDP's, final quality, mean step over the local step,
combines and bytes; medians over seeds with their range) and ``time_to_target.png`` (time to target against
hosts, per contender, one panel per task and rate).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for _p in (ROOT / "examples", HERE):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

CONTENDERS = "local,ddp,adasum-x1,adasum-x1-H4,adasum-x1-H4-delay,mean-x1-H4"
BASE_LR = {"mnist1d": 0.03, "chars": 0.004, "mnist1d-adamw": 0.005}  # the study's base rates (tuned on one rank)
IFACE = "adasum0"  # the emulated host's interface (cluster/netns.sh)
WARMUP_STEPS = 10  # untimed steps before the local step's timed ones


def _value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def settings(task: str, sets: list[str]) -> dict:
    """The study's settings of ``task`` with ``--set KEY=VALUE`` applied."""
    from study.tasks import presets

    s = dict(presets(False)[task])
    for item in sets:
        key, eq, text = item.partition("=")
        if not eq or key not in s:
            raise SystemExit(f"--set takes KEY=VALUE with a setting of {task} ({', '.join(s)}), got {item!r}")
        s[key] = _value(text)
    return s


def tx_bytes() -> int | None:
    """Bytes sent so far on the emulated host's interface (this network namespace's), None where there is none."""
    try:
        with open("/proc/net/dev") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name.strip() == IFACE:
                    return int(rest.split()[8])
    except OSError:
        pass
    return None


# --- one job: every contender in turn ---------------------------------------------------------------------------

def init_gloo(comm) -> None:
    import socket

    import torch.distributed as dist

    if dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    port = None
    if comm.Get_rank() == 0:
        with socket.socket() as s:
            s.bind((os.environ["MASTER_ADDR"], 0))
            port = s.getsockname()[1]
    os.environ["MASTER_PORT"] = str(comm.bcast(port, root=0))
    dist.init_process_group("gloo", rank=comm.Get_rank(), world_size=comm.Get_size())


class _DDPStep:
    """The optimizer calls of the study's loop for a DDP model: the gradients arrive averaged by DDP's
    backward, the inner optimizer steps on every rank; one boundary (one allreduce of the model) per step."""

    def __init__(self, inner):
        self.inner = inner
        self.boundaries = self.skipped_updates = 0
        self.step_was_skipped = False

    def force_boundary(self) -> None:
        pass

    def step(self) -> None:
        self.inner.step()
        self.boundaries += 1

    def zero_grad(self) -> None:
        self.inner.zero_grad()

    def close(self) -> None:
        pass


def timed_run_class():
    from study.training import Run

    class TimedRun(Run):
        """The study's run with a clock that stops during evaluations; with ``ddp`` the model is torch DDP's."""

        def __init__(self, cfg, data, comm, s, ddp: bool):
            super().__init__(cfg, data, comm, s)
            self.steps = 0
            self.module = self.model
            if ddp:
                from torch.nn.parallel import DistributedDataParallel

                self.optimizer.close()  # built by the study's Run, unused here
                self.inner = self.task.optimizer(self.model, self.lr, s)
                self.optimizer = _DDPStep(self.inner)
                with warnings.catch_warnings():  # the models' buffers are the same on every rank; no sync
                    warnings.simplefilter("ignore", FutureWarning)
                    self.model = DistributedDataParallel(self.module, broadcast_buffers=False)
            self.started = self.excluded = 0.0

        def start(self) -> None:
            self.comm.Barrier()
            self.started, self.excluded = time.perf_counter(), 0.0

        def measure(self, epoch, loss_sum, seen):
            self.comm.Barrier()
            paused = time.perf_counter()
            trained = paused - self.started - self.excluded
            model, self.model = self.model, self.module  # evaluate the plain module (no DDP forward)
            try:
                h = super().measure(epoch, loss_sum, seen)
            finally:
                self.model = model
            h["seconds"] = trained
            h["steps"] = self.steps
            self.excluded += time.perf_counter() - paused
            return h

        def epoch(self, epoch):
            step = self.optimizer.step

            def counted():
                self.steps += 1
                step()

            self.optimizer.step = counted
            try:
                super().epoch(epoch)
            finally:
                del self.optimizer.step

    return TimedRun


def train_contender(name: str, task: str, s: dict, data, comm, seed: int, base_lr: float) -> dict:
    """Train contender ``name`` (collective); its record, the same on every rank."""
    from study.schedules import Config

    ddp = name == "ddp"
    cfg = Config(task, comm.Get_size(), "mean-x1" if ddp else name, 1, seed, base_lr)
    if ddp:
        init_gloo(comm)
    run = timed_run_class()(cfg, data, comm, s, ddp)
    params = sum(p.numel() for p in run.module.parameters())
    load = os.getloadavg()
    sent = tx_bytes()
    run.start()
    run.best = run.measure(0, 0.0, 0)["metric"]
    for epoch in range(1, s["epochs"] + 1):
        run.epoch(epoch)
        if run.reason is not None:
            break
    run.comm.Barrier()
    sent = None if sent is None else tx_bytes() - sent
    run.optimizer.close()
    h = run.history
    reached = run.first(s["target"])
    combines = run.optimizer.boundaries
    trained = h[-1]["seconds"]
    return {
        "contender": name, "seed": seed, "lr": run.lr, "parameters": params, "model_bytes": 4 * params,
        "final": h[-1]["metric"], "best": run.best, "diverged": run.reason,
        "seconds_to_target": reached["seconds"] if reached else None,
        "epochs_to_target": reached["epoch"] if reached else None,
        "train_seconds": trained, "steps": run.steps, "mean_step_s": trained / max(1, run.steps),
        "combines": combines, "bytes_by_count": combines * 4 * params,
        "bytes_counted": comm.allreduce(sent, op=_max_op()) if sent is not None else None,
        "loadavg_before": load, "loadavg_after": os.getloadavg(),
        "history": h,
    }


def _max_op():
    from mpi4py import MPI

    return MPI.MAX


def local_step(task: str, s: dict, data, comm, seed: int, base_lr: float, steps: int) -> dict:
    """The same model and inner optimizer on this rank's shard without communication, ``steps`` micro-batch
    steps on every rank at once after ``WARMUP_STEPS`` untimed ones; the slowest rank's mean step."""
    from model import shard_batches
    from study.tasks import TASKS

    t = TASKS[task]
    model = t.build(seed, s)
    inner = t.optimizer(model, base_lr, s)
    n = t.train_count(data, s)
    rank, size = comm.Get_rank(), comm.Get_size()
    batches = []
    epoch = 0
    while len(batches) < WARMUP_STEPS + steps:
        batches += shard_batches(n, s["batch_size"], rank, size, epoch, seed)
        epoch += 1
    load = os.getloadavg()

    def train(part):
        for idx in part:
            t.loss(model, data, idx, s).backward()
            inner.step()
            inner.zero_grad()

    train(batches[:WARMUP_STEPS])  # first steps allocate and warm caches: not timed
    comm.Barrier()
    started = time.perf_counter()
    train(batches[WARMUP_STEPS:WARMUP_STEPS + steps])
    mine = (time.perf_counter() - started) / steps
    return {"contender": "local", "seed": seed, "steps": steps, "mean_step_s": comm.allreduce(mine, op=_max_op()),
            "loadavg_before": load, "loadavg_after": os.getloadavg()}


def load_data(task: str, s: dict, comm, cache: str | None):
    """The task's data: read by rank 0 (from ``cache`` if it holds these settings' data) and broadcast."""
    import hashlib

    import torch
    from study.tasks import TASKS

    data = None
    if comm.Get_rank() == 0:
        path = None
        if cache:
            key = hashlib.sha1(json.dumps([task, {k: v for k, v in s.items() if k != "grid"}],
                                          sort_keys=True).encode()).hexdigest()[:12]
            path = Path(cache) / f"{task}-{key}.pt"
        if path is not None and path.exists():
            data = torch.load(path, weights_only=False)
        else:
            data = TASKS[task].load(s)
            if path is not None:
                path.parent.mkdir(parents=True, exist_ok=True)
                torch.save(data, path)
    return comm.bcast(data, root=0)


def worker(args) -> dict | None:
    import logging

    import torch
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    torch.set_num_threads(1)
    logging.getLogger("adasum").setLevel(logging.ERROR)  # a skipped update is recorded as divergence instead
    s = settings(args.task, args.set)
    base_lr = args.base_lr or BASE_LR[args.task]
    data = load_data(args.task, s, comm, args.cache)
    contenders = [c for c in args.contenders.split(",") if c]
    result = {"task": args.task, "hosts": comm.Get_size(), "rate": args.rate, "target": s["target"],
              "higher_is_better": args.task != "chars", "base_lr": base_lr,
              "settings": {k: v for k, v in s.items() if k != "grid"}, "seeds": args.seeds,
              "clock": "training only: evaluations excluded (a barrier, then the clock stops until the evaluation "
                       "ends)", "loadavg_start": os.getloadavg(), "runs": []}
    started = time.perf_counter()
    for seed in range(args.seeds):
        for name in contenders:
            if name == "local":
                r = local_step(args.task, s, data, comm, seed, base_lr, args.local_steps)
            else:
                r = train_contender(name, args.task, s, data, comm, seed, base_lr)
            result["runs"].append(r)
            if rank == 0:
                msg = f"{args.task} P{comm.Get_size()} {args.rate or 'local'} seed {seed} {name}: " \
                      f"step {1e3 * r['mean_step_s']:.1f} ms"
                if name != "local":
                    msg += f", final {r['final']:.4f}, to target {r['seconds_to_target']} s, {r['combines']} combines"
                print(msg, flush=True)
    import torch.distributed as dist

    if dist.is_initialized():  # DDP's group, initialised by this job's first ddp run
        dist.destroy_process_group()
    result["seconds"] = time.perf_counter() - started
    result["loadavg_end"] = os.getloadavg()
    result["summary"] = summarize(result)
    if rank == 0 and args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result if rank == 0 else None


# --- the summary, the tables and the plot -----------------------------------------------------------------------

def _median(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def summarize(result: dict) -> dict:
    """Per contender, the median over seeds (with min and max) of each measure; time to target only over the
    seeds that reached it (``reached`` says how many)."""
    runs = result["runs"]
    local = _median([r["mean_step_s"] for r in runs if r["contender"] == "local"])
    out = {}
    for name in dict.fromkeys(r["contender"] for r in runs):
        mine = [r for r in runs if r["contender"] == name]
        row = {"seeds": len(mine), "mean_step_s": _median([r["mean_step_s"] for r in mine])}
        if name != "local":
            for key in ("seconds_to_target", "final", "combines", "bytes_by_count", "bytes_counted", "train_seconds"):
                vals = [r[key] for r in mine if r[key] is not None]
                row[key] = _median(vals)
                row[key + "_range"] = [min(vals), max(vals)] if vals else None
            row["reached"] = sum(r["seconds_to_target"] is not None for r in mine)
            row["step_over_local"] = row["mean_step_s"] / local if local else None
        out[name] = row
    ddp = out.get("ddp")
    for name, row in out.items():
        if name != "local" and ddp and (ddp.get("seconds_to_target") or 0) > 0 and \
                row.get("seconds_to_target") is not None:
            row["time_over_ddp"] = row["seconds_to_target"] / ddp["seconds_to_target"]
    return out


def merge(out: Path) -> dict:
    """Every run's results, keyed ``task`` → ``rate`` → hosts."""
    merged: dict = {}
    for path in sorted(out.glob("*h.json")):
        r = json.loads(path.read_text())
        merged.setdefault(r["task"], {}).setdefault(r["rate"] or "local", {})[str(r["hosts"])] = r
    (out / "results.json").write_text(json.dumps(merged, indent=1))
    return merged


def _quality(task_result: dict, v) -> str:
    if v is None:
        return "–"
    return f"{v:.3f}" if not task_result["higher_is_better"] else f"{100 * v:.1f} %"


def tables(merged: dict) -> str:
    lines = []
    for task, rates in merged.items():
        for rate, by_hosts in rates.items():
            for n, res in sorted(by_hosts.items(), key=lambda kv: int(kv[0])):
                sm = res["summary"]
                local = sm.get("local", {}).get("mean_step_s")
                model_bytes = next((r["model_bytes"] for r in res["runs"] if "model_bytes" in r), None)
                target = _quality(res, res["target"])
                lines += [f"\n{task}, {n} hosts at {rate}: target {target}, {res['settings']['epochs']} epochs, "
                          f"{res['seeds']} seed(s), local step "
                          f"{'not timed' if local is None else f'{1e3 * local:.1f} ms'}, model "
                          f"{model_bytes / 1e3:.0f} kB, load average {res['loadavg_start'][0]:.1f} → "
                          f"{res['loadavg_end'][0]:.1f}\n",
                          "| contender | time to target s | / DDP | reached | final | step ms | step / local | "
                          "combines | MB sent by count | MB counted on the link |",
                          "|---|---|---|---|---|---|---|---|---|---|"]
                for name, row in sm.items():
                    if name == "local":
                        continue
                    tt = row["seconds_to_target"]
                    rng = row["seconds_to_target_range"]
                    tts = "not reached" if tt is None else (
                        f"{tt:.1f}" + (f" [{rng[0]:.1f}, {rng[1]:.1f}]" if row["seeds"] > 1 else ""))
                    over = f"{row['time_over_ddp']:.2f}" if row.get("time_over_ddp") is not None else "–"
                    fr = row["final_range"]
                    final = _quality(res, row["final"]) + (
                        f" [{_quality(res, fr[0])}, {_quality(res, fr[1])}]" if row["seeds"] > 1 else "")
                    sol = f"{row['step_over_local']:.2f}" if row.get("step_over_local") else "–"
                    counted = f"{row['bytes_counted'] / 1e6:.1f}" if row.get("bytes_counted") is not None else "–"
                    lines.append(f"| {name} | {tts} | {over} | {row['reached']}/{row['seeds']} | {final} | "
                                 f"{1e3 * row['mean_step_s']:.1f} | {sol} | {row['combines']:.0f} | "
                                 f"{row['bytes_by_count'] / 1e6:.1f} | {counted} |")
    return "\n".join(lines).lstrip("\n") + "\n"


def plot(merged: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(task, rate) for task, rates in merged.items() for rate in rates]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.8), squeeze=False)
    for ax, (task, rate) in zip(axes[0], panels):
        by_hosts = merged[task][rate]
        xs = sorted(int(n) for n in by_hosts)
        names = [c for c in by_hosts[str(xs[-1])]["summary"] if c != "local"]
        palette = iter(["tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:brown", "tab:pink", "tab:olive",
                        "tab:cyan", "tab:gray"])
        for name in names:
            pts = [(x, by_hosts[str(x)]["summary"].get(name, {}).get("seconds_to_target")) for x in xs]
            pts = [(x, y) for x, y in pts if y is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=name, color="tab:red" if name == "ddp" else next(palette),
                        linestyle="-" if name == "ddp" or "delay" in name else "--")
        ax.set_title(f"{task}, {rate}: time to target {_quality(by_hosts[str(xs[-1])], by_hosts[str(xs[-1])]['target'])}",
                     fontsize=9)
        ax.set_xlabel("hosts (one rank each)")
        ax.set_ylabel("training seconds to target (no evaluation)")
        ax.set_xticks(xs)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=100)


# --- the driver ---------------------------------------------------------------------------------------------------

def drive(args, passed: list[str]) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    hosts = [int(h) for h in args.hosts.split(",")]
    python = str(ROOT / ".venv" / "bin" / "python")
    netns = ["bash", str(HERE / "cluster" / "netns.sh")]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    for rate in args.rates.split(","):
        subprocess.run([*netns, "down"], check=True)
        subprocess.run([*netns, "up", str(max(hosts)), rate], check=True)
        try:
            for n in hosts:
                print(f"== {args.task}, {n} hosts at {rate}", flush=True)
                job = [python, "-m", "mpi4py", str(HERE / "time_to_target.py"), "--worker", "--rate", rate,
                       "--json", str(out / f"{args.task}-{rate}-{n}h.json"), *passed]
                subprocess.run([*netns, "run", str(n), "1", "--", "env", f"PYTHONPATH={ROOT}", *job],
                               check=True, env=env)
        finally:
            subprocess.run([*netns, "down"], check=True)


def report(out: Path) -> str:
    merged = merge(out)
    text = tables(merged)
    (out / "tables.md").write_text(text)
    plot(merged, out / "time_to_target.png")
    return text


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", default="mnist1d")
    p.add_argument("--contenders", default=CONTENDERS)
    p.add_argument("--seeds", type=int, default=1)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="change one of the task's settings")
    p.add_argument("--base-lr", type=float, help="the base rate (default: the study's for the task)")
    p.add_argument("--local-steps", type=int, default=200, help="steps timed for the local step")
    p.add_argument("--cache", default=str(ROOT / "benchmarks" / "out" / "data-cache"),
                   help="folder keeping the generated data between jobs ('' for none)")
    p.add_argument("--hosts", default="2,4")
    p.add_argument("--rates", default="1gbit")
    p.add_argument("--out", default="benchmarks/out/time-to-target")
    p.add_argument("--worker", action="store_true", help="train in this MPI job (no emulated hosts)")
    p.add_argument("--rate", default="", help="(worker) the link rate the job runs across, for the record")
    p.add_argument("--json", help="(worker) where rank 0 writes the results")
    p.add_argument("--plot-only", action="store_true", help="merge, tabulate and plot the runs in --out")
    return p.parse_args(argv)


def passthrough(args) -> list[str]:
    """The worker's arguments that the driver's command line chose."""
    out = ["--task", args.task, "--contenders", args.contenders, "--seeds", str(args.seeds),
           "--local-steps", str(args.local_steps), "--cache", args.cache]
    for item in args.set:
        out += ["--set", item]
    return out + (["--base-lr", str(args.base_lr)] if args.base_lr else [])


def main(argv=None):
    args = parse(argv)
    if args.worker:
        return worker(args)
    if not args.plot_only:
        drive(args, passthrough(args))
    print(report(Path(args.out)))
    return None


if __name__ == "__main__":
    main()
