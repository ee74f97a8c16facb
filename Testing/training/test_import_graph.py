"""The training benchmarks' layers: the two stages never import each other, and the modules that
must stay cheap to import load no torch. The graph is ``Testing/import_graph.py``'s;
``Testing/core/test_import_layers.py`` checks it, and that neither package has an import cycle."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import medvoltrain
from import_graph import import_graph, package_modules

ROOT = Path(medvoltrain.__file__).resolve().parent.parent
HEAVY = ("torch", "trl", "transformers", "peft", "datasets")


def test_the_benchmark_stages_share_modules_and_never_import_each_other():
    graph = import_graph(package_modules(ROOT, "medvoltrain"))
    learning, vision = set(graph["medvoltrain.bench.learning"]), set(graph["medvoltrain.bench.vision"])
    assert "medvoltrain.bench.vision" not in learning and "medvoltrain.bench.learning" not in vision
    shared = {f"medvoltrain.bench.{m}" for m in ("model", "common", "report")}
    assert shared <= learning and shared <= vision
    for m in shared:  # the shared modules know neither stage
        assert not set(graph[m]) & {"medvoltrain.bench.learning", "medvoltrain.bench.vision"}, m


def test_cheap_modules_load_no_torch():
    code = ("import sys, importlib; importlib.import_module(sys.argv[1]); "
            f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))")
    for module in ("medvoltrain.cli", "medvoltrain.grpo", "medvoltrain.bench", "medvoltrain.bench.learning",
                   "medvoltrain.bench.vision", "medvoltrain.bench.presence"):
        r = subprocess.run([sys.executable, "-c", code, module], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip().splitlines()[-1] == "[]", module
