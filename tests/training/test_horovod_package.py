"""The Horovod façade as a package: ``adasum.horovod`` is the code (``adasum/horovod/``), its imports form no
cycle and none hides inside a function, importing it calls no MPI, and the old names are gone. Nothing here
depends on the world size: one size under mpiexec."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import adasum.horovod as hvd

from helpers import ONE_SIZE

FOLDER = Path(hvd.__file__).parent
ROOT = FOLDER.parents[1]


MODULES = {p.stem for p in FOLDER.glob("*.py")} - {"__init__"}


def _imports(name: str) -> tuple[set[str], list[str]]:
    """The modules of the package that ``name`` imports, and its imports that are not at module level."""
    tree = ast.parse((FOLDER / f"{name}.py").read_text())
    top = set(tree.body)
    found, inside = set(), []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)) and node not in top:
            inside.append(f"{name}.py:{node.lineno}: {ast.unparse(node)}")
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module is None:
                found |= {a.name for a in node.names if a.name in MODULES}
            elif node.module.split(".")[0] in MODULES:
                found.add(node.module.split(".")[0])
    return found, inside


@ONE_SIZE
def test_the_package_has_no_import_cycle_and_no_import_inside_a_function():
    """No module of adasum/horovod/ imports, directly or through others, a module that imports it, and every
    import is at the top of its module (none inside a function, where it could hide a cycle)."""
    edges, inside = {}, []
    for name in MODULES:
        edges[name], nested = _imports(name)
        inside += nested

    def reaches(start, target, seen=()):
        return any(n == target or (n not in seen and reaches(n, target, (*seen, n))) for n in edges[start])

    assert inside == []
    assert sorted(n for n in MODULES if reaches(n, n)) == []


@ONE_SIZE
def test_no_module_of_the_package_shares_a_name_with_another_of_the_library():
    names = [p.stem for p in (ROOT / "adasum").rglob("*.py") if p.stem != "__init__"]
    assert sorted(n for n in MODULES if names.count(n) > 1) == []


@ONE_SIZE
def test_importing_the_facade_calls_no_mpi():
    """``import adasum.horovod`` runs no MPI call: with mpi4py told not to initialise MPI, any call would
    fail; nothing is kept before ``hvd.init()``."""
    code = ("import mpi4py; mpi4py.rc.initialize = False\n"
            "import adasum.horovod as hvd\n"
            "from mpi4py import MPI\n"
            "from adasum.horovod import facade\n"
            "assert not MPI.Is_initialized() and facade.current() is None and not hvd.is_initialized()\n"
            "print(hvd.elastic.run.__module__, hvd.elastic.TorchState.__name__, hvd.DistributedOptimizer.__name__)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["adasum.torch.elastic", "TorchState", "DistributedOptimizer"]


@ONE_SIZE
@pytest.mark.parametrize("gone", ["adasum.torch.horovod", "adasum.integrations"])
def test_the_old_module_names_are_gone(gone):
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(gone)
