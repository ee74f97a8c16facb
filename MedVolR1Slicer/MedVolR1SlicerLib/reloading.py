"""The order in which the developer "Reload" button reloads the module's parts, derived from the
files themselves: every module of the three packages (each package's ``__init__`` included),
each after the modules of the packages it imports.

Slicer's Reload re-runs the module file only; a part that imports names from another
(``from .markups import place_rois``) keeps the old objects unless what it imports was reloaded
first. The imports are read from the source with :mod:`ast` (function-local ones count too, so
the order does not depend on which functions ran), so a new file or a new import needs no list
kept by hand.

The rule: module A depends on module B when A names B in an import — ``import B``,
``from B import x``, or ``from P import B`` where ``P.B`` is a module (then A depends on ``P.B``,
not on ``P``). The importing module's parent packages are not counted: Python runs them before
it, but they do not hold what it imports. Among modules that are ready, names are taken in
alphabetical order, so the order is stable; a circle (there is none, and
``Testing/slicer_lib/test_module_files.py`` keeps it so) is broken in the same order.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Set

PACKAGES = ("MedVolR1SlicerLib", "MedVolR1SlicerScene", "MedVolR1SlicerPanel")
MODULE_DIR = Path(__file__).resolve().parents[1]  # the folder Slicer puts on sys.path


def package_modules(root: Path = MODULE_DIR, packages: Iterable[str] = PACKAGES) -> Dict[str, Path]:
    """``{dotted name: file}`` of every module of ``packages`` (folders under ``root``)."""
    found = {}
    for package in packages:
        for path in sorted((Path(root) / package).rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def imports_of(name: str, path: Path, known: Iterable[str]) -> Set[str]:
    """The modules among ``known`` that module ``name`` (file ``path``) imports anywhere in it."""
    known = set(known)
    here = name.split(".") if Path(path).name == "__init__.py" else name.split(".")[:-1]
    tree = ast.parse(Path(path).read_text(encoding="utf-8"), str(path))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[:len(here) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            for alias in node.names:
                sub = f"{module}.{alias.name}" if module else alias.name
                if sub in known:
                    found.add(sub)
                elif module in known:
                    found.add(module)
    found.discard(name)
    return found


def reload_order(root: Path = MODULE_DIR, packages: Iterable[str] = PACKAGES,
                 modules: Optional[Dict[str, Path]] = None) -> List[str]:
    """Every module of ``packages``, each after the modules it imports (see the module's doc)."""
    modules = package_modules(root, packages) if modules is None else dict(modules)
    depends = {name: imports_of(name, path, modules) for name, path in modules.items()}
    order: List[str] = []
    left = dict(depends)
    while left:
        ready = sorted(n for n, deps in left.items() if not (deps & left.keys()))
        if not ready:  # a circle: take the first name, as documented
            ready = [min(left)]
        for name in ready:
            order.append(name)
            del left[name]
    return order
