"""``medvol-train bench-vision``: does the image path carry pixels to the answer?

Synthetic volumes with one bright square (:func:`build_cases`; the query is always "the bright
object", so only the pixels say which slice and where) go through the product's own data path
(``prepare`` → the grounder's prompt builder → the SFT collator → :func:`~medvoltrain.sft.train_sft`).
The trained adapter then answers each held-out volume greedily, without a grammar, with its
**own** slices, with **swapped** slices (another test volume's, the same prompt text) and with
**black** slices (:func:`score_conditions`). Each condition gets, with its standard error:

* ``key``: the answer's slice is the key slice (the square's largest cross-section);
* ``box``: the product's box reward (IoU with the truth of the slice the answer names);
* ``box_true_slice``: the answer's boxes against the key slice's truth, whatever slice it named;
* ``format``: the answer parses.

Inputs: :class:`VisionBenchSettings` (defaults: the full stage; ``quick_settings()``: the test
suite's variant). Everything it writes stays in ``DIR`` (:func:`run_vision_benchmark`):
``cases/``, ``cases.jsonl``, ``data/``, ``model/``, ``runs/sft``, ``table.md`` and ``result.json``
(``scores``, ``chance``, ``goals``, ``settings``, ``model``, ``training``, ``data``, ``timings_s``,
``torch_threads``).

The task, its two variants, the model and the measured runs: ``docs/learning-benchmarks.md``, "Does the
model read the images? (`medvol-train bench-vision`)".
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional

import numpy as np

from medvolcore.errors import InputError

from ..errors import DataError
from .common import CONDITIONS, ablated_images, mean_se, run_stage, short_think_targets, swap_partners
from .model import MODEL_SIZES, build_model, count_parameters, tokenizer_corpus
from .report import METRICS, RESULT, finish_stage, vision_table

log = logging.getLogger(__name__)

TARGET = "bright_object"
# the canonical stack [z, y, x] (z head → feet, y anterior → posterior, x patient right → left) as a
# NIfTI array: z is −S at 3 mm, y is −A, x is −R (RAS+), 1 mm in plane
STACK_AFFINE = np.array([[0.0, 0.0, -1.0, 0.0], [0.0, -1.0, 0.0, 0.0], [-3.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]])


@dataclass
class VisionBenchSettings:
    """The vision sanity stage. Defaults: the full stage; :meth:`quick_settings`: the variant the test
    suite runs (their times: docs/learning-benchmarks.md, "Does the model read the images?")."""

    seed: int = 0
    # -- the task --
    depth: int = 4  # slices per volume (all shown)
    size: int = 64  # in-plane pixels
    object_slices: int = 1  # consecutive slices with the square; the key slice is the middle one
    placement: str = "grid"  # "grid": the square is one image token; "free": any pixel, side_min..side_max
    hold_out: str = "volumes"  # "volumes": new volumes, positions of the same grid; "positions": checkerboard
    side_min: int = 16  # (placement "free")
    side_max: int = 32
    cell: int = 8  # checkerboard cell (pixels) of hold_out "positions" with placement "free"
    train_cases: int = 2400
    test_cases: int = 40
    # -- the model and the recipe --
    model: str = "seeing"  # a key of model.MODEL_SIZES
    vocab_size: int = 1024
    image_patch: int = 32
    steps: int = 2400
    lr: float = 1e-3
    batch: int = 2
    lora_r: int = 32
    lora_alpha: int = 64
    lora_modules_to_save: str = "embed_tokens,lm_head,visual,q_norm,k_norm"
    max_new_tokens: int = 64
    threads: Optional[int] = 1
    quick: bool = False

    @classmethod
    def quick_settings(cls, **kw) -> "VisionBenchSettings":
        """The test suite's variant: 4 slices with the square on one, 64-pixel slices, 150 volumes."""
        base = dict(depth=4, size=64, object_slices=1, placement="free", hold_out="positions", side_min=16,
                    side_max=32, cell=8, train_cases=150, test_cases=24, steps=600, quick=True)
        base.update(kw)
        return cls(**base)

    @property
    def key_positions(self) -> int:
        return self.depth - self.object_slices + 1

    @property
    def tokens_per_side(self) -> int:
        """Image tokens along a side of a rendered slice (the prompt's 256 pixels, patch ``image_patch``,
        2 × 2 merge)."""
        from ..prepare import _prompt_geometry

        return _prompt_geometry()[1] // (2 * self.image_patch)

    @property
    def checker_cell(self) -> int:
        """The checkerboard cell of hold_out 'positions': one image token with placement 'grid'."""
        return self.size // self.tokens_per_side if self.placement == "grid" else self.cell

    def validate(self) -> "VisionBenchSettings":
        for key in ("depth", "size", "object_slices", "side_min", "cell", "train_cases", "steps", "batch",
                    "lora_r", "max_new_tokens"):
            if getattr(self, key) < 1:
                raise InputError(f"{key} must be ≥ 1, got {getattr(self, key)}")
        if self.test_cases < 2:
            raise InputError(f"test_cases must be ≥ 2 (the swapped-slices control needs another volume), "
                             f"got {self.test_cases}")
        if self.placement not in ("grid", "free"):
            raise InputError(f"placement must be 'grid' or 'free', got {self.placement!r}")
        if self.hold_out not in ("volumes", "positions"):
            raise InputError(f"hold_out must be 'volumes' or 'positions', got {self.hold_out!r}")
        if self.placement == "grid" and (self.size % self.tokens_per_side or self.size < self.tokens_per_side):
            raise InputError(f"placement 'grid' needs a size ({self.size}) that is a multiple of the "
                             f"{self.tokens_per_side} image tokens along a side")
        if self.object_slices > self.depth:
            raise InputError(f"object_slices ({self.object_slices}) > depth ({self.depth})")
        if self.placement == "free" and not self.side_min <= self.side_max <= self.size:
            raise InputError(f"need side_min ≤ side_max ≤ size, got {self.side_min}, {self.side_max}, {self.size}")
        if self.hold_out == "positions" and self.size < 2 * self.checker_cell:
            raise InputError(f"size ({self.size}) must hold two checkerboard cells of {self.checker_cell} pixels")
        if self.model not in MODEL_SIZES:
            raise InputError(f"model must be one of {', '.join(MODEL_SIZES)}, got {self.model!r}")
        if self.image_patch not in (16, 32, 64):
            raise InputError(f"image_patch must be 16, 32 or 64, got {self.image_patch}")
        if self.lr <= 0:
            raise InputError(f"lr must be > 0, got {self.lr}")
        if self.threads is not None and self.threads < 0:
            raise InputError(f"threads must be ≥ 0 (0: torch's choice), got {self.threads}")
        return self


# ---- data ------------------------------------------------------------------------------------

def held_out(x0: int, y0: int, cell: int) -> bool:
    """True when a square whose top-left corner is (x0, y0) belongs to the test split."""
    return (x0 // cell + y0 // cell) % 2 == 1


def build_cases(out_dir, settings: VisionBenchSettings) -> List[dict]:
    """Write the synthetic volumes and their label maps (``out_dir/cases``) and the manifest
    (``out_dir/cases.jsonl``); returns the manifest rows (with ``square``: z0, y0, x0, side)."""
    import nibabel as nib

    from ..datasets import write_manifest
    from ..queries import seeded_rng

    out_dir = Path(out_dir)
    folder = out_dir / "cases"
    folder.mkdir(parents=True, exist_ok=True)
    rng = seeded_rng(settings.seed, "bench-vision", "cases")
    d, s, k = settings.depth, settings.size, settings.object_slices
    rows: List[dict] = []
    for split, n in (("train", settings.train_cases), ("test", settings.test_cases)):
        made = 0
        while made < n:
            if settings.placement == "grid":  # exactly one image token of the rendered slice
                side, tokens = s // settings.tokens_per_side, settings.tokens_per_side
                x0, y0 = side * int(rng.integers(0, tokens)), side * int(rng.integers(0, tokens))
            else:
                side = int(rng.integers(settings.side_min, settings.side_max + 1))
                x0, y0 = int(rng.integers(0, s - side + 1)), int(rng.integers(0, s - side + 1))
            if settings.hold_out == "positions" and held_out(x0, y0, settings.checker_cell) != (split == "test"):
                continue
            z0 = int(rng.integers(0, d - k + 1))
            hu = rng.normal(40.0, 15.0, size=(d, s, s))
            lab = np.zeros((d, s, s), np.uint8)
            for j in range(k):
                if j == k // 2:
                    lab[z0 + j, y0:y0 + side, x0:x0 + side] = 1
                else:  # a smaller square inside, so the middle slice is the largest
                    inner = max(1, side - 2 - int(rng.integers(0, max(1, side // 3))))
                    a = (side - inner) // 2
                    lab[z0 + j, y0 + a:y0 + a + inner, x0 + a:x0 + a + inner] = 1
            hu[lab > 0] = rng.normal(300.0, 20.0, size=int(lab.sum()))
            cid = f"{split}{made:04d}"
            nib.save(nib.Nifti1Image(np.rint(hu).astype(np.int16), STACK_AFFINE), str(folder / f"{cid}.nii.gz"))
            nib.save(nib.Nifti1Image(lab, STACK_AFFINE), str(folder / f"{cid}_seg.nii.gz"))
            rows.append({"id": cid, "volume": str(folder / f"{cid}.nii.gz"), "labels": str(folder / f"{cid}_seg.nii.gz"),
                         "split": split, "targets": {TARGET: 1},
                         "square": {"z0": z0, "y0": y0, "x0": x0, "side": side, "key_slice": z0 + k // 2}})
            made += 1
    write_manifest([{k2: v for k2, v in r.items() if k2 != "square"} for r in rows], out_dir / "cases.jsonl",
                   overwrite=True)
    return rows


# ---- evaluation ----------------------------------------------------------------------------

def greedy_answer(grounder, sample: dict, images, max_new_tokens: int) -> str:
    """The model's greedy answer (no grammar) to ``sample``'s prompt with ``images`` as its slices."""
    import torch

    tok = grounder.tokenizer
    inputs = grounder.inputs_from_images(images, sample["shown"], int(sample["depth"]), sample["query"],
                                         sample.get("prompt_window"))
    stops = [int(tok.convert_tokens_to_ids(t)) for t in ("<|im_end|>", "<|endoftext|>")]
    with torch.inference_mode():
        out = grounder.model.generate(**inputs, max_new_tokens=int(max_new_tokens), do_sample=False,
                                      eos_token_id=stops, pad_token_id=stops[1])
    row = out[0, inputs["input_ids"].shape[1]:].tolist()
    cut = next((i for i, t in enumerate(row) if t in stops), len(row))
    return tok.decode(row[:cut], skip_special_tokens=False)


def score_conditions(model_dir, adapter, samples: List[dict], conditions=CONDITIONS, max_new_tokens: int = 64,
                     progress: Optional[Callable[[str], None]] = None) -> dict:
    """Mean ± SE of each metric of :data:`METRICS` per image condition, plus three example answers each."""
    from medvolcore.grounder import QwenVLGrounder

    from ..rewards import box_reward, parsed

    grounder = QwenVLGrounder.from_pretrained(model_dir, adapter=adapter)
    grounder.model.eval()
    out = {}
    partners = swap_partners(samples)
    for cond in conditions:
        per = {m: [] for m in METRICS}
        examples = []
        for j, s in enumerate(samples):
            text = greedy_answer(grounder, s, ablated_images(samples, j, cond, partners), max_new_tokens)
            a = parsed(text)
            key = int(s["target_info"]["slice"])
            gt = {str(z): b for z, b in s["gt_boxes_norm"].items()}
            per["format"].append(float(a is not None))
            per["key"].append(float(a is not None and int(a.slice) == key))
            per["box"].append(0.0 if a is None else box_reward(a.boxes_norm, gt.get(str(a.slice), [])))
            per["box_true_slice"].append(0.0 if a is None else box_reward(a.boxes_norm, gt.get(str(key), [])))
            if j < 3:
                examples.append({"id": s["id"], "target": s["target"], "answer": text})
        out[cond] = {m: mean_se(per[m]) for m in METRICS}
        out[cond]["examples"] = examples
        if progress:
            progress(f"  {cond:>7}: " + ", ".join(f"{m} {out[cond][m]['mean']:.3f} ± {out[cond][m]['se']:.3f}"
                                                  for m in METRICS))
    return out


def goals(result: dict) -> Dict[str, bool]:
    """The stage's goals: held-out key slice ≥ 0.8 and box IoU ≥ 0.5 with the volume's own slices;
    with swapped slices the key slice at most 0.1 above chance and the box ≤ 0.15. The full stage
    holds out volumes; ``hold_out="positions"`` asks the same of unseen positions."""
    own, sw = result["scores"]["own"], result["scores"]["swapped"]
    return {"own key ≥ 0.8": own["key"]["mean"] >= 0.8,
            "own box ≥ 0.5": own["box"]["mean"] >= 0.5,
            "swapped key ≤ chance + 0.1": sw["key"]["mean"] <= result["chance"]["key"] + 0.1,
            "swapped box ≤ 0.15": sw["box"]["mean"] <= 0.15}


# ---- the stage -----------------------------------------------------------------------------

_OWNED = ("cases", "cases.jsonl", "data", "model", "runs", RESULT, "table.md")


def sft_settings(settings: VisionBenchSettings, model_dir: Path):
    from ..config import SFTSettings

    return SFTSettings(preset="tiny", model_path=str(model_dir), lora_r=settings.lora_r, lora_alpha=settings.lora_alpha,
                       lora_dropout=0.0, lora_modules_to_save=settings.lora_modules_to_save,
                       learning_rate=settings.lr, max_steps=settings.steps, per_device_train_batch_size=settings.batch,
                       warmup_ratio=0.05, lr_scheduler_type="cosine", gradient_checkpointing=False, logging_steps=10,
                       save_steps=10 ** 6, save_total_limit=1, report_to="none", dataloader_num_workers=0,
                       seed=settings.seed, bf16=False).validate()


def run_vision_benchmark(out_dir, settings: Optional[VisionBenchSettings] = None, overwrite: bool = False,
                         echo=None) -> dict:
    """Build the synthetic task, train the SFT adapter, score it with own, swapped and black slices;
    returns (and writes) the result."""
    settings = (settings or VisionBenchSettings()).validate()
    return run_stage(out_dir, overwrite, _OWNED, settings.threads, lambda out, say: _run(out, settings, say), echo)


def _run(out: Path, settings: VisionBenchSettings, echo) -> dict:
    import torch

    from ..prepare import PrepareSettings, load_samples, prepare
    from ..sft import train_sft

    timings: Dict[str, float] = {}
    t_all = time.perf_counter()
    t = time.perf_counter()
    rows = build_cases(out, settings)
    # every volume holds the square: no negative samples (the presence task has them: bench/presence.py)
    prepare(out / "cases.jsonl", out / "data", PrepareSettings(seed=settings.seed, top_k=1, negative_fraction=0.0),
            progress=False)
    short_think_targets(out / "data")
    train, test = load_samples(out / "data", "train"), load_samples(out / "data", "test")
    if len(test) < 2 or not train:
        raise DataError(f"the synthetic task gave {len(train)} train and {len(test)} test samples; need ≥ 1 and ≥ 2")
    truth = {r["id"]: r["square"]["key_slice"] for r in rows}
    wrong = [s["id"] for s in train + test if int(s["target_info"]["slice"]) != truth[s["case_id"]]]
    if wrong:  # prepare's Top-1 key slice must be the square's middle slice, or the task is not the one described
        raise DataError(f"prepare chose another key slice than the square's largest for {', '.join(wrong[:5])}")
    timings["data"] = round(time.perf_counter() - t, 1)
    echo(f"[data] {len(train)} train, {len(test)} test volumes ({settings.depth} × {settings.size} × {settings.size}, "
         f"{'square on one image token' if settings.placement == 'grid' else 'square anywhere'}, held out by "
         f"{settings.hold_out}) in {timings['data']:.1f} s")
    t = time.perf_counter()
    model_dir = build_model(out / "model", settings.model, corpus=tokenizer_corpus(train),
                            vocab_size=settings.vocab_size, patch_size=settings.image_patch)
    n_params = count_parameters(model_dir)
    sft = train_sft(out / "data", out / "runs" / "sft", sft_settings(settings, model_dir), overwrite=True)
    timings["sft"] = round(time.perf_counter() - t, 1)
    echo(f"[sft] {settings.model} Qwen3-VL ({n_params} parameters), {sft['global_step']} steps, loss "
         f"{sft['loss_first']:.3f} → {sft['loss_last']:.3f}, in {timings['sft']:.1f} s")
    t = time.perf_counter()
    scores = score_conditions(model_dir, out / "runs" / "sft" / "adapter", test, CONDITIONS, settings.max_new_tokens,
                              progress=echo)
    timings["eval"] = round(time.perf_counter() - t, 1)
    timings["total"] = round(time.perf_counter() - t_all, 1)
    result = {
        "scores": scores,
        "chance": {"key": round(1.0 / settings.key_positions, 4), "key_positions": settings.key_positions},
        "settings": asdict(settings),
        "model": {"size": settings.model, "parameters": n_params, "dir": str(model_dir)},
        "training": {k: sft[k] for k in ("global_step", "seconds", "seconds_per_step", "loss_first", "loss_last")},
        "data": {"train_samples": len(train), "test_samples": len(test)},
        "timings_s": timings,
        "torch_threads": torch.get_num_threads(),
    }
    result["goals"] = goals(result)
    table = vision_table(result)
    return finish_stage(out, result, table, timings, echo)


__all__ = ["VisionBenchSettings", "run_vision_benchmark", "build_cases", "score_conditions", "greedy_answer", "held_out",
           "goals"]
