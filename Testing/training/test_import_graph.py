"""The import graph of ``medvoltrain``: no cycle (function-local imports count), the two benchmark
stages never import each other, and the modules that must stay cheap to import load no torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Set

import medvoltrain

PACKAGE = Path(medvoltrain.__file__).resolve().parent
HEAVY = ("torch", "trl", "transformers", "peft", "datasets")


def module_files(root: Path = PACKAGE) -> Dict[str, Path]:
    """Dotted module name → file, for every module of the package under ``root``."""
    out = {}
    for f in sorted(root.rglob("*.py")):
        parts = [root.name, *f.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def import_graph(files: Dict[str, Path]) -> Dict[str, Set[str]]:
    """Module → the package's modules it imports anywhere in its file (inside functions too), with
    the packages a dotted import loads first; a module's own parent packages are left out."""
    graph: Dict[str, Set[str]] = {m: set() for m in files}
    for name, f in files.items():
        here = name.split(".") if f.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"), str(f))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(here[:len(here) - node.level + 1] + [node.module or ""] if node.level
                                else [node.module or ""]).rstrip(".")
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for t in targets:
                parts = t.split(".")
                for k in range(1, len(parts) + 1):
                    dep = ".".join(parts[:k])
                    if dep in files and dep != name and not name.startswith(dep + "."):
                        graph[name].add(dep)
    return graph


def cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    found: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_checker_finds_a_cycle_through_a_function_local_import(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..a import x\n")
    (pkg / "c.py").write_text("from . import a\n")
    graph = import_graph(module_files(pkg))
    assert graph["pkg.a"] == {"pkg.sub", "pkg.sub.b"} and graph["pkg.sub.b"] == {"pkg.a"}
    assert graph["pkg.c"] == {"pkg.a"}
    assert cycles(graph) == [["pkg.a", "pkg.sub.b"]]


def test_medvoltrain_has_no_import_cycle():
    graph = import_graph(module_files())
    assert "medvoltrain.bench.learning" in graph and len(graph) > 15
    assert cycles(graph) == []


def test_the_benchmark_stages_share_modules_and_never_import_each_other():
    graph = import_graph(module_files())
    learning, vision = graph["medvoltrain.bench.learning"], graph["medvoltrain.bench.vision"]
    assert "medvoltrain.bench.vision" not in learning and "medvoltrain.bench.learning" not in vision
    shared = {f"medvoltrain.bench.{m}" for m in ("model", "common", "report")}
    assert shared <= learning and shared <= vision
    for m in shared:  # the shared modules know neither stage
        assert not graph[m] & {"medvoltrain.bench.learning", "medvoltrain.bench.vision"}, m


def test_cheap_modules_load_no_torch():
    code = ("import sys, importlib; importlib.import_module(sys.argv[1]); "
            f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))")
    for module in ("medvoltrain.cli", "medvoltrain.grpo", "medvoltrain.bench", "medvoltrain.bench.learning",
                   "medvoltrain.bench.vision"):
        r = subprocess.run([sys.executable, "-c", code, module], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip().splitlines()[-1] == "[]", module
