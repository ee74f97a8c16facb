"""``medvol-train prepare`` on a manifest built from the shared real CT and label maps, and M3D-Seg."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from medvolcore.stack import AxialStack
from medvolcore.volume import load_label_map, load_volume
from medvoltrain.cli import main
from medvoltrain.errors import DataError
from medvoltrain.prepare import PrepareSettings, load_mask, load_samples, load_slices, prepare

from training_data import write_jsonl

SPLEEN, KIDNEY_RIGHT, KIDNEY_LEFT, LIVER = 1, 2, 3, 5


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, ct_path, seg_path, ct_sm_path, seg_sm_path):
    import nibabel as nib

    root = tmp_path_factory.mktemp("prep")
    shifted = nib.load(str(seg_sm_path))
    aff = shifted.affine.copy()
    aff[0, 3] += 30.0
    nib.save(nib.Nifti1Image(np.asarray(shifted.dataobj), aff), str(root / "seg_shifted.nii.gz"))
    manifest = write_jsonl(root / "cases.jsonl", [
        {"id": "full", "volume": str(ct_path), "labels": str(seg_path), "split": "train",
         "targets": {"liver": LIVER, "kidneys": [KIDNEY_RIGHT, KIDNEY_LEFT], "spleen": SPLEEN, "brain": 90}},
        {"id": "upper", "volume": str(ct_sm_path), "labels": str(seg_sm_path), "split": "test",
         "targets": json.dumps({"liver": LIVER, "urinary_bladder": 21})},
        {"id": "wrong_shape", "volume": str(ct_sm_path), "labels": str(seg_path), "split": "train",
         "targets": {"liver": LIVER}},
        {"id": "wrong_affine", "volume": str(ct_sm_path), "labels": "seg_shifted.nii.gz", "split": "train",
         "targets": {"liver": LIVER}},
        {"id": "no_file", "volume": "missing.nii.gz", "labels": str(seg_path), "split": "train",
         "targets": {"liver": LIVER}},
        {"id": "bad_split", "volume": str(ct_path), "labels": str(seg_path), "split": "validation",
         "targets": {"liver": LIVER}},
    ])
    out = root / "DATA"
    rc = main(["prepare", "--manifest", str(manifest), "--out", str(out), "--seed", "5", "--workers", "2",
               "--negative-fraction", "0.25", "--no-progress"])  # one negative for the three train positives
    assert rc == 0
    return manifest, out


def test_prepare_reports_each_bad_row_and_keeps_the_rest(prepared):
    _, out = prepared
    summary = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    reasons = {(s["case"], s.get("target")): s["reason"] for s in summary["skipped"]}
    assert reasons == {("full", "brain"): "unknown_label", ("upper", "urinary_bladder"): "unknown_label",
                       ("wrong_shape", None): "grid_mismatch", ("wrong_affine", None): "grid_mismatch",
                       ("no_file", None): "missing_file", ("bad_split", None): "bad_row"}
    samples = load_samples(out)
    # full/brain: label 90 is not in the label map, so it is the negative (not present) sample
    assert [s["id"] for s in samples] == ["full/liver", "full/kidneys", "full/spleen", "full/brain", "upper/liver"]
    assert [s["absent"] for s in samples] == [False, False, False, True, False]
    assert summary["samples_by_split"] == {"train": 4, "test": 1}
    assert summary["negatives_by_split"] == {"train": 1, "test": 0}


def test_prepared_sample_holds_what_sft_and_the_rewards_need(prepared, ct_path, seg_path):
    _, out = prepared
    s = next(x for x in load_samples(out) if x["id"] == "full/kidneys")
    stack = AxialStack(load_volume(ct_path))
    truth = np.isin(stack.to_stack(load_label_map(seg_path).array), [KIDNEY_RIGHT, KIDNEY_LEFT])
    assert s["shown"] == stack.sample_indices(64) and s["depth"] == stack.depth == 112
    assert s["stack_shape"] == list(stack.shape) and s["image_size"] == [256, 256] and s["mask_frame"] == "stack"
    images = load_slices(s)
    assert len(images) == 64
    for i in (0, 31, 63):  # exactly the grounder's rendering
        assert np.array_equal(images[i], stack.render_slice(s["shown"][i], 256))
    assert np.array_equal(load_mask(s), truth)
    assert s["slice_areas"] == [int(v) for v in truth.reshape(112, -1).sum(1)]
    z = s["target_info"]["slice"]
    assert z in s["shown"] and len(s["target_info"]["boxes"]) == 2
    assert s["gt_boxes"][str(z)] == s["target_info"]["boxes"]
    assert s["target"].startswith("<think>") and f'"slice": {z}' in s["target"]
    assert s["query_info"]["kind"] == "implicit" and s["query"].startswith(s["query_info"]["description"])
    assert "<slice 0><image>" in s["messages"][1]["content"] and s["query"] in s["messages"][1]["content"]


def test_prepare_resumes_finished_cases_and_is_deterministic(prepared, tmp_path):
    manifest, out = prepared
    before = {p: p.stat().st_mtime_ns for p in (out / "cases").rglob("*.npz")}
    index = (out / "samples.jsonl").read_text(encoding="utf-8")
    summary = prepare(manifest, out, PrepareSettings(seed=5, negative_fraction=0.25), workers=1, progress=False)
    assert summary["cases_resumed"] == 2
    assert {p: p.stat().st_mtime_ns for p in (out / "cases").rglob("*.npz")} == before
    assert (out / "samples.jsonl").read_text(encoding="utf-8") == index
    fresh = prepare(manifest, tmp_path / "again", PrepareSettings(seed=5, negative_fraction=0.25), workers=1,
                    progress=False)
    assert fresh["cases_resumed"] == 0
    assert (tmp_path / "again" / "samples.jsonl").read_text(encoding="utf-8").replace(str(tmp_path / "again"), "") == \
        index.replace(str(out), "")
    assert not [p for p in out.rglob("*") if ".part" in p.name]  # no temporary files left


def test_prompt_is_token_for_token_the_grounders(prepared, ct_path):
    """The SFT collator's prompt equals what QwenVLGrounder builds at inference for the same CT and query."""
    import torch
    from medvolcore import models
    from medvolcore.grounder import QwenVLGrounder
    from medvoltrain.sft import IGNORE_INDEX, GrounderSFTCollator

    _, out = prepared
    s = next(x for x in load_samples(out) if x["id"] == "full/liver")
    g = QwenVLGrounder.from_pretrained(models.resolve("tiny").grounder_dir)
    ref, shown = g.build_inputs(AxialStack(load_volume(ct_path)), s["query"])
    assert shown == s["shown"]
    coll = GrounderSFTCollator(g)
    batch = coll([s, next(x for x in load_samples(out) if x["id"] == "full/kidneys")])
    n = ref["input_ids"].shape[1]
    assert torch.equal(batch["input_ids"][0, :n], ref["input_ids"][0])
    assert torch.equal(batch["mm_token_type_ids"][0, :n], ref["mm_token_type_ids"][0])
    assert torch.equal(batch["pixel_values"][: ref["pixel_values"].shape[0]], ref["pixel_values"])
    assert torch.equal(batch["image_grid_thw"][:64], ref["image_grid_thw"])
    # labels: -100 over the whole prompt, the completion (target + <|im_end|>) after it, -100 on padding
    labels = batch["labels"][0]
    assert (labels[:n] == IGNORE_INDEX).all()
    comp = coll.completion_ids(s["target"])
    assert labels[n:n + len(comp)].tolist() == comp and comp[-1] == g.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert g.tokenizer.decode(comp[:-1]) == s["target"]
    assert (labels[n + len(comp):] == IGNORE_INDEX).all()
    assert (batch["attention_mask"][0, n + len(comp):] == 0).all() and batch["attention_mask"][0, :n + len(comp)].all()
    assert int((batch["labels"] != IGNORE_INDEX).sum()) == len(comp) + len(coll.completion_ids(
        next(x for x in load_samples(out) if x["id"] == "full/kidneys")["target"]))
    # a negative sample goes through the same prompt builder; its completion is the absent answer
    neg = next(x for x in load_samples(out) if x["absent"])
    enc = coll.encode(neg)
    n_neg = enc["input_ids"].shape[0] - len(coll.completion_ids(neg["target"]))
    assert g.tokenizer.decode(enc["labels"][n_neg:-1].tolist()).endswith("</think><answer>[]</answer>")
    assert (enc["labels"][:n_neg] == IGNORE_INDEX).all()


def test_nothing_prepared_is_an_error_with_one_line(tmp_path, ct_path, seg_path):
    manifest = write_jsonl(tmp_path / "bad.jsonl", [
        {"id": "a", "volume": "nope.nii.gz", "labels": str(seg_path), "split": "train", "targets": {"liver": 5}},
        {"id": "b", "volume": str(ct_path), "labels": str(seg_path), "split": "train", "targets": {"x": 200}},
    ])
    env = dict(os.environ)
    r = subprocess.run([sys.executable, "-m", "medvoltrain", "prepare", "--manifest", str(manifest), "--out",
                        str(tmp_path / "D"), "--no-progress"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("medvol-train: error: nothing could be prepared")
    assert "Traceback" not in r.stderr and "does not exist" in lines[0]
    assert not (tmp_path / "D" / "samples.jsonl").exists()


def test_csv_manifest_with_dataset_code(tmp_path, ct_sm_path, seg_sm_path):
    """A CSV row with ``dataset`` instead of ``targets``: AbdomenCT-1K (0003) ids 1..4 = liver, kidney, spleen,
    pancreas; the TotalSegmentator map is not that dataset, so the names follow the code, not the organs."""
    (tmp_path / "cases.csv").write_text(
        "id,volume,labels,dataset,split\n"
        f"c1,{ct_sm_path},{seg_sm_path},0003,train\n"
        f"c2,{ct_sm_path},{seg_sm_path},9999,train\n", encoding="utf-8")
    summary = prepare(tmp_path / "cases.csv", tmp_path / "D", workers=1, progress=False)
    ids = [s["id"] for s in load_samples(tmp_path / "D")]
    assert ids == ["c1/liver", "c1/kidney", "c1/spleen", "c1/pancreas"]
    assert [s["label_ids"] for s in load_samples(tmp_path / "D")] == [[1], [2], [3], [4]]
    assert summary["skipped"][0]["case"] == "c2" and "9999" in summary["skipped"][0]["message"]


# ---- M3D-Seg ---------------------------------------------------------------------------------

def _write_m3d(root: Path, code: str, cases: dict) -> None:
    from scipy import sparse

    (root / code).mkdir(parents=True)
    split = {"train": [], "test": []}
    for name, (img, channels, which) in cases.items():
        d = root / code / name
        d.mkdir()
        np.save(d / "image.npy", img[None].astype(np.float32))
        shape = channels.shape
        fname = f"mask_({shape[0]}, {shape[1]}, {shape[2]}, {shape[3]}).npz"
        sparse.save_npz(d / fname, sparse.csr_matrix(channels.reshape(shape[0], -1).astype(np.uint8)))
        split[which].append({"image": f"{code}/{name}/image.npy", "label": f"{code}/{name}/{fname}"})
    (root / code / f"{code}.json").write_text(json.dumps(split), encoding="utf-8")


def test_m3dseg_folder_to_samples_with_relational_test_queries(tmp_path, caplog):
    """Synthetic KiTS23-like M3D-Seg set (0004: kidney, kidney tumor, kidney cyst), z-scored images."""
    rng = np.random.default_rng(0)
    h, w, d = 40, 48, 20
    img = rng.normal(size=(h, w, d))
    ch = np.zeros((3, h, w, d), bool)
    ch[0, 5:15, 5:15, 4:16] = True  # one kidney
    ch[0, 25:35, 30:42, 4:16] = True  # the other
    ch[2, 27:31, 33:37, 8:11] = True  # a cyst in the second kidney
    ch[0, 27:31, 33:37, 8:11] = False
    _write_m3d(tmp_path / "M3D_Seg", "0004", {"case_00001": (img, ch, "train"), "case_00002": (img, ch, "test")})
    bad = tmp_path / "M3D_Seg" / "0004" / "case_00003"
    bad.mkdir()
    np.save(bad / "image.npy", img[None])
    (bad / "mask_(3, 40, 48, 20).npz").write_bytes(b"not an npz")
    sp = json.loads((tmp_path / "M3D_Seg" / "0004" / "0004.json").read_text(encoding="utf-8"))
    sp["train"].append({"image": "0004/case_00003/image.npy", "label": "0004/case_00003/mask_(3, 40, 48, 20).npz"})
    (tmp_path / "M3D_Seg" / "0004" / "0004.json").write_text(json.dumps(sp), encoding="utf-8")

    assert main(["m3dseg-manifest", "--root", str(tmp_path / "M3D_Seg"), "--code", "0004", "--out",
                 str(tmp_path / "cases.jsonl")]) == 0
    with caplog.at_level("WARNING"):
        summary = prepare(tmp_path / "cases.jsonl", tmp_path / "D", workers=1, progress=False)
    assert any("not HU" in r.getMessage() for r in caplog.records)
    samples = {s["id"]: s for s in load_samples(tmp_path / "D")}
    assert set(samples) == {"0004_case_00001/kidney", "0004_case_00001/kidney cyst", "0004_case_00002/kidney",
                            "0004_case_00002/kidney cyst", "0004_case_00002/kidney containing kidney cyst"}
    reasons = sorted((s["case"], s.get("target"), s["reason"]) for s in summary["skipped"])
    assert ("0004_case_00003", None, "unreadable_npz") in reasons
    assert ("0004_case_00001", "kidney tumor", "empty_label") in reasons
    rel = samples["0004_case_00002/kidney containing kidney cyst"]
    assert rel["query_info"]["kind"] == "relational" and rel["split"] == "test"
    assert rel["intensity"] == "m3d_normalised" and rel["render_window"]["name"] == "custom"
    mask = load_mask(rel)
    # the target is the whole kidney that holds the cyst (kidney + cyst voxels), not the other kidney
    assert mask.sum() == ch[0, 25:35, 30:42, 4:16].sum() + ch[2].sum() and mask.shape == (d, w, h)  # RAS: array axis 0 is x, axis 1 is y
    assert rel["depth"] == d and len(rel["shown"]) == d


# ---- negative (not present) samples ----------------------------------------------------------------

def test_negatives_never_name_a_label_present_in_the_volume(tmp_path, ct_sm_path, seg_sm_path):
    """A label map with many labels (TotalSegmentator): the candidates are the row's labels absent from
    the map and its 'absent' names; a name that is present (also as an alias: 'kidney' for 'kidneys')
    is refused; the fraction picks round(f / (1 − f) × positives) per split, with the seed."""
    from medvolcore.answer import parse_answer

    labels = load_label_map(seg_sm_path)
    present = {int(v) for v in np.unique(labels.array)} - {0}
    assert {1, 2, 3, 4, 5, 6} <= present and not {21, 22, 90} & present
    manifest = write_jsonl(tmp_path / "cases.jsonl", [
        {"id": "a", "volume": str(ct_sm_path), "labels": str(seg_sm_path), "split": "train",
         "targets": {"liver": LIVER, "spleen": SPLEEN, "kidneys": [KIDNEY_RIGHT, KIDNEY_LEFT], "gallbladder": 4,
                     "stomach": 6, "urinary_bladder": 21, "prostate": 22, "brain": 90},
         "absent": ["heart", "liver", "kidney"]},
        {"id": "b", "volume": str(ct_sm_path), "labels": str(seg_sm_path), "split": "test",
         "targets": {"liver": LIVER, "brain": 90}},
    ])
    summary = prepare(manifest, tmp_path / "D", PrepareSettings(seed=3, negative_fraction=0.4), progress=False)
    refused = {s["target"]: s["message"] for s in summary["skipped"] if s["reason"] == "present_label"}
    assert set(refused) == {"liver", "kidney"} and "'kidneys'" in refused["kidney"]
    samples = load_samples(tmp_path / "D")
    negatives = [s for s in samples if s["absent"]]
    # train: 5 positives → round(0.4 / 0.6 × 5) = 3 of the 4 candidates; test: 1 positive → 1
    assert summary["negatives_by_split"] == {"train": 3, "test": 1}
    assert summary["negative_candidates_by_split"] == {"train": 4, "test": 1}
    names = {s["label"] for s in samples if not s["absent"]}
    for s in negatives:
        assert s["label"] not in names and s["label"] in {"urinary_bladder", "prostate", "brain", "heart"}
        assert not set(s["label_ids"]) & present  # no voxel of it in the map
        assert s["negative_source"] == ("manifest" if s["label"] == "heart" else "labels")
        assert parse_answer(s["target"]).absent and s["target_info"]["slice"] is None
        assert s["target_info"]["boxes"] == [] and s["gt_boxes_norm"] == {} and s["mask_file"] is None
        assert s["slice_areas"] == [0] * s["depth"] and not load_mask(s).any()
        assert load_mask(s).shape == tuple(s["stack_shape"])
        assert s["query"] in s["messages"][1]["content"] and len(load_slices(s)) == len(s["shown"])
    assert [s["id"] for s in negatives if s["split"] == "test"] == ["b/brain"]
    # the same seed gives the same choice; another fraction re-selects without preparing the cases again
    again = prepare(manifest, tmp_path / "D", PrepareSettings(seed=3, negative_fraction=0.4), progress=False)
    assert again["cases_resumed"] == 2 and load_samples(tmp_path / "D") == samples
    more = prepare(manifest, tmp_path / "D", PrepareSettings(seed=3, negative_fraction=0.5), progress=False)
    assert more["cases_resumed"] == 2 and more["negatives_by_split"] == {"train": 4, "test": 1}
    assert "5 negative (not present) sample(s) wanted" in more["notes"][0]  # capped at the 4 candidates
    none = prepare(manifest, tmp_path / "D", PrepareSettings(seed=3, negative_fraction=0.0), progress=False)
    assert none["negatives_by_split"] == {"train": 0, "test": 0} and none["samples"] == 6


def test_select_negatives_spreads_over_cases_with_the_seed():
    from medvoltrain import resources
    from medvoltrain.prepare import same_structure, select_negatives

    terms = resources.term_dictionary()
    assert same_structure("kidney", "kidneys", terms) and same_structure("kidney_left", "left kidney", terms)
    assert same_structure("gall bladder", "gallbladder", terms)
    assert not same_structure("kidney tumor", "kidney", terms) and not same_structure("brain", "brainstem", terms)

    def rec(case, n_pos, n_neg):
        return {"samples": [{"split": "train"}] * n_pos,
                "negative_candidates": [{"split": "train", "case_id": case, "label": f"{case}{i}"} for i in range(n_neg)]}

    records = [rec("a", 4, 3), rec("b", 4, 3), rec("c", 4, 3)]  # 12 positives
    pick = select_negatives(records, 0.2, seed=0)  # round(0.25 × 12) = 3: one per case before any second
    assert sorted(pick) == ["a", "b", "c"] and all(len(v) == 1 for v in pick.values())
    assert select_negatives(records, 0.2, seed=0) == pick
    assert sum(map(len, select_negatives(records, 0.5, seed=0).values())) == 9  # wants 12, all 9 candidates
    assert select_negatives(records, 0.0, seed=0) == {}
    with pytest.raises(DataError, match="negative fraction"):
        select_negatives(records, 1.0, seed=0)


def test_a_bad_absent_name_or_fraction_is_one_clear_line(tmp_path, ct_sm_path, seg_sm_path, capsys):
    manifest = write_jsonl(tmp_path / "m.jsonl", [
        {"id": "a", "volume": str(ct_sm_path), "labels": str(seg_sm_path), "split": "train",
         "targets": {"liver": LIVER}, "absent": ["unicorn horn"]},
        {"id": "b", "volume": str(ct_sm_path), "labels": str(seg_sm_path), "split": "train",
         "targets": {"liver": LIVER}}])
    summary = prepare(manifest, tmp_path / "D", PrepareSettings(negative_fraction=0.0), progress=False)
    (bad,) = summary["skipped"]
    assert bad["reason"] == "bad_row" and "'unicorn horn' is not in M3D's term dictionary" in bad["message"]
    capsys.readouterr()
    assert main(["prepare", "--manifest", str(manifest), "--out", str(tmp_path / "E"), "--negative-fraction", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--negative-fraction must be a number in [0, 1)" in err[0]


@pytest.mark.probe("55.6", "medvol-train prepare --manifest D/samples.jsonl --out D")
def test_prepare_refuses_to_replace_its_own_manifest_without_overwrite(prepared, tmp_path, capsys):
    manifest, _ = prepared
    out = tmp_path / "D"
    out.mkdir()
    for name in ("samples.jsonl", "summary.json"):
        inside = out / name
        inside.write_bytes(Path(manifest).read_bytes())
        before = inside.read_bytes()
        code = main(["prepare", "--manifest", str(inside), "--out", str(out), "--no-progress"])
        err = capsys.readouterr().err
        assert code == 2 and "--overwrite" in err and "Traceback" not in err, err
        assert inside.read_bytes() == before
        inside.unlink()
