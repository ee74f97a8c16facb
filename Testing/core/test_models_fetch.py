"""Downloading and importing weights (medvolcore.models.fetch): offline downloads, the Hugging Face
cache, sha256 checks against the hub's and the table's, import by copy and by link.

Nothing here touches the network: MEDVOL_HOME is a temporary folder (``core.model_folders.home``),
downloads run with HF_HUB_OFFLINE=1 or against a stand-in for huggingface_hub's public functions.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from medvolcore import models
from medvolcore.errors import InputError, ModelError, ModelNotFoundError
from medvolcore.models import fetch

from core.model_folders import (SAM_BYTES, SAM_SHA, WEIGHT_BYTES, FakeHub, cache_snapshot, home,  # noqa: F401
                                make_adapter, make_grounder, make_import_folder, one_error_line, override_table,
                                pinned_preset, qwen_files, run_cli)  # home: autouse


# ---- download (no network) ---------------------------------------------------------------

def test_download_offline_names_import(monkeypatch, home):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants

    # huggingface_hub reads HF_HUB_OFFLINE once, at import: keep this test independent of import order.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelNotFoundError) as e:
        models.download("qwen3-vl-2b", progress=False)
    msg = str(e.value)
    assert "medvol models import qwen3-vl-2b FOLDER" in msg and "\n" not in msg
    assert not models.registration_path("qwen3-vl-2b").exists()


def test_download_offline_keeps_an_earlier_import(tmp_path, monkeypatch, home):
    models.import_weights("qwen3-vl-4b", make_import_folder(tmp_path / "src"), progress=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelNotFoundError):
        models.download("qwen3-vl-4b", progress=False)
    assert models.resolve("qwen3-vl-4b").sam_checkpoint.read_bytes() == SAM_BYTES


def test_download_offline_cli_subprocess(tmp_path, home):
    env = {**os.environ, "MEDVOL_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-m", "medvolcore.cli", "models", "download", "medvol-r1", "--no-progress"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2
    line = one_error_line(r.stderr)
    assert line.startswith("medvol models: error:") and "medvol models import medvol-r1 FOLDER" in line


def test_download_checks_hub_sha256_and_registers(monkeypatch, home):
    hub = FakeHub({"Qwen/Qwen3-VL-2B-Instruct": qwen_files(),
                   "wanglab/MedSAM2": {"MedSAM2_latest.pt": SAM_BYTES, "README.md": b"hi"}}).install(monkeypatch)
    res = models.download("qwen3-vl-2b", progress=False)
    # one commit per repo (the pinned one asked for): every transfer asks for the commit model_info reported
    assert [c[2] for c in hub.calls if c[0] == "model_info"] == [
        models.get_preset("qwen3-vl-2b").grounder["revision"], models.get_preset("qwen3-vl-2b").medsam2["revision"]]
    assert {c[2] for c in hub.calls if c[0] != "model_info"} == {FakeHub.COMMIT}
    d = home / "models" / "qwen3-vl-2b"
    # the files are in the Hugging Face cache, registered where they are (no copy under MEDVOL_HOME)
    snaps = hub.cache / "models--Qwen--Qwen3-VL-2B-Instruct" / "snapshots" / FakeHub.COMMIT
    assert res["grounder"] == str(snaps)
    sam_snap = hub.cache / "models--wanglab--MedSAM2" / "snapshots" / FakeHub.COMMIT
    assert res["medsam2"] == str(sam_snap / "MedSAM2_latest.pt")
    assert not (d / "grounder").exists()
    reg = json.loads((d / "medvol_weights.json").read_text())
    assert reg["grounder"]["revision"] == FakeHub.COMMIT and reg["grounder"]["cache"] == "huggingface"
    from medvolcore.cli.models import _revision_text
    pin = models.get_preset("qwen3-vl-2b").grounder["revision"]
    assert _revision_text(models.revisions("qwen3-vl-2b")["grounder"]) == \
        f"Qwen/Qwen3-VL-2B-Instruct@{FakeHub.COMMIT[:12]} (downloaded; the table pins {pin[:12]})"
    assert reg["method"] == "download" and reg["medsam2"]["sha256"] == SAM_SHA
    assert reg["medsam2"]["sha256_checked_against"] == "hub" and reg["medsam2"]["revision"] == FakeHub.COMMIT
    assert reg["grounder"]["sha256_checked_files"] == 1
    assert models.resolve("qwen3-vl-2b").sam_checkpoint.read_bytes() == SAM_BYTES


def test_download_sha256_mismatch_removes_file(monkeypatch, home):
    hub = FakeHub({"Qwen/Qwen3-VL-2B-Instruct": qwen_files(), "wanglab/MedSAM2": {"MedSAM2_latest.pt": SAM_BYTES}},
                  reported_sha={"MedSAM2_latest.pt": "f" * 64}).install(monkeypatch)
    with pytest.raises(ModelError, match="sha256"):
        models.download("qwen3-vl-2b", progress=False)
    repo = hub.cache / "models--wanglab--MedSAM2"
    # the file and its cache blob are gone (else huggingface_hub would link the bad blob in again)
    assert not (repo / "snapshots" / FakeHub.COMMIT / "MedSAM2_latest.pt").exists()
    assert not (repo / "blobs" / SAM_SHA).exists()
    assert not models.registration_path("qwen3-vl-2b").exists()
    with pytest.raises(ModelNotFoundError):
        models.resolve("qwen3-vl-2b")


def test_download_reuses_the_hugging_face_cache_offline(tmp_path, home):
    """An existing Hugging Face cache copy at the pinned commits is found by the real
    huggingface_hub (HF_HUB_OFFLINE=1, nothing mocked) and registered where it is; each LFS file is
    checked against its blob name (its sha256). A revision the cache lacks: one line, nothing changed."""
    cache = tmp_path / "hf" / "hub"
    p = models.get_preset("qwen3-vl-2b")
    qwen_rev, sam_rev = p.grounder["revision"], p.medsam2["revision"]
    snap = cache_snapshot(cache, "Qwen/Qwen3-VL-2B-Instruct", qwen_rev, qwen_files())
    cache_snapshot(cache, "wanglab/MedSAM2", sam_rev, {"MedSAM2_latest.pt": SAM_BYTES})
    env = {**os.environ, "MEDVOL_HOME": str(home), "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache),
           "PYTHONPATH": os.pathsep.join(sys.path)}

    def cli(*argv):
        return subprocess.run([sys.executable, "-m", "medvolcore.cli", "models", *argv], capture_output=True,
                              text=True, env=env, timeout=120)

    r = cli("download", "qwen3-vl-2b", "--no-progress", "--json")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["grounder"] == str(snap.resolve()) and Path(res["medsam2"]).read_bytes() == SAM_BYTES
    assert not (home / "models" / "qwen3-vl-2b" / "grounder").exists()  # no second copy
    reg = json.loads((home / "models" / "qwen3-vl-2b" / "medvol_weights.json").read_text())
    assert (reg["grounder"]["revision"], reg["medsam2"]["revision"]) == (qwen_rev, sam_rev)
    assert reg["grounder"]["sha256_checked_files"] == 1 and reg["medsam2"]["sha256"] == SAM_SHA
    assert res["revisions"]["grounder"]["state"] == "registered"

    other = "f" * 40  # a commit the cache does not hold: refused in one line, the registration stays
    r = cli("download", "qwen3-vl-2b", "--revision", other, "--no-progress")
    assert r.returncode == 2 and "holds no complete copy" in one_error_line(r.stderr) and str(cache) in r.stderr
    assert json.loads((home / "models" / "qwen3-vl-2b" / "medvol_weights.json").read_text()) == reg


def test_a_corrupt_cached_file_is_caught_offline(tmp_path, monkeypatch, home):
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    p = models.get_preset("qwen3-vl-2b")
    snap = cache_snapshot(cache, "Qwen/Qwen3-VL-2B-Instruct", p.grounder["revision"], qwen_files())
    cache_snapshot(cache, "wanglab/MedSAM2", p.medsam2["revision"], {"MedSAM2_latest.pt": SAM_BYTES})
    (snap / "model.safetensors").resolve().write_bytes(WEIGHT_BYTES + b" ")  # not what its blob name says
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelError, match="Hugging Face cache's blob name"):
        models.download("qwen3-vl-2b", progress=False)
    assert not (snap / "model.safetensors").exists() and not models.registration_path("qwen3-vl-2b").exists()


@pytest.mark.parametrize("rev, needle", [("ebb281e", "not 40 lower-case hex digits"), ("a b", "neither"),
                                         ("../main", "neither")])
def test_revision_is_checked_in_one_line(capsys, rev, needle):
    code, out, err = run_cli(capsys, "models", "download", "qwen3-vl-2b", "--revision", rev)
    assert code == 2 and needle in one_error_line(err)
    code, out, err = run_cli(capsys, "models", "download", "tiny", "--revision", "main")
    assert code == 2 and "--revision has no effect" in one_error_line(err)


def test_hub_metadata_parsing_gives_lfs_sha256():
    """What model_info(files_metadata=True) returns: RepoSibling.lfs.sha256 (not blob_id, a git sha1)."""
    from huggingface_hub.hf_api import ModelInfo

    info = ModelInfo(id="wanglab/MedSAM2", sha=FakeHub.COMMIT, siblings=[
        {"rfilename": "MedSAM2_latest.pt", "size": 3, "blobId": "a" * 40,
         "lfs": {"size": 3, "sha256": SAM_SHA, "pointerSize": 134}},
        {"rfilename": "README.md", "size": 2, "blobId": "b" * 40}])
    assert fetch._lfs_sha256(info.siblings[0]) == SAM_SHA
    assert fetch._lfs_sha256(info.siblings[1]) is None


def test_download_medvol_r1_fetches_what_qwen3_vl_4b_needs(monkeypatch, capsys, tmp_path, home):
    FakeHub({"Qwen/Qwen3-VL-4B-Instruct": qwen_files(), "wanglab/MedSAM2": {"MedSAM2_latest.pt": SAM_BYTES}}
            ).install(monkeypatch)
    code, out, err = run_cli(capsys, "models", "download", "medvol-r1", "--no-progress")
    assert code == 0, err
    title = out.splitlines()[0]
    assert title.startswith("downloaded what qwen3-vl-4b needs (sha256 checked): medvol-r1 uses the same weights")
    assert "--adapter DIR (none is published" in title
    d = home / "models" / "qwen3-vl-4b"
    assert models.registration_path("qwen3-vl-4b") == d / "medvol_weights.json"
    snap = models.resolve("qwen3-vl-4b").grounder_dir
    assert snap.parts[-3:] == ("models--Qwen--Qwen3-VL-4B-Instruct", "snapshots", FakeHub.COMMIT)
    adapter = make_adapter(tmp_path / "run" / "adapter")
    assert models.resolve("medvol-r1", adapter=adapter).grounder_dir == snap
    assert not (home / "models" / "medvol-r1").exists()


# ---- import ------------------------------------------------------------------------------

def test_import_copies_and_resolve_returns_the_copies(tmp_path, home):
    src = make_import_folder(tmp_path / "usb")
    res = models.import_weights("qwen3-vl-4b", src, progress=False)
    d = home / "models" / "qwen3-vl-4b"
    r = models.resolve("qwen3-vl-4b")
    assert r.grounder_dir == d / "grounder" and r.sam_checkpoint == d / "medsam2" / "MedSAM2_latest.pt"
    assert r.sam_random is None and not r.smoke and r.adapter_dir is None and r.settings == {"think_budget": "real"}
    assert (r.grounder_dir / "model.safetensors").read_bytes() == WEIGHT_BYTES
    assert r.sam_checkpoint.read_bytes() == SAM_BYTES and res["medsam2"] == str(r.sam_checkpoint)
    reg = models.read_registration("qwen3-vl-4b")
    assert reg["method"] == "import (copied)" and reg["medsam2"]["sha256"] == SAM_SHA
    assert reg["medsam2"]["sha256_checked_against"] is None  # the shipped preset pins no sha256
    assert reg["grounder"]["source"] == str(src / "grounder") and reg["registered"]
    assert models.preset_status("qwen3-vl-4b")["present"]
    assert not models.preset_status("qwen3-vl-2b")["present"]


def test_import_folder_is_the_qwen_folder_itself(tmp_path, home):
    src = make_grounder(tmp_path / "Qwen3-VL-4B-Instruct")
    (src / "MedSAM2_latest.pt").write_bytes(SAM_BYTES)
    models.import_weights("qwen3-vl-4b", src, progress=False)
    r = models.resolve("qwen3-vl-4b")
    assert not (r.grounder_dir / "MedSAM2_latest.pt").exists()  # the checkpoint is not copied twice
    assert r.sam_checkpoint.read_bytes() == SAM_BYTES


def test_import_link_registers_in_place(tmp_path, home):
    src = make_import_folder(tmp_path / "big_disk")
    make_adapter(src / "adapter")
    models.import_weights("medvol-r1", src, link=True, progress=False)
    r = models.resolve("medvol-r1")  # its registered adapter: no --adapter needed
    assert r.grounder_dir == src / "grounder" and r.sam_checkpoint == src / "MedSAM2_latest.pt"
    assert r.adapter_dir == src / "adapter"
    assert not (home / "models" / "qwen3-vl-4b" / "grounder").exists()
    assert models.registration_path("medvol-r1") == home / "models" / "qwen3-vl-4b" / "medvol_weights.json"
    # the same weights serve the zero-shot preset, which never takes medvol-r1's adapter
    zero_shot = models.resolve("qwen3-vl-4b")
    assert zero_shot.grounder_dir == r.grounder_dir and zero_shot.adapter_dir is None
    (src / "MedSAM2_latest.pt").unlink()  # the linked file went away: the preset is missing again
    with pytest.raises(ModelNotFoundError, match="MedSAM2"):
        models.resolve("medvol-r1")


def test_import_pinned_sha256(tmp_path, monkeypatch, home):
    override_table(tmp_path, monkeypatch, {"pinned": pinned_preset(SAM_SHA)})
    models.import_weights("pinned", make_import_folder(tmp_path / "ok"), progress=False)
    assert models.read_registration("pinned")["medsam2"]["sha256_checked_against"] == "preset"
    assert models.resolve("pinned").sam_checkpoint.read_bytes() == SAM_BYTES


def test_import_sha256_mismatch_registers_nothing(tmp_path, monkeypatch, home):
    override_table(tmp_path, monkeypatch, {"pinned": pinned_preset(SAM_SHA)})
    bad = make_import_folder(tmp_path / "bad", sam=SAM_BYTES + b"!")
    with pytest.raises(ModelError) as e:
        models.import_weights("pinned", bad, progress=False)
    assert "sha256" in str(e.value) and SAM_SHA in str(e.value)
    assert not models.registration_path("pinned").exists()
    assert not (home / "models" / "pinned" / "medsam2").exists()
    # a good import survives a later rejected one
    models.import_weights("pinned", make_import_folder(tmp_path / "good"), progress=False)
    with pytest.raises(ModelError):
        models.import_weights("pinned", bad, progress=False)
    assert models.resolve("pinned").sam_checkpoint.read_bytes() == SAM_BYTES


def test_import_wrong_model_type(tmp_path, home):
    with pytest.raises(ModelError) as e:
        models.import_weights("qwen3-vl-4b", make_import_folder(tmp_path / "llama", model_type="llama"), progress=False)
    assert "'llama'" in str(e.value) and "qwen3_vl" in str(e.value)
    assert not models.registration_path("qwen3-vl-4b").exists()


@pytest.mark.parametrize("break_it, needle", [
    (lambda src: (src / "MedSAM2_latest.pt").unlink(), "no MedSAM2 checkpoint MedSAM2_latest.pt"),
    (lambda src: (src / "grounder" / "model.safetensors").unlink(), "no weights"),
    (lambda src: (src / "grounder" / "preprocessor_config.json").unlink(), "preprocessor_config.json"),
    (lambda src: (src / "MedSAM2_latest.pt").write_bytes(b"version https://git-lfs.github.com/spec/v1\noid sha256:"),
     "Git LFS pointer"),
    (lambda src: (src / "grounder" / "config.json").unlink(), "no grounder model"),
])
def test_import_incomplete_folder(tmp_path, home, break_it, needle):
    src = make_import_folder(tmp_path / "src")
    break_it(src)
    with pytest.raises(ModelError, match=needle):
        models.import_weights("qwen3-vl-4b", src, progress=False)
    assert not models.registration_path("qwen3-vl-4b").exists()


def test_import_missing_folder_and_tiny(tmp_path):
    with pytest.raises(InputError, match="is not a folder"):
        models.import_weights("qwen3-vl-4b", tmp_path / "nope")
    with pytest.raises(InputError, match="built locally"):
        models.import_weights("tiny", tmp_path)


# ---- the pieces: hashing, the Hugging Face cache's blob names, the import layout -----------------

def test_sha256_file_reads_every_block(tmp_path):
    f = tmp_path / "weights.bin"
    data = os.urandom(3 << 10) * ((8 << 20) // (3 << 10) + 5)  # a little over one 8 MiB block
    f.write_bytes(data)
    assert len(data) > 8 << 20
    assert fetch.sha256_file(f) == hashlib.sha256(data).hexdigest()
    assert fetch.sha256_file(f, progress=True) == hashlib.sha256(data).hexdigest()


def test_a_cached_lfs_file_must_have_the_sha256_its_blob_is_named_by(tmp_path):
    weights, config = b"weights of the model", b'{"model_type": "qwen3_vl"}'
    snap = cache_snapshot(tmp_path / "hub", "Qwen/Qwen3-VL-2B-Instruct", FakeHub.COMMIT,
                          {"model.safetensors": weights, "config.json": config})
    assert fetch._cache_blob_sha256(snap / "model.safetensors") == hashlib.sha256(weights).hexdigest()
    assert fetch._cache_blob_sha256(snap / "config.json") is None  # a git blob id (40 hex): no sha256 to check
    (tmp_path / "plain.safetensors").write_bytes(weights)
    assert fetch._cache_blob_sha256(tmp_path / "plain.safetensors") is None


def test_allow_patterns_match_files_and_folders():
    assert fetch._matches("anything.bin", None) and fetch._matches("anything.bin", [])
    assert fetch._matches("config.json", ["*.json"]) and not fetch._matches("model.safetensors", "*.json")
    assert fetch._matches("sub/model.bin", ["sub/"]) and not fetch._matches("other/model.bin", ["sub/"])


def test_the_import_layout_is_found_where_the_layout_says_first_match_first(tmp_path):
    preset = models.get_preset("qwen3-vl-4b")
    root = tmp_path / "copied"
    make_grounder(root / "Qwen3-VL-4B-Instruct")
    (root / "checkpoints").mkdir(parents=True)
    (root / "checkpoints" / "MedSAM2_latest.pt").write_bytes(SAM_BYTES)
    layout = fetch.find_import_layout(preset, root)
    assert layout.grounder == root / "Qwen3-VL-4B-Instruct" and layout.adapter is None
    assert layout.medsam2 == root / "checkpoints" / "MedSAM2_latest.pt"
    make_grounder(root / "grounder")  # grounder/ comes before the repository's name
    (root / "MedSAM2_latest.pt").write_bytes(SAM_BYTES)  # the folder itself before checkpoints/
    make_adapter(root / "adapter")
    layout = fetch.find_import_layout(preset, root)
    assert (layout.grounder, layout.medsam2, layout.adapter) == (
        root / "grounder", root / "MedSAM2_latest.pt", root / "adapter")
    (root / "MedSAM2_latest.pt").write_bytes(b"")
    with pytest.raises(ModelError, match="MedSAM2_latest.pt is empty"):
        fetch.find_import_layout(preset, root)
    (root / "MedSAM2_latest.pt").write_bytes(b"version https://git-lfs.github.com/spec/v1\noid sha256:0\n")
    with pytest.raises(ModelError, match="is a Git LFS pointer, not the weights"):
        fetch.find_import_layout(preset, root)
    with pytest.raises(InputError, match="is not a folder; expected FOLDER/grounder/ \\(or FOLDER/Qwen3-VL-4B-Instruct/"):
        fetch.find_import_layout(preset, tmp_path / "absent")
    assert "FOLDER/Qwen3-VL-2B-Instruct/" in fetch.import_layout(models.get_preset("qwen3-vl-2b"))
