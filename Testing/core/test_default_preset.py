"""The default model preset comes from the manifest (``models.default_preset()``) at every front door.

``$MEDVOL_MODELS_JSON`` names a manifest whose ``default`` is ``tiny``: a command, pipeline, batch,
worker or training run given no preset must then use ``tiny``, not a name written in the code.
"""

from __future__ import annotations

import json

import pytest

from medvolcore import models
from medvolcore.cli import main


@pytest.fixture
def tiny_default(tmp_path, monkeypatch):
    manifest = tmp_path / "models.json"
    manifest.write_text(json.dumps({"schema": "medvol.models/1", "default": "tiny", "presets": {}}))
    monkeypatch.setenv("MEDVOL_MODELS_JSON", str(manifest))
    assert models.default_preset() == "tiny"
    return manifest


def test_without_an_override_the_default_is_the_shipped_manifests():
    from medvolcore.resources import resource_path

    shipped = json.loads(resource_path("models.json").read_text(encoding="utf-8"))
    assert models.default_preset() == shipped["default"] == "qwen3-vl-4b"


def test_pipeline_without_a_preset(tiny_default):
    from medvolcore.pipeline import Pipeline

    assert Pipeline().preset == "tiny"


def test_segment_without_a_preset(tiny_default, tmp_path, small_ct, capsys):
    code = main(["segment", "--volume", str(small_ct[0]), "--query", "the liver", "--out", str(tmp_path / "m.nii.gz"),
                 "--device", "cpu", "--json", "--no-progress"])
    out, err = capsys.readouterr()
    assert code == 0, err
    res = json.loads(out)
    assert res["preset"] == "tiny" and res["smoke"] is True


def test_batch_options_without_a_preset(tiny_default, tmp_path, small_ct):
    from medvolcore.batch import BatchOptions, run_batch

    manifest = tmp_path / "cases.csv"
    manifest.write_text(f"id,volume,query\nc1,{small_ct[0]},the liver\n")
    res = run_batch(manifest, tmp_path / "out", BatchOptions(device="cpu", progress=False))
    assert res.info["preset"] == "tiny" and res.exit_code == 0
    assert json.loads((tmp_path / "out" / "c1" / "done.json").read_text())["case"]["preset"] == "tiny"


def test_worker_load_without_a_preset(tiny_default):
    from medvolcore.serve import Worker

    w = Worker(transport="stdio", device="cpu")
    got = []
    try:
        w.handle_line(json.dumps({"id": 1, "op": "load"}), reply=got.append)
        w.drain()
        assert w.join(120)
    finally:
        w.close(5)
    replies = [r for r in got if "event" not in r]
    assert replies and replies[-1]["ok"] is True and replies[-1]["result"]["preset"] == "tiny"


def test_training_settings_without_a_preset(tiny_default):
    pytest.importorskip("medvoltrain")
    from medvoltrain.config import GRPOSettings, SFTSettings, load_settings

    assert load_settings().preset == "tiny"
    assert load_settings(cls=GRPOSettings).preset == "tiny"
    assert load_settings(preset="qwen3-vl-2b").preset == "qwen3-vl-2b"
    assert SFTSettings().preset_name() == "tiny"
