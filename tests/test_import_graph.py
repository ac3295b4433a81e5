"""docs/ARCHITECTURE.md's dependency rule, read from the source (every import statement, also inside
functions): run.py → kvbench → {methods, eval}; methods and eval never import each other or kvbench;
kvbench knows methods through the package API only, never a method's own module."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: what kvbench may import of ``methods``: the registry (the package), the contract, the artifact files
METHODS_API = {"methods", "methods.base", "methods.artifacts"}


def imports(path: Path) -> set[str]:
    """Dotted names of the modules ``path`` imports (relative imports resolved; ``from pkg import mod``
    counts as ``pkg.mod`` when ``mod`` is a module of the repository)."""
    package = ".".join(path.relative_to(ROOT).parent.parts)
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package.split(".")[: len(package.split(".")) - node.level + 1], *[base] * bool(base)])
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if (ROOT / sub.replace(".", "/")).with_suffix(".py").is_file() else base)
    return found


GRAPH = {p.relative_to(ROOT).as_posix(): imports(p) for top in ("kvbench", "methods", "eval") for p in (ROOT / top).rglob("*.py")}


def test_the_parser_sees_imports_inside_functions_and_relative_ones():
    assert {"methods.base", "kvbench.kvcache"} <= GRAPH["kvbench/attention.py"]  # from .kvcache import ...
    assert "eval.niah" in GRAPH["kvbench/config.py"]  # imported inside a function
    assert "methods.scoring" in GRAPH["methods/snapkv.py"]


@pytest.mark.parametrize("package, forbidden", [("methods", ("kvbench", "eval")), ("eval", ("kvbench", "methods"))])
def test_methods_and_eval_import_neither_each_other_nor_kvbench(package, forbidden):
    bad = {f: sorted(m for m in mods if m.split(".")[0] in forbidden) for f, mods in GRAPH.items() if f.startswith(package + "/")}
    assert not {f: m for f, m in bad.items() if m}


def test_kvbench_imports_no_method_module():
    bad = {f: sorted(m for m in mods if m.split(".")[0] == "methods" and m not in METHODS_API)
           for f, mods in GRAPH.items() if f.startswith("kvbench/")}
    assert not {f: m for f, m in bad.items() if m}


def test_kvbench_modules_import_downward_only():
    """No import cycle among kvbench's modules (config.py ↔ models.py was one): each imports only modules below it."""
    graph = {f[:-3].replace("/", "."): {m for m in mods if m.startswith("kvbench.")}
             for f, mods in GRAPH.items() if f.startswith("kvbench/")}
    placed: list[str] = []
    while len(placed) < len(graph):  # peel off modules whose kvbench imports are all placed already
        below = [m for m in graph if m not in placed and graph[m] <= set(placed) | {m}]
        left = set(graph) - set(placed)
        assert below, f"import cycle: {({m: sorted(graph[m] & left - {m}) for m in sorted(left)})}"
        placed += below
