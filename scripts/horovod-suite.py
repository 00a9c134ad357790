#!/usr/bin/env python
"""Run Horovod's own torch test file against ``adasum.horovod``, each test in its own ``mpiexec``.

    python scripts/horovod-suite.py /path/to/horovod            # a Horovod checkout
    python scripts/horovod-suite.py /path/to/test_torch.py -n 3  # or the file itself, at 3 ranks

The file (``test/parallel/test_torch.py`` of the checkout) is copied into a temporary folder with its import
changed (``import horovod.torch as hvd`` → ``import adasum.horovod as hvd``), beside a small ``common.py``
written here that provides the three helpers it takes from Horovod's ``test/utils/common.py``. Optimizers
named by ``--skip-optimizer`` (default ``Muon``: torch's Muon takes 2-D parameters only, which Horovod's
tests predate) are left out of the tests that loop over torch's optimizers. Each test runs as
``mpiexec -n N python -m mpi4py -m pytest FILE::TorchTests::NAME`` with ``ADASUM_STALL_TIMEOUT`` (30 unless
set) and a wall-clock limit; the counts of passed, failed and skipped tests and the failing names are
printed at the end. This copy of ``adasum`` (the repository holding this script) comes first on
``PYTHONPATH``. Nothing of Horovod is kept: the temporary folder is removed afterwards (``--keep`` keeps it).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

COMMON = '''"""The helpers Horovod's test_torch.py imports from its test/utils/common.py (written for this run)."""
import contextlib
import os
import tempfile


def mpi_env_rank_and_size():
    for rank, size in (("PMI_RANK", "PMI_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")):
        if os.environ.get(rank) is not None and os.environ.get(size) is not None:
            return int(os.environ[rank]), int(os.environ[size])
    return 0, 1


def skip_or_fail_gpu_test(test, message):
    if int(os.environ.get("HOROVOD_TEST_GPU", 0)):
        test.fail(message)
    test.skipTest(message)


@contextlib.contextmanager
def temppath():
    with tempfile.TemporaryDirectory() as folder:
        yield os.path.join(folder, "temp_test_file")
'''


def test_file(path: Path) -> Path:
    if path.is_dir():
        path = path / "test" / "parallel" / "test_torch.py"
    if not path.is_file():
        sys.exit(f"no test_torch.py at {path}")
    return path


def prepared(source: str, skip_optimizers: list[str]) -> str:
    text, n = re.subn(r"^import horovod\.torch as hvd$", "import adasum.horovod as hvd", source, flags=re.M)
    if n != 1:
        sys.exit("the file does not contain the line 'import horovod.torch as hvd'")
    for name in skip_optimizers:
        text = text.replace("subclass != torch.optim.SparseAdam",
                            f"subclass != torch.optim.SparseAdam and subclass.__name__ != {name!r}")
    return text


def test_names(text: str, pattern: str | None) -> list[str]:
    names = re.findall(r"^    def (test_\w+)\(", text, flags=re.M)
    return [n for n in names if pattern is None or re.search(pattern, n)]


def outcome(rc: int, output: str) -> str:
    if rc != 0 or re.search(r"\b\d+ (failed|error)", output):
        return "failed"
    if re.search(r"\b\d+ passed", output):
        return "passed"
    if re.search(r"\b\d+ skipped", output):
        return "skipped"
    return "failed"


def run(folder: Path, name: str, args) -> tuple[str, str, float]:
    env = dict(os.environ)
    env.setdefault("ADASUM_STALL_TIMEOUT", "30")
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    cmd = [args.mpiexec, "-n", str(args.ranks), args.python, "-m", "mpi4py", "-m", "pytest", "-q", "-p",
           "no:cacheprovider", f"test_torch.py::TorchTests::{name}"]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=args.timeout)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # mpiexec and its ranks: the session started for them
        output, _ = proc.communicate()
        rc, output = -1, f"timed out after {args.timeout} s\n{output}"
    return outcome(rc, output), output, time.monotonic() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", type=Path, help="a Horovod checkout, or its test/parallel/test_torch.py")
    parser.add_argument("-n", "--ranks", type=int, default=2, help="ranks per test (default 2)")
    parser.add_argument("-k", "--select", help="run only the tests whose name matches this regex")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per test (default 300)")
    parser.add_argument("--skip-optimizer", action="append", default=None,
                        help="an optimizer class to leave out of the optimizer loops (default: Muon)")
    parser.add_argument("--mpiexec", default=shutil.which("mpiexec") or "mpiexec")
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--log", type=Path, help="write each failing test's output under this folder")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder")
    args = parser.parse_args()
    skip = ["Muon"] if args.skip_optimizer is None else args.skip_optimizer
    text = prepared(test_file(args.path).read_text(), skip)
    names = test_names(text, args.select)
    folder = Path(tempfile.mkdtemp(prefix="horovod-suite-"))
    results: dict[str, list[str]] = {"passed": [], "failed": [], "skipped": []}
    try:
        (folder / "test_torch.py").write_text(text)
        (folder / "common.py").write_text(COMMON)
        for i, name in enumerate(names, 1):
            result, output, took = run(folder, name, args)
            results[result].append(name)
            print(f"[{i}/{len(names)}] {result:7s} {name} ({took:.1f} s)", flush=True)
            if result == "failed" and args.log is not None:
                args.log.mkdir(parents=True, exist_ok=True)
                (args.log / f"{name}.txt").write_text(output)
    finally:
        if args.keep:
            print(f"kept {folder}")
        else:
            shutil.rmtree(folder, ignore_errors=True)
    print(f"\n{args.ranks} ranks: {len(results['passed'])} passed, {len(results['failed'])} failed, "
          f"{len(results['skipped'])} skipped")
    for name in results["failed"]:
        print(f"FAILED {name}")
    sys.exit(1 if results["failed"] else 0)


if __name__ == "__main__":
    main()
