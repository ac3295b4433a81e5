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
    assert {"methods.base", "kvbench.engine.kvcache"} <= GRAPH["kvbench/engine/attention.py"]
    assert "eval.niah" in GRAPH["kvbench/job/config.py"]  # imported inside a function
    assert "methods.scoring" in GRAPH["methods/snapkv.py"]


@pytest.mark.parametrize("package, forbidden", [("methods", ("kvbench", "eval")), ("eval", ("kvbench", "methods"))])
def test_methods_and_eval_import_neither_each_other_nor_kvbench(package, forbidden):
    bad = {f: sorted(m for m in mods if m.split(".")[0] in forbidden) for f, mods in GRAPH.items() if f.startswith(package + "/")}
    assert not {f: m for f, m in bad.items() if m}


def test_kvbench_imports_no_method_module():
    bad = {f: sorted(m for m in mods if m.split(".")[0] == "methods" and m not in METHODS_API)
           for f, mods in GRAPH.items() if f.startswith("kvbench/")}
    assert not {f: m for f, m in bad.items() if m}


def module_name(f: str) -> str:
    return f[:-3].replace("/", ".").removesuffix(".__init__")


#: kvbench's packages, lowest first: each may import only itself and those before it (kvbench/__init__.py)
FLOORS = ["kvbench.cli", "kvbench.engine", "kvbench.job", "kvbench.report", "kvbench.tools"]


def floor(module: str) -> int:
    return next(i for i, p in enumerate(FLOORS) if module == p or module.startswith(p + "."))


def test_kvbench_packages_import_downward_only():
    """The engine knows no job, the job no report, nothing but the cli the tools (the package docstrings)."""
    assert {floor(module_name(f)) for f in GRAPH if f.startswith("kvbench/") and f.count("/") > 1} == {1, 2, 3, 4}
    bad = {f: sorted(m for m in mods if m.startswith("kvbench.") and floor(m) > floor(module_name(f)))
           for f, mods in GRAPH.items() if f.startswith("kvbench/") and f.count("/") > 1}
    assert not {f: m for f, m in bad.items() if m}


def test_no_kvbench_package_holds_more_than_twelve_modules():
    folders = [p for p in (ROOT / "kvbench").rglob("*") if p.is_dir() and p.name != "__pycache__"]
    assert folders and all(len(list(p.glob("*.py"))) <= 12 for p in folders)


def test_kvbench_modules_import_downward_only():
    """No import cycle among kvbench's modules (config.py ↔ models.py was one): each imports only modules below it."""
    graph = {module_name(f): {m for m in mods if m.startswith("kvbench.")}
             for f, mods in GRAPH.items() if f.startswith("kvbench/")}
    placed: list[str] = []
    while len(placed) < len(graph):  # peel off modules whose kvbench imports are all placed already
        below = [m for m in graph if m not in placed and graph[m] <= set(placed) | {m}]
        left = set(graph) - set(placed)
        assert below, f"import cycle: {({m: sorted(graph[m] & left - {m}) for m in sorted(left)})}"
        placed += below
