"""The evidence anchor: one key axial slice, inclusive pixel boxes on it, and corrections
(:class:`EvidenceAnchor`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, List, Optional, Sequence

import numpy as np

from ..errors import AnchorError, InputError
from ..fileio import write_text_atomic
from ..prompts import check_z_range, plan_objects
from .geometry import Box, _pixel_prompt, _show, _slice_centre, box_to_norm, box_to_ras, check_box, norm_to_box, ras_to_box
from .parsing import anchor_from_dict, load_anchor
from .schema import MAX_BOXES, SCHEMA, SCHEMA_V2, SCHEMA_V3, SCHEMA_V4, SOURCES, _image_size, dumps


@dataclass
class EvidenceAnchor:
    """A key slice (0-based ``z`` of the canonical stack), inclusive pixel boxes on it, and corrections.

    ``image_size`` is the slice's ``(W, H)`` in pixels. ``world`` (RAS) is filled by
    :meth:`with_world` when the stack is known. ``notes`` carries remarks a reader should see
    (e.g. that the model was an untrained smoke model, or that a box was reordered).
    ``propagation`` records how the anchor was last propagated (written by the pipeline:
    ``PropagationResult.stop_summary()``, i.e. early stop's K and where each direction
    stopped); it is written to the file but never read back, since it describes a past run,
    not an input.

    ``prompts`` (pixel form, see :mod:`medvolcore.prompts`) correct objects 1..N on any slice or add
    new objects; ``z_range`` limits propagation to ``[z0, z1]``. With either, the file's schema is
    ``medvol.anchor/2``; :meth:`with_world` fills each prompt's ``world`` form.

    ``absent`` (schema ``medvol.anchor/3``): the grounder answered that the target is not in this
    volume. Such an anchor has ``slice`` None, no boxes, prompts or range, and nothing to
    propagate; it keeps the query, the reasoning, the notes and the slice size (so it is still
    checked against the volume it was made for). Use :meth:`absent_for` to make one.

    What the grounder says about its own answer (written when set, never read back: like
    ``propagation`` they describe how this anchor was made, and an edited anchor is no longer
    that answer): ``signal``, the answer's token signal (``answer_mean_logprob``,
    ``answer_mean_prob``, ``answer_scored_tokens``: :meth:`QwenVLGrounder._answer_signal`);
    ``confidence``, the agreement of a consensus's samples in [0, 1], and ``samples``, each
    sampled answer in compact form (:mod:`medvolcore.consensus`). Readers of every schema accept
    these keys and ignore them.
    """

    slice: Optional[int]
    boxes: List[Box]
    image_size: Sequence[int]
    query: str = ""
    reasoning: str = ""
    source: str = "mask"
    world: Optional[dict] = None
    notes: List[str] = field(default_factory=list)
    propagation: Optional[dict] = None
    prompts: List[dict] = field(default_factory=list)
    z_range: Optional[List[int]] = None
    absent: bool = False
    signal: Optional[dict] = None
    confidence: Optional[float] = None
    samples: Optional[List[dict]] = None

    def __post_init__(self):
        if not isinstance(self.absent, bool):
            raise AnchorError(f"anchor 'absent' must be true or false, got {_show(self.absent)}")
        if self.absent:
            if self.slice is not None or self.boxes or self.prompts or self.z_range is not None:
                raise AnchorError("an absent anchor (the target is not in this volume) has no slice, boxes, prompts "
                                  "or slice range")
            self.boxes, self.prompts = [], []
            self.image_size = _image_size(self.image_size)
            if self.source not in SOURCES:
                raise AnchorError(f"anchor source must be one of {', '.join(SOURCES)}, got {self.source!r}")
            return
        if self.slice is None:
            raise AnchorError("the anchor has no slice (only an absent anchor has none)")
        if isinstance(self.slice, bool) or not isinstance(self.slice, (int, np.integer)) or self.slice < 0:
            raise AnchorError(f"anchor slice must be a non-negative integer, got {self.slice!r}")
        self.slice = int(self.slice)
        self.image_size = _image_size(self.image_size)
        if self.source not in SOURCES:
            raise AnchorError(f"anchor source must be one of {', '.join(SOURCES)}, got {self.source!r}")
        if not self.boxes:
            raise AnchorError("an anchor needs at least one box")
        if len(self.boxes) > MAX_BOXES:  # each box is tracked through every slice: bound the work
            raise AnchorError(f"the anchor has {len(self.boxes)} boxes; at most {MAX_BOXES} are allowed (one per "
                              "structure; merge or drop some)")
        w, h = self.image_size
        try:
            self.boxes = [check_box(b, w, h, f"box {i + 1}") for i, b in enumerate(self.boxes)]
        except InputError as e:
            raise AnchorError(str(e)) from None
        self.prompts = self._checked_prompts(self.prompts)
        rng = check_z_range(self.z_range, None, AnchorError)
        self.z_range = None if rng is None else list(rng)
        self.plan()

    def _checked_prompts(self, prompts) -> List[dict]:
        """Prompts with their types checked and boxes clamped to the slice (as anchor boxes are)."""
        if prompts is None:
            return []
        if not isinstance(prompts, (list, tuple)):
            raise AnchorError(f"'prompts' must be a list, got {type(prompts).__name__}")
        out = []
        for i, raw in enumerate(prompts):
            p = _pixel_prompt(raw, i, self.width, self.height, f"prompt {i + 1}")
            if isinstance(raw, dict) and isinstance(raw.get("world"), dict):
                p["world"] = raw["world"]
            out.append(p)
        return out

    def plan(self, depth: Optional[int] = None):
        """The objects to propagate (:func:`medvolcore.prompts.plan_objects`); checks every prompt rule.
        An absent anchor has none to propagate: :class:`AnchorError`."""
        if self.absent:
            raise AnchorError("this anchor says the target is not in this volume: there is nothing to propagate "
                              "(draw a box on the slice where it is to correct it)")
        return plan_objects(self.slice, self.boxes, self.pixel_prompts(), width=self.width, height=self.height,
                            depth=depth, z_range=self.z_range, error=AnchorError)

    def pixel_prompts(self) -> List[dict]:
        """The prompts without their ``world`` form (what the propagator takes)."""
        return [{k: p[k] for k in ("slice", "object", "box", "points", "mask") if k in p} for p in self.prompts]

    @property
    def schema(self) -> str:
        if self.absent:
            return SCHEMA_V3
        if any(p.get("mask") is not None for p in self.prompts):
            return SCHEMA_V4
        return SCHEMA_V2 if (self.prompts or self.z_range is not None) else SCHEMA

    @property
    def num_objects(self) -> int:
        return max([len(self.boxes)] + [p["object"] for p in self.prompts])

    @property
    def width(self) -> int:
        return self.image_size[0]

    @property
    def height(self) -> int:
        return self.image_size[1]

    @property
    def boxes_norm(self) -> List[List[float]]:
        return [box_to_norm(b, self.width, self.height) for b in self.boxes]

    # -- constructors --
    @classmethod
    def absent_for(cls, image_size: Sequence[int], **kw) -> "EvidenceAnchor":
        """An absent anchor for slices of ``image_size`` (``[W, H]``)."""
        return cls(None, [], image_size, absent=True, **kw)

    @classmethod
    def from_norm(cls, slice_index: int, boxes_norm: Iterable[Sequence[float]], image_size: Sequence[int], **kw) -> "EvidenceAnchor":
        w, h = _image_size(image_size)
        boxes = [norm_to_box(b, w, h, f"box {i + 1}") for i, b in enumerate(boxes_norm)]
        return cls(slice_index, boxes, [w, h], **kw)

    @classmethod
    def from_world(cls, world: dict, stack, **kw) -> "EvidenceAnchor":
        boxes_ras = (world or {}).get("boxes_ras")
        if not boxes_ras:
            raise AnchorError("anchor 'world' has no boxes_ras")
        zs, boxes = [], []
        for i, corners in enumerate(boxes_ras):
            z, b = ras_to_box(stack, corners, f"world box {i + 1}")
            zs.append(z)
            boxes.append(b)
        if len(set(zs)) != 1:
            raise AnchorError(f"world boxes lie on different slices ({sorted(set(zs))}); an anchor has one key slice")
        return cls(zs[0], boxes, [stack.width, stack.height], **kw).with_world(stack)

    def with_world(self, stack) -> "EvidenceAnchor":
        """Check the anchor against ``stack`` and fill ``world`` (RAS mm)."""
        if [stack.width, stack.height] != self.image_size:
            raise AnchorError(
                f"the anchor is for a {self.width}×{self.height} slice but the volume's axial slices are "
                f"{stack.width}×{stack.height}; was it made for another volume?"
            )
        if self.absent:
            self.world = None
            return self
        if not 0 <= self.slice < stack.depth:
            raise AnchorError(f"anchor slice {self.slice} is outside the stack (0..{stack.depth - 1})")
        self.plan(stack.depth)
        self.world = {
            "slice_center_ras": _slice_centre(stack, self.slice),
            "boxes_ras": [box_to_ras(stack, self.slice, b) for b in self.boxes],
        }
        if self.z_range is not None:
            self.world["z_range_ras"] = [_slice_centre(stack, z) for z in self.z_range]
        for p in self.prompts:
            if p.get("mask") is not None:  # the mask is on its slice's pixels: the world form locates the slice
                p["world"] = {"slice_center_ras": _slice_centre(stack, p["slice"])}
                continue
            pts = stack.stack_to_ras([[p["slice"], y, x] for x, y, _label in p["points"]]) if p["points"] else []
            p["world"] = {"box_ras": None if p["box"] is None else box_to_ras(stack, p["slice"], p["box"]),
                          "points_ras": [[float(v) for v in r] + [int(q[2])] for r, q in zip(pts, p["points"])]}
        return self

    # -- file format --
    def to_dict(self) -> dict:
        if self.absent:
            d = {"schema": self.schema, "absent": True, "slice": None, "boxes": [], "boxes_norm": [],
                 "image_size": list(self.image_size), "query": self.query, "reasoning": self.reasoning,
                 "source": self.source}
            if self.notes:
                d["notes"] = list(self.notes)
            return self._with_grounder_facts(d)
        d = {
            "schema": self.schema,
            "slice": self.slice,
            "boxes": [list(b) for b in self.boxes],
            "boxes_norm": [[round(v, 6) for v in b] for b in self.boxes_norm],
            "image_size": list(self.image_size),
        }
        if self.world is not None:
            d["world"] = self.world
        if self.prompts:
            d["prompts"] = [dict(p) for p in self.prompts]
        if self.z_range is not None:
            d["z_range"] = list(self.z_range)
        d.update(query=self.query, reasoning=self.reasoning, source=self.source)
        if self.notes:
            d["notes"] = list(self.notes)
        self._with_grounder_facts(d)
        if self.propagation is not None:
            d["propagation"] = self.propagation
        return d

    def _with_grounder_facts(self, d: dict) -> dict:
        """``d`` with the answer signal, the confidence and the samples, each only when set."""
        if self.signal:
            d.update(self.signal)
        if self.confidence is not None:
            d["confidence"] = round(float(self.confidence), 4)
        if self.samples is not None:
            d["samples"] = [dict(s) for s in self.samples]
        return d

    def to_json(self) -> str:
        return dumps(self.to_dict())

    def save(self, path, overwrite: bool = False) -> Path:
        return write_text_atomic(path, self.to_json(), overwrite)

    @classmethod
    def from_dict(cls, d: dict, stack=None, origin: str = "anchor") -> "EvidenceAnchor":
        """Read an anchor object. ``boxes``, ``boxes_norm`` or ``world`` may carry the boxes.

        With a ``stack``, ``world`` is used when ``boxes`` is absent, and both are checked
        against each other when both are present (an error names the disagreement).
        """
        return anchor_from_dict(cls, d, stack, origin)

    @classmethod
    def load(cls, path, stack=None) -> "EvidenceAnchor":
        """Read an anchor file: at most :data:`MAX_ANCHOR_FILE_BYTES` (checked before reading),
        strict JSON (no key twice in an object, no NaN or Infinity), then :meth:`from_dict`."""
        return load_anchor(cls, path, stack)
