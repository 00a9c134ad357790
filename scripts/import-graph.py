#!/usr/bin/env python
"""The import graph of the package ``adasum``: its import cycles and its imports inside functions.

    python scripts/import-graph.py          # this checkout
    python scripts/import-graph.py PATH     # the checkout at PATH

Every module of ``adasum/`` is read with ``ast`` (nothing is imported). An edge goes from a module to each
module of the package it imports (``from .x import name`` to ``x.name`` where that is a module, else to
``x``). The cycles (groups of modules that import each other, directly or through others) are printed
twice: among the imports at module level, as Python runs them, then counting the imports inside functions
too, which is where a cycle hides when one side's import is moved into a function. Then every import inside
a function (of the package or not). The exit status is 1 where a cycle exists at module level.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def targets(modules: dict, mod: str, is_package: bool, node: ast.Import | ast.ImportFrom) -> set[str]:
    """The modules of the package that ``node``, in module ``mod``, imports."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name in modules}
    if node.level:
        base = mod.split(".") if is_package else mod.split(".")[:-1]
        base = base[:len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    found = {f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target for a in node.names}
    return {f for f in found if f in modules}


def read(root: Path) -> tuple[dict, dict, list]:
    """({module: modules imported at module level}, {module: modules imported inside functions}, [(module,
    line, text) of each import inside a function])."""
    modules = {module_name(root, p): p for p in sorted((root / "adasum").rglob("*.py"))}
    top, inner, listed = {}, {}, []
    for mod, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        is_package = path.name == "__init__.py"
        top[mod], inner[mod] = set(), set()
        stack = [(node, False) for node in tree.body]
        while stack:
            node, in_function = stack.pop()
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                (inner if in_function else top)[mod].update(targets(modules, mod, is_package, node))
                if in_function:
                    listed.append((mod, node.lineno, ast.unparse(node)))
            deeper = in_function or isinstance(node, FUNCTIONS)
            stack.extend((child, deeper) for child in ast.iter_child_nodes(node))
        top[mod].discard(mod)
        inner[mod].discard(mod)
    return top, inner, sorted(listed)


def cycles(edges: dict) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm, without recursion)."""
    index, low, on, stack, groups = {}, {}, set(), [], []
    for start in edges:
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on.add(start)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                group = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    group.append(w)
                    if w == v:
                        break
                if len(group) > 1:
                    groups.append(sorted(group))
    return groups


def one_cycle(edges: dict, group: list[str]) -> list[str]:
    """A path from the group's first module back to itself, inside the group (a shortest one)."""
    start, inside = group[0], set(group)
    paths = [[start]]
    seen = {start}
    while paths:
        path = paths.pop(0)
        for w in sorted(edges[path[-1]] & inside):
            if w == start:
                return path + [start]
            if w not in seen:
                seen.add(w)
                paths.append(path + [w])
    return group


def show(title: str, edges: dict) -> int:
    groups = cycles(edges)
    print(f"{title}: {len(groups)} import cycle(s)")
    for group in groups:
        print("  " + " -> ".join(one_cycle(edges, group)))
    return len(groups)


def main() -> int:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent).resolve()
    top, inner, listed = read(root)
    print(f"{len(top)} modules, {sum(map(len, top.values()))} imports of the package's modules at module level")
    found = show("module-level imports", top)
    show("counting the imports inside functions", {m: top[m] | inner[m] for m in top})
    print(f"imports inside functions: {len(listed)}")
    for mod, line, text in listed:
        print(f"  {mod}:{line}: {text}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
