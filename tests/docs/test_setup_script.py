"""scripts/setup.sh, run on a copy of what it reads, with a .venv whose python records pip's calls instead
of making them: the first run installs and says what, a second run with nothing changed says so without
pip, and a change to pyproject.toml or to a C kernel installs again."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def checkout(tmp_path) -> Path:
    for rel in ["scripts/setup.sh", "requirements-dev.txt", "pyproject.toml", "setup.py",
                *[p.relative_to(ROOT).as_posix() for p in (ROOT / "adasum" / "kernels").glob("_kernels*.[ch]")]]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, tmp_path / rel)
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f"""#!/bin/sh
if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then echo "$*" >> "{tmp_path}/pip-calls"; exit 0; fi
exec "{sys.executable}" "$@"
""")
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    return tmp_path


def _setup(where: Path) -> tuple[str, list[str]]:
    env = {k: v for k, v in os.environ.items() if k != "TORCH_INDEX_URL"}
    run = subprocess.run(["bash", "scripts/setup.sh"], cwd=where, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    calls = where / "pip-calls"
    return run.stdout, calls.read_text().splitlines() if calls.exists() else []


def test_setup_installs_once_then_has_nothing_to_do(checkout):
    out, calls = _setup(checkout)
    assert calls == ["-m pip install -r requirements-dev.txt"]
    assert "[setup] installing requirements-dev.txt" in out and "1.7 GB" in out and "[setup] done" in out
    assert (checkout / ".venv" / ".setup-stamp").is_file()

    out, calls = _setup(checkout)
    assert len(calls) == 1, "a second run called pip"
    assert out.startswith("[setup] .venv is up to date") and "nothing to do" in out

    with open(checkout / "pyproject.toml", "a") as f:
        f.write("\n# changed\n")
    out, calls = _setup(checkout)
    assert len(calls) == 2, "a changed pyproject.toml did not reinstall"

    (checkout / "adasum" / "kernels" / "_kernels.c").write_text("/* changed */\n", encoding="utf-8")
    out, calls = _setup(checkout)
    assert len(calls) == 3, "a changed C kernel did not rebuild"
    out, calls = _setup(checkout)
    assert len(calls) == 3 and "nothing to do" in out
