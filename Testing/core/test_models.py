"""Model presets and weights: listing, resolving, offline download, import (copy and link), sha256.

Nothing here touches the network: MEDVOL_HOME is a temporary folder, downloads run with
HF_HUB_OFFLINE=1 or against stand-ins for huggingface_hub's public download functions.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from medvolcore import RESEARCH_USE_NOTICE, models
from medvolcore.models import fetch
from medvolcore.cli import main
from medvolcore.errors import AdapterRequiredError, InputError, ModelError, ModelNotFoundError

SAM_BYTES = b"not really a MedSAM2 checkpoint, but bytes with a known sha256"
SAM_SHA = hashlib.sha256(SAM_BYTES).hexdigest()
WEIGHT_BYTES = b"\x08\x00\x00\x00\x00\x00\x00\x00{}      "  # an empty safetensors file


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    h = tmp_path / "medvol_home"
    monkeypatch.setenv("MEDVOL_HOME", str(h))
    monkeypatch.delenv("MEDVOL_MODELS_JSON", raising=False)
    return h


def make_grounder(folder: Path, model_type="qwen3_vl") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": model_type}))
    (folder / "model.safetensors").write_bytes(WEIGHT_BYTES)
    (folder / "tokenizer.json").write_text("{}")
    (folder / "tokenizer_config.json").write_text("{}")
    (folder / "preprocessor_config.json").write_text("{}")
    return folder


def make_import_folder(root: Path, model_type="qwen3_vl", sam=SAM_BYTES) -> Path:
    make_grounder(root / "grounder", model_type)
    (root / "MedSAM2_latest.pt").write_bytes(sam)
    return root


def make_adapter(folder: Path, base="Qwen/Qwen3-VL-4B-Instruct") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "base_model_name_or_path": base}))
    (folder / "adapter_model.safetensors").write_bytes(WEIGHT_BYTES)
    return folder


def override_table(tmp_path, monkeypatch, presets: dict) -> Path:
    f = tmp_path / "my_models.json"
    f.write_text(json.dumps({"presets": presets}))
    monkeypatch.setenv("MEDVOL_MODELS_JSON", str(f))
    return f


def pinned_preset(sha):
    return {"description": "pinned MedSAM2", "smoke": False, "gpu_memory_gb": 12, "settings": {"think_budget": "real"},
            "grounder": {"repo_id": "Qwen/Qwen3-VL-4B-Instruct", "revision": None, "allow_patterns": ["*.json"]},
            "medsam2": {"repo_id": "wanglab/MedSAM2", "revision": None, "filename": "MedSAM2_latest.pt", "sha256": sha}}


def run_cli(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def one_error_line(err):
    lines = [l for l in err.splitlines() if "error" in l]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


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


def cache_snapshot(cache: Path, repo_id: str, commit: str, files: dict, ref: str = None) -> Path:
    """Lay ``files`` out as huggingface_hub's cache does: ``models--ORG--NAME/blobs/<id>`` (an LFS
    file's blob id is its sha256, another file's a 40-hex git id), ``snapshots/<commit>/<name>``
    linking to the blob, and ``refs/<ref>`` holding the commit."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / commit
    for fn, data in files.items():
        lfs = fn.endswith((".pt", ".safetensors"))
        blob_id = hashlib.sha256(data).hexdigest() if lfs else hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        blob = repo / "blobs" / blob_id
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        (snap / fn).parent.mkdir(parents=True, exist_ok=True)
        if (snap / fn).is_symlink():
            (snap / fn).unlink()
        os.symlink(os.path.relpath(blob, (snap / fn).parent), snap / fn)
    if ref:
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snap


class FakeHub:
    """Stand-ins for huggingface_hub's public HfApi.model_info / snapshot_download / hf_hub_download.

    They serve files from memory into a Hugging Face cache layout (:func:`cache_snapshot`) and
    record the revisions asked for; the sha256 reported for LFS files is what the real API puts in
    ``RepoSibling.lfs`` (``BlobLfsInfo.sha256``).
    """

    COMMIT = "0123456789abcdef0123456789abcdef01234567"

    def __init__(self, files_by_repo, reported_sha=None, cache=None):
        self.files = files_by_repo
        self.reported_sha = reported_sha or {}
        self.calls = []
        self.cache = cache

    def install(self, monkeypatch, cache: Path = None):
        import huggingface_hub
        from huggingface_hub.hf_api import ModelInfo

        hub = self
        hub.cache = cache or hub.cache or Path(os.environ["MEDVOL_HOME"]).parent / "hf_cache"

        class Api:
            def model_info(self, repo_id, revision=None, files_metadata=False, **kw):
                hub.calls.append(("model_info", repo_id, revision))
                siblings = []
                for fn, data in hub.files[repo_id].items():
                    s = {"rfilename": fn, "size": len(data), "blobId": "0" * 40}
                    if fn.endswith((".pt", ".safetensors")):
                        sha = hub.reported_sha.get(fn, hashlib.sha256(data).hexdigest())
                        s["lfs"] = {"size": len(data), "sha256": sha, "pointerSize": 134}
                    siblings.append(s)
                return ModelInfo(id=repo_id, sha=hub.COMMIT, siblings=siblings)

        def snapshot_download(repo_id, revision=None, allow_patterns=None, local_dir=None, **kw):
            assert local_dir is None  # downloads go to the Hugging Face cache
            hub.calls.append(("snapshot_download", repo_id, revision))
            return str(cache_snapshot(hub.cache, repo_id, revision, hub.files[repo_id]))

        def hf_hub_download(repo_id, filename, revision=None, local_dir=None, **kw):
            assert local_dir is None
            hub.calls.append(("hf_hub_download", repo_id, revision))
            snap = cache_snapshot(hub.cache, repo_id, revision, {filename: hub.files[repo_id][filename]})
            return str(snap / filename)

        monkeypatch.setattr(huggingface_hub, "HfApi", Api)
        monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
        monkeypatch.setattr(huggingface_hub, "hf_hub_download", hf_hub_download)
        return self


def qwen_files():
    return {"config.json": json.dumps({"model_type": "qwen3_vl"}).encode(), "model.safetensors": WEIGHT_BYTES,
            "tokenizer.json": b"{}", "tokenizer_config.json": b"{}", "preprocessor_config.json": b"{}"}


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


def test_table_revisions_are_checked(tmp_path, monkeypatch):
    entry = pinned_preset(None)
    entry["grounder"]["revision"] = "1234abc"
    override_table(tmp_path, monkeypatch, {"mine": entry})
    with pytest.raises(ModelError, match="preset 'mine': grounder.revision '1234abc' looks like a commit id"):
        models.list_presets()


def test_hub_metadata_parsing_gives_lfs_sha256():
    """What model_info(files_metadata=True) returns: RepoSibling.lfs.sha256 (not blob_id, a git sha1)."""
    from huggingface_hub.hf_api import ModelInfo

    info = ModelInfo(id="wanglab/MedSAM2", sha=FakeHub.COMMIT, siblings=[
        {"rfilename": "MedSAM2_latest.pt", "size": 3, "blobId": "a" * 40,
         "lfs": {"size": 3, "sha256": SAM_SHA, "pointerSize": 134}},
        {"rfilename": "README.md", "size": 2, "blobId": "b" * 40}])
    assert fetch._lfs_sha256(info.siblings[0]) == SAM_SHA
    assert fetch._lfs_sha256(info.siblings[1]) is None


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
