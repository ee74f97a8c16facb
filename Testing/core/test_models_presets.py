"""Model presets (medvolcore.models.presets): the shipped table and overrides, resolving a preset's
weights, adapters checked against their base, medvol-r1 and qwen3-vl-4b, and `medvol models`.
Downloading and importing weights are test_models_fetch.py's.

Nothing here touches the network: MEDVOL_HOME is a temporary folder (``core.model_folders.home``).
"""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest

from medvolcore import RESEARCH_USE_NOTICE, models
from medvolcore.errors import AdapterRequiredError, InputError, ModelError, ModelNotFoundError

from core.model_folders import (SAM_BYTES, SAM_SHA, FakeHub, home, make_adapter, make_grounder,  # noqa: F401
                                make_import_folder, one_error_line, override_table, pinned_preset, qwen_files,
                                run_cli)  # home: autouse


# ---- import cost -------------------------------------------------------------------------

def test_importing_models_loads_nothing_heavy():
    code = ("import sys, medvolcore.models, medvolcore.cli.models; "
            "heavy = [m for m in ('torch', 'transformers', 'huggingface_hub', 'peft') if m in sys.modules]; "
            "print(heavy); sys.exit(1 if heavy else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


# ---- presets -----------------------------------------------------------------------------

def test_shipped_presets():
    presets = {p.name: p for p in models.list_presets()}
    assert list(presets) == ["qwen3-vl-4b", "qwen3-vl-2b", "medvol-r1", "tiny"]
    assert models.default_preset() == "qwen3-vl-4b"
    q4, q2, r1, tiny = presets["qwen3-vl-4b"], presets["qwen3-vl-2b"], presets["medvol-r1"], presets["tiny"]
    assert q4.grounder["repo_id"] == "Qwen/Qwen3-VL-4B-Instruct" and q4.adapter is None
    assert q2.grounder["repo_id"] == "Qwen/Qwen3-VL-2B-Instruct"
    # medvol-r1: qwen3-vl-4b's weights and folder (one download), plus an adapter it cannot run without
    assert r1.requires_adapter and r1.same_weights_as == "qwen3-vl-4b" and r1.adapter is None
    assert (r1.grounder, r1.medsam2, r1.settings) == (q4.grounder, q4.medsam2, q4.settings)
    assert r1.weights_folder_name == q4.weights_folder_name == "qwen3-vl-4b"
    assert q4.weights_also_in == ("medvol-r1",) and not (q4.requires_adapter or q2.requires_adapter)
    for p in (q4, q2, r1):
        assert (p.medsam2["repo_id"], p.medsam2["filename"]) == ("wanglab/MedSAM2", "MedSAM2_latest.pt")
        assert p.grounder_kind == "hub" and p.medsam2_kind == "hub" and p.needs_download and not p.smoke
        assert p.settings == {"think_budget": "real"}
    assert tiny.smoke and tiny.grounder_kind == "builder" and tiny.medsam2_kind == "random"
    assert (tiny.medsam2["random_seed"], tiny.medsam2["image_size"]) == (0, 64) and not tiny.needs_download
    assert tiny.settings == {"think_budget": "tiny"}
    assert all(p.gpu_memory_note == "estimated" and p.gpu_memory_gb > 0 for p in presets.values())
    assert q2.gpu_memory_gb < q4.gpu_memory_gb


def test_unknown_preset_lists_known_ones():
    with pytest.raises(InputError) as e:
        models.get_preset("medvol-r2")
    assert "medvol-r1" in str(e.value) and "qwen3-vl-2b" in str(e.value) and "tiny" in str(e.value)


def test_bad_override_table_is_a_clear_error(tmp_path, monkeypatch):
    override_table(tmp_path, monkeypatch, {"x": pinned_preset("abc")})
    with pytest.raises(ModelError, match="sha256 must be 64 hex digits"):
        models.list_presets()


def test_medvol_home(monkeypatch, home):
    assert models.medvol_home() == home
    monkeypatch.delenv("MEDVOL_HOME")
    assert models.medvol_home() == Path.home() / ".medvol"


# ---- resolve -----------------------------------------------------------------------------

def test_resolve_missing_names_download_and_import(home):
    with pytest.raises(ModelNotFoundError) as e:
        models.resolve("qwen3-vl-4b")
    msg = str(e.value)
    assert "medvol models download qwen3-vl-4b" in msg and "medvol models import qwen3-vl-4b FOLDER" in msg
    assert "\n" not in msg
    assert models.preset_status("qwen3-vl-4b") == {"present": False, "available": False, "status": "missing",
                                                   "needs_adapter": False}


def test_tiny_is_built_on_first_use(monkeypatch, home):
    calls = []

    def ensure_tiny_model(root):
        calls.append(Path(root))
        return make_grounder(Path(root))

    monkeypatch.setitem(sys.modules, "medvolcore.models.tiny", types.SimpleNamespace(ensure_tiny_model=ensure_tiny_model))
    assert models.preset_status("tiny")["available"] and not models.preset_status("tiny")["present"]
    r = models.resolve("tiny")
    assert calls == [home / "models" / "tiny" / "grounder"]
    assert r.grounder_dir == home / "models" / "tiny" / "grounder"
    assert r.sam_checkpoint is None and r.sam_random == (0, 64) and r.smoke and r.adapter_dir is None
    assert r.settings == {"think_budget": "tiny"}
    assert models.preset_status("tiny")["present"]
    assert models.download("tiny")["grounder"] == str(r.grounder_dir)  # download tiny = build it
    assert len(calls) == 2


def test_table_revisions_are_checked(tmp_path, monkeypatch):
    entry = pinned_preset(None)
    entry["grounder"]["revision"] = "1234abc"
    override_table(tmp_path, monkeypatch, {"mine": entry})
    with pytest.raises(ModelError, match="preset 'mine': grounder.revision '1234abc' looks like a commit id"):
        models.list_presets()


# ---- adapters ----------------------------------------------------------------------------

def test_adapter_checks(tmp_path, home):
    models.import_weights("qwen3-vl-4b", make_import_folder(tmp_path / "src"), progress=False)
    with pytest.raises(ModelError, match="does not exist"):
        models.resolve("medvol-r1", adapter=tmp_path / "no_such_adapter")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError, match="adapter_config.json"):
        models.resolve("medvol-r1", adapter=tmp_path / "empty")
    wrong = make_adapter(tmp_path / "a2b", base="Qwen/Qwen3-VL-2B-Instruct")
    with pytest.raises(ModelError, match="Qwen3-VL-2B-Instruct"):
        models.resolve("medvol-r1", adapter=wrong)
    good = make_adapter(tmp_path / "a4b")
    assert models.resolve("medvol-r1", adapter=good).adapter_dir == good


def adapter_with_record(folder: Path, base: dict, stage="sft") -> Path:
    """An adapter folder with the medvol_adapter.json medvol-train writes (schema medvol.adapter/1)."""
    make_adapter(folder, base=base.get("repo_id") or base.get("path") or "")
    (folder / "medvol_adapter.json").write_text(json.dumps({"schema": "medvol.adapter/1", "stage": stage,
                                                            "base_model": base}))
    return folder


def test_an_adapter_is_checked_against_the_base_model_it_records(tmp_path, capsys, home):
    from medvolcore.errors import AdapterMismatchError

    models.import_weights("qwen3-vl-4b", make_import_folder(tmp_path / "src"), progress=False)
    pin = models.get_preset("qwen3-vl-4b").grounder["revision"]
    a4b = adapter_with_record(tmp_path / "a4b", {"repo_id": "Qwen/Qwen3-VL-4B-Instruct", "revision": pin})
    a2b = adapter_with_record(tmp_path / "a2b", {"repo_id": "Qwen/Qwen3-VL-2B-Instruct", "revision": None})
    atiny = adapter_with_record(tmp_path / "atiny", {"builder": "tiny", "path": "/somewhere/tiny/grounder"})
    # medvol-r1 takes an adapter recorded as trained on the 4B base: a MedVol-R1 adapter
    r = models.resolve("medvol-r1", adapter=a4b)
    assert r.adapter_dir == a4b and models.identity(r)["trained_for_task"]
    with pytest.raises(AdapterMismatchError) as e:
        models.resolve("medvol-r1", adapter=a2b)
    msg = str(e.value)
    assert "Qwen/Qwen3-VL-2B-Instruct" in msg and "uses Qwen/Qwen3-VL-4B-Instruct" in msg
    assert "use preset 'qwen3-vl-2b'" in msg and "\n" not in msg
    with pytest.raises(AdapterMismatchError, match="trained on the tiny smoke model .* but preset 'qwen3-vl-4b' uses"
                                                   " Qwen/Qwen3-VL-4B-Instruct: use preset 'tiny'"):
        models.resolve("qwen3-vl-4b", adapter=atiny)
    with pytest.raises(AdapterMismatchError, match="Qwen/Qwen3-VL-4B-Instruct@.*but preset 'tiny' uses the tiny"):
        models.check_adapter_dir(a4b, models.get_preset("tiny"))
    # an adapter made elsewhere (no medvol_adapter.json) is not refused: nothing to check it against
    foreign = make_adapter(tmp_path / "foreign")
    assert models.resolve("medvol-r1", adapter=foreign).adapter_dir == foreign
    # the CLI and the worker's code: one line, exit 2, before the CT is read
    code, out, err = run_cli(capsys, "segment", "--volume", tmp_path / "no_such_ct.nii.gz", "--query", "the liver",
                             "--out", tmp_path / "m.nii.gz", "--preset", "medvol-r1", "--adapter", a2b,
                             "--device", "cpu", "--no-progress")
    assert code == 2 and "was trained on Qwen/Qwen3-VL-2B-Instruct" in one_error_line(err) and "no_such_ct" not in err
    assert AdapterMismatchError.code == "adapter_mismatch"


# ---- medvol-r1, qwen3-vl-4b and the folder older versions downloaded into ----------------------

def old_medvol_r1_folder(home: Path, repo_id="Qwen/Qwen3-VL-4B-Instruct", adapter=False) -> Path:
    """What `medvol models download medvol-r1` left before the presets were renamed: the 4B weights
    in models/medvol-r1/, registered for preset medvol-r1 (relative paths)."""
    d = home / "models" / "medvol-r1"
    make_grounder(d / "grounder")
    (d / "medsam2").mkdir(parents=True)
    (d / "medsam2" / "MedSAM2_latest.pt").write_bytes(SAM_BYTES)
    reg = {"schema": models.REGISTRATION_SCHEMA, "preset": "medvol-r1", "method": "download",
           "grounder": {"path": "grounder", "repo_id": repo_id, "revision": FakeHub.COMMIT},
           "medsam2": {"path": "medsam2/MedSAM2_latest.pt", "repo_id": "wanglab/MedSAM2", "sha256": SAM_SHA}}
    if adapter:
        make_adapter(d / "adapter")
        reg["adapter"] = {"path": "adapter"}
    (d / "medvol_weights.json").write_text(json.dumps(reg))
    return d


def test_medvol_r1_without_an_adapter_is_one_clear_line(tmp_path, capsys, home):
    """No trained adapter is published: medvol-r1 alone would be the base model under the method's
    name, so it is refused, before any weights or volume are looked at, naming what to do instead."""
    with pytest.raises(AdapterRequiredError) as e:
        models.resolve("medvol-r1")
    msg = str(e.value)
    assert "no trained MedVol-R1 adapter is published" in msg and "--adapter DIR" in msg
    assert "'qwen3-vl-4b'" in msg and "Training/README.md" in msg and "\n" not in msg
    for argv in (["models", "path", "medvol-r1"],
                 ["segment", "--volume", tmp_path / "no_such_ct.nii.gz", "--query", "the liver", "--out",
                  tmp_path / "m.nii.gz", "--preset", "medvol-r1", "--device", "cpu", "--no-progress"]):
        code, out, err = run_cli(capsys, *argv)
        assert code == 2 and out == ""
        line = one_error_line(err)
        assert line.startswith(f"medvol {argv[0]}: error: model preset 'medvol-r1' needs a trained") and \
            "no_such_ct" not in line
    assert models.preset_status("medvol-r1")["needs_adapter"] and not models.preset_status("medvol-r1")["available"]


def test_qwen3_vl_4b_finds_the_weights_an_older_version_put_in_models_medvol_r1(tmp_path, monkeypatch, home):
    old = old_medvol_r1_folder(home, adapter=True)
    r = models.resolve("qwen3-vl-4b")
    assert r.grounder_dir == old / "grounder" and r.sam_checkpoint == old / "medsam2" / "MedSAM2_latest.pt"
    assert r.adapter_dir is None  # the zero-shot preset never borrows medvol-r1's registered adapter
    assert models.preset_status("qwen3-vl-4b")["present"] and models.weights_dir("qwen3-vl-4b") == old
    assert models.resolve("medvol-r1").adapter_dir == old / "adapter"  # the old medvol-r1 keeps its adapter
    assert not (home / "models" / "qwen3-vl-4b").exists()
    # a download completes the old folder in place: no second copy of the weights anywhere else
    FakeHub({"Qwen/Qwen3-VL-4B-Instruct": qwen_files(), "wanglab/MedSAM2": {"MedSAM2_latest.pt": SAM_BYTES}}
            ).install(monkeypatch)
    res = models.download("qwen3-vl-4b", progress=False)
    assert res["registration"] == str(old / "medvol_weights.json")
    assert Path(res["grounder"]).parts[-3:] == ("models--Qwen--Qwen3-VL-4B-Instruct", "snapshots", FakeHub.COMMIT)
    assert not (home / "models" / "qwen3-vl-4b").exists()


def test_an_old_folder_of_other_weights_is_not_taken(home):
    old_medvol_r1_folder(home, repo_id="Qwen/Qwen3-VL-2B-Instruct")  # an old override's medvol-r1, say
    with pytest.raises(ModelNotFoundError, match="qwen3-vl-4b"):
        models.resolve("qwen3-vl-4b")
    assert models.weights_dir("qwen3-vl-4b") == home / "models" / "qwen3-vl-4b"


@pytest.mark.parametrize("entry, needle", [
    ({"same_weights_as": "nope"}, "must name another preset"),
    ({"same_weights_as": "qwen3-vl-4b", "medsam2": {"random_seed": 1, "image_size": 64}}, "no medsam2"),
    ({"same_weights_as": "qwen3-vl-4b", "grounder": {"repo_id": "x/y"}}, "may give grounder.adapter"),
    ({"same_weights_as": "medvol-r1"}, "weights of its own"),
])
def test_same_weights_as_is_checked(tmp_path, monkeypatch, entry, needle):
    override_table(tmp_path, monkeypatch, {"mine": dict({"description": "x"}, **entry)})
    with pytest.raises(ModelError, match=needle):
        models.list_presets()


def test_medvol_r1_follows_a_replaced_qwen3_vl_4b_and_takes_an_adapter_from_the_table(tmp_path, monkeypatch):
    adapter = make_adapter(tmp_path / "runs" / "grpo" / "adapter")
    override_table(tmp_path, monkeypatch, {
        "qwen3-vl-4b": dict(pinned_preset(SAM_SHA), weights_also_in=["medvol-r1"]),
        "medvol-r1": {"same_weights_as": "qwen3-vl-4b", "requires_adapter": True, "description": "mine",
                      "grounder": {"adapter": str(adapter)}}})
    r1 = models.get_preset("medvol-r1")
    assert r1.medsam2["sha256"] == SAM_SHA and r1.adapter == {"path": str(adapter)}
    assert not models.preset_status("medvol-r1")["needs_adapter"]
    models.check_adapter_given("medvol-r1")  # its own adapter: nothing to give


# ---- CLI ---------------------------------------------------------------------------------

def test_cli_list_text_and_json(capsys, tmp_path, home):
    code, out, err = run_cli(capsys, "models", "list")
    assert code == 0, err
    lines = out.splitlines()
    names = {"qwen3-vl-4b", "qwen3-vl-2b", "medvol-r1", "tiny"}
    rows = {l.split()[0]: (l, lines[i + 1], lines[i + 2]) for i, l in enumerate(lines[1:], 1)
            if l.split() and l.split()[0] in names}
    assert set(rows) == {"qwen3-vl-4b", "qwen3-vl-2b", "medvol-r1", "tiny"}
    assert rows["qwen3-vl-4b"][0].startswith("qwen3-vl-4b *")  # the default
    assert "missing" in rows["qwen3-vl-4b"][0] and "est." in rows["qwen3-vl-4b"][0]
    assert "built on first use" in rows["tiny"][0] and "needs --adapter" in rows["medvol-r1"][0]
    # what each preset runs as, on the line below it
    assert rows["qwen3-vl-4b"][1].strip() == "runs as: Qwen3-VL-4B-Instruct, zero-shot, not trained for this task"
    assert "cannot run" in rows["medvol-r1"][1] and "meaningless" in rows["tiny"][1]
    assert "No trained MedVol-R1 adapter is published" in out and RESEARCH_USE_NOTICE in out
    # the revision in use: the table's pins until something is downloaded
    pin = models.get_preset("qwen3-vl-4b").grounder["revision"]
    assert rows["qwen3-vl-4b"][2].strip().startswith(f"revision: Qwen/Qwen3-VL-4B-Instruct@{pin[:12]} (pinned, not "
                                                     "downloaded); wanglab/MedSAM2@")
    models.import_weights("qwen3-vl-2b", make_import_folder(tmp_path / "src"), progress=False)
    code, out, err = run_cli(capsys, "models", "list", "--json")
    assert code == 0, err
    d = {r["name"]: r for r in json.loads(out)["presets"]}
    assert (d["qwen3-vl-4b"]["present"], d["qwen3-vl-2b"]["present"]) == (False, True)
    assert d["tiny"]["smoke"] and d["tiny"]["available"] and d["qwen3-vl-4b"]["default"]
    assert d["qwen3-vl-2b"]["identity"]["zero_shot"] and d["medvol-r1"]["identity"]["needs_adapter"]
    assert d["qwen3-vl-2b"]["gpu_memory_note"] == "estimated"
    # weights imported by hand: their commit is not known, and list says so rather than show the pin
    assert d["qwen3-vl-2b"]["revisions"]["grounder"] == {
        "repo_id": "Qwen/Qwen3-VL-2B-Instruct", "revision": None, "state": "unknown",
        "pinned": models.get_preset("qwen3-vl-2b").grounder["revision"]}
    assert d["qwen3-vl-4b"]["revisions"]["grounder"]["state"] == "pinned" and d["tiny"]["revisions"] == {}
    code, out2, _ = run_cli(capsys, "models", "--json", "list")  # --json before the action works too
    assert code == 0 and json.loads(out2)["presets"]


def test_cli_import_then_path(capsys, tmp_path, home):
    src = make_import_folder(tmp_path / "src")
    code, out, err = run_cli(capsys, "models", "import", "qwen3-vl-4b", src, "--no-progress", "--json")
    assert code == 0, err
    assert json.loads(out)["medsam2"] == str(home / "models" / "qwen3-vl-4b" / "medsam2" / "MedSAM2_latest.pt")
    code, out, err = run_cli(capsys, "models", "path", "qwen3-vl-4b", "--json")
    assert code == 0, err
    d = json.loads(out)
    assert d["grounder"] == str(home / "models" / "qwen3-vl-4b" / "grounder") and d["preset"] == "qwen3-vl-4b"
    assert d["registration"] == str(home / "models" / "qwen3-vl-4b" / "medvol_weights.json")
    assert d["identity"]["label"] == "Qwen3-VL-4B-Instruct, zero-shot, not trained for this task"


def test_cli_errors_are_one_line(capsys, tmp_path, home):
    code, _, err = run_cli(capsys, "models", "path", "qwen3-vl-2b")
    line = one_error_line(err)
    assert code == 2 and "medvol models download qwen3-vl-2b" in line and "medvol models import qwen3-vl-2b" in line
    code, _, err = run_cli(capsys, "models", "import", "qwen3-vl-4b", make_import_folder(tmp_path / "x", "qwen2_vl"))
    assert code == 2 and "qwen2_vl" in one_error_line(err)
    code, _, err = run_cli(capsys, "models", "path", "nope")
    assert code == 2 and "known presets" in one_error_line(err)
    code, _, err = run_cli(capsys, "models")
    assert code == 2 and "give an action" in one_error_line(err)


def test_tiny_with_the_real_builder(home):
    """resolve('tiny') builds the real tiny Qwen3-VL (no network) where the preset layout says."""
    r = models.resolve("tiny")
    assert r.grounder_dir == home / "models" / "tiny" / "grounder"
    models.check_grounder_dir(r.grounder_dir, "qwen3_vl")  # what import would accept
    assert models.preset_status("tiny")["present"] and r.smoke and r.sam_random == (0, 64)
