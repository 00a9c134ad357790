"""What a dead rank costs elastic training: examples/train.py --elastic with one rank SIGKILLed from outside,
against the same job without a failure, and with the world grown back (ADASUM_ELASTIC_REPLACE=1).

    .venv-ompi/bin/python benchmarks/elastic_cost.py --ranks 4 --kill-rank 2 --epochs 6

Runs under Open MPI with ULFM (scripts/run-elastic-tests.sh makes .venv-ompi; ``mpiexec`` is taken from
beside this Python). Each repeat launches the job twice with the same settings: once untouched, once with
``kill -9`` of rank ``--kill-rank``'s process, found by its ``OMPI_COMM_WORLD_RANK``, at ``--kill-at``
(a fraction of an epoch) into epoch ``--kill-epoch``, timed from the length of the epochs before it; and
(unless ``--no-replace``) a third time killed the same way with ``ADASUM_ELASTIC_REPLACE=1``, where the
survivors start a process in its place at the next commit. From each job's metrics (rank 0 of the final
world writes them) it prints the final test accuracy and loss, the world size at the end and the job's
training time, and for the killed ones the time from the kill to the survivors' seeing it, from there to
training again (shrink, rebuild, restore, sync), from the kill to training again at the launch size (the
newcomer started, joined and synced), and the micro-batches trained again after the rollback to the last
commit.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MPIEXEC = Path(sys.executable).with_name("mpiexec")
# rank 0's line at the end of each epoch, with the seconds of training so far
EPOCH_LINE = re.compile(r"epoch (\d+)/\d+: train loss .*, ([\d.]+) s$", re.MULTILINE)


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _pid_of_rank(launcher: int, rank: int) -> int | None:
    """The process of ``rank`` among the launcher's descendants (Open MPI sets ``OMPI_COMM_WORLD_RANK``)."""
    for pid in _descendants(launcher):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if f"OMPI_COMM_WORLD_RANK={rank}".encode() in env and b"train.py" in cmdline:
            return pid
    return None


def run_job(args, metrics: Path, log: Path, kill: bool, replace: bool = False) -> dict:
    """One job; with ``kill``, rank ``--kill-rank`` SIGKILLed during epoch ``--kill-epoch``; with ``replace``,
    ``ADASUM_ELASTIC_REPLACE=1``."""
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMP_NUM_THREADS="1",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               ADASUM_ELASTIC_REPLACE="1" if replace else "0")
    cmd = [str(MPIEXEC), "--oversubscribe", "--with-ft", "ulfm", "-n", str(args.ranks), sys.executable,
           str(ROOT / "examples" / "train.py"), "--elastic", "--no-progress", "--epochs", str(args.epochs),
           "--checkpoint-every", str(args.commit_every), "--metrics-json", str(metrics),
           # the dataset rank 0 wrote, which a process started in place of a dead one reads rather than makes
           "--data-cache", str(metrics.parent / "mnist1d.npz"), *args.train_args]
    killed_at = None
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
        try:
            if kill:
                killed_at = _kill_during(args, proc, log)
            proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise SystemExit(f"the job did not end in {args.timeout} s; its log: {log}")
    if not metrics.exists():
        raise SystemExit(f"the job wrote no metrics (exit {proc.returncode}); its log: {log}")
    result = json.loads(metrics.read_text())
    result["killed_at"] = killed_at
    return result


def _kill_during(args, proc: subprocess.Popen, log: Path) -> float:
    """Wait for the log line of epoch ``--kill-epoch`` - 1, then for ``--kill-at`` of the mean epoch so far
    (the seconds that line gives), and SIGKILL the rank's process; returns when (``time.time()``)."""
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"the job ended before the kill (exit {proc.returncode}); its log: {log}")
        done = {int(m.group(1)): float(m.group(2)) for m in EPOCH_LINE.finditer(log.read_text())}
        if args.kill_epoch - 1 in done:
            break
        time.sleep(0.02)
    time.sleep(args.kill_at * done[args.kill_epoch - 1] / (args.kill_epoch - 1))
    pid = _pid_of_rank(proc.pid, args.kill_rank)
    if pid is None:
        raise SystemExit(f"no process of rank {args.kill_rank} found under the launcher {proc.pid}")
    killed_at = time.time()
    os.kill(pid, signal.SIGKILL)
    return killed_at


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--commit-every", type=int, default=8, metavar="N",
                    help="commit every N micro-batches (and at every epoch's end), in both jobs")
    ap.add_argument("--kill-rank", type=int, default=2)
    ap.add_argument("--kill-epoch", type=int, default=3, help="the epoch (from 2) in which the rank dies")
    ap.add_argument("--kill-at", type=float, default=0.5, help="how far into that epoch, as a fraction")
    ap.add_argument("--repeats", type=int, default=1, help="pairs of jobs; the table gives medians")
    ap.add_argument("--timeout", type=int, default=600, help="seconds allowed for one job")
    ap.add_argument("--no-replace", action="store_true", help="leave out the job that grows back")
    ap.add_argument("--out", default=None, help="write every job's metrics here as JSON")
    ap.add_argument("train_args", nargs="*", help="more arguments of examples/train.py (after --)")
    args = ap.parse_args()
    if not MPIEXEC.exists():
        ap.error(f"no mpiexec beside {sys.executable}: run this with the Python of .venv-ompi")
    if not 2 <= args.kill_epoch <= args.epochs:
        ap.error(f"--kill-epoch must be from 2 to --epochs ({args.epochs}), got {args.kill_epoch}")
    if not 0 <= args.kill_rank < args.ranks:
        ap.error(f"--kill-rank {args.kill_rank} is not a rank of {args.ranks}")
    jobs = [("no failure", False, False), ("one rank killed", True, False),
             *([] if args.no_replace else [("killed, grown back", True, True)])]
    runs: dict[str, list[dict]] = {name: [] for name, _, _ in jobs}
    with tempfile.TemporaryDirectory(prefix="adasum-elastic-cost-") as tmp:
        for i in range(args.repeats):
            for j, (name, kill, replace) in enumerate(jobs):
                where = Path(tmp) / f"{i}-{j}"
                runs[name].append(run_job(args, where.with_suffix(".json"), where.with_suffix(".log"), kill,
                                          replace))
    print(f"examples/train.py --elastic at {args.ranks} ranks, {args.epochs} epochs, a commit every "
          f"{args.commit_every} micro-batches and at each epoch's end; rank {args.kill_rank} SIGKILLed "
          f"{args.kill_at:.0%} into epoch {args.kill_epoch}; medians of {args.repeats} repeat(s)")
    head = ("job", "final ranks", "test acc.", "test loss", "train s", "kill→seen s", "seen→training s",
            "kill→training s", "kill→launch size s", "replayed")
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for name, results in runs.items():
        print("| " + " | ".join(_cells(name, results)) + " |")
    if args.out:
        Path(args.out).write_text(json.dumps(runs, indent=2))


def _cells(name: str, results: list[dict]) -> list[str]:
    """One row of the table: medians over the repeats of one kind of job."""
    def med(key, f=lambda r, k: r.get(k)):
        values = [v for v in (f(r, key) for r in results) if v is not None]
        return statistics.median(values) if values else None

    def since(late: str, early: str):
        return med("", lambda r, _: r[late] - r[early] if r.get("killed_at") and r.get(late) else None)

    times = (since("last_failure_seen_at", "killed_at"), since("last_resumed_at", "last_failure_seen_at"),
             since("last_resumed_at", "killed_at"), since("last_grown_at", "killed_at"))
    return [name, f"{med('world_size'):.0f}", f"{100 * med('test_accuracy'):.2f} %", f"{med('test_loss'):.4f}",
            f"{med('seconds'):.1f}", *("–" if v is None else f"{v:.2f}" for v in times),
            f"{med('replayed_micro_batches'):.0f}"]


if __name__ == "__main__":
    main()
