"""The model presets and default of the Slicer module (``MedVolR1SlicerLib.presets``): read from
the same ``Resources/models.json`` as the worker's ``medvolcore.models``, with
``$MEDVOL_MODELS_JSON`` laid over it the way the worker does; where the manifest is looked for
(``$MEDVOL_RESOURCES``, the checkout, the copy installed with the extension); the fallback; and the
panel's, the ``Options``' and the batch's defaults following it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from MedVolR1SlicerLib import presets

REPO = Path(__file__).resolve().parents[2]
MODULE = REPO / "MedVolR1Slicer"
MANIFEST = REPO / "Resources" / "models.json"
SHIPPED = json.loads(MANIFEST.read_text(encoding="utf-8"))
SHIPPED_NAMES = tuple(SHIPPED["presets"])  # qwen3-vl-4b, qwen3-vl-2b, medvol-r1, tiny
ENV_NAMES = (presets.OVERRIDE_ENV, presets.RESOURCES_ENV)


@pytest.fixture
def engine_env(monkeypatch):
    """``medvolcore.models`` with neither override set (it reads ``os.environ`` at each call)."""
    from medvolcore import models

    for name in ENV_NAMES:
        monkeypatch.delenv(name, raising=False)
    return models


def engine_view(models):
    table = models.list_presets()
    return models.default_preset(), tuple(p.name for p in table), {p.name: p.description for p in table}


def lib_view(got):
    return got.default, got.names, got.descriptions


def write_json(path: Path, data) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


def manifest_with(**changes) -> dict:
    return dict(json.loads(MANIFEST.read_text(encoding="utf-8")), **changes)


MINE = {"description": "a local grounder", "grounder": {"path": "/models/mine"},
        "medsam2": {"random_seed": 1, "image_size": 64}}


# ---- the repository's manifest, as the worker reads it ----------------------------------------

def test_the_repository_manifest_gives_the_workers_default_and_presets(engine_env):
    got = presets.read_presets(environ={})
    assert got.manifest == MANIFEST and got.override is None
    assert lib_view(got) == engine_view(engine_env)
    assert (got.default, got.names) == (SHIPPED["default"], SHIPPED_NAMES)


def test_the_fallback_is_the_shipped_manifests_default_and_presets():
    assert (presets.FALLBACK.default, presets.FALLBACK.names) == (SHIPPED["default"], SHIPPED_NAMES)
    assert set(presets.FALLBACK.descriptions) == set(SHIPPED_NAMES)


@pytest.mark.parametrize("overlay, default, names", [
    ({"default": "tiny", "presets": {}}, "tiny", SHIPPED_NAMES),
    # added at the end, replaced in place, the manifest's default kept
    ({"presets": {"mine": MINE, "qwen3-vl-2b": dict(MINE, description="replaced")}},
     SHIPPED["default"], SHIPPED_NAMES + ("mine",)),
    ({"default": "mine", "presets": {"mine": MINE}}, "mine", SHIPPED_NAMES + ("mine",)),
], ids=["default-only", "add-and-replace", "new-default"])
def test_medvol_models_json_is_laid_over_the_manifest_as_the_worker_does(engine_env, monkeypatch, tmp_path,
                                                                        overlay, default, names):
    path = write_json(tmp_path / "models.json", overlay)
    monkeypatch.setenv(presets.OVERRIDE_ENV, str(path))
    got = presets.read_presets(environ={presets.OVERRIDE_ENV: str(path)})
    assert (got.default, got.names) == (default, names)
    assert got.manifest == MANIFEST and got.override == path
    assert lib_view(got) == engine_view(engine_env)


def test_an_unreadable_override_leaves_the_manifest_to_the_panel(tmp_path):
    for text in ("{not json", '{"default": "tiny"}', "[1]"):
        bad = tmp_path / "bad.json"
        bad.write_text(text, encoding="utf-8")
        got = presets.read_presets(environ={presets.OVERRIDE_ENV: str(bad)})
        assert (got.default, got.override, got.manifest) == (SHIPPED["default"], None, MANIFEST), text
    got = presets.read_presets(environ={presets.OVERRIDE_ENV: str(tmp_path / "missing.json")})
    assert got.default == SHIPPED["default"] and got.override is None


# ---- where the manifest is looked for ----------------------------------------------------------

def test_the_checkout_then_the_installed_copy_then_the_fallback(tmp_path):
    """A built extension's layout: ``qt-scripted-modules/MedVolR1Slicer.py`` with the manifest
    installed in ``qt-scripted-modules/Resources/``; a checkout has it in ``../Resources/``."""
    module_dir = tmp_path / "lib" / "qt-scripted-modules"
    module_dir.mkdir(parents=True)
    got = presets.read_presets(module_dir, environ={})
    assert got == presets.FALLBACK

    installed = write_json(module_dir / "Resources" / "models.json", manifest_with(default="tiny"))
    got = presets.read_presets(module_dir, environ={})
    assert (got.manifest, got.default, got.names) == (installed, "tiny", SHIPPED_NAMES)

    checkout = write_json(module_dir.parent / "Resources" / "models.json", manifest_with(default="qwen3-vl-2b"))
    assert presets.read_presets(module_dir, environ={}).manifest == checkout

    # an unreadable or foreign file is passed over, not trusted
    checkout.write_text("{", encoding="utf-8")
    assert presets.read_presets(module_dir, environ={}).manifest == installed
    write_json(checkout, manifest_with(schema="medvol.models/0"))
    assert presets.read_presets(module_dir, environ={}).manifest == installed

    # the fallback still takes the override
    installed.unlink()
    override = write_json(tmp_path / "o.json", {"default": "tiny", "presets": {"mine": MINE}})
    got = presets.read_presets(module_dir, environ={presets.OVERRIDE_ENV: str(override)})
    assert (got.manifest, got.default, got.names) == (None, "tiny", presets.FALLBACK.names + ("mine",))


def test_the_source_checkout_finds_the_repository_manifest():
    assert presets.manifest_candidates(MODULE, environ={})[0] == MANIFEST
    assert presets.manifest_candidates(MODULE, environ={})[1] == MODULE / "Resources" / "models.json"


def test_medvol_resources_is_taken_only_where_the_worker_takes_it(tmp_path):
    folder = tmp_path / "res"
    mine = write_json(folder / "models.json", manifest_with(default="tiny"))
    env = {presets.RESOURCES_ENV: str(folder)}
    assert presets.read_presets(MODULE, environ=env).manifest == MANIFEST  # no windows.json: not a resources folder
    shutil.copy(REPO / "Resources" / "windows.json", folder / "windows.json")
    got = presets.read_presets(MODULE, environ=env)
    assert (got.manifest, got.default) == (mine, "tiny")


ENGINE_AND_LIB = """
import json, sys
sys.path.insert(0, sys.argv[1])
from medvolcore import models
from MedVolR1SlicerLib import batchjobs, params, presets
from MedVolR1SlicerLib.session import Options
print(json.dumps({
    "engine": [models.default_preset(), [p.name for p in models.list_presets()]],
    "lib": [presets.default_preset(), list(presets.model_presets().names)],
    "params": [params.DEFAULTS["preset"], list(params.PRESETS)],
    "options": Options().preset,
    "panel": params.options_from_panel("").preset,
    "batch": batchjobs.parse_args(["--input", "ct.nii.gz", "--query", "q", "--output", "o.seg.nrrd"]).preset,
}))
"""


def run_engine_and_lib(tmp_path, **env):
    script = tmp_path / "both.py"
    script.write_text(ENGINE_AND_LIB, encoding="utf-8")
    environ = {k: v for k, v in os.environ.items() if k not in ENV_NAMES}
    environ.update(env)
    r = subprocess.run([sys.executable, str(script), str(MODULE)], capture_output=True, text=True, timeout=120,
                       env=environ)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("how", ["MEDVOL_MODELS_JSON", "MEDVOL_RESOURCES"])
def test_a_manifest_whose_default_is_tiny_makes_every_default_of_the_module_tiny(tmp_path, how):
    """Read at import, as Slicer does at start-up: the Lib's default, the panel's default and
    preset list, ``Options()`` and the batch's ``--preset`` all follow, and equal the worker's."""
    if how == "MEDVOL_MODELS_JSON":
        env = {how: str(write_json(tmp_path / "models.json", {"default": "tiny", "presets": {"mine": MINE}}))}
        names = list(SHIPPED_NAMES) + ["mine"]
    else:
        folder = tmp_path / "res"
        table = manifest_with(default="tiny")
        del table["presets"]["qwen3-vl-2b"]
        write_json(folder / "models.json", table)
        shutil.copy(REPO / "Resources" / "windows.json", folder / "windows.json")
        env = {how: str(folder)}
        names = [n for n in SHIPPED_NAMES if n != "qwen3-vl-2b"]
    got = run_engine_and_lib(tmp_path, **env)
    assert got["engine"] == got["lib"] == got["params"] == ["tiny", names]
    assert got["options"] == got["panel"] == got["batch"] == "tiny"
    plain = run_engine_and_lib(tmp_path)
    assert plain["engine"] == plain["lib"] == plain["params"] == [SHIPPED["default"], list(SHIPPED_NAMES)]
    assert plain["options"] == plain["panel"] == plain["batch"] == SHIPPED["default"] != "tiny"


def test_the_sample_ct_is_found_beside_a_checkout_and_in_a_built_module(tmp_path):
    import hashlib

    from MedVolR1SlicerLib.presets import sample_ct

    here = sample_ct()  # this checkout: Resources/samples beside MedVolR1Slicer/
    assert here is not None and here.path.name == "abdomen_ct_30slices.nii.gz"
    assert hashlib.sha256(here.path.read_bytes()).hexdigest() == here.sha256  # what Sample Data checks
    # a built extension: no checkout beside the module, the copy in the module's Resources/
    module = tmp_path / "lib" / "MedVolR1Slicer"
    (module / "Resources" / "samples").mkdir(parents=True)
    assert sample_ct(module) is None
    for name in ("samples.json", "abdomen_ct_30slices.nii.gz"):
        (module / "Resources" / "samples" / name).write_bytes((here.path.parent / name).read_bytes())
    built = sample_ct(module)
    assert built.path == module / "Resources" / "samples" / "abdomen_ct_30slices.nii.gz"
    assert built.sha256 == here.sha256 and built.query == "the organ that secretes bile"


# ---- what the panel says a preset runs as (the logic behind modelLabel and the status line) --------

def test_the_panels_labels_are_the_workers_identity_labels(engine_env):
    """The Lib reads the manifest without medvolcore; its labels must still be the worker's."""
    got = presets.read_presets(environ={})
    assert got.labels == {p.name: engine_env.preset_identity(p.name)["label"] for p in engine_env.list_presets()}
    assert presets.FALLBACK.labels == got.labels


def test_model_text_before_a_run_says_zero_shot_needs_an_adapter_or_smoke():
    table = presets.read_presets(environ={})
    assert presets.model_text("qwen3-vl-4b", "", table) == (
        "Model: Qwen3-VL-4B-Instruct, zero-shot, not trained for this task: results are often wrong; check every "
        "result.")
    r1 = presets.model_text("medvol-r1", "", table)
    assert "needs a trained adapter" in r1 and "none is published" in r1 and "qwen3-vl-4b" in r1
    assert "meaningless" in presets.model_text("tiny", "", table)
    # with an adapter only the worker knows whether medvol-train made it: the panel does not claim MedVol-R1
    with_adapter = presets.model_text("medvol-r1", "/data/runs/grpo1/adapter", table)
    assert "LoRA adapter grpo1/adapter" in with_adapter and not with_adapter.startswith("Model: MedVol-R1")


def test_result_model_text_after_a_run_is_the_workers_label():
    label = "MedVol-R1 (adapter: grpo1/adapter, medvol-train grpo stage, on Qwen3-VL-4B-Instruct)"
    assert presets.result_model_text({"model_label": label, "smoke": False}) == "Model: " + label
    assert presets.result_model_text({"identity": {"label": "x, zero-shot"}}) == "Model: x, zero-shot"
    assert presets.result_model_text({"smoke": True}) == "Model: " + presets.SMOKE_LABEL
    assert presets.result_model_text({"smoke": False}) == ""  # a propagation of a given anchor names no model


def test_the_panel_shows_the_research_use_notice_first():
    import xml.etree.ElementTree as ET

    from medvolcore import RESEARCH_USE_NOTICE

    ui = ET.parse(MODULE / "Resources" / "UI" / "MedVolR1Slicer.ui").getroot()
    widgets = {w.get("name"): w for w in ui.iter("widget")}
    text = {n: w.find("property[@name='text']/string").text for n, w in widgets.items()
            if w.find("property[@name='text']/string") is not None}
    assert text["noticeLabel"] == RESEARCH_USE_NOTICE
    assert ui.find("widget/layout/item/widget").get("name") == "noticeLabel"  # first in the panel, always visible
    assert "modelLabel" in widgets  # filled from model_text (Testing/slicer_mrml/test_mrml_widget.py)


def test_segment_style_from_a_results_terminology():
    from MedVolR1SlicerLib.segments import segment_style

    entry = "Segmentation category and type - DICOM master list~SCT^123037004^Anatomical Structure~SCT^10200004^Liver~^^~Anatomic codes - DICOM master list~^^~^^"
    color, got = segment_style({"color": [255, 0, 51], "slicer_terminology": entry})
    assert color == (1.0, 0.0, 0.2) and got == entry
    for bad in (None, {}, {"color": [300, 0, 0], "slicer_terminology": entry}, {"color": [1, 2, 3], "slicer_terminology": "x"}):
        assert segment_style(bad) is None  # an older worker, or nonsense: Slicer's own defaults
