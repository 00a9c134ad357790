"""What the READMEs and the documentation site tell a new user to run: the quick start is the file it names
and prints what each rank got, the commands it gives are there, and every script, example and hostfile a
command names exists where the command says."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from adasum.rule.reference import reference_allreduce

ROOT = Path(__file__).resolve().parents[2]
READMES = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, flags=re.S | re.M)


def _section(text: str, title: str) -> str:
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def test_readme_quick_start_is_the_example_file():
    quick = _section((ROOT / "README.md").read_text(), "Quick start")
    code = _blocks(quick, "python")
    assert code, "README's Quick start shows no python block"
    assert code[0] == (ROOT / "examples" / "quickstart.py").read_text(), \
        "README's Quick start differs from examples/quickstart.py"
    commands = "".join(_blocks(quick, "bash"))
    assert ". .venv/bin/activate" in commands, "README's Quick start does not activate .venv first"
    assert "mpiexec -n 4 python -m mpi4py examples/quickstart.py" in commands


def test_readme_keeps_the_two_commands():
    """The project's contract: these two commands, as written, in a bash block of README.md."""
    commands = "".join(_blocks((ROOT / "README.md").read_text(), "bash"))
    for command in ("bash scripts/run-example.sh", "bash scripts/run-tests.sh"):
        assert command in commands, f"README.md no longer shows {command!r}"


def _quickstart_inputs(size: int) -> list[list[np.ndarray]]:
    """The two layers examples/quickstart.py gives each rank."""
    return [[np.eye(size)[r], (r + 1) * np.array([1.0, 2.0])] for r in range(size)]


_LINE = re.compile(r"rank (\d+) of (\d+): orthogonal -> \[([^]]*)\] \(the sum\), parallel -> \[([^]]*)\] \(the mean\)")


def _parse(out: str) -> list[tuple[int, int, np.ndarray, np.ndarray]]:
    """Each rank's line (the launcher may interleave the ranks' output, even within a line)."""
    return [(int(m[1]), int(m[2]), np.array(m[3].split(), dtype=float), np.array(m[4].split(), dtype=float))
            for m in _LINE.finditer(out)]


@pytest.mark.timeout(240)
def test_quick_start_prints_what_each_of_three_ranks_got():
    mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    assert mpiexec, "no mpiexec on PATH"
    env = dict(os.environ, MPIEXEC_TIMEOUT="180", OMP_NUM_THREADS="1")
    run = subprocess.run([mpiexec, "-n", "3", sys.executable, "-m", "mpi4py", "examples/quickstart.py"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=220)
    assert run.returncode == 0, f"the quick start failed (exit {run.returncode}):\n{run.stdout}\n{run.stderr}"
    parsed = _parse(run.stdout)
    assert sorted(p[0] for p in parsed) == [0, 1, 2] and {p[1] for p in parsed} == {3}, \
        f"want one line from each of 3 ranks, got:\n{run.stdout}"
    want = reference_allreduce(_quickstart_inputs(3))
    for rank, _, orthogonal, parallel in parsed:
        # The print shows numpy's default 8 significant digits.
        np.testing.assert_allclose(orthogonal, want[0], rtol=1e-7, err_msg=f"rank {rank}")
        np.testing.assert_allclose(parallel, want[1], rtol=1e-7, err_msg=f"rank {rank}")
        np.testing.assert_array_equal(orthogonal, np.ones(3), err_msg=f"rank {rank}: orthogonal layers add")
        np.testing.assert_array_equal(parallel, [2.0, 4.0], err_msg=f"rank {rank}: parallel layers average")


# Files a command reads: a script, a hostfile, a document, with or without a directory (a bare train.py is
# one that would have to be in the repository root).
_PATH = re.compile(r"(?<![\w./-])((?:[\w+-]+/)*(?:[\w+.-]+\.(?:py|sh|txt|md)|hostfiles/[\w+.-]+))(?![\w/])")


@pytest.mark.parametrize("readme", READMES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_path_in_a_readme_command_exists(readme):
    """Every command in these READMEs runs from the repository root: what it names must be there."""
    missing = []
    for block in _blocks(readme.read_text(), "bash"):
        for line in block.splitlines():
            command = line.split("#", 1)[0]
            for path in _PATH.findall(command):
                if not (ROOT / path).exists():
                    missing.append(f"{path!r} in: {line.strip()}")
    assert not missing, f"{readme.relative_to(ROOT)}: commands name files that do not exist:\n" + "\n".join(missing)
