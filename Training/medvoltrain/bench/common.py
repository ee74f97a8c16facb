"""What both benchmark stages share: the output folder, the SFT targets' short reasoning, the
image ablations (whose slices an answer is shown) and mean ± standard error."""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

from medvolcore.errors import InputError, OutputExistsError

from ..errors import DataError

CONDITIONS = ("own", "swapped", "black")


def prepare_out(out: Path, overwrite: bool, owned: Sequence[str], what: str = "a benchmark") -> None:
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


THINK_TEMPLATE = "The query describes the {target}; slice {slice}."
ABSENT_THINK_TEMPLATE = "The query describes the {target}; not present."


def run_stage(out_dir, overwrite: bool, owned: Sequence[str], threads: Optional[int], run: Callable, echo=None):
    """The frame of a vision stage: the output folder made ready (:func:`prepare_out`), torch's
    thread count set to ``threads`` for the run and restored after, then ``run(out, echo)``."""
    import sys

    echo = echo or (lambda line: (sys.stdout.write(line + "\n"), sys.stdout.flush()))
    out = Path(out_dir).expanduser().resolve()
    prepare_out(out, overwrite, owned, "a vision benchmark")
    import torch

    saved = torch.get_num_threads()
    if threads:
        torch.set_num_threads(int(threads))
    try:
        return run(out, echo)
    finally:
        torch.set_num_threads(saved)


def short_think_targets(data_dir, template: str = THINK_TEMPLATE, absent_template: str = ABSENT_THINK_TEMPLATE) -> int:
    """Rewrite the SFT targets of a prepared set (``data_dir``'s index, in place) with one short
    reasoning sentence, ``template`` with the target's name and the key slice (``absent_template``
    for a negative sample, whose answer stays ``[]``); returns the count.

    The key slice and the boxes (``target_info``) are unchanged; the text is rebuilt with
    :func:`medvolcore.answer.format_answer` as ``prepare`` builds it. Why one template:
    docs/learning-benchmarks.md, "Training." under the learning benchmark.
    """
    from medvolcore.answer import absent_answer, format_answer

    from ..prepare import INDEX, _write_json, load_samples

    samples = load_samples(data_dir)
    for s in samples:
        info = s["target_info"]
        name = s["label"].replace("_", " ")
        if s.get("absent"):
            think = absent_template.replace("{target}", name)
            s["target"] = info["text"] = absent_answer(think)
        else:
            think = template.replace("{target}", name).replace("{slice}", str(int(info["slice"])))
            s["target"] = info["text"] = format_answer(int(info["slice"]), info["boxes_norm"], think)
        info["think"] = think
        s.pop("data_dir", None)
    _write_json(Path(data_dir) / INDEX, samples, lines=True)
    return len(samples)


def swap_partners(samples: List[dict], group: Callable[[dict], object] = lambda s: s.get("case_id")) -> List[int]:
    """For each sample, the index of the next sample (cyclically) of another ``group`` (default:
    another volume): whose slices the ``swapped`` condition shows. The next one rather than a pair
    swap, so that no two samples share one chance coincidence of key slices."""
    n = len(samples)
    out = []
    for j in range(n):
        g = group(samples[j])
        k = next(((j + d) % n for d in range(1, n) if group(samples[(j + d) % n]) != g), None)
        if k is None:
            raise DataError("every scored sample shows the same volume: there is no other one to swap slices with")
        out.append(k)
    return out


def ablated_images(samples: List[dict], j: int, condition: str, partners: Optional[List[int]] = None):
    """The slices shown for sample ``j`` under ``condition``: its own, another volume's
    (``swapped``, from :func:`swap_partners` unless ``partners`` is given; the same prompt text; when
    that volume shows another number of slices, its slices at evenly spaced indices), or black ones."""
    from ..prepare import load_slices

    if condition == "own":
        return load_slices(samples[j])
    if condition == "swapped":
        k = (partners if partners is not None else swap_partners(samples))[j]
        other, n = load_slices(samples[k]), len(samples[j]["shown"])
        if len(other) != n:
            other = [other[int(i)] for i in np.rint(np.linspace(0, len(other) - 1, n))]
        return other
    if condition == "black":
        return [np.zeros_like(im) for im in load_slices(samples[j])]
    raise InputError(f"unknown image condition {condition!r}; use one of {', '.join(CONDITIONS)}")


def standard_error(values) -> float:
    """The standard error of the mean of ``values``; NaN for fewer than two values or a non-finite one."""
    a = np.asarray(values, dtype=float)
    return float(a.std(ddof=1) / math.sqrt(len(a))) if len(a) > 1 and np.isfinite(a).all() else float("nan")


def mean_se(values: List[float]) -> Dict[str, float]:
    """``{"mean", "se"}`` of ``values`` (see :func:`standard_error`), to 4 decimals."""
    a = np.asarray(values, dtype=float)
    return {"mean": round(float(a.mean()), 4), "se": round(standard_error(a), 4)}


__all__ = ["CONDITIONS", "THINK_TEMPLATE", "ABSENT_THINK_TEMPLATE", "prepare_out", "short_think_targets", "swap_partners", "ablated_images",
           "standard_error", "mean_se"]
