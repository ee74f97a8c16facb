"""The learning benchmark's task: crops of the real test CTs, split by z-band of the one patient
(:data:`TRAIN_BANDS`, :data:`TEST_BANDS`), each a NIfTI case with the targets present in it
(:func:`build_cases`), and the test samples scored (:func:`select_test_samples`)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

import numpy as np

from ..errors import DataError
from ..queries import seeded_rng
from .learning_settings import BenchSettings

# Stack z-bands of the patient (example_ct's canonical stack, 112 slices, 3 mm, head → feet).
# Test bands (6 slices each) interleaved with the train bands: every test slice lies between
# training slices of the same organs, at most 3 slices (9 mm) from one.
TRAIN_BANDS = ((0, 10), (16, 26), (32, 44), (50, 66), (72, 86), (92, 112))
TEST_BANDS = ((10, 16), (26, 32), (44, 50), (66, 72), (86, 92))
# Share of the train crops per band: the upper abdomen (z < 50) holds most of the targets.
TRAIN_BAND_WEIGHTS = (0.2, 0.2, 0.2, 0.15, 0.1, 0.15)
SM_DEPTH = 30  # example_ct_sm = example_ct's stack slices 0..29 (checked when the cases are built)

# Targets: M3D term-dictionary key → the target name used in the manifest (the QueryBank finds the
# key again from it); TotalSegmentator ids come from text/m3d_to_totalseg_crosswalk.json.
TARGET_TERMS = {
    "liver": "liver", "spleen": "spleen", "right kidney": "kidney_right", "left kidney": "kidney_left",
    "kidneys": "kidneys", "gallbladder": "gallbladder", "stomach": "stomach", "pancreas": "pancreas",
    "duodenum": "duodenum", "aorta": "aorta", "inferior vena cava": "inferior_vena_cava",
    "urinary bladder": "urinary_bladder", "sacrum": "sacrum",
}
MIN_VOXELS = 40  # a target enters a crop with at least this many voxels …
MIN_SLICE_AREA = 20  # … and a slice of at least this many pixels (of 122 × 101)


def default_real_dir() -> Path:
    """``$MEDVOL_REAL_DATA``, else ``Testing/data`` of the repository checkout this package runs from
    (an installed copy outside a checkout has none: give ``--real-dir``)."""
    env = os.environ.get("MEDVOL_REAL_DATA")
    if env:
        return Path(env).expanduser()
    return Path(__file__).resolve().parents[3] / "Testing" / "data"


@dataclass
class _Source:
    name: str
    stack_hu: np.ndarray  # (D, H, W) canonical stack
    labels: np.ndarray  # (D, H, W) TotalSegmentator ids
    index_to_ras: np.ndarray  # 4×4: stack (z, y, x, 1) → RAS mm
    z_offset: int  # stack z of slice 0 in the patient frame (example_ct's stack)
    volume: str
    label_file: str


def _load_sources(real_dir: Path) -> List[_Source]:
    from medvolcore.stack import AxialStack
    from medvolcore.volume import load_label_map, load_volume

    ts = real_dir / "totalsegmentator"
    out = []
    for name, vol, lab in (("ct", "example_ct.nii.gz", "example_seg_fast_force_split.nii.gz"),
                           ("ct_sm", "example_ct_sm.nii.gz", "example_seg.nii.gz")):
        for f in (vol, lab):
            if not (ts / f).is_file():
                raise DataError(f"{ts / f} is missing: the learning benchmark needs the real test CTs "
                                f"(Testing/data in the repository; --real-dir or $MEDVOL_REAL_DATA elsewhere)")
        v = load_volume(ts / vol)
        stack = AxialStack(v)
        labels = stack.to_stack(load_label_map(ts / lab).array)
        out.append(_Source(name, np.ascontiguousarray(stack.data, dtype=np.float32), np.ascontiguousarray(labels),
                           stack.index_to_ras.copy(), 0, str(ts / vol), str(ts / lab)))
    ct, sm = out
    if sm.stack_hu.shape[0] != SM_DEPTH or not np.array_equal(sm.stack_hu, ct.stack_hu[:SM_DEPTH]):
        raise DataError("example_ct_sm is not example_ct's first 30 stack slices any more; the benchmark's "
                        "z-ranges assume it is (see Testing/data/README.md)")
    sm.index_to_ras = ct.index_to_ras.copy()  # sm's own header is a quirk: same patient frame as ct
    return out


def _targets(real_dir: Path) -> Dict[str, List[int]]:
    """Target name → TotalSegmentator ids, from the M3D → TotalSegmentator crosswalk of the test data."""
    path = real_dir / "text" / "m3d_to_totalseg_crosswalk.json"
    if not path.is_file():
        raise DataError(f"{path} is missing (see Testing/data/README.md in the repository)")
    cw = json.loads(path.read_text(encoding="utf-8"))
    out = {}
    for term, name in TARGET_TERMS.items():
        if term in cw.get("single", {}):
            out[name] = [int(cw["single"][term]["label_id"])]
        elif term in cw.get("union", {}):
            out[name] = [int(i) for i in cw["union"][term]["label_ids"]]
        else:
            raise DataError(f"the crosswalk {path} has no entry {term!r}")
    return out


def _crop(source: _Source, z0: int, depth: int, dy: int, dx: int, scale: float, offset: float):
    """``(hu, labels, affine)``: stack slices ``[z0, z0+depth)`` shifted in-plane by ``(dy, dx)``
    pixels (content moves by +dy, +dx; air / background fills the gap), HU jittered."""
    d, h, w = source.stack_hu.shape
    hu = np.full((depth, h, w), -1024.0, dtype=np.float32)
    lab = np.zeros((depth, h, w), dtype=np.uint8)
    ys, yd = (slice(0, h - dy), slice(dy, h)) if dy >= 0 else (slice(-dy, h), slice(0, h + dy))
    xs, xd = (slice(0, w - dx), slice(dx, w)) if dx >= 0 else (slice(-dx, w), slice(0, w + dx))
    hu[:, yd, xd] = source.stack_hu[z0:z0 + depth, ys, xs] * scale + offset
    lab[:, yd, xd] = source.labels[z0:z0 + depth, ys, xs]
    shift = np.eye(4)
    shift[:3, 3] = (z0, -dy, -dx)  # crop index (z, y, x) → source stack index
    return np.rint(hu).astype(np.int16), lab, source.index_to_ras @ shift


def _save_nifti(array: np.ndarray, affine: np.ndarray, path: Path) -> None:
    import nibabel as nib
    from medvolcore.fileio import atomic_path

    img = nib.Nifti1Image(array, affine)
    img.header.set_xyzt_units("mm")
    with atomic_path(path, overwrite=True) as tmp:
        nib.save(img, str(tmp))  # the temporary name keeps the .nii.gz suffix nibabel reads


def _present(lab: np.ndarray, ids: Sequence[int]) -> bool:
    m = np.isin(lab, ids)
    return int(m.sum()) >= MIN_VOXELS and int(m.sum(axis=(1, 2)).max()) >= MIN_SLICE_AREA


def _plan_crops(settings: BenchSettings, split: str, n: int) -> List[dict]:
    """Seeded crop plans: source, z0, depth, shift and jitter; z-ranges inside the split's bands."""
    bands = TRAIN_BANDS if split == "train" else TEST_BANDS
    weights = np.asarray(TRAIN_BAND_WEIGHTS, dtype=float)
    plans = []
    for i in range(n):
        rng = seeded_rng(settings.seed, "bench-crop", split, i)
        band = bands[i % len(bands)] if split == "test" else bands[int(rng.choice(len(bands), p=weights / weights.sum()))]
        a, b = band
        depth = int(rng.integers(settings.crop_min, settings.crop_max + 1))
        depth = min(depth, b - a)
        z0 = int(rng.integers(a, b - depth + 1))
        src = "ct"
        if split == "train" and z0 + depth <= SM_DEPTH and rng.random() < settings.sm_fraction:
            src = "ct_sm"
        plans.append({"split": split, "source": src, "z0": z0, "depth": depth,
                      "dy": int(rng.integers(-settings.max_shift, settings.max_shift + 1)),
                      "dx": int(rng.integers(-settings.max_shift, settings.max_shift + 1)),
                      "hu_scale": float(1.0 + rng.uniform(-settings.hu_scale, settings.hu_scale)),
                      "hu_offset": float(rng.uniform(-settings.hu_offset, settings.hu_offset))})
    return plans


def build_cases(out_dir, real_dir, settings: BenchSettings) -> Tuple[Path, List[dict]]:
    """Write the augmented NIfTI cases and ``cases.jsonl`` (the manifest); returns both.

    Each row carries, besides the manifest fields, ``patient_z`` (``[z0, z1)`` on example_ct's
    stack), ``source``, ``shift_yx`` and ``hu_scale`` / ``hu_offset``.
    """
    out_dir, real_dir = Path(out_dir), Path(real_dir)
    sources = {s.name: s for s in _load_sources(real_dir)}
    targets = _targets(real_dir)
    folder = out_dir / "cases"
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for split, n in (("train", settings.train_cases), ("test", settings.test_cases)):
        for i, plan in enumerate(_plan_crops(settings, split, n)):
            src = sources[plan["source"]]
            hu, lab, affine = _crop(src, plan["z0"], plan["depth"], plan["dy"], plan["dx"], plan["hu_scale"],
                                    plan["hu_offset"])
            present = {name: ids for name, ids in targets.items() if _present(lab, ids)}
            if not present:
                continue
            cid = f"{split}{i:03d}_{plan['source']}_z{plan['z0']}-{plan['z0'] + plan['depth']}"
            vol, labf = folder / f"{cid}.nii.gz", folder / f"{cid}_seg.nii.gz"
            _save_nifti(hu, affine, vol)
            _save_nifti(lab, affine, labf)
            rows.append({"id": cid, "volume": str(vol), "labels": str(labf), "split": split, "targets": present,
                         "source": plan["source"], "source_volume": src.volume, "source_labels": src.label_file,
                         "patient_z": [plan["z0"], plan["z0"] + plan["depth"]], "shift_yx": [plan["dy"], plan["dx"]],
                         "hu_scale": round(plan["hu_scale"], 4), "hu_offset": round(plan["hu_offset"], 2)})
    from ..datasets import write_manifest

    manifest = write_manifest(rows, out_dir / "cases.jsonl", overwrite=True)
    return Path(manifest), rows


def select_test_samples(samples: List[dict], limit: int) -> List[dict]:
    """At most ``limit`` test samples, taken round-robin over labels (in case order) so that every
    label is scored, and deterministic."""
    by_label: Dict[str, List[dict]] = {}
    for s in samples:
        by_label.setdefault(s["label"], []).append(s)
    out, i = [], 0
    while len(out) < limit and any(i < len(v) for v in by_label.values()):
        for label in sorted(by_label):
            if i < len(by_label[label]) and len(out) < limit:
                out.append(by_label[label][i])
        i += 1
    return out
