"""The learning benchmark's scoring: a model's completions sampled with fixed seeds
(:func:`sample_completions`), their mean rewards (:func:`evaluate_model`, with the image
ablations), and the content-blind reference boxes (:func:`prior_boxes`, :func:`label_prior_box`)."""

from __future__ import annotations

import json
import sys
from typing import Dict, List, Optional, Sequence

import numpy as np

from ..errors import DataError
from ..queries import seeded_rng
from .common import ablated_images, standard_error
from .learning_settings import BenchSettings
from .report import TERMS

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
