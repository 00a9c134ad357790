"""Runs the test suite: once serially, then under mpiexec at each world size in --sizes, the framework
tests (Lightning, Accelerate, transformers) at --frameworks-sizes, the core tests again on the numpy kernels (--numpy-kernels-sizes), then the hierarchical-mode tests on emulated nodes
(--hostfile-runs), and last the convergence study's --quick run with a check of its outputs.

Rank 0 of each MPI run prints to the terminal; the other ranks write to logs that are printed, and kept,
only when their run fails. After each run one line says how it went ("np=3: 512 passed, 0 failed,
4 skipped, 95 s"); at the end these lines come again, then the total over all runs, in the form
"N passed, N failed".
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV_BIN = ROOT / ".venv" / "bin"

# Emulated nodes on one machine: MPICH's hydra, with the fork launcher, makes every line of a hostfile its
# own node (its own Split_type(COMM_TYPE_SHARED) group) whatever host name it gives. Each run: (name,
# ranks, expected nodes as "ranks;ranks"); hostfiles/emulated-<name>.txt; the tests check the layout.
HOSTFILE_RUNS = [
    ("2x2", 4, "0,1;2,3"),
    ("2x3", 6, "0,1,2;3,4,5"),
    ("3x2", 6, "0,1;2,3;4,5"),
    ("4x2", 8, "0,1;2,3;4,5;6,7"),
    ("3x1", 3, "0;1;2"),
    ("1x4", 4, "0,1,2,3"),
    ("3+1+2", 6, "0,1,2;3;4,5"),
    ("interleaved", 5, "0,2,4;1,3"),  # two one-slot hosts, ranks wrap around: unequal and non-contiguous
]
HOSTFILE_TESTS = ["tests/test_hierarchical.py", "tests/test_world.py"]
# The numpy kernels (the fallback where adasum.kernels._kernels could not be built) run the core tests too.
NUMPY_KERNEL_TESTS = ["tests/test_allreduce.py", "tests/test_hierarchical.py"]


def _counts(text: str) -> dict[str, int]:
    """The counts on pytest's closing line ("3 failed, 40 passed, 2 skipped in 1.2s")."""
    lines = [ln for ln in text.splitlines() if re.search(r"\b(passed|failed|error|errors|skipped|deselected)\b", ln)
             and " in " in ln]
    found: dict[str, int] = {}
    if lines:
        for n, word in re.findall(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed)", lines[-1]):
            found["error" if word.startswith("error") else word] = int(n)
    return found


def _quiet_ranks() -> list[str]:
    """A prefix for the rank command: every rank but 0 writes its output to $ADASUM_TEST_LOGDIR/rankN.log
    (PMI_RANK is set by the process manager)."""
    script = ('if [ "${PMI_RANK:-0}" != 0 ]; then exec >"$ADASUM_TEST_LOGDIR/rank$PMI_RANK.log" 2>&1; fi; '
              'exec "$@"')
    return ["sh", "-c", script, "sh"]


def _run(cmd: list[str], env: dict[str, str], timeout: int) -> tuple[int, str]:
    print("$ " + " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    out = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            out.append(line)
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = 124
    sys.stdout.flush()
    return rc, "".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    # 3 and 5 are the sizes that are not powers of two (a fold of one pair over trees of 2 and 4); the tree
    # geometry of every P up to 64 is checked serially (tests/test_tree.py)
    ap.add_argument("--sizes", default="1,2,3,4,5,8", help="MPI world sizes (comma-separated)")
    ap.add_argument("--frameworks-sizes", default="2,3",
                    help="world sizes at which the framework tests (Lightning, Accelerate, transformers) run")
    ap.add_argument("--numpy-kernels-sizes", default="3",
                    help="world sizes at which the core tests run again on the numpy kernels")
    ap.add_argument("--no-serial", action="store_true", help="skip the serial (non-MPI) run")
    ap.add_argument("--timeout", type=int, default=1200, help="seconds allowed for each mpiexec run")
    ap.add_argument("--no-convergence", action="store_true",
                    help="skip the convergence study's --quick run (benchmarks/convergence.py on 6 ranks)")
    ap.add_argument("--hostfile-runs", default="all",
                    help="emulated-node runs of the hierarchical tests: 'all', 'none' or names from "
                         f"{', '.join(name for name, _, _ in HOSTFILE_RUNS)} (comma-separated)")
    args, extra = ap.parse_known_args()

    env = dict(os.environ)
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PYTHONHASHSEED", "0")
    py = str(VENV_BIN / "python")
    totals = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
    failures = []
    started = time.time()

    runs: list[tuple[str, list[str], str | None, dict[str, str]]] = []
    if not args.no_serial:
        runs.append(("serial", [py, "-m", "pytest", "-q", "-m", "not mpi", *extra], None, {}))
    for n in [int(s) for s in args.sizes.split(",") if s]:
        logdir = tempfile.mkdtemp(prefix=f"adasum-np{n}-")
        cmd = [str(VENV_BIN / "mpiexec"), "-n", str(n), *_quiet_ranks(), py, "-m", "mpi4py", "-m", "pytest", "-q",
               "--with-mpi", "-m", "mpi and not frameworks", *extra]
        runs.append((f"np={n}", cmd, logdir, {}))
    for n in [int(s) for s in args.frameworks_sizes.split(",") if s]:
        logdir = tempfile.mkdtemp(prefix=f"adasum-np{n}-frameworks-")
        cmd = [str(VENV_BIN / "mpiexec"), "-n", str(n), *_quiet_ranks(), py, "-m", "mpi4py", "-m", "pytest", "-q",
               "--with-mpi", "-m", "mpi and frameworks", *extra]
        runs.append((f"np={n}, frameworks", cmd, logdir, {}))
    for n in [int(s) for s in args.numpy_kernels_sizes.split(",") if s]:
        logdir = tempfile.mkdtemp(prefix=f"adasum-np{n}-numpy-")
        cmd = [str(VENV_BIN / "mpiexec"), "-n", str(n), *_quiet_ranks(), py, "-m", "mpi4py", "-m", "pytest", "-q",
               "--with-mpi", "-m", "mpi", *NUMPY_KERNEL_TESTS, *extra]
        runs.append((f"np={n}, numpy kernels", cmd, logdir, {"ADASUM_KERNELS": "numpy"}))
    wanted = {s.strip() for s in args.hostfile_runs.split(",") if s.strip()}
    unknown = wanted - {"all", "none"} - {name for name, _, _ in HOSTFILE_RUNS}
    if unknown:
        ap.error(f"--hostfile-runs: unknown run(s) {', '.join(sorted(unknown))}")
    for name, n, nodes in HOSTFILE_RUNS:
        if "none" in wanted or not ("all" in wanted or name in wanted):
            continue
        logdir = tempfile.mkdtemp(prefix=f"adasum-{name}-")
        hostfile = ROOT / "hostfiles" / f"emulated-{name}.txt"
        cmd = [str(VENV_BIN / "mpiexec"), "-launcher", "fork", "-f", str(hostfile), "-n", str(n), *_quiet_ranks(),
               py, "-m", "mpi4py", "-m", "pytest", "-q", "--with-mpi", "-m", "mpi", *HOSTFILE_TESTS, *extra]
        runs.append((f"nodes {name} (np={n})", cmd, logdir, {"ADASUM_TEST_NODES": nodes}))
    if not args.no_convergence:
        # The study at toy sizes, end to end on 6 ranks (world sizes 1, 2, 3, 6), then its outputs checked.
        logdir = tempfile.mkdtemp(prefix="adasum-convergence-")
        out = os.path.join(logdir, "quick")
        study = [str(VENV_BIN / "mpiexec"), "-n", "6", *_quiet_ranks(), py, "-m", "mpi4py",
                 "benchmarks/convergence.py", "--quick", "--out", out]
        check = [py, "-m", "pytest", "-q", "tests/test_benchmark_convergence.py", "-k", "quick_outputs", *extra]
        cmd = ["sh", "-c", f"{shlex.join(study)} && {shlex.join(check)}"]
        runs.append(("convergence --quick (np=6)", cmd, logdir, {"ADASUM_CONVERGENCE_QUICK": out}))

    summaries = []
    for number, (name, cmd, logdir, run_vars) in enumerate(runs, 1):
        run_env = dict(env, **run_vars)
        if logdir:
            run_env["ADASUM_TEST_LOGDIR"] = logdir
            run_env["MPIEXEC_TIMEOUT"] = str(args.timeout)
        print(f"\n===== {name} (run {number} of {len(runs)}) =====", flush=True)
        run_started = time.time()
        rc, text = _run(cmd, run_env, args.timeout + 60)
        counts = _counts(text)
        for key in totals:
            totals[key] += counts.get(key, 0)
        failed = counts.get("failed", 0) + counts.get("error", 0)
        kept = ""
        if rc not in (0, 5):
            failures.append(name)
            if not failed:
                failed = 1  # a rank other than 0 failed, or the run died
                totals["failed"] += 1
            if logdir:
                for log in sorted(Path(logdir).glob("rank*.log")):
                    print(f"----- {name} {log.stem} -----")
                    print(log.read_text()[-20000:])
                kept = f"; rank logs kept in {logdir}"
                logdir = None
        if logdir:
            shutil.rmtree(logdir, ignore_errors=True)
        how = "timed out" if rc == 124 else f"exit {rc}" if rc not in (0, 5) else "ok"
        summaries.append(f"{name}: {counts.get('passed', 0)} passed, {failed} failed, {counts.get('skipped', 0)} "
                         f"skipped, {time.time() - run_started:.0f} s ({how}{kept})")
        print(f"===== {summaries[-1]}", flush=True)

    print("\n===== summary =====")
    for line in summaries:
        print("  " + line)
    print(f"runs failed: {', '.join(failures) or 'none'}; {time.time() - started:.0f} s")
    print(f"{totals['passed']} passed, {totals['failed'] + totals['error']} failed, {totals['skipped']} skipped")
    return 1 if failures or totals["passed"] == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
