"""Model folders for the tests of ``medvolcore.models`` (test_models_presets.py, test_models_fetch.py):
grounder, MedSAM2 and adapter files with known bytes, preset tables, and a stand-in for the Hugging
Face hub with its cache layout built in a temporary folder. Nothing here touches the network.

``home`` is an autouse fixture: a test module that imports it gets a MEDVOL_HOME of its own per test.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from medvolcore.cli import main

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
