"""The main job: CT + free-form query → evidence anchor (Qwen3-VL) → 3-D mask (MedSAM2).

A :class:`Pipeline` keeps both models loaded between calls, so a second ``segment`` or a
``repropagate`` after a box edit pays no model loading (the worker and Slicer reuse one).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Union

import numpy as np

from .anchor import EvidenceAnchor
from .devices import resolve_device
from .errors import InputError
from .progress import part_of
from .stack import AxialStack
from .volume import CTVolume, load_volume

log = logging.getLogger(__name__)

SMOKE_NOTE = ("made with the untrained 'tiny' smoke model: the anchor and mask are meaningless; "
              "for a real model run `medvol models download qwen3-vl-4b` (zero-shot: no trained MedVol-R1 adapter is "
              "published)")

VolumeLike = Union[str, Path, CTVolume, AxialStack]


def absent_note(query: str) -> str:
    """The line every front door shows when the grounder answers that the target is absent."""
    q = " ".join(str(query).split())
    return f"not found in this CT: {q[:200] + '…' if len(q) > 200 else q}"

Progress = Callable[[str, float, str], None]  # (stage, fraction 0..1, message)


@dataclass
class Segmentation:
    """Result of :meth:`Pipeline.segment` / :meth:`Pipeline.repropagate`.

    ``mask`` is uint8 on the volume's source grid (same shape and affine as the input);
    ``mask_stack`` the same mask on the canonical stack. ``timings`` are seconds per stage.
    When the grounder answered that the target is not in the volume (:attr:`absent`), nothing
    was propagated and both masks are all zero.

    With a consensus of G > 1 samples (``consensus``): ``agreement`` (source grid) and
    ``agreement_stack`` hold per voxel the number of samples whose mask includes it (uint8,
    0..G), ``confidence`` their mean pairwise agreement (:mod:`medvolcore.consensus`) and
    ``samples`` each answer in compact form (also in the anchor). ``consensus_mask`` says which
    mask ``mask`` is: ``greedy`` (the greedy answer's, as without a consensus) or ``majority``.
    ``encoded_slices`` lists every slice MedSAM2's image encoder ran on, in order, over all the
    propagations of the call.
    """

    anchor: EvidenceAnchor
    mask: np.ndarray
    mask_stack: np.ndarray
    stack: AxialStack
    reasoning: str = ""
    raw_text: str = ""
    timings: dict = field(default_factory=dict)
    preset: str = ""
    smoke: bool = False
    notes: list = field(default_factory=list)
    propagation: object = None
    identity: Optional[dict] = None  # the models that made it (medvolcore.models.identity); None: MedSAM2 only
    consensus: int = 1
    consensus_mask: str = "greedy"
    agreement: Optional[np.ndarray] = None
    agreement_stack: Optional[np.ndarray] = None
    confidence: Optional[float] = None
    samples: Optional[list] = None
    encoded_slices: tuple = ()

    @property
    def absent(self) -> bool:
        """True when the grounder answered that the target is not in this volume: the greedy answer
        did, or, with ``consensus_mask="majority"``, more than half of the samples did."""
        if self.consensus_mask == "majority" and self.samples:
            return 2 * sum(1 for s in self.samples if s.get("absent")) > len(self.samples)
        return bool(self.anchor.absent)

    def summary(self) -> dict:
        return {
            "preset": self.preset, "smoke": self.smoke, "absent": self.absent, "identity": self.identity,
            "anchor": self.anchor.to_dict(),
            "reasoning": self.reasoning, "raw_text": self.raw_text, "notes": list(self.notes),
            "mask_voxels": int(self.mask.sum()), "timings": {k: round(v, 4) if isinstance(v, float) else v
                                                              for k, v in self.timings.items()},
            "consensus": self.consensus, "consensus_mask": self.consensus_mask, "confidence": self.confidence,
        }


def as_stack(volume: VolumeLike) -> AxialStack:
    if isinstance(volume, AxialStack):
        return volume
    if isinstance(volume, CTVolume):
        return AxialStack(volume)
    return AxialStack(load_volume(volume))


class Pipeline:
    """Grounder + propagator for one model preset, loaded lazily and kept loaded.

    ``preset``: a name from ``Resources/models.json`` (``qwen3-vl-4b``, ``qwen3-vl-2b``, ``medvol-r1`` with an
    adapter, ``tiny``); None (the default) is the manifest's default preset
    (:func:`medvolcore.models.default_preset`). ``identity`` says what the models are
    (:func:`medvolcore.models.identity`); grounded results carry its note when no task-trained
    model made them.
    ``adapter``: a LoRA adapter folder overriding the preset's. ``low_memory``: on CUDA, move
    the language model off the GPU while MedSAM2 runs. ``propagator``: a loaded
    :class:`~medvolcore.propagation.MedSAM2Propagator` to use instead of the preset's MedSAM2
    (evaluation with another checkpoint, or seeded random weights). ``stop_after_empty``: the
    default K of early stop for this pipeline's propagations (see
    :meth:`~medvolcore.propagation.MedSAM2Propagator.propagate`; 0 = the whole stack, the paper's
    behaviour); ``segment`` and ``repropagate`` may override it per call. ``grounder_dtype``:
    the language model's dtype (``"bfloat16"``, ``"float32"``; default fp32 on CPU, bf16 on CUDA).
    """

    def __init__(self, preset: Optional[str] = None, adapter=None, device: str = "cpu", low_memory: bool = False,
                 propagator=None, stop_after_empty: Optional[int] = None, grounder_dtype: Optional[str] = None):
        from . import models

        self._setup(models.resolve(preset, adapter=adapter), device, low_memory, propagator, stop_after_empty,
                    grounder_dtype)

    @classmethod
    def with_propagator(cls, propagator, stop_after_empty: Optional[int] = None) -> "Pipeline":
        """A pipeline of a loaded MedSAM2 alone (``medvol propagate --sam-checkpoint``): it propagates
        given anchors (:meth:`repropagate`) and has no grounder, so no model preset is needed."""
        pipe = cls.__new__(cls)
        pipe._setup(None, str(propagator.device), False, propagator, stop_after_empty, None)
        return pipe

    def _setup(self, resolved, device, low_memory, propagator, stop_after_empty, grounder_dtype) -> None:
        from .propagation import DEFAULT_STOP_AFTER_EMPTY, check_stop_after_empty

        self.stop_after_empty = check_stop_after_empty(
            DEFAULT_STOP_AFTER_EMPTY if stop_after_empty is None else stop_after_empty)
        self.models = resolved
        self.preset = resolved.name if resolved is not None else ""
        self.smoke = bool(resolved.smoke) if resolved is not None else False
        self.identity = _identity(resolved) if resolved is not None else None  # what every output names
        self.device = str(resolve_device(device))
        self.low_memory = bool(low_memory)
        self.grounder_dtype = grounder_dtype
        self._grounder = None
        self._propagator = propagator
        self._lock = threading.RLock()
        self.load_seconds = {}

    # -- models, loaded once --
    @property
    def grounder(self):
        with self._lock:
            if self._grounder is None:
                if self.models is None:
                    raise InputError("this pipeline has MedSAM2 only (no model preset): it propagates given anchors "
                                     "and cannot answer a query")
                from .grounder import QwenVLGrounder

                t = time.perf_counter()
                self._grounder = QwenVLGrounder.from_pretrained(
                    self.models.grounder_dir, adapter=self.models.adapter_dir, device=self.device,
                    dtype=self.grounder_dtype, settings=self.models.settings)
                self.load_seconds["grounder"] = time.perf_counter() - t
            return self._grounder

    @property
    def propagator(self):
        with self._lock:
            if self._propagator is None:
                from .propagation import MedSAM2Propagator

                t = time.perf_counter()
                if self.models.sam_checkpoint is not None:
                    self._propagator = MedSAM2Propagator.from_checkpoint(self.models.sam_checkpoint, device=self.device)
                else:
                    seed, size = self.models.sam_random
                    self._propagator = MedSAM2Propagator.from_random(seed, image_size=size, device=self.device)
                self.load_seconds["medsam2"] = time.perf_counter() - t
            return self._propagator

    def load(self) -> "Pipeline":
        """Load both models now (otherwise they load on first use)."""
        if self.models is not None:
            self.grounder  # noqa: B018
        self.propagator  # noqa: B018
        return self

    # -- the jobs --
    def segment(self, volume: VolumeLike, query: str, *, constrain: bool = True, seed: Optional[int] = None,
                do_sample: bool = False, hu_window=None, progress: Optional[Progress] = None, cancel=None,
                stop_after_empty: Optional[int] = None, features=None, consensus: int = 1,
                consensus_mask: str = "greedy") -> Segmentation:
        """Ground ``query`` on the volume's 64 sampled slices, then propagate the anchor.

        ``features``: a :class:`~medvolcore.propagation.FeatureStore` of this volume (same HU
        window, this pipeline's MedSAM2) to reuse and fill: its slices are not encoded again.

        ``consensus = G > 1``: G answers (:meth:`QwenVLGrounder.ground_samples`: the greedy one,
        then G − 1 sampled with ``seed``, the slices encoded and the prompt prefilled once), each
        present one propagated (identical anchors once) through one feature store, so MedSAM2
        encodes every slice at most once for all G; the result carries the agreement map, the
        confidence and the samples (:class:`Segmentation`). ``consensus_mask``: ``greedy`` (the
        mask is the greedy answer's: the same as without a consensus) or ``majority``."""
        (query,), consensus, consensus_mask, stop_k = self._check_grounding([query], consensus, consensus_mask,
                                                                            do_sample, stop_after_empty)
        with self._lock:
            t0 = time.perf_counter()
            stack = self._ground_stack(volume, progress)
            grounder = self.grounder
            sampled = None
            # progress through the encoding, the prefill and each decoding step; cancel checked at each
            if consensus > 1:
                sampled = grounder.ground_samples(stack, query, consensus, constrain=constrain, seed=seed,
                                                  window=hu_window, progress=progress, cancel=cancel)
                g = sampled.greedy
            else:
                g = grounder.ground(stack, query, constrain=constrain, do_sample=do_sample, seed=seed,
                                    window=hu_window, progress=progress, cancel=cancel)
            t_ground = time.perf_counter() - t0
            if self.low_memory:
                self._lvlm_to("cpu")
            return self._from_grounding(stack, query, g, sampled, consensus_mask, hu_window, progress, cancel, stop_k,
                                        features, t0, t_ground)

    def segment_queries(self, volume: VolumeLike, queries, *, constrain: bool = True, seed: Optional[int] = None,
                        do_sample: bool = False, hu_window=None, progress: Optional[Progress] = None, cancel=None,
                        stop_after_empty: Optional[int] = None, features=None, consensus: int = 1,
                        consensus_mask: str = "greedy") -> list:
        """Several targets in one volume: one :class:`Segmentation` per query, in order, each what
        :meth:`segment` gives for that query alone (up to floating-point rounding in the grounder).

        The work the targets share is done once: the slices are rendered, encoded and the shared
        part of the prompt prefilled once (:meth:`QwenVLGrounder.ground_queries`), and every anchor
        is propagated through one :class:`~medvolcore.propagation.FeatureStore` (``features``, or one
        made here), so MedSAM2 encodes each slice at most once for all the targets. ``progress``:
        the ``ground`` stage covers every query, then the ``propagate`` stage every target, each an
        equal part with its messages prefixed ``query i/n`` / ``target i/n``. The other arguments are
        :meth:`segment`'s, applied to every query."""
        from .propagation import FeatureStore

        queries, consensus, consensus_mask, stop_k = self._check_grounding(queries, consensus, consensus_mask,
                                                                           do_sample, stop_after_empty)
        with self._lock:
            t0 = time.perf_counter()
            stack = self._ground_stack(volume, progress)
            grounded = self.grounder.ground_queries(stack, queries, consensus, constrain=constrain,
                                                    do_sample=do_sample, seed=seed, window=hu_window,
                                                    progress=progress, cancel=cancel)
            t_ground = time.perf_counter() - t0
            if self.low_memory:
                self._lvlm_to("cpu")
            features = FeatureStore() if features is None else features  # every slice encoded once for all
            out = []
            for i, (query, sampled) in enumerate(zip(queries, grounded)):
                seg = self._from_grounding(stack, query, sampled.greedy, sampled if consensus > 1 else None,
                                           consensus_mask, hu_window, part_of(progress, i, len(queries), "target"),
                                           cancel, stop_k, features, time.perf_counter(),
                                           sampled.greedy.timings.get("total_s", 0.0))
                out.append(seg)
            for seg in out:
                seg.timings["queries"] = len(queries)
                seg.timings["ground_all_s"] = t_ground
                seg.timings["all_s"] = time.perf_counter() - t0
            return out

    def _check_grounding(self, queries, consensus, consensus_mask, do_sample, stop_after_empty) -> tuple:
        """The grounding request's values checked before any model is loaded →
        ``(queries, consensus, consensus_mask, stop_k)``."""
        from .consensus import check_mask_mode
        from .grounder import check_samples, validate_query

        queries = [validate_query(q) for q in queries]
        if not queries:
            raise InputError("give at least one query")
        consensus = check_samples(consensus, "consensus (the number of samples)")
        consensus_mask = check_mask_mode(consensus_mask)
        if consensus > 1 and do_sample:
            raise InputError("a consensus samples its own answers after the greedy one: do not ask for sampling too")
        return queries, consensus, consensus_mask, self._stop_k(stop_after_empty)

    def _ground_stack(self, volume: VolumeLike, progress) -> AxialStack:
        """The volume as a stack the grounder can take, and the language model on its device."""
        stack = as_stack(volume)
        if stack.depth < 2:
            raise InputError(f"volume too small: the stack has {stack.depth} axial slice(s); at least 2 are needed")
        _stage(progress, "ground", 0.0, "rendering the slices")
        self.grounder  # noqa: B018 - loaded here, before the device move
        self._lvlm_to(self.device)
        return stack

    def _from_grounding(self, stack, query: str, g, sampled, consensus_mask: str, hu_window, progress, cancel,
                        stop_k: int, features, t0: float, t_ground: float) -> Segmentation:
        """The :class:`Segmentation` of one grounded query: notes, then the anchor propagated (nothing
        for an absent answer), then the consensus's other samples (``sampled``, or None)."""
        grounder = self.grounder
        anchor = g.anchor.with_world(stack)
        notes = list(stack.volume.notes) + list(g.notes)
        if self.smoke or getattr(grounder, "is_smoke", False):
            if not self.smoke:
                self.identity = _identity(self.models, smoke=True)
            self.smoke = True
            notes.append(SMOKE_NOTE)
        notes += _identity_notes(self.identity)
        if anchor.absent:
            notes.append(absent_note(query))
        anchor.notes = list(dict.fromkeys(list(anchor.notes) + notes))
        if sampled is not None and features is None:
            from .propagation import FeatureStore

            features = FeatureStore()  # this call's: every slice encoded once for all samples
        consensus = len(sampled.samples) if sampled is not None else 1
        if anchor.absent:
            seg = Segmentation(anchor=anchor, mask=np.zeros(stack.volume.shape, np.uint8),
                               mask_stack=np.zeros(stack.data.shape, np.uint8), stack=stack, preset=self.preset,
                               smoke=self.smoke, identity=self.identity,
                               timings={"propagate_s": 0.0, "slices_encoded": 0, "slices_propagated": 0,
                                        "encoder_calls": 0})
            _stage(progress, "propagate", 1.0, "not present: nothing to propagate")
        else:
            part = part_of(progress, 0, consensus, "sample")
            seg = self._propagate(stack, anchor, hu_window, part, cancel, stop_k, features=features)
            seg.encoded_slices = tuple(seg.propagation.encoded_slices)
        seg.reasoning, seg.raw_text = g.reasoning, g.raw_text
        seg.timings.update({f"ground_{k}": v for k, v in g.timings.items()})
        if sampled is not None:
            self._consensus(seg, sampled, consensus_mask, hu_window, progress, cancel, stop_k, features)
        seg.timings["ground_s"] = t_ground
        seg.timings["total_s"] = time.perf_counter() - t0
        seg.notes = anchor.notes
        return seg

    def _consensus(self, seg: Segmentation, sampled, mode: str, hu_window, progress, cancel, stop_k: int,
                   features) -> None:
        """Propagate samples 2..G beside the greedy one (``seg``) and fill the consensus fields."""
        from . import consensus as cons

        stack, n = seg.stack, len(sampled.samples)
        t = time.perf_counter()
        masks = {}  # (slice, boxes) → mask on the stack: an anchor given twice is propagated once
        if not seg.anchor.absent:
            masks[(seg.anchor.slice, tuple(map(tuple, seg.anchor.boxes)))] = seg.mask_stack.astype(bool)
        outcomes, records, encoded = [], [], list(seg.encoded_slices)
        calls, propagations = int(seg.timings.get("encoder_calls", 0)), int(not seg.anchor.absent)
        for i, sample in enumerate(sampled.samples):
            a = sample.anchor
            if a is None:
                outcome = None
            elif a.absent:
                outcome = cons.ABSENT
            else:
                key = (a.slice, tuple(map(tuple, a.boxes)))
                if key not in masks:
                    r = self._propagate(stack, a, hu_window, part_of(progress, i, n, "sample"), cancel, stop_k,
                                        features=features).propagation
                    masks[key] = r.mask.astype(bool)
                    encoded += list(r.encoded_slices)
                    calls += r.encoder_calls
                    propagations += 1
                outcome = masks[key]
            outcomes.append(outcome)
            voxels = None if not isinstance(outcome, np.ndarray) else int(outcome.sum())
            records.append(cons.sample_record(sample.index, a, sample.error, sample.signal, voxels))
        agreement_stack = cons.agreement_map(outcomes, stack.data.shape)
        seg.consensus, seg.consensus_mask = n, mode
        seg.agreement_stack = agreement_stack
        seg.agreement = stack.to_source(agreement_stack)
        seg.confidence = cons.confidence(outcomes)
        seg.samples = records
        seg.encoded_slices = tuple(encoded)
        seg.anchor.confidence, seg.anchor.samples = seg.confidence, records
        unusable = sum(1 for o in outcomes if o is None)
        if unusable:
            seg.anchor.notes.append(f"{unusable} of {n} samples gave an unusable answer (counted as disagreeing)")
        if mode == "majority":
            seg.mask_stack = cons.majority_mask(agreement_stack, n)
            seg.mask = stack.to_source(seg.mask_stack)
            seg.anchor.notes.append(f"the mask is the majority of {n} samples (voxels more than half of them include); "
                                    "the anchor is the greedy answer's")
            note = absent_note(seg.anchor.query)
            if seg.absent and note not in seg.anchor.notes:  # more than half said "not present"
                seg.anchor.notes.append(note)
            elif not seg.absent and note in seg.anchor.notes:  # the greedy answer did, the majority did not
                seg.anchor.notes.remove(note)
        seg.timings.update({"propagate_s": seg.timings.get("propagate_s", 0.0) + time.perf_counter() - t,
                            "slices_encoded": len(encoded), "encoder_calls": calls, "propagations": propagations,
                            "consensus": n})
        seg.timings.update({f"ground_{k}": v for k, v in sampled.timings.items()})

    def repropagate(self, volume: VolumeLike, anchor: Union[EvidenceAnchor, dict], *, hu_window=None,
                    progress: Optional[Progress] = None, cancel=None, stop_after_empty: Optional[int] = None,
                    span: Optional[int] = None, largest_component: bool = False, features=None) -> Segmentation:
        """Propagate a given (e.g. edited or corrected) anchor; the language model is not used.

        ``span``: propagate only slices ``[k - span, k + span]``; ``largest_component``: keep each
        box's largest 3-D component (see :meth:`~medvolcore.propagation.MedSAM2Propagator.propagate`).
        The anchor's correction prompts and ``z_range`` are propagated with it; ``features`` as in
        :meth:`segment`.
        """
        stop_k = self._stop_k(stop_after_empty)
        with self._lock:
            t0 = time.perf_counter()
            stack = as_stack(volume)
            if isinstance(anchor, dict):
                anchor = EvidenceAnchor.from_dict(anchor, stack)
            else:
                anchor = anchor.with_world(stack)
            anchor.plan(stack.depth)  # an absent anchor has nothing to propagate: one clear AnchorError
            seg = self._propagate(stack, anchor, hu_window, progress, cancel, stop_k, span, largest_component,
                                  features=features)
            seg.reasoning = anchor.reasoning
            seg.notes = list(dict.fromkeys(list(stack.volume.notes) + list(seg.notes)))
            seg.timings["total_s"] = time.perf_counter() - t0
            return seg

    # -- internals --
    def _stop_k(self, value) -> int:
        from .propagation import check_stop_after_empty

        return self.stop_after_empty if value is None else check_stop_after_empty(value)

    def _propagate(self, stack, anchor, hu_window, progress, cancel, stop_k: int, span: Optional[int] = None,
                   largest_component: bool = False, features=None) -> Segmentation:
        t = time.perf_counter()
        prop = self.propagator

        def on_slice(done, total, message):
            _stage(progress, "propagate", done / max(total, 1), message)

        r = prop.propagate(stack.data, anchor.slice, anchor.boxes, prompts=anchor.pixel_prompts(), z_range=anchor.z_range,
                           hu_window=hu_window, progress=on_slice, cancel=cancel, stop_after_empty=stop_k, window=span,
                           largest_component=largest_component, features=features)
        mask = stack.to_source(r.mask)
        anchor.propagation = r.stop_summary()
        timings = {"propagate_s": time.perf_counter() - t, "propagate_s_per_slice": r.seconds_per_slice,
                   "slices_encoded": r.slices_encoded, "slices_propagated": r.slices_propagated,
                   "encoder_calls": r.encoder_calls}
        return Segmentation(anchor=anchor, mask=mask, mask_stack=r.mask, stack=stack, timings=timings,
                            preset=self.preset, smoke=self.smoke, notes=list(anchor.notes), propagation=r,
                            identity=self.identity)

    def _lvlm_to(self, device: str) -> None:
        if self._grounder is None or not str(self.device).startswith("cuda"):
            return
        model = self._grounder.model
        if str(next(model.parameters()).device).split(":")[0] != device.split(":")[0]:
            model.to(device)
            if device == "cpu":
                import torch

                torch.cuda.empty_cache()


def _identity(resolved, smoke=None) -> dict:
    from .models.identity import identity

    return identity(resolved, smoke=smoke)


def _identity_notes(ident) -> list:
    """The note of a grounded result that no task-trained model made (zero-shot, unknown adapter)."""
    from .models.identity import identity_note

    note = identity_note(ident)
    return [note] if note else []


def _stage(progress, stage, fraction, message):
    if progress is not None:
        progress(stage, float(fraction), message)
