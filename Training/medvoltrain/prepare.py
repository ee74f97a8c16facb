"""``medvol-train prepare``: cases → a training set on disk, and the loader that reads it back.

Layout of ``DATA/`` (format ``medvol.train.samples/1``)
-------------------------------------------------------
::

    DATA/
      samples.jsonl            index: one JSON object per sample (fields below), in manifest order
      summary.json             what was prepared, what was skipped and why, settings, timings
      cases/<case>/slices.npz  uint8 array "images" (N, 256, 256): the N ≤ 64 shown slices, windowed
                               and resized exactly as the grounder renders them (the grey level of its
                               RGB image; the grounder's RGB is this grey in all three channels), and
                               int array "shown" (N,) with their stack indices
      cases/<case>/masks/<target>.npz   bool array "mask" (D, H, W): the target mask ON THE CANONICAL
                               AXIAL STACK (medvolcore.stack.AxialStack of the case's CT), so index z of
                               the mask is the z of the prompt's <slice z> tags; ``AxialStack.to_source``
                               maps it back to the CT's grid exactly
      cases/<case>/case.json   the case's samples and skipped targets, written last (resume marker)

Every file is written under a temporary name and renamed, so an interrupted run leaves either
nothing or a complete file; a re-run skips cases whose ``case.json`` matches the row and settings.

Sample fields (``samples.jsonl``)
---------------------------------
``id`` ``"<case>/<target>"``; ``case_id``; ``split`` (train/test); ``dataset`` (M3D-Seg code or null);
``label`` (target name) and ``label_ids``; ``query`` (the text the grounder receives) and
``query_info`` (kind implicit/explicit/relational, description, template, term); ``prompt_window``
(the window named in the prompt, the inference default unless set) and ``render_window``
(``{"name", "center", "width"}`` used for the pictures); ``intensity`` (``hu`` or
``m3d_normalised``); ``messages`` (the system and user text with ``<image>`` where the slice images
go — for reading; training rebuilds the exact token ids with the grounder's own prompt builder);
``target`` (the SFT completion text, without the end-of-turn token) and ``target_info`` (slice,
pixel boxes, normalised boxes, think sentence); ``top_k``, ``seed``; ``shown`` (the stack indices of the
shown slices, in prompt order); ``depth`` (stack depth D); ``stack_shape`` ``[D, H, W]``;
``image_size`` ``[256, 256]`` (width, height of the rendered slices); ``slices_file`` and
``mask_file`` (paths relative to DATA); ``mask_frame`` ``"stack"``; ``slice_areas`` (D integers:
foreground pixels of every stack slice, index = z); ``gt_boxes`` and ``gt_boxes_norm`` (per shown
slice with foreground, keyed by ``str(z)``: the target's component boxes as inclusive pixels on the
stack slice and normalised 0–1000 as ``box_to_norm`` gives them); ``source`` (volume and label
paths); ``absent`` (false).

Negative samples (``"absent": true``)
-------------------------------------
A query for a structure that is **not in that volume**, with the absent answer as its target
(``<think>…</think><answer>[]</answer>``). Candidates, per case: the row's labels with no voxel in
its label map (its ``targets``, or its dataset's label list — an id the map does not hold means
the structure is absent there, since the map annotates it), and the row's ``absent`` names
(term-dictionary structures the manifest says are not in that CT, e.g. "brain" on an abdominal
CT). A candidate that is the same structure as a label present in the volume ("kidney" when
"kidneys" is there) is never used (skipped with reason ``present_label``). Which candidates become
samples: per split,
``round(f / (1 − f) × positives)`` of them (``f`` = ``--negative-fraction``, default 0.10, so that
negatives are about a fraction ``f`` of the split; 0 = none, the paper's data), drawn with the seed,
spread over cases (a case's second candidate only after every case's first). Their fields are a
positive's, except: ``target_info`` has ``slice`` None and no boxes; ``mask_file`` is None (the
mask is all zero: :func:`load_mask`); ``slice_areas`` are all 0 and ``gt_boxes``/``gt_boxes_norm``
empty; ``label_ids`` are the row's ids (empty for an ``absent`` name); ``negative_source`` is
``labels`` or ``manifest``. The term dictionary words the query, as for positives.

:func:`load_samples`, :func:`load_slices` and :func:`load_mask` read it back (Training II reuses
them).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np

from .datasets import M3D_WARNING, Case, load_case, read_manifest, safe_name
from .errors import CaseError, DataError
from .queries import QueryBank, seeded_rng
from .targets import absent_target, reward_ground_truth, sft_target

log = logging.getLogger(__name__)

FORMAT = "medvol.train.samples/1"
INDEX = "samples.jsonl"
SUMMARY = "summary.json"
CASE_FILE = "case.json"
# Bump when the content of prepared cases changes, so a resume redoes them.
PREPARE_VERSION = 2  # 2: negative (absent) candidates in case.json; "absent" in every sample
DEFAULT_NEGATIVE_FRACTION = 0.10


@dataclass(frozen=True)
class PrepareSettings:
    """Settings of ``prepare``; they are part of each case's fingerprint (a change redoes the case)."""

    seed: int = 0
    top_k: int = 3  # the key slice is drawn among the 3 largest shown slices (1 = always the largest)
    query_kind: str = "implicit"
    test_fraction: float = 0.2
    relational: bool = True  # KiTS23-style relational test queries where the dataset has them
    prompt_window: Optional[str] = None  # None: the grounder's default window (soft tissue 40/400 HU)
    # about this fraction of each split are negative (not present) samples; 0: none (the paper's data).
    # Not part of a case's fingerprint: the choice is made over all cases after they are prepared.
    negative_fraction: float = DEFAULT_NEGATIVE_FRACTION


def _prompt_geometry():
    from medvolcore.grounder import load_prompts

    p = load_prompts()
    return int(p.get("num_slices", 64)), int(p.get("image_size", 256)), p


def _fingerprint(case: Case, settings: PrepareSettings) -> str:
    per_case = {k: v for k, v in asdict(settings).items() if k != "negative_fraction"}
    blob = json.dumps({"row": case.raw, "volume": str(case.volume), "labels": str(case.labels),
                       "targets": case.targets, "settings": per_case, "version": PREPARE_VERSION},
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def _save_npz(path: Path, **arrays) -> None:
    from medvolcore.fileio import atomic_path

    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path, overwrite=True) as tmp:
        with open(tmp, "wb") as f:
            np.savez_compressed(f, **arrays)


def _write_json(path: Path, obj, lines: bool = False) -> None:
    from medvolcore.fileio import write_text_atomic

    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(o) + "\n" for o in obj) if lines else json.dumps(obj, indent=1) + "\n"
    write_text_atomic(path, text, overwrite=True)


def _messages(prompts: dict, query: str, shown, depth: int, window) -> list:
    from medvolcore.grounder import describe_window

    values = {"query": query, "window": describe_window(window), "num_shown": str(len(shown)), "depth": str(depth)}
    user = prompts["user"]
    for k in ("window", "num_shown", "depth"):
        user = user.replace("{" + k + "}", values[k])
    slices = "".join(prompts["slice_tag"].replace("{z}", str(z)) + "<image>" + prompts.get("slice_separator", "\n")
                     for z in shown)
    user = user.replace("{slices}", slices).replace("{query}", query)  # the query last: its braces stay as typed
    return [{"role": "system", "content": prompts["system"]}, {"role": "user", "content": user}]


def _relational_targets(case: Case, labels, bank: QueryBank, settings: PrepareSettings):
    """(name, lesion, mask) for relational queries: the organ's 3-D components that contain the lesion."""
    from scipy import ndimage

    spec = bank.relational_spec(case.dataset)
    if not settings.relational or spec is None or case.split != "test":
        return []
    from . import resources

    names = {v: k for k, v in resources.dataset_labels(case.dataset).items()}
    organ_ids = [names[n] for n in spec["organ_labels"] if n in names]
    out = []
    for lesion in spec["lesions"]:
        if lesion not in names or names[lesion] not in labels.present_ids():
            continue
        lesion_mask = labels.mask([names[lesion]])
        comp, n = ndimage.label(labels.mask(organ_ids), structure=np.ones((3, 3, 3), bool))
        hit = np.unique(comp[lesion_mask & (comp > 0)])
        if hit.size:
            out.append((f"{spec['organ']} containing {lesion}", lesion, organ_ids, np.isin(comp, hit)))
    return out


def same_structure(a: str, b: str, terms: dict) -> bool:
    """Whether two label names denote one structure: the same term-dictionary key, or each names the
    other (:func:`medvoltrain.queries.names_label`: singular or plural, "gall bladder" or
    "gallbladder", either word order) — "kidney" and "kidneys" are one; "kidney tumor" and "kidney"
    are not."""
    from .queries import names_label, term_key

    ka, kb = term_key(a, terms), term_key(b, terms)
    if ka is not None and ka == kb:
        return True
    ta, tb = str(a).replace("_", " "), str(b).replace("_", " ")
    return names_label(ta, tb) and names_label(tb, ta)


def negative_candidates(case: Case, labels, terms: dict):
    """``([(name, ids, source)], refused)``: the structures of ``case`` that may be asked for as
    negative (not present) samples, and the skip records of those refused.

    ``source`` ``labels``: a label of the row (its ``targets``, or its dataset's label list) with
    no voxel in the label map; an id the label source cannot hold at all (an M3D channel that does
    not exist) is an unknown label, not an absent one. ``manifest``: a name of the row's ``absent``
    list. Refused (reason ``present_label``): a candidate that is the same structure
    (:func:`same_structure`) as a label present in the volume, whatever the ids say.
    """
    present, known = labels.present_ids(), labels.known_ids()
    present_names = {name: ids for name, ids in case.targets.items() if any(i in present for i in ids)}
    raw = [(name, list(ids), "labels") for name, ids in case.targets.items()
           if name not in present_names and (known is None or all(i in known for i in ids))]
    raw += [(name, [], "manifest") for name in case.absent]
    out, refused = [], []
    for name, ids, source in raw:
        other = next((p for p in present_names if same_structure(name, p, terms)), None)
        if other is not None:
            refused.append({"case": case.id, "target": name, "reason": "present_label",
                            "message": f"not used as a negative (not present) sample: the label map holds {other!r} "
                                       f"(id {', '.join(map(str, present_names[other]))})"})
        elif not any(same_structure(name, n, terms) for n, _, _ in out):
            out.append((name, ids, source))
    return out, refused


def negatives_wanted(fraction: float, positives: int) -> int:
    """``round(fraction / (1 − fraction) × positives)`` (half up): negatives that make up about
    ``fraction`` of a split with ``positives`` positive samples."""
    return int(math.floor(fraction / (1.0 - fraction) * positives + 0.5))


def select_negatives(records: List[dict], fraction: float, seed: int) -> Dict[str, List[dict]]:
    """The negative samples to keep, per case id: for each split, ``round(fraction / (1 − fraction)
    × positives)`` of the candidates (at most all of them), drawn with ``seed`` and spread over
    cases (every case's first candidate before any case's second). ``records``: the case records in
    manifest order."""
    if not 0.0 <= float(fraction) < 1.0:
        raise DataError(f"the negative fraction must be in [0, 1), got {fraction!r}")
    keep: Dict[str, List[dict]] = {}
    for split in ("train", "test"):
        positives = sum(1 for r in records for x in r["samples"] if x["split"] == split)
        pool = [(rank, x) for r in records for rank, x in enumerate(r.get("negative_candidates", []))
                if x["split"] == split]
        want = min(len(pool), negatives_wanted(fraction, positives))
        if not want:
            continue
        draw = seeded_rng(seed, "negatives", split).permutation(len(pool))  # draw[i]: candidate i's place
        chosen = sorted(range(len(pool)), key=lambda i: (pool[i][0], int(draw[i])))[:want]
        for i in sorted(chosen):  # manifest order
            keep.setdefault(pool[i][1]["case_id"], []).append(pool[i][1])
    return keep


def prepare_case(case: Case, out_dir, settings: PrepareSettings) -> dict:
    """Prepare one case into ``out_dir/cases/<case>/``; returns its ``case.json`` content.

    Per-target problems (unknown label id, empty label) are listed under ``skipped``; a problem
    with the whole case raises :class:`CaseError`.
    """
    t0 = time.perf_counter()
    out_dir = Path(out_dir)
    folder = out_dir / "cases" / case.folder_name
    fingerprint = _fingerprint(case, settings)
    done = folder / CASE_FILE
    if done.is_file():
        try:
            prev = json.loads(done.read_text(encoding="utf-8"))
            if prev.get("fingerprint") == fingerprint:
                prev["resumed"] = True
                return prev
        except (OSError, ValueError):
            pass
    n_slices, size, prompts = _prompt_geometry()
    stack, labels, render_window, intensity = load_case(case)
    if stack.depth < 2:
        raise CaseError("too_small", f"the stack has {stack.depth} slice(s); the grounder needs at least 2")
    shown = [int(z) for z in stack.sample_indices(n_slices)]
    from medvolcore.windowing import get_window

    rw = get_window(render_window)
    images = np.stack([stack.render_slice(z, size, rw)[..., 0] for z in shown])
    slices_rel = f"cases/{case.folder_name}/slices.npz"
    _save_npz(out_dir / slices_rel, images=images, shown=np.asarray(shown, dtype=np.int32))

    bank = QueryBank(settings.test_fraction, settings.query_kind)
    known, present = labels.known_ids(), labels.present_ids()
    samples, skipped = [], []
    jobs = []
    for name, ids in case.targets.items():
        unknown = [i for i in ids if (i not in known if known is not None else i not in present)]
        if known is not None and unknown:
            skipped.append({"case": case.id, "target": name, "reason": "unknown_label",
                            "message": f"label id(s) {unknown} not in the dataset's label list (1..{max(known)})"})
            continue
        if known is None and unknown and len(unknown) == len(ids):
            shown_ids = ", ".join(str(i) for i in sorted(present)[:20])
            skipped.append({"case": case.id, "target": name, "reason": "unknown_label",
                            "message": f"label id(s) {unknown} not in the label map (present: {shown_ids})"})
            continue
        jobs.append((name, ids, None, None))
    for name, lesion, ids, mask in _relational_targets(case, labels, bank, settings):
        jobs.append((name, ids, lesion, mask))

    base = {"format": FORMAT, "case_id": case.id, "split": case.split, "dataset": case.dataset,
            "prompt_window": settings.prompt_window,
            "render_window": {"name": rw.name, "center": rw.center, "width": rw.width}, "intensity": intensity,
            "top_k": settings.top_k, "seed": settings.seed, "shown": shown, "depth": stack.depth,
            "stack_shape": list(stack.shape), "image_size": [size, size], "slices_file": slices_rel,
            "mask_frame": "stack", "source": {"volume": str(case.volume), "labels": str(case.labels)}}

    def query_fields(query):
        return {"query": query.text, "query_info": query.to_dict(),
                "messages": _messages(prompts, query.text, shown, stack.depth, settings.prompt_window)}

    for name, ids, lesion, mask in jobs:
        if mask is None:
            mask = labels.mask(ids)
        if not mask.any():
            skipped.append({"case": case.id, "target": name, "reason": "empty_label",
                            "message": f"label {ids} has no voxel in this case"})
            continue
        if not mask[shown].any():
            skipped.append({"case": case.id, "target": name, "reason": "empty_label",
                            "message": f"label {ids} has no voxel on the {len(shown)} shown slices"})
            continue
        if lesion is None:
            query = bank.draw(case.id, name, case.split, settings.seed)
        else:
            query = bank.draw_relational(case.id, case.dataset, lesion, settings.seed)
        target_name = name.replace("_", " ")
        rng = seeded_rng(settings.seed, "target", case.id, name)
        tgt = sft_target(mask, shown, target_name, settings.top_k, rng)
        gt = reward_ground_truth(mask, shown)
        mask_rel = f"cases/{case.folder_name}/masks/{safe_name(name)}.npz"
        _save_npz(out_dir / mask_rel, mask=mask.astype(bool))
        samples.append({
            **base, "id": f"{case.id}/{name}", "label": name, "label_ids": list(ids), **query_fields(query),
            "target": tgt.text, "target_info": tgt.to_dict(), "mask_file": mask_rel,
            "slice_areas": gt["slice_areas"], "gt_boxes": gt["boxes"], "gt_boxes_norm": gt["boxes_norm"],
            "absent": False,
        })

    negatives = []
    candidates, refused = negative_candidates(case, labels, bank.terms)
    skipped += refused
    for name, ids, source in candidates:
        tgt = absent_target(name.replace("_", " "), seeded_rng(settings.seed, "absent", case.id, name))
        negatives.append({
            **base, "id": f"{case.id}/{name}", "label": name, "label_ids": list(ids),
            **query_fields(bank.draw(case.id, name, case.split, settings.seed)),
            "target": tgt.text, "target_info": tgt.to_dict(), "mask_file": None,
            "slice_areas": [0] * stack.depth, "gt_boxes": {}, "gt_boxes_norm": {}, "absent": True,
            "negative_source": source,
        })
    record = {"case_id": case.id, "row": case.row, "fingerprint": fingerprint, "samples": samples,
              "negative_candidates": negatives, "skipped": skipped, "intensity": intensity,
              "seconds": round(time.perf_counter() - t0, 3)}
    _write_json(done, record)
    return record


def _run_one(args):
    case, out_dir, settings = args
    try:
        return case.id, prepare_case(case, out_dir, settings), None
    except CaseError as e:
        return case.id, None, {"reason": e.reason, "message": str(e)}
    except Exception as e:  # noqa: BLE001 — one bad case must not stop the others
        from medvolcore.errors import MedVolError

        reason = "error" if not isinstance(e, MedVolError) else getattr(e, "code", "error")
        return case.id, None, {"reason": reason, "message": f"{type(e).__name__}: {e}"}


def prepare(manifest, out_dir, settings: PrepareSettings = PrepareSettings(), workers: int = 1,
            progress: bool = True, overwrite: bool = False) -> dict:
    """Prepare every case of ``manifest`` into ``out_dir``; returns the summary.

    A ``manifest`` that is one of the files this writes (``out_dir``'s samples or summary) is
    refused unless ``overwrite``: it would be replaced by what is made from it.

    Raises :class:`DataError` when no sample at all could be prepared (the CLI then exits
    non-zero); otherwise bad rows and targets are listed in the summary and the rest goes on.
    """
    from tqdm import tqdm

    t0 = time.perf_counter()
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise DataError(f"{out_dir} exists and is not a folder")
    written = {os.path.realpath(out_dir / name) for name in (INDEX, SUMMARY)}
    if not overwrite and os.path.realpath(manifest) in written:
        raise DataError(f"the manifest {manifest} is a file prepare writes into --out {out_dir}; it would be replaced: "
                        "give another --out, or --overwrite to replace it")
    if settings.query_kind not in ("implicit", "explicit"):
        raise DataError(f"query kind must be implicit or explicit, got {settings.query_kind!r}")
    if isinstance(settings.top_k, bool) or not isinstance(settings.top_k, int) or settings.top_k < 1:
        raise DataError(f"top-k must be a whole number ≥ 1, got {settings.top_k!r}")
    fraction = settings.negative_fraction
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 <= fraction < 1.0:
        raise DataError(f"--negative-fraction must be a number in [0, 1) (0: no negative samples), got {fraction!r}")
    cases, bad_rows = read_manifest(manifest)
    out_dir.mkdir(parents=True, exist_ok=True)
    if any(c.is_m3dseg for c in cases):
        log.warning(M3D_WARNING)
    results = {}
    workers = max(1, int(workers or 1))
    bar = tqdm(total=len(cases), desc="prepare", unit="case", file=sys.stderr, disable=not progress or None)
    try:
        jobs = [(c, out_dir, settings) for c in cases]
        if workers == 1 or len(cases) <= 1:
            for job in jobs:
                cid, rec, err = _run_one(job)
                results[cid] = (rec, err)
                bar.update(1)
        else:
            with ProcessPoolExecutor(max_workers=workers) as pool:
                futures = [pool.submit(_run_one, job) for job in jobs]
                for fut in as_completed(futures):
                    cid, rec, err = fut.result()
                    results[cid] = (rec, err)
                    bar.update(1)
    finally:
        bar.close()

    records = [results[c.id][0] for c in cases if results[c.id][1] is None]
    negatives = select_negatives(records, settings.negative_fraction, settings.seed)
    samples, skipped = [], list(bad_rows)
    resumed = 0
    per_case_s = []
    for c in cases:
        rec, err = results[c.id]
        if err is not None:
            skipped.append({"case": c.id, "row": c.row, "target": None, **err})
            continue
        samples += rec["samples"] + negatives.get(c.id, [])
        skipped += [dict(s, row=c.row) for s in rec["skipped"]]
        resumed += bool(rec.get("resumed"))
        if not rec.get("resumed"):
            per_case_s.append(rec["seconds"])
    by_reason = {}
    for s in skipped:
        by_reason[s["reason"]] = by_reason.get(s["reason"], 0) + 1
    neg = {sp: sum(1 for x in samples if x["split"] == sp and x.get("absent")) for sp in ("train", "test")}
    pool = {sp: sum(1 for r in records for x in r.get("negative_candidates", []) if x["split"] == sp)
            for sp in ("train", "test")}
    notes = []
    for sp in ("train", "test"):
        positives = sum(1 for x in samples if x["split"] == sp and not x.get("absent"))
        want = negatives_wanted(settings.negative_fraction, positives)
        if want > pool[sp]:
            notes.append(f"{sp}: {want} negative (not present) sample(s) wanted for a fraction of "
                         f"{settings.negative_fraction:g}, but only {pool[sp]} candidate(s) exist (labels absent "
                         "from their volume, or the rows' 'absent' names)")
            log.warning("%s", notes[-1])
    summary = {
        "format": FORMAT, "manifest": str(manifest), "cases": len(cases) + len(bad_rows),
        "cases_prepared": sum(1 for c in cases if results[c.id][1] is None),
        "cases_resumed": resumed, "samples": len(samples),
        "samples_by_split": {s: sum(1 for x in samples if x["split"] == s) for s in ("train", "test")},
        "negatives_by_split": neg, "negative_candidates_by_split": pool,
        "skipped": skipped, "skipped_by_reason": by_reason, "settings": asdict(settings), "workers": workers,
        "notes": notes, "seconds": round(time.perf_counter() - t0, 3),
        "seconds_per_case": round(float(np.mean(per_case_s)), 3) if per_case_s else None,
    }
    _write_json(out_dir / SUMMARY, summary)
    if not samples:
        raise DataError(f"nothing could be prepared from {manifest}: " + "; ".join(
            f"{s['case']}{'/' + s['target'] if s.get('target') else ''}: {s['message']}" for s in skipped[:3])
                        + (f" (and {len(skipped) - 3} more; see {out_dir / SUMMARY})" if len(skipped) > 3 else ""))
    _write_json(out_dir / INDEX, samples, lines=True)
    return summary


def format_summary(summary: dict) -> str:
    neg = summary.get("negatives_by_split") or {"train": 0, "test": 0}
    n_neg = neg["train"] + neg["test"]
    lines = [f"prepared {summary['samples']} sample(s) ({summary['samples_by_split']['train']} train, "
             f"{summary['samples_by_split']['test']} test) from {summary['cases_prepared']} of {summary['cases']} "
             f"case(s) in {summary['seconds']:.1f} s ({summary['cases_resumed']} resumed)"
             + (f"; {n_neg} of them negative (target not present: {neg['train']} train, {neg['test']} test)"
                if n_neg else "")]
    if summary["skipped"]:
        reasons = ", ".join(f"{k}: {v}" for k, v in sorted(summary["skipped_by_reason"].items()))
        lines.append(f"skipped {len(summary['skipped'])} ({reasons}):")
        for s in summary["skipped"]:
            lines.append(f"  {s['case']}{' / ' + s['target'] if s.get('target') else ''}: [{s['reason']}] "
                         f"{s['message']}")
    return "\n".join(lines)


# ---- reading a prepared set back ---------------------------------------------------------------

def load_samples(data_dir, split: Optional[str] = None) -> List[dict]:
    """The samples of a prepared folder (``samples.jsonl``), optionally of one split.

    Each sample gets ``data_dir`` (absolute) so :func:`load_slices` and :func:`load_mask` work.
    """
    data_dir = Path(data_dir).expanduser().resolve()
    index = data_dir / INDEX
    if not index.is_file():
        raise DataError(f"{data_dir} is not a prepared training set (no {INDEX}); run `medvol-train prepare`")
    out = []
    for n, line in enumerate(index.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            s = json.loads(line)
        except ValueError as e:
            raise DataError(f"{index} line {n} is not JSON ({e})") from None
        if s.get("format") != FORMAT:
            raise DataError(f"{index} line {n}: format {s.get('format')!r}, expected {FORMAT!r}")
        if split is None or s["split"] == split:
            s["data_dir"] = str(data_dir)
            out.append(s)
    return out


def load_slices(sample: dict) -> List[np.ndarray]:
    """The shown slices of a sample as the grounder renders them: RGB uint8 ``(256, 256, 3)`` each."""
    path = Path(sample["data_dir"]) / sample["slices_file"]
    try:
        with np.load(path, allow_pickle=False) as z:
            images, shown = z["images"], z["shown"]
    except Exception as e:
        raise DataError(f"cannot read {path}: {e}") from None
    if [int(v) for v in shown] != [int(v) for v in sample["shown"]]:
        raise DataError(f"{path}: its shown slices do not match the index; prepare the set again")
    return [np.repeat(im[..., None], 3, axis=2) for im in images]


def load_mask(sample: dict) -> np.ndarray:
    """The sample's target mask, bool ``(D, H, W)`` on the canonical stack (all zero for a negative
    sample, which has no mask file)."""
    if sample.get("absent"):
        return np.zeros([int(v) for v in sample["stack_shape"]], dtype=bool)
    path = Path(sample["data_dir"]) / sample["mask_file"]
    try:
        with np.load(path, allow_pickle=False) as z:
            return z["mask"].astype(bool)
    except Exception as e:
        raise DataError(f"cannot read {path}: {e}") from None


def _hu_window(sample: dict):
    """The window of the model inputs: the sample's percentile window for M3D-normalised intensities,
    None (the default soft-tissue window) on HU — as the prepared pictures were rendered."""
    if sample.get("intensity") == "m3d_normalised":
        from medvolcore.windowing import Window

        rw = sample["render_window"]
        return Window(float(rw["center"]), float(rw["width"]), "custom")
    return None


def load_stack(sample: dict):
    """``(stack, window)``: the sample's CT as an :class:`~medvolcore.stack.AxialStack`, re-read
    from ``source`` with :func:`medvoltrain.datasets.load_case`, and the window its pictures were
    rendered with (None: the default soft-tissue window on HU; M3D-Seg's normalised intensities get
    their percentile window back). Checked against the prepared set: the stack shape, and one shown
    slice rendered again must look like the stored picture (a changed file or another orientation
    would not)."""
    src = sample.get("source") or {}
    if not src.get("volume") or not src.get("labels"):
        raise DataError(f"sample {sample.get('id')}: no source volume/labels in the prepared index")
    from .datasets import Case, load_case

    case = Case(id=str(sample.get("case_id")), volume=Path(src["volume"]), labels=Path(src["labels"]), targets={},
                split=str(sample.get("split")), dataset=sample.get("dataset"), orientation=src.get("orientation"))
    stack, _labels, _window, _intensity = load_case(case)
    if list(stack.shape) != [int(v) for v in sample["stack_shape"]]:
        raise DataError(f"sample {sample.get('id')}: its CT is {list(stack.shape)} on the stack, the prepared set "
                        f"says {sample['stack_shape']}; prepare the set again")
    shown = [int(z) for z in sample["shown"]]
    i = len(shown) // 2
    size = int(sample.get("image_size", [256, 256])[0])
    again = stack.render_slice(shown[i], size, _hu_window(sample))[..., 0].astype(np.int16)
    stored = load_slices(sample)[i][..., 0].astype(np.int16)
    if again.shape != stored.shape or float(np.abs(again - stored).mean()) > 8.0:
        raise DataError(f"sample {sample.get('id')}: slice {shown[i]} of {src['volume']} no longer looks like the "
                        "prepared picture (another file or orientation?); prepare the set again")
    return stack, _hu_window(sample)


__all__ = ["PrepareSettings", "prepare", "prepare_case", "format_summary", "load_samples", "load_slices",
           "load_mask", "load_stack", "negative_candidates", "negatives_wanted", "same_structure", "select_negatives", "FORMAT", "DEFAULT_NEGATIVE_FRACTION"]
