"""Runs the test suite: once serially, then under mpiexec at each world size in --sizes (the FSDP2 tests in
jobs of their own at 4 ranks and at 2), the framework tests (Lightning, Accelerate, transformers) at
--frameworks-sizes, the core tests again on the numpy kernels (--numpy-kernels-sizes), the
hierarchical-mode tests on emulated nodes (--hostfile-runs), the convergence study's --quick run with a
check of its outputs, the elastic tests (ranks SIGKILLed under Open MPI with ULFM, in their own
environment .venv-ompi: scripts/run-elastic-tests.sh), and last the documentation build (mkdocs --strict).

Which tests run at which size: the core's (tests/core, tests/rule) at every size but the stall
inspector's (2, 3 and 4), the training layer's where their ``world_size`` marks say (tests/helpers.py:
argument checks, refusals, API errors and lifecycles at one size, training runs that are bitwise the plain
or hand-written one at 2 and 3, those against a serial reference of the tree at 1, 2, 3 and 5), the
benchmarks' harness tests where their subject differs. The test processes write and share compiled
bytecode (``PYTHONDONTWRITEBYTECODE`` is dropped); ``--reports DIR`` keeps each run's junit reports.

``--fast``: the serial run without the tests marked ``slow`` (the recipes trained under mpiexec, the wheel
built and installed, the docs' accuracies), the tests marked ``smoke`` (one of each training path:
DistributedOptimizer plain, overlapped, with local steps and with delay=1, the DDP hook, FSDP2's hooks and
ReplicaDeltas, Lightning, the Accelerate recipe, the Horovod façade) in one job at 2 ranks, and
tests/core/test_allreduce.py at 3 ranks; nothing else (no elastic tests, study or docs).

Every mpiexec command is made by one function (``_mpiexec``). Rank 0 of each MPI run prints to the
terminal; the other ranks write to logs that are printed, and kept, only when their run fails. The counts
come from the junit report each rank writes (rank 0's counts, any rank's failures). A run fails when it
exits non-zero, and also when it collects no test at all (unless the arguments select tests: ``-k``, ``-m``
or paths). After each run one line says how it went ("np=3: 512 passed, 0 failed, 4 skipped, 95 s, CPU
170 s"; the CPU seconds of its processes do not depend on what else the machine runs, its seconds do); at
the end these lines come again, then the total time and CPU time with the load averages at the start and
the end, and the total over all runs, in the form "N passed, N failed".

The tests are collected once first (scripts/selection.py lists them with their markers; not for
``--fast``), and each MPI run is given the files that hold its tests, so that it imports no other (the
frameworks' imports alone take seconds per rank). A focused run starts only what its selection touches:
with ``-k``, ``-m`` or paths only the runs that hold a selected test start: the serial run, each MPI size
(``world_size`` marks counted), the framework runs, the numpy-kernel runs, the emulated-node runs, the
convergence check, and the docs build only where a test of tests/docs/ is selected. ``--sizes`` given:
the framework and numpy-kernel sizes, the emulated-node runs and the convergence run (6 ranks) are kept
only at those sizes, unless their own option is given too. So ``bash scripts/run-tests.sh --sizes 2,3 -k
traffic`` runs the three tests of tests/core/test_traffic.py at 2 and 3 ranks, and
tests/core/test_context.py's test_traffic_is_counted_per_communicator (its name matches too) at 2, and
nothing else.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
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
HOSTFILE_TESTS = ["tests/core/test_hierarchical.py", "tests/core/test_world.py"]
# The numpy kernels (the fallback where adasum.kernels._kernels could not be built) run the core tests too.
NUMPY_KERNEL_TESTS = ["tests/core/test_allreduce.py", "tests/core/test_hierarchical.py"]
# The FSDP2 tests run in jobs of their own (they make many communicators): at 4 ranks (meshes 2x2 and 4x1)
# and at 2 (a mesh 2x1).
FSDP_SIZES = (2, 4)
# --fast: the core allreduce at a size that folds a pair first.
FAST_CORE_TESTS = ["tests/core/test_allreduce.py"]


def _smoke_files() -> list[str]:
    """The test files that hold a test marked ``smoke`` (found in their text: no collection needed)."""
    return sorted(str(f.relative_to(ROOT)) for f in (ROOT / "tests").rglob("test_*.py")
                  if "mark.smoke" in f.read_text(errors="replace"))


def _counts(reports: list[Path]) -> dict[str, int]:
    """pytest's counts for one run, from its junit reports (one per rank; rank 0's counts, and the failures
    and errors of every rank). An absent report (the run died before pytest wrote it) counts nothing."""
    found = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
    for i, path in enumerate(sorted(reports)):
        try:
            root = ET.parse(path).getroot()
        except (OSError, ET.ParseError):
            continue
        suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
        tests = sum(int(x.get("tests", 0)) for x in suites)
        failed = sum(int(x.get("failures", 0)) for x in suites)
        errors = sum(int(x.get("errors", 0)) for x in suites)
        skipped = sum(int(x.get("skipped", 0)) for x in suites)
        if i == 0:
            found["passed"] = tests - failed - errors - skipped
            found["skipped"] = skipped
        found["failed"] = max(found["failed"], failed)
        found["error"] = max(found["error"], errors)
    return found


def _mpiexec(n: int, args: list[str], hostfile: Path | None = None) -> list[str]:
    """``mpiexec -n N`` (on the emulated nodes of ``hostfile``) running ``python -m mpi4py ARGS`` on every
    rank, each rank writing its junit report to $ADASUM_TEST_LOGDIR/junit-rankN.xml; every rank but 0 writes
    its output to $ADASUM_TEST_LOGDIR/rankN.log (PMI_RANK is set by the process manager)."""
    script = ('if [ "${PMI_RANK:-0}" != 0 ]; then exec >"$ADASUM_TEST_LOGDIR/rank$PMI_RANK.log" 2>&1; fi; '
              'if [ "$1" = pytest ]; then shift; set -- -m pytest --junitxml="$ADASUM_TEST_LOGDIR/junit-rank${PMI_RANK:-0}.xml" "$@"; fi; '
              f'exec {shlex.quote(str(VENV_BIN / "python"))} -m mpi4py "$@"')
    where = ["-launcher", "fork", "-f", str(hostfile)] if hostfile else []
    return [str(VENV_BIN / "mpiexec"), *where, "-n", str(n), "sh", "-c", script, "sh", *args]


def _run(cmd: list[str], env: dict[str, str], timeout: int) -> int:
    print("$ " + " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = 124
    sys.stdout.flush()
    return rc


def _focus(args, given: set) -> None:
    """Defaults for the options not given; with ``--sizes`` given, the other runs keep only those sizes."""
    sizes = {int(s) for s in (args.sizes or "1,2,3,4,5,8").split(",") if s}

    def kept(default: str) -> str:
        wanted = [s for s in default.split(",") if s]
        return ",".join(s for s in wanted if "sizes" not in given or int(s) in sizes)

    args.sizes = args.sizes or "1,2,3,4,5,8"
    args.frameworks_sizes = args.frameworks_sizes if "frameworks_sizes" in given else kept("2,3")
    args.numpy_kernels_sizes = args.numpy_kernels_sizes if "numpy_kernels_sizes" in given else kept("3")
    if "hostfile_runs" not in given:
        names = [name for name, n, _ in HOSTFILE_RUNS if "sizes" not in given or n in sizes]
        args.hostfile_runs = ",".join(names) or "none"
    if "sizes" in given and 6 not in sizes:
        args.no_convergence = True


def _selection(extra: list[str], env: dict, py: str) -> list[dict] | None:
    """The tests the pytest arguments ``extra`` select, collected once (scripts/selection.py); None where
    the collection wrote nothing (it failed)."""
    with tempfile.TemporaryDirectory(prefix="adasum-selection-") as tmp:
        out = Path(tmp) / "selection.json"
        cmd = [py, "-m", "pytest", "--collect-only", "-q", "-p", "selection", *extra]
        run_env = dict(env, ADASUM_SELECTION=str(out),
                       PYTHONPATH=os.pathsep.join([str(ROOT / "scripts"), *filter(None, [env.get("PYTHONPATH")])]))
        subprocess.run(cmd, env=run_env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return json.loads(out.read_text()) if out.exists() else None


def _holds(tests: list[dict], name: str, cmd: list[str], extra: list[str]) -> bool:
    """Whether the run ``name`` (``cmd``, with the user's pytest arguments ``extra``) would run one of
    ``tests``."""
    if name == "serial":
        return any("mpi" not in t["marks"] for t in tests)
    if name.startswith("convergence"):
        return any("quick_outputs" in t["id"] for t in tests)
    if name.startswith("docs"):
        return any(t["id"].startswith("tests/docs/") for t in tests)
    if name.startswith("elastic"):
        return any(t["id"].startswith("tests/elastic/") for t in tests)
    return bool(_files_of(tests, name, cmd, extra))


def _files_of(tests: list[dict], name: str, cmd: list[str], extra: list[str]) -> list[str]:
    """The files holding the tests of ``tests`` that the MPI run ``name`` (``cmd``) would run."""
    n = int(cmd[cmd.index("-n") + 1])
    mpi = [t for t in tests if "mpi" in t["marks"] and (t["sizes"] is None or n in t["sizes"])]
    files = [a for a in cmd if a.startswith("tests/") and a.endswith(".py") and a not in extra]
    if files:  # the numpy-kernel, emulated-node and --fast runs: their files only
        held = [t for t in mpi if t["id"].split("::")[0] in files]
    else:
        frameworks, fsdp = ", frameworks" in name, ", FSDP2" in name
        held = [t for t in mpi if ("frameworks" in t["marks"]) == frameworks and ("fsdp" in t["marks"]) == fsdp]
    return sorted({t["id"].split("::")[0] for t in held})


def _touched(runs: list, extra: list[str], env: dict, py: str, selected: bool, narrow: bool) -> list:
    """With ``selected``, the runs that hold a test the selection ``extra`` selects; with ``narrow``, each MPI
    run that names no test files is given those that hold its tests, so that it imports no other (the
    frameworks' and the training layer's imports cost seconds per rank). All runs as they are where the
    collection failed."""
    tests = _selection(extra, env, py)
    if tests is None:
        print("selection: collecting the tests failed; every run starts", flush=True)
        return runs
    if selected:
        runs = [r for r in runs if _holds(tests, r[0], r[1], extra)]
        print(f"selection: {len(tests)} tests; runs: {', '.join(r[0] for r in runs) or 'none'}", flush=True)
    if narrow:
        out = []
        for name, cmd, run_vars in runs:
            if "-n" in cmd and not any(a.startswith("tests/") and a.endswith(".py") for a in cmd):
                cmd = cmd + _files_of(tests, name, cmd, extra)  # none: it collects all, and says so
            out.append((name, cmd, run_vars))
        runs = out
    return runs


def _fast_runs(extra: list[str]) -> list:
    """--fast: the smoke tests at 2 ranks in one job (frameworks and FSDP2 among them), the core allreduce at
    3 ranks."""
    return [("np=2, smoke", _mpiexec(2, ["pytest", "-q", "--with-mpi", "-m", "mpi and smoke", *_smoke_files(),
                                         *extra]), {}),
            ("np=3, core allreduce", _mpiexec(3, ["pytest", "-q", "--with-mpi", "-m", "mpi", *FAST_CORE_TESTS,
                                                  *extra]), {})]


def _children_cpu() -> float:
    """CPU seconds (user and system) of the finished child processes, theirs included: what a run costs
    whatever else the machine does, where its time in seconds depends on the load."""
    use = resource.getrusage(resource.RUSAGE_CHILDREN)
    return use.ru_utime + use.ru_stime


def _load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    # 3 and 5 are the sizes that are not powers of two (a fold of one pair over trees of 2 and 4); the tree
    # geometry of every P up to 64 is checked serially (tests/rule/test_tree.py)
    ap.add_argument("--sizes", default=None, help="MPI world sizes (comma-separated; default 1,2,3,4,5,8)")
    ap.add_argument("--frameworks-sizes", default=None,
                    help="world sizes at which the framework tests (Lightning, Accelerate, transformers) run "
                         "(default 2,3)")
    ap.add_argument("--numpy-kernels-sizes", default=None,
                    help="world sizes at which the core tests run again on the numpy kernels (default 3)")
    ap.add_argument("--no-serial", action="store_true", help="skip the serial (non-MPI) run")
    ap.add_argument("--timeout", type=int, default=1200, help="seconds allowed for each mpiexec run")
    ap.add_argument("--no-convergence", action="store_true",
                    help="skip the convergence study's --quick run (benchmarks/convergence.py on 6 ranks)")
    ap.add_argument("--no-docs", action="store_true", help="skip building the documentation (mkdocs --strict)")
    ap.add_argument("--no-elastic", action="store_true",
                    help="skip the elastic tests (ranks killed under Open MPI with ULFM, in .venv-ompi)")
    ap.add_argument("--fast", action="store_true",
                    help="the serial tests, the smoke tests (-m smoke: one of each training path) at 2 ranks "
                         "and the core allreduce at 3, nothing else (a few minutes)")
    ap.add_argument("--reports", default=None, metavar="DIR",
                    help="keep each run's junit reports (one per rank: every test's seconds) in DIR/<run>/")
    ap.add_argument("--hostfile-runs", default=None,
                    help="emulated-node runs of the hierarchical tests: 'all', 'none' or names from "
                         f"{', '.join(name for name, _, _ in HOSTFILE_RUNS)} (comma-separated; default all)")
    args, extra = ap.parse_known_args()
    given = {k for k, v in vars(args).items() if v is not None}
    _focus(args, given)
    if args.fast:  # the runs of the full matrix: none
        args.sizes = args.frameworks_sizes = args.numpy_kernels_sizes = ""
        args.hostfile_runs = "none"
        args.no_convergence = args.no_elastic = args.no_docs = True

    env = dict(os.environ)
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PYTHONHASHSEED", "0")
    # The test processes share compiled bytecode (__pycache__, ignored by git): each of the hundred or so
    # processes of a full run would otherwise compile the library and rewrite the test modules' asserts
    # again (1-2 s CPU each), where PYTHONDONTWRITEBYTECODE is set (as in some containers).
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env.setdefault("ADASUM_TEST_ABORT_ON_FAILURE", "1")  # tests/conftest.py: a failure ends its MPI job
    py = str(VENV_BIN / "python")
    totals = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
    failures = []
    started, cpu_started, load_started = time.time(), _children_cpu(), _load()

    runs: list[tuple[str, list[str], dict[str, str]]] = []
    if not args.no_serial:
        runs.append(("serial", ["pytest", "-q", "-m", "not mpi and not slow" if args.fast else "not mpi", *extra], {}))
    if args.fast:
        runs += _fast_runs(extra)
    for n in [int(s) for s in args.sizes.split(",") if s]:
        runs.append((f"np={n}", _mpiexec(n, ["pytest", "-q", "--with-mpi", "-m", "mpi and not frameworks and not fsdp",
                                             *extra]), {}))
        if n in FSDP_SIZES:
            runs.append((f"np={n}, FSDP2", _mpiexec(n, ["pytest", "-q", "--with-mpi", "-m", "mpi and fsdp", *extra]),
                         {}))
    for n in [int(s) for s in args.frameworks_sizes.split(",") if s]:
        runs.append((f"np={n}, frameworks",
                     _mpiexec(n, ["pytest", "-q", "--with-mpi", "-m", "mpi and frameworks", *extra]), {}))
    for n in [int(s) for s in args.numpy_kernels_sizes.split(",") if s]:
        runs.append((f"np={n}, numpy kernels",
                     _mpiexec(n, ["pytest", "-q", "--with-mpi", "-m", "mpi", *NUMPY_KERNEL_TESTS, *extra]),
                     {"ADASUM_KERNELS": "numpy"}))
    wanted = {s.strip() for s in args.hostfile_runs.split(",") if s.strip()}
    unknown = wanted - {"all", "none"} - {name for name, _, _ in HOSTFILE_RUNS}
    if unknown:
        ap.error(f"--hostfile-runs: unknown run(s) {', '.join(sorted(unknown))}")
    for name, n, nodes in HOSTFILE_RUNS:
        if "none" in wanted or not ("all" in wanted or name in wanted):
            continue
        hostfile = ROOT / "hostfiles" / f"emulated-{name}.txt"
        runs.append((f"nodes {name} (np={n})",
                     _mpiexec(n, ["pytest", "-q", "--with-mpi", "-m", "mpi", *HOSTFILE_TESTS, *extra], hostfile),
                     {"ADASUM_TEST_NODES": nodes}))
    if not args.no_convergence:
        # The study at toy sizes, end to end on 6 ranks (world sizes 1, 2, 3, 6), then its outputs checked.
        study = shlex.join(_mpiexec(6, ["benchmarks/convergence.py", "--quick", "--out"]))
        check = shlex.join([py, "-m", "pytest", "-q", "tests/benchmarks/test_benchmark_convergence.py", "-k",
                            "quick_outputs", *extra])
        line = (f'{study} "$ADASUM_CONVERGENCE_QUICK" && '
                f'{check} --junitxml="$ADASUM_TEST_LOGDIR/junit-rank0.xml"')
        runs.append(("convergence --quick (np=6)", ["sh", "-c", line], {"ADASUM_CONVERGENCE_QUICK": ""}))
    if not args.no_elastic:
        # Open MPI with ULFM in its own environment (scripts/run-elastic-tests.sh makes .venv-ompi once), with
        # the user's pytest arguments but for paths outside tests/elastic
        mine = [a for a in extra if not a.startswith("tests/") or a.startswith("tests/elastic")]
        line = (f'bash {shlex.quote(str(ROOT / "scripts" / "run-elastic-tests.sh"))} '
                f'--junitxml="$ADASUM_TEST_LOGDIR/junit-rank0.xml" {shlex.join(mine)}')
        runs.append(("elastic (Open MPI with ULFM, np=4,5)", ["sh", "-c", line], {}))
    docs = ROOT / "scripts" / "build-docs.sh"
    if not args.no_docs and docs.exists():
        runs.append(("docs (mkdocs build --strict)", ["bash", str(docs)], {}))
    selected = any(a in ("-k", "-m") or a.startswith(("-k", "tests/")) for a in extra)
    narrow = not args.fast and not any(a.startswith("tests/") for a in extra)
    if selected or narrow:
        runs = _touched(runs, extra, env, py, selected, narrow)

    summaries = []
    for number, (name, cmd, run_vars) in enumerate(runs, 1):
        logdir = Path(tempfile.mkdtemp(prefix="adasum-tests-"))
        run_env = dict(env, **run_vars, ADASUM_TEST_LOGDIR=str(logdir), MPIEXEC_TIMEOUT=str(args.timeout))
        if "ADASUM_CONVERGENCE_QUICK" in run_vars:
            run_env["ADASUM_CONVERGENCE_QUICK"] = str(logdir / "quick")
        if cmd[0] == "pytest":
            cmd = [py, "-m", "pytest", f"--junitxml={logdir / 'junit-rank0.xml'}", *cmd[1:]]
        print(f"\n===== {name} (run {number} of {len(runs)}) =====", flush=True)
        run_started, cpu_before = time.time(), _children_cpu()
        rc = _run(cmd, run_env, args.timeout + 60)
        cpu = _children_cpu() - cpu_before
        reports = list(logdir.glob("junit-rank*.xml"))
        counts = _counts(reports)
        for key in totals:
            totals[key] += counts.get(key, 0)
        failed = counts["failed"] + counts["error"]
        is_pytest = "pytest" in cmd
        empty = is_pytest and rc == 5 or (is_pytest and not reports)
        ok = rc == 0 or (rc == 5 and selected)
        if empty and not selected:
            how = "collected no test" if rc in (0, 5) else f"exit {rc} before any report was written"
        elif rc == 124:
            how = "timed out"
        else:
            how = "ok" if ok else f"exit {rc}"
        kept = ""
        if args.reports and reports:
            keep = Path(args.reports) / "".join(c if c.isalnum() or c in "=.-" else "_" for c in name)
            keep.mkdir(parents=True, exist_ok=True)
            for report in reports:
                shutil.copy2(report, keep / report.name)
        if not ok:
            failures.append(name)
            if not failed:
                failed = 1  # a rank other than 0 failed, the run died or collected nothing
                totals["failed"] += 1
            for log in sorted(logdir.glob("rank*.log")):
                print(f"----- {name} {log.stem} -----")
                print(log.read_text()[-20000:])
            kept = f"; logs kept in {logdir}"
        else:
            shutil.rmtree(logdir, ignore_errors=True)
        summaries.append(f"{name}: {counts['passed']} passed, {failed} failed, {counts['skipped']} "
                         f"skipped, {time.time() - run_started:.0f} s, CPU {cpu:.0f} s ({how}{kept})")
        print(f"===== {summaries[-1]}", flush=True)

    print("\n===== summary =====")
    for line in summaries:
        print("  " + line)
    print(f"runs failed: {', '.join(failures) or 'none'}; {time.time() - started:.0f} s, CPU "
          f"{_children_cpu() - cpu_started:.0f} s; load average {load_started} at the start, "
          f"{_load()} at the end")
    print(f"{totals['passed']} passed, {totals['failed'] + totals['error']} failed, {totals['skipped']} skipped")
    return 1 if failures or totals["passed"] == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
