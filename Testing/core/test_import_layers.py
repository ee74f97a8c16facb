"""The import graph of ``medvolcore``, ``medvoltrain`` and the Slicer module: no cycle, and the layers
of ``docs/architecture.md`` ("Layers").

The graph is read from the source, function-local imports included (``Testing/import_graph.py``).
``Testing/training/test_import_graph.py`` adds the rules of the training benchmarks.
"""

from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import pytest

from import_graph import cycles, import_graph, imported_names, package_modules

REPO = Path(__file__).resolve().parents[2]
ROOTS = {"medvolcore": REPO / "MedVolCore", "medvoltrain": REPO / "Training"}
FRONT_DOORS = ("medvolcore.cli", "medvolcore.serve", "medvolcore.agents", "medvolcore.cli_serve", "medvolcore.cli_batch")


@functools.lru_cache(maxsize=None)  # read once per session; the rules only read it
def _graph(package: str) -> Dict[str, Dict[str, int]]:
    return import_graph(package_modules(ROOTS[package], package))


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
    graph = import_graph(package_modules(tmp_path, "pkg"))
    assert graph["pkg.a"] == {"pkg.sub": 2, "pkg.sub.b": 2} and graph["pkg.d"] == {"pkg.a": 1, "pkg.c": 2}
    assert cycles(graph) == [["pkg.a", "pkg.c", "pkg.sub.b"]]


# ---- the rules ---------------------------------------------------------------------------

@pytest.mark.parametrize("package", sorted(ROOTS))
def test_no_import_cycle(package):
    assert cycles(_graph(package)) == []


def test_grounder_and_propagation_never_import_each_other():
    g = _graph("medvolcore")
    assert _violations(g, ["medvolcore.grounder"], ["medvolcore.propagation"]) == []
    assert _violations(g, ["medvolcore.propagation"], ["medvolcore.grounder"]) == []


GROUNDER_BUILD = "medvolcore.grounder.build"
GROUNDER_SHARED = ("medvolcore.grounder._common",)  # lazy heavy imports and a message helper, used by both
# the grounder's modules that predict, and the package itself
GROUNDER_PREDICTING = ("medvolcore.grounder", "medvolcore.grounder.model", "medvolcore.grounder.inputs",
                       "medvolcore.grounder.decode", "medvolcore.grounder.answers", "medvolcore.grounder.prompt",
                       "medvolcore.grounder.progress", "medvolcore.grounder._logits")


def test_the_grounder_builds_apart_from_predicting():
    """``grounder/build.py`` (weights, adapter, dtype, device) imports nothing that predicts; the
    predicting modules import it only inside the function that builds (``from_pretrained``)."""
    modules = package_modules(ROOTS["medvolcore"], "medvolcore")
    in_grounder = sorted(m for m in modules if _in(m, "medvolcore.grounder"))
    assert sorted(GROUNDER_PREDICTING + GROUNDER_SHARED + (GROUNDER_BUILD,)) == in_grounder  # a new one picks a side
    g = _graph("medvolcore")
    assert [t for t in g[GROUNDER_BUILD] if t in GROUNDER_PREDICTING] == []
    assert [t for m in GROUNDER_SHARED for t in g[m] if _in(t, "medvolcore.grounder")] == []
    at_import = [f"{m} imports {GROUNDER_BUILD} at module level (line {line})" for m in GROUNDER_PREDICTING
                 for line, module, names in imported_names(m, modules[m], module_level=True)
                 if GROUNDER_BUILD in [module] + [f"{module}.{n}" for n in names]]
    assert at_import == []
    assert GROUNDER_BUILD in g["medvolcore.grounder.model"]  # from_pretrained builds through it


def test_importing_the_grounder_modules_loads_no_heavy_library_and_predicting_loads_no_building():
    code = ("import sys, importlib; importlib.import_module(sys.argv[1]); "
            "print(sorted(m for m in ('torch', 'transformers', 'peft', 'xgrammar', 'medvolcore.grounder.build') "
            "if m in sys.modules))")
    for module in ("medvolcore.grounder", "medvolcore.grounder.model", "medvolcore.grounder.decode",
                   "medvolcore.grounder.inputs", "medvolcore.grounder.answers", GROUNDER_BUILD):
        r = subprocess.run([sys.executable, "-c", code, module], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        want = [GROUNDER_BUILD] if module == GROUNDER_BUILD else []
        assert r.stdout.strip().splitlines()[-1] == str(want), module


# The layers of medvolcore, lowest first (docs/architecture.md, "Layers"): a module of one layer imports
# nothing of a layer above it, function-local imports included. Modules named in no layer are held
# by the other rules only.
LAYERS = (
    ("medvolcore.errors", "medvolcore.resources", "medvolcore.fileio", "medvolcore.devices", "medvolcore.cpu",
     "medvolcore.strictjson"),  # one job each, no model
    ("medvolcore.volume", "medvolcore.stack", "medvolcore.windowing"),  # volumes and the axial stack
    ("medvolcore.anchor", "medvolcore.answer", "medvolcore.metrics", "medvolcore.qc"),  # anchors, answers, scores
    ("medvolcore.models", "medvolcore.grounder", "medvolcore.propagation"),  # the models
    ("medvolcore.pipeline",),
    ("medvolcore.request", "medvolcore.result", "medvolcore.jobs"),  # the one segment job
    FRONT_DOORS,
)


def _layer_violations(graph, layers) -> List[str]:
    def layer_of(module):
        return next((i for i, names in enumerate(layers) if _in(module, *names)), None)

    return [f"{m} imports {t} (line {line}), a layer above it" for m, deps in sorted(graph.items())
            if layer_of(m) is not None for t, line in deps.items()
            if layer_of(t) is not None and layer_of(t) > layer_of(m)]


def test_the_layer_checker_finds_a_function_local_import_upwards(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "low.py").write_text("import os\n\ndef f():\n    from .high import g\n")
    (pkg / "mid.py").write_text("from .low import f\n")
    (pkg / "high.py").write_text("from . import mid\n")
    graph = import_graph(package_modules(tmp_path, "pkg"))
    assert _layer_violations(graph, (("pkg.low",), ("pkg.mid",), ("pkg.high",))) == [
        "pkg.low imports pkg.high (line 4), a layer above it"]
    assert _layer_violations(graph, (("pkg.low",), ("pkg.mid", "pkg.high"))) == [
        "pkg.low imports pkg.high (line 4), a layer above it"]
    assert _layer_violations(graph, (("pkg.low", "pkg.high"), ("pkg.mid",))) == [
        "pkg.high imports pkg.mid (line 1), a layer above it"]


def test_each_layer_imports_nothing_above_it():
    g = _graph("medvolcore")
    named = [p for layer in LAYERS for p in layer]
    assert [p for p in named if not any(_in(m, p) for m in g)] == []  # each name is a module or package
    assert _layer_violations(g, LAYERS) == []


CLI_SHARED = ("medvolcore.cli.common", "medvolcore.cli.pacs")  # shared options: common's, and DICOMweb's


def test_each_command_module_imports_only_the_shared_cli_modules():
    """Inside ``cli/``: ``app.py`` assembles the command modules; each of them imports, of ``cli/``,
    only ``common.py`` and ``pacs.py`` (the DICOMweb options of segment and batch); ``common.py``
    imports none."""
    modules = package_modules(ROOTS["medvolcore"], "medvolcore")
    cli = sorted(m for m in modules if _in(m, "medvolcore.cli") and m != "medvolcore.cli")
    commands = [m for m in cli if m not in ("medvolcore.cli.app", "medvolcore.cli.__main__", "medvolcore.cli.common")]
    assert {"medvolcore.cli.steps", "medvolcore.cli.volume", "medvolcore.cli.batch"} <= set(commands)
    g = _graph("medvolcore")
    bad = [f"{m} imports {t} (line {line})" for m in commands for t, line in g[m].items()
           if _in(t, "medvolcore.cli") and t not in CLI_SHARED and t != m]
    assert bad == []
    assert [t for t in g["medvolcore.cli.common"] if _in(t, "medvolcore.cli")] == []
    assert set(commands) <= set(g["medvolcore.cli.app"])  # app.py registers every command module


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
    # the MCP server is a door over the worker: the worker knows nothing of it, and it knows nothing of the CLI
    assert _violations(g, ["medvolcore.serve"], ["medvolcore.agents"]) == []
    assert _violations(g, ["medvolcore.agents"], ["medvolcore.cli", "medvolcore.cli_serve", "medvolcore.cli_batch"]) == []


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
