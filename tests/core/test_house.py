"""The package's house rules, read from its source (nothing is imported): its imports form no cycle, even
counting the imports inside functions (``scripts/import-graph.py``); no module is over 400 lines, no class
over 300, no function over 60; and the window's agreement is made in one module of the training layer
(``adasum/torch/window/close.py``), which every path drives."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "adasum"
LIMITS = {"module": 400, "class": 300, "function": 60}


def _sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_no_import_cycle():
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "import-graph.py")], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "module-level imports: 0 import cycle(s)" in done.stdout, done.stdout
    assert "counting the imports inside functions: 0 import cycle(s)" in done.stdout, done.stdout


def test_no_module_class_or_function_over_its_limit():
    over = []
    for path in _sources():
        text = path.read_text()
        where = path.relative_to(ROOT)
        lines = len(text.splitlines())
        if lines > LIMITS["module"]:
            over.append(f"{where}: {lines} lines")
        for node in ast.walk(ast.parse(text)):
            kind = "class" if isinstance(node, ast.ClassDef) else \
                "function" if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None
            if kind is None:
                continue
            length = node.end_lineno - node.lineno + 1
            if length > LIMITS[kind]:
                over.append(f"{where}:{node.lineno}: {kind} {node.name}, {length} lines")
    assert over == [], "over the limits " + str(LIMITS) + ":\n" + "\n".join(over)


def test_the_window_agreement_is_made_in_one_module():
    """Only ``window/close.py`` calls the agreement of a window (``_agree``) or builds its companion; every
    other module of ``adasum/torch`` reaches it through ``WindowClose``."""
    close = PACKAGE / "torch" / "window" / "close.py"
    tree = ast.parse(close.read_text())
    defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    assert {"_agree", "_companion_extra"} <= defined
    elsewhere = []
    for path in (PACKAGE / "torch").rglob("*.py"):
        if path == close:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").endswith("window.close") or \
                    isinstance(node, ast.ImportFrom) and node.module == "close":
                names = {a.name for a in node.names}
                if names - {"Layout", "Ledger", "WindowClose", "Update", "Decision"}:
                    elsewhere.append(f"{path.relative_to(ROOT)} imports {sorted(names)}")
    assert elsewhere == []
