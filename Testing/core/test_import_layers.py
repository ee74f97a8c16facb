"""The import graph of ``medvolcore``, ``medvoltrain`` and the Slicer module: no cycle, and the layers
of ``docs/architecture.md`` ("Layers").

Imports are read from the source with :mod:`ast`, function-local ones included (a deferred import
is still a dependency), and resolved to the module or package they load; ``from P import name``
counts as importing ``P.name`` when that is a module. A package's ``__init__`` importing its own
submodules is an edge like any other.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

import pytest

REPO = Path(__file__).resolve().parents[2]
ROOTS = {"medvolcore": REPO / "MedVolCore", "medvoltrain": REPO / "Training"}
FRONT_DOORS = ("medvolcore.cli", "medvolcore.serve", "medvolcore.cli_serve", "medvolcore.cli_batch")


def package_modules(root: Path, package: str) -> Dict[str, Path]:
    """``{dotted module name: file}`` of every module of ``package`` under ``root``."""
    found = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imported_names(name: str, path: Path) -> Iterator[Tuple[int, str, List[str]]]:
    """``(line, absolute module, imported names)`` of every import statement in the file."""
    is_package = path.name == "__init__.py"
    here = name.split(".") if is_package else name.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[:len(here) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            yield node.lineno, module, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name, []


def import_graph(modules: Dict[str, Path], prefixes: Tuple[str, ...]) -> Dict[str, Dict[str, int]]:
    """``{module: {imported module of ours: line}}`` for the modules whose names start with ``prefixes``."""
    graph: Dict[str, Dict[str, int]] = {m: {} for m in modules}
    for name, path in modules.items():
        for line, module, names in imported_names(name, path):
            if not module.startswith(prefixes):
                continue
            targets = [f"{module}.{n}" for n in names if f"{module}.{n}" in modules] or [module]
            if len(targets) < len(names) and module in modules:
                targets.append(module)  # `from P import a_module, a_function`: both P.a_module and P
            for t in targets:
                while t not in modules and "." in t:  # `import a.b.c` of a missing c: its package
                    t = t.rsplit(".", 1)[0]
                if t in modules and t != name:
                    graph[name].setdefault(t, line)
    return graph


def cycles(graph: Dict[str, Dict[str, int]]) -> List[List[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on: Set[str] = set()
    out: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _graph(package: str) -> Dict[str, Dict[str, int]]:
    return import_graph(package_modules(ROOTS[package], package), (package,))


def _in(module: str, *prefixes: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _violations(graph, sources, forbidden) -> List[str]:
    return [f"{m} imports {t} (line {line})" for m, deps in graph.items() if _in(m, *sources)
            for t, line in deps.items() if _in(t, *forbidden)]


# ---- the checker itself ------------------------------------------------------------------

def test_the_checker_finds_a_function_local_cycle(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from .sub import b\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("from ..c import g\n")
    (pkg / "c.py").write_text("import pkg.a\n")
    (pkg / "d.py").write_text("from . import a\nfrom .c import g\n")
    graph = import_graph(package_modules(tmp_path, "pkg"), ("pkg",))
    assert graph["pkg.a"] == {"pkg.sub.b": 2} and graph["pkg.d"] == {"pkg.a": 1, "pkg.c": 2}
    assert cycles(graph) == [["pkg.a", "pkg.c", "pkg.sub.b"]]


# ---- the rules ---------------------------------------------------------------------------

@pytest.mark.parametrize("package", sorted(ROOTS))
def test_no_import_cycle(package):
    assert cycles(_graph(package)) == []


def test_grounder_and_propagation_never_import_each_other():
    g = _graph("medvolcore")
    assert _violations(g, ["medvolcore.grounder"], ["medvolcore.propagation"]) == []
    assert _violations(g, ["medvolcore.propagation"], ["medvolcore.grounder"]) == []


def test_volumes_know_nothing_of_anchors_models_or_front_doors():
    g = _graph("medvolcore")
    above = ["medvolcore.anchor", "medvolcore.answer", "medvolcore.models", "medvolcore.grounder",
             "medvolcore.propagation", "medvolcore.pipeline", "medvolcore.jobs", "medvolcore.batch", "medvolcore.qc",
             *FRONT_DOORS]
    assert _violations(g, ["medvolcore.volume", "medvolcore.stack", "medvolcore.windowing"], above) == []


def test_nothing_below_the_front_doors_imports_them():
    g = _graph("medvolcore")
    below = {m: deps for m, deps in g.items() if not _in(m, *FRONT_DOORS)}
    assert len(below) > 20 and "medvolcore.jobs" in below and "medvolcore.pipeline" in below
    assert _violations(below, ["medvolcore"], FRONT_DOORS) == []
    assert _violations(g, ["medvolcore.serve"], ["medvolcore.cli", "medvolcore.cli_serve", "medvolcore.cli_batch"]) == []


def test_the_engine_never_imports_training():
    modules = package_modules(ROOTS["medvolcore"], "medvolcore")
    bad = [f"{m} imports {mod}" for m, p in modules.items() for _, mod, _ in imported_names(m, p)
           if _in(mod, "medvoltrain")]
    assert bad == []


def test_the_slicer_module_imports_only_medvolcore_resources():
    folder = REPO / "MedVolR1Slicer"
    files = sorted(folder.rglob("*.py"))
    assert len(files) > 5
    bad = []
    for path in files:
        for line, module, _ in imported_names(path.stem, path):
            if _in(module, "medvolcore", "medvoltrain") and module != "medvolcore.resources":
                bad.append(f"{path.relative_to(REPO)}:{line} imports {module}")
    assert bad == []
