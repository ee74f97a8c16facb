"""The import graph of a package, read from its source: what ``Testing/core/test_import_layers.py``
and ``Testing/training/test_import_graph.py`` check (pytest puts ``Testing/`` on ``sys.path``).

Imports are read with :mod:`ast`, function-local ones included (a deferred import is still a
dependency). Importing ``a.b.c`` runs ``a/__init__`` and ``a/b/__init__`` first, so those count
too, except the importing module's own parent packages (already under way when it runs).
``from P import name`` counts ``P.name`` when that is a module.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple


def package_modules(root: Path, package: str) -> Dict[str, Path]:
    """``{dotted module name: file}`` of every module of ``package``, a folder under ``root``."""
    found = {}
    for path in sorted((Path(root) / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imported_names(name: str, path: Path, module_level: bool = False) -> Iterator[Tuple[int, str, List[str]]]:
    """``(line, absolute module, imported names)`` of every import statement of module ``name``;
    with ``module_level``, only those run when the module is imported (outside any function)."""
    here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    tree = ast.parse(Path(path).read_text(encoding="utf-8"), str(path))
    for node in (_outside_functions(tree) if module_level else ast.walk(tree)):
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


def _outside_functions(node: ast.AST) -> Iterator[ast.AST]:
    """``node`` and every node under it that is not inside a function's body (class bodies run at import)."""
    yield node
    for child in ast.iter_child_nodes(node):
        if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            yield from _outside_functions(child)


def import_graph(modules: Dict[str, Path]) -> Dict[str, Dict[str, int]]:
    """``{module: {module of ``modules`` it imports: first line}}``."""
    graph: Dict[str, Dict[str, int]] = {m: {} for m in modules}
    for name, path in modules.items():
        for line, module, names in imported_names(name, path):
            for target in [module] + [f"{module}.{n}" for n in names]:
                parts = target.split(".")
                for k in range(1, len(parts) + 1):
                    dep = ".".join(parts[:k])
                    if dep in modules and dep != name and not name.startswith(dep + "."):
                        graph[name].setdefault(dep, line)
    return graph


def cycles(graph: Dict[str, Dict[str, int]]) -> List[List[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on: Set[str] = set()
    found: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
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
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found
