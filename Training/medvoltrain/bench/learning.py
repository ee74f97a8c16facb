"""``medvol-train bench-learning``: does training work? A grounding task from the real test CTs,
small enough for a CPU, trained with the product's SFT then GRPO; the untrained, SFT and GRPO
models are scored on a held-out split with the same rewards (:class:`~medvoltrain.rewards.RewardFunctions`).

Inputs: ``real_dir`` (``$MEDVOL_REAL_DATA``, else the repository's ``Testing/data``: ``example_ct``,
``example_ct_sm``, their TotalSegmentator label maps and the M3D → TotalSegmentator crosswalk) and
:class:`BenchSettings`. Both CTs are one patient: the test split is held out by z-range of that
patient (:data:`TEST_BANDS`, stack z of ``example_ct``) and by description, not by patient.

Everything it writes stays in ``DIR`` (:func:`run_benchmark`):

* ``cases/*.nii.gz``, ``cases.jsonl``: the crops (:func:`build_cases`), each a NIfTI whose array is
  the canonical stack (``stack[z, y, x]``) with the source's stack-to-RAS affine shifted to the
  crop, so its world coordinates stay the patient's;
* ``data/``: ``prepare``'s output (Top-1 key slice), its SFT targets' reasoning shortened to one
  template (:func:`~medvoltrain.bench.common.short_think_targets`);
* ``model/``: the base model (:func:`~medvoltrain.bench.model.build_model`);
* ``runs/sft``, ``runs/grpo``: the two training runs and their adapters;
* ``result.json``: ``{"untrained": {...}, "sft": {...}, "grpo": {...}}`` (each term's mean reward and
  ``total = format + axial + box``) plus ``reference``, ``ablations`` (the trained models again with
  their slices blacked out and swapped, own − ablated with standard errors), ``settings``,
  ``timings_s``, ``data``, ``model``, ``torch_threads``, ``evaluation``, ``training``, ``notes``;
* ``table.md`` and ``curves.png`` (SFT loss, GRPO reward terms per step).

The task, the held-out split, the model, the training recipe and why each is what it is, with the
measured results: ``docs/learning-benchmarks.md``, "Learning benchmark (`medvol-train bench-learning`)".
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from medvolcore.errors import InputError

from ..errors import DataError
from ..queries import seeded_rng
from .common import ablated_images, prepare_out, short_think_targets, standard_error, swap_partners
from .model import MODEL_SIZES, build_model, count_parameters, tokenizer_corpus
from .report import ABLATIONS, MODELS, RESULT, TERMS, ablation_table, learning_table, plot_curves, write_result

log = logging.getLogger(__name__)

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


@dataclass
class BenchSettings:
    """Everything the benchmark does; ``quick()`` is the few-step smoke version used by the tests."""

    seed: int = 0
    # a key of MODEL_SIZES; "seeing" (the vision stage's model) because with the tiny sizes the trained
    # adapters scored the same with their slices blacked out (docs/learning-benchmarks.md, "Image ablations on the real CTs")
    model: str = "seeing"
    # BPE vocabulary learnt from the training split's text (0: the tiny preset's 640-merge tokenizer)
    vocab_size: int = 2048
    # vision patch of the bench model (the tiny preset's is 16: 64 tokens per 256 × 256 slice; 32 gives 16)
    image_patch: int = 32
    # -- cases --
    train_cases: int = 240  # ≈ 1290 samples: SFT sees each about 4 times (60 crops: 13 times)
    test_cases: int = 10  # two per test band
    crop_min: int = 6
    crop_max: int = 10
    max_shift: int = 10  # in-plane shift, pixels of the 122 × 101 slice, each axis
    hu_scale: float = 0.08  # HU' = HU · U(1 − s, 1 + s) + U(−o, o)
    hu_offset: float = 30.0
    sm_fraction: float = 0.5  # share of the train crops within z < 30 taken from example_ct_sm + example_seg
    max_test_samples: int = 64  # at most this many test samples (round-robin over labels)
    # -- SFT --
    sft_steps: int = 2500
    sft_lr: float = 1e-3  # 5e-3 with the vision tower trained in full made its output constant (ablations all equal)
    sft_batch: int = 2
    lora_r: int = 32
    lora_alpha: int = 64
    # trained in full beside the LoRA (PEFT modules_to_save): a LoRA on a *random* model cannot move its
    # token embeddings, and without that it never learnt which organ a query names; nor its random vision
    # tower (docs/learning-benchmarks.md, "Training." under the learning benchmark)
    lora_modules_to_save: str = "embed_tokens,lm_head,visual,q_norm,k_norm"
    # -- GRPO --
    grpo_steps: int = 150
    grpo_lr: float = 1e-4
    num_generations: int = 4
    beta: float = 0.01
    lambda_consistency: float = 0.0
    delta: int = 5
    max_completion_length: int = 112
    # -- sampling, the same for the GRPO rollouts and the evaluation; None: the grounder's "real" preset
    #    (Resources/prompts/grounder.json: temperature 0.7, top_p 0.8, top_k 20) --
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    # -- evaluation --
    samples_per_prompt: int = 4
    sam_seed: int = 0
    # torch threads for the whole run (None: leave torch's choice). One thread by default: on a
    # shared 2-core machine two threads spin against the other jobs (measured: docs/learning-benchmarks.md).
    threads: Optional[int] = 1
    quick: bool = False

    @classmethod
    def quick_settings(cls, **kw) -> "BenchSettings":
        base = dict(train_cases=4, test_cases=2, max_test_samples=3, sft_steps=3, grpo_steps=2, num_generations=2,
                    samples_per_prompt=2, max_completion_length=48, model="tiny", quick=True)
        base.update(kw)
        return cls(**base)

    def validate(self) -> "BenchSettings":
        from medvolcore.grounder import resolve_settings

        real = resolve_settings("real")
        for key in ("temperature", "top_p", "top_k"):
            if getattr(self, key) is None:
                setattr(self, key, real[key])
        if self.model not in MODEL_SIZES:
            raise InputError(f"model must be one of {', '.join(MODEL_SIZES)}, got {self.model!r}")
        for key in ("train_cases", "test_cases", "crop_min", "sft_steps", "grpo_steps", "sft_batch",
                    "samples_per_prompt", "max_test_samples", "max_completion_length"):
            if getattr(self, key) < 1:
                raise InputError(f"{key} must be ≥ 1, got {getattr(self, key)}")
        if self.image_patch not in (16, 32, 64):
            raise InputError(f"image_patch must be 16, 32 or 64 (a 256-pixel slice in whole merged patches), "
                             f"got {self.image_patch}")
        if self.vocab_size < 0:
            raise InputError(f"vocab_size must be ≥ 0 (0: the tiny preset's tokenizer), got {self.vocab_size}")
        if self.num_generations < 2:
            raise InputError(f"num_generations must be ≥ 2, got {self.num_generations}")
        if self.crop_max < self.crop_min:
            raise InputError(f"crop_max ({self.crop_max}) < crop_min ({self.crop_min})")
        if self.lambda_consistency < 0:
            raise InputError(f"lambda_consistency must be ≥ 0, got {self.lambda_consistency}")
        if self.threads is not None and self.threads < 0:
            raise InputError(f"threads must be ≥ 0 (0: torch's choice), got {self.threads}")
        return self


# ---- data ------------------------------------------------------------------------------------

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


# ---- evaluation ----------------------------------------------------------------------------

def sample_completions(grounder, sample: dict, n: int, seed: int, max_new_tokens: int,
                       temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, images=None) -> List[str]:
    """``n`` completions of one prepared sample, sampled from the model itself (no grammar), with
    a fixed seed; cut at the end-of-turn token as the GRPO reward functions cut them. Vision
    placeholder tokens are never sampled (as in the GRPO rollouts). ``images``: the slices to show
    instead of the sample's own (the image ablations)."""
    import torch
    from transformers import GenerationConfig

    from ..grpo import _suppressed_ids
    from ..prepare import load_slices

    tok = grounder.tokenizer
    inputs = grounder.inputs_from_images(load_slices(sample) if images is None else images, sample["shown"],
                                         int(sample["depth"]), sample["query"], sample.get("prompt_window"))
    stops = [int(tok.convert_tokens_to_ids(t)) for t in ("<|im_end|>", "<|endoftext|>")]
    config = GenerationConfig(max_new_tokens=int(max_new_tokens), do_sample=True, temperature=float(temperature),
                              top_p=float(top_p), top_k=int(top_k), num_beams=1, num_return_sequences=int(n), eos_token_id=stops,
                              pad_token_id=stops[1], suppress_tokens=_suppressed_ids(tok), use_cache=True)
    saved = grounder.model.generation_config
    try:
        grounder.model.generation_config = config
        with torch.random.fork_rng(devices=[]), torch.inference_mode():
            torch.manual_seed(int(seed))
            out = grounder.model.generate(**inputs, generation_config=config)
    finally:
        grounder.model.generation_config = saved
    texts = []
    for row in out[:, inputs["input_ids"].shape[1]:].tolist():
        cut = next((i for i, t in enumerate(row) if t in stops), len(row))
        texts.append(tok.decode(row[:cut], skip_special_tokens=False))
    return texts


def evaluate_model(model_dir, adapter, samples: List[dict], settings: BenchSettings, scorer,
                   label: str = "", images: str = "own", partners: Optional[List[int]] = None,
                   prior: Optional[Dict[str, list]] = None) -> dict:
    """Mean rewards of one model over ``samples`` (each sampled ``samples_per_prompt`` times).

    ``images``: ``own``, or an ablation (``swapped``: another test crop's slices, see ``partners``;
    ``black``), with the same prompts and sampling seeds. ``prior`` (label → boxes, see
    :func:`prior_boxes`): also score the content-blind boxes on the slice each completion chose
    (``box_prior_same_slice``), so the model's box column has a like-for-like reference.
    ``means`` also holds each term's standard error over completions (``<term>_se``).
    """
    from medvolcore.grounder import QwenVLGrounder

    from ..rewards import RewardFunctions, box_reward, parsed

    grounder = QwenVLGrounder.from_pretrained(model_dir, adapter=adapter)
    grounder.model.eval()
    rewards = RewardFunctions(scorer=scorer, samples={s["id"]: s for s in samples})
    scores = {t: [] for t in TERMS}
    prior_same_slice: List[float] = []
    per_label: Dict[str, List[float]] = {}
    examples = []
    lengths = []
    for j, s in enumerate(samples):
        seed = int(seeded_rng(settings.seed, "bench-eval", s["id"]).integers(2 ** 31))
        texts = sample_completions(grounder, s, settings.samples_per_prompt, seed, settings.max_completion_length,
                                   settings.temperature, settings.top_p, settings.top_k,
                                   images=None if images == "own" else ablated_images(samples, j, images, partners))
        n = len(texts)
        if prior is not None:
            gt = {str(z): b for z, b in s["gt_boxes_norm"].items()}
            for t in texts:
                a = parsed(t)
                prior_same_slice.append(0.0 if a is None or s["label"] not in prior
                                        else box_reward(prior[s["label"]], gt.get(str(a.slice), [])))
        cols = {"slice_areas": [s["slice_areas"]] * n, "gt_boxes_norm": [json.dumps(s["gt_boxes_norm"])] * n,
                "sample_id": [s["id"]] * n}
        got = {"format": rewards.format(None, texts, **cols), "axial": rewards.axial(None, texts, **cols),
               "box": rewards.box(None, texts, **cols),
               "consistency": rewards.consistency(None, texts, **cols) if scorer is not None else [float("nan")] * n}
        for t in TERMS:
            if any(v is None for v in got[t]):
                raise DataError(f"the {t} reward could not be computed for {s['id']} (see the log)")
            scores[t] += [float(v) for v in got[t]]
        per_label.setdefault(s["label"], []).extend(
            got["format"][i] + got["axial"][i] + got["box"][i] for i in range(n))
        lengths += [len(grounder.tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
        if j < 3:
            examples.append({"id": s["id"], "query": s["query"], "target": s["target"], "completion": texts[0]})
        if label:
            sys.stderr.write(f"\r  eval {label}: {j + 1}/{len(samples)}")
            sys.stderr.flush()
    if label:
        sys.stderr.write("\n")
    means = {t: float(np.mean(scores[t])) for t in TERMS}
    means["total"] = means["format"] + means["axial"] + means["box"]
    totals = np.asarray(scores["format"]) + np.asarray(scores["axial"]) + np.asarray(scores["box"])
    for t, v in [*((t, scores[t]) for t in TERMS), ("total", totals)]:
        means[f"{t}_se"] = standard_error(v)
    if prior is not None:
        means["box_prior_same_slice"] = float(np.mean(prior_same_slice))
    return {"means": means, "images": images, "per_label_total": {k: round(float(np.mean(v)), 4) for k, v in sorted(per_label.items())},
            "completions": len(scores["format"]), "mean_completion_tokens": float(np.mean(lengths)),
            "examples": examples}


def prior_boxes(train_samples: Sequence[dict]) -> Dict[str, list]:
    """Each label's content-blind boxes: the training samples' key-slice boxes averaged coordinate
    by coordinate, over the samples with the most frequent number of boxes (the fewer on a tie)."""
    by_label: Dict[str, Dict[int, List[List[List[float]]]]] = {}
    for s in train_samples:
        boxes = s["target_info"]["boxes_norm"]
        by_label.setdefault(s["label"], {}).setdefault(len(boxes), []).append(boxes)
    prior = {}
    for label, groups in by_label.items():
        n = max(sorted(groups), key=lambda k: len(groups[k]))
        prior[label] = np.mean(np.asarray(groups[n], dtype=float), axis=0).tolist()
    return prior


def label_prior_box(train_samples: Sequence[dict], test_samples: Sequence[dict]) -> float:
    """A content-blind reference for the box column: the box reward a model would earn that never
    looks at the image and answers, for each label, the training samples' *mean* key-slice boxes,
    scored against each test sample's ground-truth boxes on its *true* key slice (so the slice is
    never wrong and only the box is measured).

    Per label, the training samples with the most frequent number of boxes (the fewer on a tie) are
    averaged coordinate by coordinate; a label without training samples scores 0.
    """
    from ..rewards import box_reward

    prior = prior_boxes(train_samples)
    scores = []
    for s in test_samples:
        k = int(s["target_info"]["slice"])
        gt = s["gt_boxes_norm"].get(str(k), s["gt_boxes_norm"].get(k, []))
        scores.append(box_reward(prior[s["label"]], gt) if s["label"] in prior else 0.0)
    return float(np.mean(scores)) if scores else 0.0


# ---- the benchmark ---------------------------------------------------------------------------

_OWNED = ("cases", "cases.jsonl", "data", "model", "runs", RESULT, "curves.png", "table.md")

def _sft_settings(settings: BenchSettings, model_dir: Path):
    from ..config import SFTSettings

    return SFTSettings(preset="tiny", model_path=str(model_dir), lora_r=settings.lora_r, lora_alpha=settings.lora_alpha,
                       lora_dropout=0.0, lora_modules_to_save=settings.lora_modules_to_save,
                       learning_rate=settings.sft_lr, max_steps=settings.sft_steps,
                       per_device_train_batch_size=settings.sft_batch, warmup_ratio=0.05, lr_scheduler_type="cosine",
                       gradient_checkpointing=False, logging_steps=1, save_steps=10 ** 6, save_total_limit=1,
                       report_to="none", dataloader_num_workers=0, seed=settings.seed, bf16=False).validate()


def _grpo_settings(settings: BenchSettings, model_dir: Path):
    from ..config import GRPOSettings

    return GRPOSettings(preset="tiny", model_path=str(model_dir), num_generations=settings.num_generations,
                        lora_r=settings.lora_r, lora_alpha=settings.lora_alpha, lora_dropout=0.0,
                        lora_modules_to_save=settings.lora_modules_to_save,
                        beta=settings.beta, max_completion_length=settings.max_completion_length,
                        temperature=settings.temperature, top_p=settings.top_p, top_k=settings.top_k,
                        learning_rate=settings.grpo_lr, max_steps=settings.grpo_steps, prompts_per_device=1,
                        warmup_ratio=0.05, lr_scheduler_type="cosine", gradient_checkpointing=False,
                        lambda_consistency=settings.lambda_consistency, delta=settings.delta, seed=settings.seed,
                        logging_steps=1, save_steps=10 ** 6, save_total_limit=1, report_to="none",
                        dataloader_num_workers=0, bf16=False).validate()


def run_benchmark(out_dir, real_dir=None, settings: Optional[BenchSettings] = None, overwrite: bool = False,
                  echo=None) -> dict:
    """Build the task, train SFT and GRPO, evaluate the three models; returns (and writes) the result.

    ``echo`` (default: print to stdout) receives each progress line, phase times included.
    """
    settings = (settings or BenchSettings()).validate()
    echo = echo or (lambda line: (sys.stdout.write(line + "\n"), sys.stdout.flush()))
    out = Path(out_dir).expanduser().resolve()
    real_dir = Path(real_dir).expanduser().resolve() if real_dir else default_real_dir()
    prepare_out(out, overwrite, _OWNED)
    import torch

    saved_threads = torch.get_num_threads()
    if settings.threads:
        torch.set_num_threads(int(settings.threads))
    try:
        return _run(out, real_dir, settings, echo)
    finally:
        torch.set_num_threads(saved_threads)


def _run(out: Path, real_dir: Path, settings: BenchSettings, echo) -> dict:
    import torch

    from ..grpo import train_grpo
    from ..prepare import PrepareSettings, load_samples, prepare
    from ..sft import train_sft

    timings: Dict[str, float] = {}
    t_all = time.perf_counter()

    def phase(name):
        class _Phase:
            def __enter__(self):
                echo(f"[{name}] …")
                self.t = time.perf_counter()

            def __exit__(self, *exc):
                timings[name] = round(time.perf_counter() - self.t, 1)
                if exc[0] is None:
                    echo(f"[{name}] {timings[name]:.1f} s")
        return _Phase()

    with phase("data"):
        manifest, rows = build_cases(out, real_dir, settings)
        summary = prepare(manifest, out / "data", PrepareSettings(seed=settings.seed, top_k=1, negative_fraction=0.0),
                          progress=False)
        short_think_targets(out / "data")
        train = load_samples(out / "data", "train")
        test = select_test_samples(load_samples(out / "data", "test"), settings.max_test_samples)
        echo(f"  {len(rows)} cases ({sum(r['split'] == 'train' for r in rows)} train, "
             f"{sum(r['split'] == 'test' for r in rows)} test); {len(train)} train samples, {len(test)} of "
             f"{summary['samples_by_split']['test']} test samples scored, {len({s['label'] for s in train})} labels")
        prior_box = label_prior_box(train, test)
        prior = prior_boxes(train)
        echo(f"  content-blind reference (each label's mean training box, on the true key slice): box {prior_box:.3f}")
        # the swapped-slices ablation shows each test crop another test band's crop (other organs' levels)
        band_of = {r["id"]: next((i for i, (a, b) in enumerate(TEST_BANDS) if a <= r["patient_z"][0] < b), -1)
                   for r in rows if r["split"] == "test"}
        group = lambda smp: band_of.get(smp["case_id"])  # noqa: E731
        if len({group(smp) for smp in test}) < 2:  # a small run may score one band only: another crop then
            group = lambda smp: smp["case_id"]  # noqa: E731
        ablation_kinds = ABLATIONS if len({group(smp) for smp in test}) > 1 else ("black",)
        partners = swap_partners(test, group=group) if "swapped" in ablation_kinds else None
        if "swapped" not in ablation_kinds:
            echo("  every scored test sample shows the same crop: the swapped-slices ablation is skipped")
    with phase("model"):
        model_dir = build_model(out / "model", settings.model, corpus=tokenizer_corpus(train),
                                vocab_size=settings.vocab_size, patch_size=settings.image_patch)
        n_params = count_parameters(model_dir)
        echo(f"  {settings.model} Qwen3-VL, {n_params} parameters, in {model_dir}")
    with phase("sft"):
        sft = train_sft(out / "data", out / "runs" / "sft", _sft_settings(settings, model_dir), overwrite=True)
        echo(f"  {sft['global_step']} steps, loss {sft['loss_first']:.3f} → {sft['loss_last']:.3f}")
    with phase("grpo"):
        grpo = train_grpo(out / "data", out / "runs" / "grpo", _grpo_settings(settings, model_dir),
                          adapter=out / "runs" / "sft" / "adapter", overwrite=True,
                          random_weights=settings.sam_seed if settings.lambda_consistency > 0 else None)
        last = grpo["history"][-1] if grpo["history"] else {}
        echo("  " + f"{grpo['global_step']} steps; last step: " + ", ".join(
            f"{k.split('/')[1]} {v:.3f}" for k, v in last.items() if k.startswith("rewards/") and k.endswith("/mean")))

    from medvolcore.propagation import MedSAM2Propagator

    from ..rewards import ConsistencyScorer

    scorer = ConsistencyScorer(MedSAM2Propagator.from_random(settings.sam_seed, image_size=64), delta=settings.delta)
    adapters = {"untrained": None, "sft": out / "runs" / "sft" / "adapter", "grpo": out / "runs" / "grpo" / "adapter"}
    evals = {}
    for name in MODELS:
        with phase(f"eval_{name}"):
            evals[name] = evaluate_model(model_dir, adapters[name], test, settings, scorer, label=name,
                                         prior=prior if name != "untrained" else None)
            m = evals[name]["means"]
            echo("  " + ", ".join(f"{t} {m[t]:.3f}" for t in (*TERMS, "total")))
    # image ablations of the trained models: the same prompts and seeds, the slices blacked out or swapped
    ablations: Dict[str, Dict[str, dict]] = {}
    for name in ("sft", "grpo"):
        ablations[name] = {"own": evals[name]["means"]}
        for images in ablation_kinds:
            with phase(f"eval_{name}_{images}"):
                ev = evaluate_model(model_dir, adapters[name], test, settings, scorer, label=f"{name} {images}",
                                    images=images, partners=partners, prior=prior)
                ablations[name][images] = ev["means"]
                echo("  " + ", ".join(f"{t} {ev['means'][t]:.3f}" for t in (*TERMS, "total")))
    timings["total"] = round(time.perf_counter() - t_all, 1)

    result = {name: {k: round(v, 4) for k, v in evals[name]["means"].items()
                     if k in (*TERMS, "total")} for name in MODELS}
    result.update({
        "reference": {"label_prior_box": round(prior_box, 4),
                      "what": "box reward of each label's mean training key-slice boxes against the test "
                              "samples' boxes on their true key slice: a model that never looks at the image",
                      "label_prior_box_on_model_slice": {n: round(evals[n]["means"]["box_prior_same_slice"], 4)
                                                         for n in ("sft", "grpo")},
                      "what_on_model_slice": "the same content-blind boxes scored on the slice each of the model's "
                                             "completions chose (0 where the completion does not parse): the model's "
                                             "box column with the slice choice held equal"},
        "ablations": ablation_table(ablations),
        "settings": asdict(settings),
        "timings_s": timings,
        "data": {"cases": rows, "train_samples": len(train), "test_samples_scored": [s["id"] for s in test],
                 "test_samples_prepared": summary["samples_by_split"]["test"],
                 "train_labels": sorted({s["label"] for s in train}), "train_bands": TRAIN_BANDS,
                 "test_bands": TEST_BANDS},
        "model": {"size": settings.model, "parameters": n_params, "dir": str(model_dir)},
        "torch_threads": torch.get_num_threads(),
        "evaluation": {"samples_per_prompt": settings.samples_per_prompt, "temperature": settings.temperature,
                       "top_p": settings.top_p, "top_k": settings.top_k, "constrained": False,
                       "max_new_tokens": settings.max_completion_length, "completions_per_model": evals["sft"]["completions"],
                       "consistency": f"MedSAM2 with seeded random weights (seed {settings.sam_seed}, 64 px), "
                                      f"delta {settings.delta}: noise, not a measure of segmentation",
                       "per_model": {n: {k: evals[n][k] for k in ("per_label_total", "mean_completion_tokens",
                                                                  "examples")} for n in MODELS}},
    })
    result["training"] = {
        "sft": {k: sft[k] for k in ("global_step", "seconds", "seconds_per_step", "loss_first", "loss_last",
                                    "loss_history")},
        "grpo": {k: grpo[k] for k in ("global_step", "seconds", "seconds_per_step", "reward_weights",
                                      "reward_failures", "history")}}
    result["notes"] = [
        "Both CTs are one patient: the test split is held out by z-range of that patient (no test slice is a "
        "training slice) and by description, not by patient.",
        "MedSAM2 has random weights: the consistency column is computed and reported but is noise; GRPO "
        f"trained with lambda_consistency = {settings.lambda_consistency}.",
        "The model is a small Qwen3-VL with random initial weights built locally (no download); its answers "
        "mean nothing outside this benchmark.",
        f"Sampling (GRPO rollouts and evaluation, no grammar): temperature {settings.temperature}, top_p "
        f"{settings.top_p}, top_k {settings.top_k} (the grounder's 'real' preset), {settings.samples_per_prompt} "
        "seeded samples per test prompt, the same seeds for every model.",
        "SFT targets use one short reasoning template (short_think_targets); no reward reads the reasoning.",
    ] + (["--quick: a few steps only, a smoke test of the pipeline; the numbers mean nothing."] if settings.quick
         else [])
    same = result["reference"]["label_prior_box_on_model_slice"]
    table = learning_table(result) + (f"\n\nContent-blind reference: each label's mean training box on the true key "
                                    f"slice scores box {prior_box:.3f}; on the slices the models chose, "
                                    f"{same['sft']:.3f} (SFT's) and {same['grpo']:.3f} (GRPO's).")
    plot_curves(out / "curves.png", sft["loss_history"], grpo["history"],
                title=f"MedVol-R1 learning benchmark ({settings.model} model, seed {settings.seed})")
    write_result(out, result, table)
    echo("")
    echo(table)
    echo("")
    echo("timings (s): " + ", ".join(f"{k} {v:.1f}" for k, v in timings.items()))
    echo(f"wrote {out / RESULT}, {out / 'table.md'} and {out / 'curves.png'}")
    return result


__all__ = ["BenchSettings", "run_benchmark", "build_cases", "evaluate_model", "sample_completions",
           "select_test_samples", "default_real_dir", "TRAIN_BANDS", "TEST_BANDS", "prior_boxes", "label_prior_box"]
