"""``medvol-train bench-learning``: does training work? A grounding task small enough for a CPU,
trained with SFT then GRPO, and the untrained, SFT and GRPO models scored with the same rewards.

What it does (all inside ``DIR``)
---------------------------------
1. **Cases** (``DIR/cases/*.nii.gz``, ``DIR/cases.jsonl``): short axial crops (6–10 slices) of the
   shared real CT ``example_ct`` (labels ``example_seg_fast_force_split``) and, for the upper slab it
   covers, of ``example_ct_sm`` (labels ``example_seg``; its voxels are ``example_ct``'s first 30
   stack slices, so it adds a second label map, not a second patient). Each crop gets an in-plane
   shift (crop on one side, air padding on the other; never a flip or a rotation, so the canonical
   orientation holds) and an intensity jitter (HU scale and offset). A crop is written as a NIfTI
   whose array *is* the canonical stack (``stack[z, y, x]``) with the source's stack-to-RAS affine
   shifted to the crop, so its world coordinates stay the patient's.
2. **Held-out split.** Both CTs are **one patient**, so the test split cannot be a new patient. It
   is held out by **z-range** of that patient: five 6-slice test bands (stack z ``[10, 16)``,
   ``[26, 32)``, ``[44, 50)``, ``[66, 72)``, ``[86, 92)``) interleaved with six train bands (the rest);
   no test slice is ever a training slice, and a test slice is at most 9 mm (3 slices) from the
   nearest training slice, so the test asks for the same organs on slices the model has not seen
   *between* slices it has. (Two wide test bands, ``[22, 36)`` and ``[76, 92)``, were tried first:
   there the organs' shapes are ones no training slab shows, and the SFT box reward on them was
   0.03–0.05 for every variant tried, against up to 0.15 on training crops; see
   ``Training/README.md``.) It is held out by **description** as well
   (:class:`~medvoltrain.queries.QueryBank`: test queries use only the held-out descriptions of each
   label). Targets are organs present in both splits: liver, spleen, kidneys (right, left, both),
   gallbladder, stomach, pancreas, duodenum, aorta, inferior vena cava, urinary bladder and
   sacrum, with TotalSegmentator ids from the shared crosswalk.
3. ``prepare`` (``DIR/data``; Top-1 key slice), the SFT targets' reasoning shortened to one
   template (:func:`short_think_targets`) → ``train_sft`` (``DIR/runs/sft``) → ``train_grpo`` from the
   SFT adapter (``DIR/runs/grpo``; λc = 0 by default: MedSAM2 has random weights here, so the
   consistency term is noise).
4. **Evaluation** of the untrained base, the SFT adapter and the GRPO adapter on the test split:
   each prompt is *sampled* without a grammar ``samples_per_prompt`` times with fixed seeds (the same
   seeds for every model), and every completion is scored with
   :class:`~medvoltrain.rewards.RewardFunctions` (format, axial, box; consistency with seeded random
   MedSAM2, Δ = ``delta``). ``total = format + axial + box``. Sampling uses the grounder's own
   settings for real models (``Resources/prompts/grounder.json`` preset ``real``: temperature 0.7,
   top-p 0.8, top-k 20), for the GRPO rollouts as well as for the evaluation: a model trained from
   random weights in a few CPU minutes keeps a long flat tail over its 660 tokens, and at
   temperature 1 with no truncation nearly every completion leaves the format at some token
   (measured: 0 % well-formed after 1200 SFT steps, against 98 % with the ``real`` settings).
   The SFT and GRPO adapters are scored again with their slices **ablated** — blacked out, and
   swapped for another test band's crop (same prompts, same seeds) — so the images' contribution is
   a number with a standard error (``ablations``); and the content-blind boxes are scored on the
   slices the models chose as well as on the true key slice (``reference``), so the box column has a
   like-for-like reference. Whether the image path works at all is the vision stage's question
   (:mod:`medvoltrain.bench_vision`, ``medvol-train bench-vision``).
5. ``DIR/result.json`` (``{"untrained": {...}, "sft": {...}, "grpo": {...}}`` plus ``ablations``, ``settings``,
   ``timings_s``, ``data``, ``model``, ``evaluation``, ``training``, ``notes``), ``DIR/curves.png`` (SFT
   loss, GRPO reward terms per step) and ``DIR/table.md``.

The model (``DIR/model``): a Qwen3-VL with seeded random weights, built locally (nothing is
downloaded). ``model="seeing"`` (default) is the vision stage's model (head_dim 32, rope_theta
10 000, a sine/cosine vision position table; see :data:`MODEL_SIZES`); ``model="tiny"`` has the tiny
preset's language and vision sizes (the default until the image ablations showed that its adapters
scored the same with black slices), ``model="bench"`` a wider and deeper one. Three changes from the tiny preset,
each because without it the model did not learn the task in CPU minutes (measured, see
``Training/README.md``):

* **Tokenizer** (``vocab_size``): the tiny preset's byte-level BPE (same pre-tokenizer — digits stay
  single tokens — same special tokens and chat template) with its merges learnt from the *training*
  split's text (:func:`tokenizer_corpus`), so words are tokens as in a real Qwen vocabulary. Test
  descriptions are not in that text: a held-out description reaches the model through the words it
  shares with training text. With the 640-merge tokenizer, words are letter pieces.
* **Vision patch** (``image_patch``, default 32): 16 tokens per 256 × 256 slice instead of 64; the
  image processor and the vision tower agree, and the grounder's prompt builder counts the image
  tokens from the processor's grid as always. A quarter of the image tokens make a step about 3×
  cheaper and dilute the query less among them.
* **Output head** drawn with std ``2/sqrt(hidden)`` instead of 0.02 (see :func:`build_model`).

Training uses the product's SFT and GRPO with a LoRA plus
``lora_modules_to_save="embed_tokens,lm_head,visual,q_norm,k_norm"`` (PEFT trains those in full and
stores them in the adapter). A LoRA alone cannot move a random model's token embeddings, and then
the model never learns which organ a query describes: with the LoRA alone, every SFT variant tried
answered the label distribution's mode for every query (1/13 of the organs right, on the training
queries too) while the attention from the answer to the query stayed at about 3 %. The vision tower
(random here) and the q/k norms are trained in full for the same reason on the image side; SFT's
learning rate is 1e-3, since at 5e-3 the fully trained tower's output became constant.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from medvolcore.errors import InputError, OutputExistsError

from .errors import DataError
from .queries import seeded_rng

log = logging.getLogger(__name__)

RESULT = "result.json"
MODELS = ("untrained", "sft", "grpo")
TERMS = ("format", "axial", "box", "consistency")

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

# Language-model / vision-tower sizes of the bench model (the tokenizer and vision geometry are tiny's).
MODEL_SIZES = {
    "tiny": {"text": {}, "vision": {}},  # the tiny preset's own sizes (medvolcore.tiny)
    "bench": {"text": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=32,
                           rope_parameters={"rope_type": "default", "rope_theta": 5000000.0,
                                            "mrope_section": [8, 4, 4], "mrope_interleaved": True}),
              "vision": dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=128)},
    # The model of the vision sanity stage (medvoltrain.bench_vision), chosen because it learns from pixels
    # in CPU minutes where "tiny" and "bench" did not (Training/README.md, "Does the model read the images?"):
    # * head_dim 32 and rope_theta 10 000 (tiny: 16 and 5e6): with 5e6 the rotary step between neighbouring
    #   image-grid cells is 0.02–0.15 rad in the fastest row and column pairs, so attention barely tells one
    #   image position from the next; here it is 0.56 (rows) and 0.32 rad (columns), nearer Qwen3-VL-4B's 0.6–0.8;
    # * three layers of width 128: room for a slice-comparing circuit, still ≈ 1.3 M parameters;
    # * "pos_sincos": the vision tower's learnt position table starts as a 2-D sine/cosine code instead of
    #   N(0, 0.02), which next to patch features of unit size says almost nothing about where a patch is.
    # The recipe trains the vision tower and the q/k norms in full beside the LoRA (bench_vision).
    "seeing": {"text": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=32,
                            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                             "mrope_section": [8, 4, 4], "mrope_interleaved": True}),
               "vision": dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=128),
               "pos_sincos": True},
}
BENCH_MODEL_SEED = 20240614
HEAD_STD = 2.0  # output head init: std HEAD_STD / sqrt(hidden) (see build_model)


@dataclass
class BenchSettings:
    """Everything the benchmark does; ``quick()`` is the few-step smoke version used by the tests."""

    seed: int = 0
    # a key of MODEL_SIZES; "seeing" (the vision stage's model) because with the tiny sizes the trained
    # adapters scored the same with their slices blacked out (Training/README.md, image ablations)
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
    # tower (see the module docstring)
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
    # shared 2-core machine two threads spin against the other jobs (measured 5 s per SFT step with
    # two threads against 0.7 s with one, with one other job running; 0.45 s with two on an idle CPU).
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
    """``$MEDVOL_REAL_DATA``, else ``../shared/data/real`` beside the repository."""
    env = os.environ.get("MEDVOL_REAL_DATA")
    if env:
        return Path(env).expanduser()
    return Path(__file__).resolve().parents[2].parent / "shared" / "data" / "real"


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
                raise DataError(f"{ts / f} is missing: the learning benchmark needs the shared real CTs "
                                f"(--real-dir or $MEDVOL_REAL_DATA; see ../shared/data/real/README.md)")
        v = load_volume(ts / vol)
        stack = AxialStack(v)
        labels = stack.to_stack(load_label_map(ts / lab).array)
        out.append(_Source(name, np.ascontiguousarray(stack.data, dtype=np.float32), np.ascontiguousarray(labels),
                           stack.index_to_ras.copy(), 0, str(ts / vol), str(ts / lab)))
    ct, sm = out
    if sm.stack_hu.shape[0] != SM_DEPTH or not np.array_equal(sm.stack_hu, ct.stack_hu[:SM_DEPTH]):
        raise DataError("example_ct_sm is not example_ct's first 30 stack slices any more; the benchmark's "
                        "z-ranges assume it is (see the shared data README)")
    sm.index_to_ras = ct.index_to_ras.copy()  # sm's own header is a quirk: same patient frame as ct
    return out


def _targets(real_dir: Path) -> Dict[str, List[int]]:
    """Target name → TotalSegmentator ids, from the shared M3D → TotalSegmentator crosswalk."""
    path = real_dir / "text" / "m3d_to_totalseg_crosswalk.json"
    if not path.is_file():
        raise DataError(f"{path} is missing (see ../shared/data/real/README.md)")
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
    from .datasets import write_manifest

    manifest = write_manifest(rows, out_dir / "cases.jsonl", overwrite=True)
    return Path(manifest), rows


THINK_TEMPLATE = "The query describes the {target}; slice {slice}."


def short_think_targets(data_dir, template: str = THINK_TEMPLATE) -> int:
    """Rewrite the SFT targets of a prepared set with one short reasoning sentence; returns the count.

    ``prepare`` draws the ``<think>`` sentence from five templates (Resources/training/think_templates.json).
    No reward reads the reasoning, and for a model trained from random weights in a few hundred CPU
    steps every extra token of free text is one more place where a sampled completion leaves the
    format; one short template spends those steps on the answer instead. The key slice and the
    boxes (``target_info``) are unchanged; the text is rebuilt with
    :func:`medvolcore.answer.format_answer` as ``prepare`` builds it.
    """
    from medvolcore.answer import format_answer

    from .prepare import INDEX, _write_json, load_samples

    samples = load_samples(data_dir)
    for s in samples:
        info = s["target_info"]
        think = template.replace("{target}", s["label"].replace("_", " ")).replace("{slice}", str(int(info["slice"])))
        info["think"] = think
        s["target"] = info["text"] = format_answer(int(info["slice"]), info["boxes_norm"], think)
        s.pop("data_dir", None)
    _write_json(Path(data_dir) / INDEX, samples, lines=True)
    return len(samples)


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


# ---- the model -----------------------------------------------------------------------------

def tokenizer_corpus(train_samples: Sequence[dict]) -> List[str]:
    """The text the benchmark's tokenizer learns its vocabulary from: the *training* samples'
    prompts (system and user text, queries) and targets — never a test query, so a held-out
    description reaches the model only through the words it shares with the training text."""
    texts: List[str] = []
    for s in train_samples:
        for m in s.get("messages", []):
            content = m.get("content")
            if isinstance(content, str):
                texts.append(content)
            elif isinstance(content, list):
                texts.extend(str(c.get("text")) for c in content if isinstance(c, dict) and c.get("text"))
        texts.append(str(s["query"]))
        texts.append(str(s["target"]))
    return list(dict.fromkeys(texts))


def build_model(folder, size: str, corpus: Optional[Sequence[str]] = None, vocab_size: int = 0,
                patch_size: int = 16) -> Path:
    """The benchmark's base model in ``folder``: seeded random weights, built locally (no download).

    The tiny preset's tokenizer (or, with ``vocab_size`` and ``corpus``, the same kind of tokenizer
    with its merges learnt from ``corpus``), image processor and vision geometry (patch
    ``patch_size``), with the sizes of :data:`MODEL_SIZES` (``tiny``: the tiny preset's own sizes).
    One change from the tiny preset's initialisation: the output head is drawn with std
    ``HEAD_STD/sqrt(hidden)`` instead of 0.02. With a 0.02 head the largest logit a unit-RMS hidden
    state can reach is about ``0.02 · hidden`` (1.3 for the tiny model), and a LoRA, which does not
    adapt the head, leaves such a model near uniform over its vocabulary, so sampling it never gives
    a well-formed answer.
    """
    import hashlib

    from medvolcore import tiny

    folder = Path(folder)
    marker = f"medvol-bench-qwen3-vl/{size}/head{HEAD_STD:g}"
    if vocab_size:
        if not corpus:
            raise InputError("a benchmark tokenizer with its own vocabulary needs a training corpus")
        digest = hashlib.sha256("\n".join(corpus).encode("utf-8")).hexdigest()[:16]
        marker += f"/vocab{int(vocab_size)}-{digest}"
    marker += f"/patch{int(patch_size)}"
    if (folder / tiny.MARKER).is_file() and (folder / tiny.MARKER).read_text(encoding="utf-8").strip() == marker:
        return folder
    import torch
    from transformers import GenerationConfig, Qwen3VLConfig, Qwen3VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    tokenizer = tiny.build_tokenizer(corpus, vocab_size) if vocab_size else tiny.build_tokenizer()
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in tiny.SPECIAL_TOKENS}
    sizes = MODEL_SIZES[size]
    if sizes.get("pos_sincos"):
        marker += "/pos-sincos"
    config = Qwen3VLConfig(
        text_config=dict(tiny.TEXT_CONFIG, **sizes["text"], vocab_size=len(tokenizer), pad_token_id=ids["<|endoftext|>"]),
        vision_config=dict(tiny.VISION_CONFIG, **sizes["vision"], patch_size=int(patch_size)),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(BENCH_MODEL_SEED)
        model = Qwen3VLForConditionalGeneration(config).to(torch.float32).eval()
        head = model.get_output_embeddings().weight
        with torch.no_grad():
            head.normal_(0.0, HEAD_STD / math.sqrt(head.shape[1]))
            if sizes.get("pos_sincos"):
                table = model.model.visual.pos_embed.weight
                table.copy_(torch.from_numpy(sincos_positions(*table.shape)).to(table.dtype))
    model.generation_config = GenerationConfig(eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]],
                                               pad_token_id=ids["<|endoftext|>"], do_sample=False)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    Qwen2VLImageProcessorPil(**dict(tiny.IMAGE_PROCESSOR, patch_size=int(patch_size))).save_pretrained(folder)
    n_params = sum(p.numel() for p in model.parameters())
    (folder / "medvol_model.json").write_text(json.dumps({
        "smoke": True, "note": f"untrained {size} Qwen3-VL of the learning benchmark ({n_params} parameters): "
                               "its answers are meaningless", "build": marker, "seed": BENCH_MODEL_SEED,
        "parameters": n_params}, indent=2) + "\n", encoding="utf-8")
    (folder / tiny.MARKER).write_text(marker + "\n", encoding="utf-8")
    return folder


def sincos_positions(n: int, dim: int) -> np.ndarray:
    """A 2-D sine/cosine position code for a vision tower's learnt position table of ``n`` entries
    (a √n × √n grid, row-major, as Qwen3-VL interpolates it) and width ``dim``: a quarter of the
    channels each for sin(row·ω), cos(row·ω), sin(col·ω), cos(col·ω), with ω from 1 down to 0.01
    radians per grid step (any leftover channels zero). Unit-size entries, like the patch features."""
    side = int(round(math.sqrt(n)))
    if side * side != n:
        raise InputError(f"a position table of {n} entries is not a square grid")
    rows, cols = np.meshgrid(np.arange(side), np.arange(side), indexing="ij")
    q = dim // 4
    omega = 1.0 / (100.0 ** (np.arange(q) / max(1, q - 1)))
    parts = []
    for c in (rows.reshape(-1), cols.reshape(-1)):
        a = c[:, None] * omega[None, :]
        parts += [np.sin(a), np.cos(a)]
    code = np.zeros((n, dim), np.float32)
    code[:, :4 * q] = np.concatenate(parts, axis=1)
    return code


def count_parameters(model_dir) -> int:
    from safetensors import safe_open

    n = 0
    for f in Path(model_dir).glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                n += int(np.prod(st.get_slice(k).get_shape()))
    return n


# ---- evaluation ----------------------------------------------------------------------------

def sample_completions(grounder, sample: dict, n: int, seed: int, max_new_tokens: int,
                       temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, images=None) -> List[str]:
    """``n`` completions of one prepared sample, sampled from the model itself (no grammar), with
    a fixed seed; cut at the end-of-turn token as the GRPO reward functions cut them. Vision
    placeholder tokens are never sampled (as in the GRPO rollouts). ``images``: the slices to show
    instead of the sample's own (the image ablations)."""
    import torch
    from transformers import GenerationConfig

    from .grpo import _suppressed_ids
    from .prepare import load_slices

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

    from .bench_vision import ablated_images
    from .rewards import RewardFunctions, box_reward, parsed

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
        v = np.asarray(v, dtype=float)
        means[f"{t}_se"] = float(v.std(ddof=1) / math.sqrt(len(v))) if len(v) > 1 and np.isfinite(v).all() else float("nan")
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
    from .rewards import box_reward

    prior = prior_boxes(train_samples)
    scores = []
    for s in test_samples:
        k = int(s["target_info"]["slice"])
        gt = s["gt_boxes_norm"].get(str(k), s["gt_boxes_norm"].get(k, []))
        scores.append(box_reward(prior[s["label"]], gt) if s["label"] in prior else 0.0)
    return float(np.mean(scores)) if scores else 0.0


# ---- reward curves (PIL: matplotlib is not a dependency) --------------------------------------

_COLOURS = {"loss": (31, 119, 180), "format": (31, 119, 180), "axial": (255, 127, 14), "box": (44, 160, 44),
            "consistency": (148, 103, 189), "reward": (60, 60, 60)}


def _panel(draw, box, title: str, series: Dict[str, List[Tuple[float, float]]], y_label: str, font) -> None:
    x0, y0, x1, y1 = box
    left, right, top, bottom = x0 + 56, x1 - 12, y0 + 28, y1 - 40
    draw.text((x0 + 8, y0 + 6), title, fill=(0, 0, 0), font=font)
    pts = [p for s in series.values() for p in s]
    if not pts:
        draw.text((left + 10, (top + bottom) // 2), "nothing logged", fill=(120, 120, 120), font=font)
        return
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    xmin, xmax = min(xs), max(xs)
    ymin, ymax = min(0.0, min(ys)), max(ys)
    if xmax == xmin:
        xmax = xmin + 1
    if ymax - ymin < 1e-9:
        ymax = ymin + 1
    ymax += 0.05 * (ymax - ymin)

    def px(x, y):
        return (left + (x - xmin) / (xmax - xmin) * (right - left), bottom - (y - ymin) / (ymax - ymin) * (bottom - top))

    draw.rectangle([left, top, right, bottom], outline=(0, 0, 0))
    for k in range(6):
        yv = ymin + k * (ymax - ymin) / 5
        _, yy = px(xmin, yv)
        draw.line([left - 4, yy, left, yy], fill=(0, 0, 0))
        draw.line([left + 1, yy, right - 1, yy], fill=(230, 230, 230))
        draw.text((x0 + 4, yy - 6), f"{yv:.2f}", fill=(0, 0, 0), font=font)
        xv = xmin + k * (xmax - xmin) / 5
        xx, _ = px(xv, ymin)
        draw.line([xx, bottom, xx, bottom + 4], fill=(0, 0, 0))
        draw.text((xx - 8, bottom + 6), f"{xv:.0f}", fill=(0, 0, 0), font=font)
    draw.text(((left + right) // 2 - 12, bottom + 22), "step", fill=(0, 0, 0), font=font)
    draw.text((left + 4, top + 4), y_label, fill=(90, 90, 90), font=font)
    for i, (name, s) in enumerate(series.items()):
        colour = _COLOURS.get(name, (0, 0, 0))
        line = [px(x, y) for x, y in s]
        if len(line) > 1:
            draw.line(line, fill=colour, width=2)
        for x, y in line:
            draw.ellipse([x - 2, y - 2, x + 2, y + 2], fill=colour)
        lx, ly = right - 110, top + 6 + 14 * i
        draw.line([lx, ly + 6, lx + 18, ly + 6], fill=colour, width=3)
        draw.text((lx + 22, ly), name, fill=(0, 0, 0), font=font)


def plot_curves(path, sft_history: List[dict], grpo_history: List[dict], title: str = "") -> Path:
    """``path`` (PNG): SFT loss per step (left) and GRPO per-term reward means per step (right)."""
    from PIL import Image, ImageDraw, ImageFont

    img = Image.new("RGB", (1100, 420), (255, 255, 255))
    draw = ImageDraw.Draw(img)
    font = ImageFont.load_default()
    sft = {"loss": [(h["step"], h["loss"]) for h in sft_history if h.get("loss") is not None]}
    grpo = {}
    for term in (*TERMS, "reward"):
        key = "reward" if term == "reward" else f"rewards/{term}/mean"
        pts = [(h["step"], h[key]) for h in grpo_history if key in h and h[key] is not None
               and math.isfinite(h[key])]
        if pts:
            grpo[term] = pts
    _panel(draw, (0, 20, 550, 420), "SFT: training loss (completion tokens)", sft, "loss", font)
    _panel(draw, (550, 20, 1100, 420), "GRPO: mean reward per term (rollouts)", grpo, "reward", font)
    if title:
        draw.text((8, 4), title, fill=(0, 0, 0), font=font)
    from medvolcore.fileio import atomic_path

    with atomic_path(path, overwrite=True) as tmp:
        img.save(str(tmp), format="PNG")
    return Path(path)


# ---- the benchmark ---------------------------------------------------------------------------

_OWNED = ("cases", "cases.jsonl", "data", "model", "runs", RESULT, "curves.png", "table.md")


ABLATIONS = ("black", "swapped")


def _ablation_table(ablations: Dict[str, Dict[str, dict]]) -> dict:
    """Per trained model and image condition, each term's mean and standard error, and the image
    contribution (own − ablated) with its standard error (the two conditions' errors combined as if
    independent: conservative, since both use the same prompts and seeds)."""
    out: Dict[str, dict] = {}
    for name, conds in ablations.items():
        out[name] = {c: {t: [round(m[t], 4), round(m[f"{t}_se"], 4)] for t in (*TERMS, "total")}
                     for c, m in conds.items()}
        own = conds["own"]
        out[name]["own_minus"] = {
            c: {t: [round(own[t] - conds[c][t], 4), round(math.hypot(own[f"{t}_se"], conds[c][f"{t}_se"]), 4)]
                for t in (*TERMS, "total")} for c in conds if c != "own"}
    return out


def format_table(result: dict) -> str:
    head = f"| model | {' | '.join(TERMS)} | total (f+a+b) |"
    rows = [head, "|" + "---|" * (len(TERMS) + 2)]
    for m in MODELS:
        r = result[m]
        rows.append(f"| {m} | " + " | ".join(f"{r[t]:.3f}" for t in TERMS) + f" | {r['total']:.3f} |")
    for m, conds in result.get("ablations", {}).items():
        for c in ABLATIONS:
            if c in conds:
                r = conds[c]
                rows.append(f"| {m}, {c} slices | " + " | ".join(f"{r[t][0]:.3f}" for t in TERMS)
                            + f" | {r['total'][0]:.3f} |")
    for m, conds in result.get("ablations", {}).items():
        for c, d in conds.get("own_minus", {}).items():
            rows.append(f"| {m}: own − {c} | " + " | ".join(f"{d[t][0]:+.3f} ± {d[t][1]:.3f}" for t in TERMS)
                        + f" | {d['total'][0]:+.3f} ± {d['total'][1]:.3f} |")
    return "\n".join(rows)


def _sft_settings(settings: BenchSettings, model_dir: Path):
    from .config import SFTSettings

    return SFTSettings(preset="tiny", model_path=str(model_dir), lora_r=settings.lora_r, lora_alpha=settings.lora_alpha,
                       lora_dropout=0.0, lora_modules_to_save=settings.lora_modules_to_save,
                       learning_rate=settings.sft_lr, max_steps=settings.sft_steps,
                       per_device_train_batch_size=settings.sft_batch, warmup_ratio=0.05, lr_scheduler_type="cosine",
                       gradient_checkpointing=False, logging_steps=1, save_steps=10 ** 6, save_total_limit=1,
                       report_to="none", dataloader_num_workers=0, seed=settings.seed, bf16=False).validate()


def _grpo_settings(settings: BenchSettings, model_dir: Path):
    from .config import GRPOSettings

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


def _prepare_out(out: Path, overwrite: bool, owned: Sequence[str] = _OWNED, what: str = "a benchmark") -> None:
    """Make ``out``, or empty the entries of it a benchmark writes (``owned``) when ``overwrite``;
    anything else in it is left alone."""
    if out.exists() and not out.is_dir():
        raise InputError(f"{out} exists and is not a folder")
    if out.is_dir():
        present = [n for n in owned if (out / n).exists()]
        if present and not overwrite:
            raise OutputExistsError(f"{out} already holds {what} ({', '.join(present)}); pass --overwrite to "
                                    "run it again there")
        for n in present:
            p = out / n
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    out.mkdir(parents=True, exist_ok=True)


def run_benchmark(out_dir, real_dir=None, settings: Optional[BenchSettings] = None, overwrite: bool = False,
                  echo=None) -> dict:
    """Build the task, train SFT and GRPO, evaluate the three models; returns (and writes) the result.

    ``echo`` (default: print to stdout) receives each progress line, phase times included.
    """
    settings = (settings or BenchSettings()).validate()
    echo = echo or (lambda line: (sys.stdout.write(line + "\n"), sys.stdout.flush()))
    out = Path(out_dir).expanduser().resolve()
    real_dir = Path(real_dir).expanduser().resolve() if real_dir else default_real_dir()
    _prepare_out(out, overwrite)
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

    from .grpo import train_grpo
    from .prepare import PrepareSettings, load_samples, prepare
    from .sft import train_sft

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
        summary = prepare(manifest, out / "data", PrepareSettings(seed=settings.seed, top_k=1), progress=False)
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
        from .bench_vision import swap_partners

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

    from .rewards import ConsistencyScorer

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
        "ablations": _ablation_table(ablations),
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
    from medvolcore.fileio import write_text_atomic

    same = result["reference"]["label_prior_box_on_model_slice"]
    table = format_table(result) + (f"\n\nContent-blind reference: each label's mean training box on the true key "
                                    f"slice scores box {prior_box:.3f}; on the slices the models chose, "
                                    f"{same['sft']:.3f} (SFT's) and {same['grpo']:.3f} (GRPO's).")
    write_text_atomic(out / "table.md", table + "\n", overwrite=True)
    plot_curves(out / "curves.png", sft["loss_history"], grpo["history"],
                title=f"MedVol-R1 learning benchmark ({settings.model} model, seed {settings.seed})")
    write_text_atomic(out / RESULT, json.dumps(result, indent=1, default=_json_default) + "\n", overwrite=True)
    echo("")
    echo(table)
    echo("")
    echo("timings (s): " + ", ".join(f"{k} {v:.1f}" for k, v in timings.items()))
    echo(f"wrote {out / RESULT}, {out / 'table.md'} and {out / 'curves.png'}")
    return result


def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


__all__ = ["BenchSettings", "run_benchmark", "build_cases", "build_model", "evaluate_model", "sample_completions",
           "select_test_samples", "plot_curves", "format_table", "default_real_dir", "TRAIN_BANDS", "TEST_BANDS",
           "MODEL_SIZES", "RESULT", "prior_boxes", "sincos_positions", "ABLATIONS"]
