"""``medvol-train bench-vision --task presence``: can a model trained through the product's path
say "not present" — from the pixels?

Synthetic volumes (:func:`build_presence_cases`): soft-tissue noise, and in exactly half of them a
bright square (on one slice in the full stage, on three of the four in the quick variant, the
middle one largest). The query is always "the bright object". They go through the product's
own path: ``prepare`` (the volumes without the square become its **negative samples**, target
``<answer>[]</answer>``; ``--negative-fraction`` 0.5 makes every one of them a sample), the
grounder's prompt builder, the SFT collator and :func:`~medvoltrain.sft.train_sft`. The adapter then
answers every held-out volume with the product's **constrained decoding** (the answer grammar,
which allows ``[]``) and the product's parser, greedily, with three sets of slices
(:func:`score_presence`):

* ``own``: the volume's own slices;
* ``swapped``: another held-out volume's slices, with the partners chosen so that the partner's
  class does not depend on the sample's (:func:`presence_partners`: half of each class shows a
  volume of the other class, half one of its own), so the truth is independent of the pixels shown
  and a model that reads its images scores chance (0.5); a model that knew the answer from
  anything else (the prompt text) would keep its own-slice score. Had every present volume been
  swapped with another present one, a pixel reader would score 1.0 there and the control would say
  nothing; had every swap crossed the classes, it would score 0 (also reported:
  ``follows_shown``, how often the answer matches the slices shown, and accuracy by pair kind);
* ``black``: all slices black (the right answer for a pixel reader is "absent": 0.5 overall).

Accuracy counts an answer right when it parses and says absent exactly when the volume has no
square; an unparsable answer is wrong. ``result.json`` carries ``"presence": {"own", "swapped",
"black", "chance"}`` (accuracies) beside the details (standard errors, per class, format rate, the
key slice on present volumes), ``goals`` (own ≥ 0.9; swapped within 0.15 of chance), the settings,
the model, training, data and timings. The reasoning of the SFT targets is one short sentence
(``Seen on slice z.`` / ``Not seen: not present.``) because the grammar of a smoke model's preset
caps the reasoning at 24 characters (``Resources/prompts/grounder.json``, preset ``tiny``).

Results and what they mean: docs/learning-benchmarks.md, "Can it say 'not present'?".
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
from .common import CONDITIONS, mean_se, run_stage, short_think_targets
from .model import MODEL_SIZES, build_model, count_parameters, tokenizer_corpus
from .report import finish_stage

log = logging.getLogger(__name__)

TARGET = "bright_object"
PRESENT_THINK = "Seen on slice {slice}."
ABSENT_THINK = "Not seen: not present."
CHANCE = 0.5  # half the volumes hold the square: any answer that ignores the truth scores 0.5
GOAL_OWN = 0.9
GOAL_SWAPPED_MARGIN = 0.15
_OWNED = ("cases", "cases.jsonl", "data", "model", "runs", "result.json", "table.md")


@dataclass
class PresenceBenchSettings:
    """The presence stage. Defaults: the full stage; :meth:`quick_settings`: the test suite's variant
    (their measured figures: docs/learning-benchmarks.md, "Can it say 'not present'?")."""

    seed: int = 0
    # -- the task --
    depth: int = 4  # slices per volume (all shown)
    object_slices: int = 1  # consecutive slices with the square, when there is one; the middle one is the largest
    size: int = 64  # in-plane pixels
    placement: str = "free"  # "free": side_min..side_max pixels anywhere; "grid": exactly one image token
    side_min: int = 16  # the square's side, anywhere in the slice (placement "free")
    side_max: int = 32
    train_cases: int = 600  # half with the square
    test_cases: int = 40  # a multiple of 4: half with the square, half of each class swapped across
    # -- the model and the recipe (the key-slice stage's, but lr 2e-3: see the docs) --
    model: str = "seeing"
    vocab_size: int = 1024
    image_patch: int = 32
    steps: int = 300
    lr: float = 2e-3
    lr_scheduler: str = "cosine"
    batch: int = 2
    lora_r: int = 32
    lora_alpha: int = 64
    lora_modules_to_save: str = "embed_tokens,lm_head,visual,q_norm,k_norm"
    max_new_tokens: int = 96
    threads: Optional[int] = 1
    quick: bool = False

    @classmethod
    def quick_settings(cls, **kw) -> "PresenceBenchSettings":
        """The test suite's variant: the object on 3 of the 4 slices and larger (24–40 px), so that it is
        learnt in fewer steps; 120 training and 16 held-out volumes."""
        base = dict(object_slices=3, side_min=24, side_max=40, train_cases=120, test_cases=16, steps=80, quick=True)
        base.update(kw)
        return cls(**base)

    def validate(self) -> "PresenceBenchSettings":
        for key in ("depth", "size", "side_min", "train_cases", "steps", "batch", "lora_r", "max_new_tokens"):
            if getattr(self, key) < 1:
                raise InputError(f"{key} must be ≥ 1, got {getattr(self, key)}")
        if self.depth < 2:
            raise InputError(f"depth must be ≥ 2 (the grounder needs two slices), got {self.depth}")
        if self.train_cases < 2:
            raise InputError(f"train_cases must be ≥ 2 (one with the object, one without), got {self.train_cases}")
        if self.test_cases < 4 or self.test_cases % 4:
            raise InputError(f"test_cases must be a multiple of 4 (half with the object; half of each class swapped "
                             f"with the other class), got {self.test_cases}")
        if not 1 <= self.object_slices <= self.depth:
            raise InputError(f"object_slices must be 1..depth ({self.depth}), got {self.object_slices}")
        if self.placement not in ("free", "grid"):
            raise InputError(f"placement must be 'free' or 'grid', got {self.placement!r}")
        if not self.side_min <= self.side_max <= self.size:
            raise InputError(f"need side_min ≤ side_max ≤ size, got {self.side_min}, {self.side_max}, {self.size}")
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

def build_presence_cases(out_dir, settings: PresenceBenchSettings) -> List[dict]:
    """Write the synthetic volumes and label maps (``out_dir/cases``) and the manifest
    (``out_dir/cases.jsonl``); returns the rows, each with ``present`` and, when present,
    ``square`` (z, y0, x0, side). Volumes alternate present / absent, so each split is half and
    half (one more present when odd)."""
    import nibabel as nib

    from ..datasets import write_manifest
    from ..prepare import _prompt_geometry
    from ..queries import seeded_rng
    from .vision import STACK_AFFINE

    out_dir = Path(out_dir)
    folder = out_dir / "cases"
    folder.mkdir(parents=True, exist_ok=True)
    rng = seeded_rng(settings.seed, "bench-presence", "cases")
    d, s = settings.depth, settings.size
    rows: List[dict] = []
    for split, n in (("train", settings.train_cases), ("test", settings.test_cases)):
        for i in range(n):
            present = i % 2 == 0
            hu = rng.normal(40.0, 15.0, size=(d, s, s))
            lab = np.zeros((d, s, s), np.uint8)
            square = None
            if present:
                if settings.placement == "grid":
                    tokens = _prompt_geometry()[1] // (2 * settings.image_patch)
                    side = s // tokens
                    x0, y0 = side * int(rng.integers(0, tokens)), side * int(rng.integers(0, tokens))
                else:
                    side = int(rng.integers(settings.side_min, settings.side_max + 1))
                    x0, y0 = int(rng.integers(0, s - side + 1)), int(rng.integers(0, s - side + 1))
                k = settings.object_slices
                z0 = int(rng.integers(0, d - k + 1))
                for j in range(k):
                    if j == k // 2:
                        lab[z0 + j, y0:y0 + side, x0:x0 + side] = 1
                    else:  # a smaller square inside, so the middle slice is the largest
                        inner = max(1, side - 2 - int(rng.integers(0, max(1, side // 3))))
                        a = (side - inner) // 2
                        lab[z0 + j, y0 + a:y0 + a + inner, x0 + a:x0 + a + inner] = 1
                hu[lab > 0] = rng.normal(300.0, 20.0, size=int(lab.sum()))
                square = {"z": z0 + k // 2, "y0": y0, "x0": x0, "side": side}
            cid = f"{split}{i:04d}"
            nib.save(nib.Nifti1Image(np.rint(hu).astype(np.int16), STACK_AFFINE), str(folder / f"{cid}.nii.gz"))
            nib.save(nib.Nifti1Image(lab, STACK_AFFINE), str(folder / f"{cid}_seg.nii.gz"))
            rows.append({"id": cid, "volume": str(folder / f"{cid}.nii.gz"), "labels": str(folder / f"{cid}_seg.nii.gz"),
                         "split": split, "targets": {TARGET: 1}, "present": present, "square": square})
    write_manifest([{k: v for k, v in r.items() if k not in ("present", "square")} for r in rows],
                   out_dir / "cases.jsonl", overwrite=True)
    return rows


def presence_partners(samples: List[dict]) -> List[int]:
    """Whose slices the ``swapped`` condition shows, per sample: with ``P`` the present and ``A`` the
    absent samples in order (equally many, at least two), ``P[i]`` and ``A[i]`` show each other's
    slices for even ``i`` (across the classes), and for odd ``i`` each shows the next volume of its
    own class (``P[i+1]``, ``A[i+1]``, cyclically). So half of each class crosses and half does not:
    the truth is independent of the pixels shown."""
    present = [j for j, s in enumerate(samples) if not s.get("absent")]
    absent = [j for j, s in enumerate(samples) if s.get("absent")]
    n = len(present)
    if n != len(absent) or n < 2:
        raise DataError(f"the swapped-slices control needs as many volumes with the object as without (≥ 2 each), got "
                        f"{len(present)} and {len(absent)}")
    out = [0] * len(samples)
    for i in range(n):
        if i % 2 == 0:
            out[present[i]], out[absent[i]] = absent[i], present[i]
        else:
            out[present[i]], out[absent[i]] = present[(i + 1) % n], absent[(i + 1) % n]
    return out


def _images(samples: List[dict], j: int, condition: str, partners: List[int]):
    from ..prepare import load_slices

    if condition == "own":
        return load_slices(samples[j])
    if condition == "swapped":
        return load_slices(samples[partners[j]])
    if condition == "black":
        return [np.zeros_like(im) for im in load_slices(samples[j])]
    raise InputError(f"unknown image condition {condition!r}; use one of {', '.join(CONDITIONS)}")


# ---- evaluation ----------------------------------------------------------------------------

def constrained_answer(grounder, sample: dict, images, max_new_tokens: int) -> str:
    """The model's greedy answer under the product's answer grammar, to ``sample``'s prompt with
    ``images`` as its slices (the generation :meth:`QwenVLGrounder.ground` runs, on given images)."""
    inputs = grounder.inputs_from_images(images, sample["shown"], int(sample["depth"]), sample["query"],
                                         sample.get("prompt_window"))
    text, _ = grounder._generate_text(inputs, sample["shown"], constrain=True, do_sample=False, seed=None,
                                      max_new_tokens=int(max_new_tokens))
    return text


def presence_grounder(model_dir, adapter=None):
    """The grounder the stage answers with: ``model_dir`` (a benchmark model, which is a smoke model)
    with ``adapter``, its answer grammar allowing the absent answer ``[]``. A smoke model's preset
    (``tiny``) keeps to box answers, so without the override the model could never say "not present"
    and would score 0.5 however well it learnt."""
    from medvolcore.grounder import QwenVLGrounder

    grounder = QwenVLGrounder.from_pretrained(model_dir, adapter=adapter, settings={"allow_absent": True})
    grounder.model.eval()
    return grounder


def score_presence(model_dir, adapter, samples: List[dict], conditions=CONDITIONS, max_new_tokens: int = 96,
                   progress: Optional[Callable[[str], None]] = None) -> dict:
    """Per image condition: ``accuracy`` (mean ± SE), ``accuracy_present`` / ``accuracy_absent``
    (by the volume's truth), ``format`` (the answer parses), ``said_absent`` (fraction answered
    ``[]``), ``key_on_present`` (own slices: the key slice named on present volumes) and, for
    ``swapped``, ``follows_shown`` (the answer matches the class of the volume whose slices were
    shown) and the accuracy on cross-class and same-class pairs; four example answers each."""
    from ..rewards import parsed

    grounder = presence_grounder(model_dir, adapter)
    partners = presence_partners(samples)
    out = {}
    for cond in conditions:
        right, fmt, said_absent, follows, key = [], [], [], [], []
        by_truth = {True: [], False: []}
        by_pair = {"cross": [], "same": []}
        examples = []
        for j, s in enumerate(samples):
            text = constrained_answer(grounder, s, _images(samples, j, cond, partners), max_new_tokens)
            a = parsed(text)
            truth = bool(s.get("absent"))
            ok = a is not None and a.absent == truth
            right.append(float(ok))
            by_truth[truth].append(float(ok))
            fmt.append(float(a is not None))
            said_absent.append(float(a is not None and a.absent))
            if cond == "own" and not truth:
                key.append(float(a is not None and not a.absent and a.slice == int(s["target_info"]["slice"])))
            if cond == "swapped":
                shown_absent = bool(samples[partners[j]].get("absent"))
                follows.append(float(a is not None and a.absent == shown_absent))
                by_pair["cross" if shown_absent != truth else "same"].append(float(ok))
            if j < 4:  # two volumes of each class (they alternate)
                examples.append({"id": s["id"], "absent": truth, "target": s["target"], "answer": text})
        r = {"accuracy": mean_se(right), "accuracy_present": mean_se(by_truth[False]),
             "accuracy_absent": mean_se(by_truth[True]), "format": mean_se(fmt), "said_absent": mean_se(said_absent)}
        if key:
            r["key_on_present"] = mean_se(key)
        if follows:
            r["follows_shown"] = mean_se(follows)
            r["accuracy_cross_pairs"] = mean_se(by_pair["cross"])
            r["accuracy_same_pairs"] = mean_se(by_pair["same"])
        r["examples"] = examples
        out[cond] = r
        if progress:
            progress(f"  {cond:>7}: accuracy {r['accuracy']['mean']:.3f} ± {r['accuracy']['se']:.3f} (with the object "
                     f"{r['accuracy_present']['mean']:.3f}, without {r['accuracy_absent']['mean']:.3f}), answered [] "
                     f"{r['said_absent']['mean']:.3f}, format {r['format']['mean']:.3f}")
    return out


def presence_goals(presence: dict) -> Dict[str, bool]:
    """Own slices ≥ 0.9; swapped slices within 0.15 of chance."""
    return {f"own ≥ {GOAL_OWN}": presence["own"] >= GOAL_OWN,
            f"swapped within {GOAL_SWAPPED_MARGIN} of chance": abs(presence["swapped"] - presence["chance"])
            <= GOAL_SWAPPED_MARGIN}


def presence_table(result: dict) -> str:
    """``table.md`` of the presence stage."""
    sc = result["scores"]
    rows = ["| images | accuracy | with the object | without | answered [] | format |", "|---|---|---|---|---|---|"]
    for cond in CONDITIONS:
        if cond in sc:
            r = sc[cond]
            rows.append(f"| {cond} | " + " | ".join(f"{r[m]['mean']:.3f} ± {r[m]['se']:.3f}" for m in (
                "accuracy", "accuracy_present", "accuracy_absent", "said_absent", "format")) + " |")
    rows.append("")
    rows.append(f"Chance: {result['presence']['chance']:.3f} (half the held-out volumes hold the object). Swapped: "
                "another held-out volume's slices, half of each class from the other class, so the truth is "
                "independent of the pixels shown.")
    sw = sc.get("swapped", {})
    if "follows_shown" in sw:
        rows.append(f"Swapped, the answer matches the slices shown: {sw['follows_shown']['mean']:.3f}; accuracy on "
                    f"cross-class pairs {sw['accuracy_cross_pairs']['mean']:.3f}, same-class pairs "
                    f"{sw['accuracy_same_pairs']['mean']:.3f}.")
    if "key_on_present" in sc.get("own", {}):
        rows.append(f"Own slices, key slice named on volumes with the object: {sc['own']['key_on_present']['mean']:.3f}.")
    return "\n".join(rows)


# ---- the stage -----------------------------------------------------------------------------

def run_presence_benchmark(out_dir, settings: Optional[PresenceBenchSettings] = None, overwrite: bool = False,
                           echo=None) -> dict:
    """Build the task, train the SFT adapter, score it with own, swapped and black slices; returns
    (and writes) the result."""
    settings = (settings or PresenceBenchSettings()).validate()
    return run_stage(out_dir, overwrite, _OWNED, settings.threads, lambda out, say: _run(out, settings, say), echo)


def _run(out: Path, settings: PresenceBenchSettings, echo) -> dict:
    import torch

    from ..prepare import PrepareSettings, load_samples, prepare
    from ..sft import train_sft
    from .vision import sft_settings

    timings: Dict[str, float] = {}
    t_all = t = time.perf_counter()
    rows = build_presence_cases(out, settings)
    # every volume without the object becomes a negative sample: as many negatives as positives
    prepare(out / "cases.jsonl", out / "data", PrepareSettings(seed=settings.seed, top_k=1, negative_fraction=0.5),
            progress=False)
    short_think_targets(out / "data", PRESENT_THINK, ABSENT_THINK)
    train, test = load_samples(out / "data", "train"), load_samples(out / "data", "test")
    truth = {r["id"]: r for r in rows}
    wrong = [s["id"] for s in train + test if bool(s.get("absent")) == truth[s["case_id"]]["present"]
             or (not s.get("absent") and int(s["target_info"]["slice"]) != truth[s["case_id"]]["square"]["z"])]
    if wrong or len(train) + len(test) != len(rows):
        raise DataError(f"prepare did not make one sample per volume with the right answer ({len(train) + len(test)} "
                        f"samples for {len(rows)} volumes; wrong: {', '.join(wrong[:5])})")
    timings["data"] = round(time.perf_counter() - t, 1)
    n_abs = sum(bool(s.get("absent")) for s in train)
    echo(f"[data] {len(train)} train ({n_abs} without the object), {len(test)} test volumes ({settings.depth} × "
         f"{settings.size} × {settings.size}) in {timings['data']:.1f} s")
    t = time.perf_counter()
    model_dir = build_model(out / "model", settings.model, corpus=tokenizer_corpus(train),
                            vocab_size=settings.vocab_size, patch_size=settings.image_patch)
    n_params = count_parameters(model_dir)
    import dataclasses

    recipe = dataclasses.replace(sft_settings(settings, model_dir), lr_scheduler_type=settings.lr_scheduler)
    sft = train_sft(out / "data", out / "runs" / "sft", recipe.validate(), overwrite=True)
    timings["sft"] = round(time.perf_counter() - t, 1)
    echo(f"[sft] {settings.model} Qwen3-VL ({n_params} parameters), {sft['global_step']} steps, loss "
         f"{sft['loss_first']:.3f} → {sft['loss_last']:.3f}, in {timings['sft']:.1f} s")
    t = time.perf_counter()
    scores = score_presence(model_dir, out / "runs" / "sft" / "adapter", test, CONDITIONS, settings.max_new_tokens,
                            progress=echo)
    timings["eval"] = round(time.perf_counter() - t, 1)
    timings["total"] = round(time.perf_counter() - t_all, 1)
    presence = {c: scores[c]["accuracy"]["mean"] for c in CONDITIONS}
    presence["chance"] = CHANCE
    result = {
        "task": "presence",
        "presence": presence,
        "scores": scores,
        "settings": asdict(settings),
        "model": {"size": settings.model, "parameters": n_params, "dir": str(model_dir)},
        "training": {k: sft[k] for k in ("global_step", "seconds", "seconds_per_step", "loss_first", "loss_last")},
        "data": {"train_samples": len(train), "train_absent": n_abs, "test_samples": len(test),
                 "test_absent": sum(bool(s.get("absent")) for s in test)},
        "timings_s": timings,
        "torch_threads": torch.get_num_threads(),
    }
    result["goals"] = presence_goals(presence)
    table = presence_table(result)
    return finish_stage(out, result, table, timings, echo)


__all__ = ["PresenceBenchSettings", "run_presence_benchmark", "build_presence_cases", "presence_partners",
           "score_presence", "presence_grounder", "constrained_answer", "presence_goals", "presence_table", "CHANCE"]
