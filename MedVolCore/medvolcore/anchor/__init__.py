"""Evidence anchors: one key axial slice and 2-D boxes on it (docs/architecture.md, "Evidence anchor file").

Geometry, on the canonical slice of width ``W`` and height ``H``:

* a pixel ``(x, y)`` covers ``[x, x+1) × [y, y+1)``;
* a pixel box is the inclusive index range ``[x0, y0, x1, y1]``;
* its normalised form (0–1000, Qwen3-VL's convention) is
  ``[1000·x0/W, 1000·y0/H, 1000·(x1+1)/W, 1000·(y1+1)/H]``; converting back rounds outward
  and clamps to the slice;
* its world form is the RAS millimetre centres of its first and last voxel,
  ``(z, y0, x0)`` and ``(z, y1, x1)`` on the stack.

The anchor file (``*.anchor.json``) has schema ``medvol.anchor/1``, or ``medvol.anchor/2`` when it
carries correction prompts or a slice range (:mod:`medvolcore.prompts`), or ``medvol.anchor/3`` when
it is an *absent* anchor (``"absent": true``: the grounder answered that the target is not in this
volume; ``slice`` is null and there are no boxes), or ``medvol.anchor/4`` when a prompt is a painted
mask (``/2`` with mask prompts, :mod:`medvolcore.prompts`). Readers take all four; writers write the
lowest that holds the anchor.

The package's modules, one concern each: :mod:`~medvolcore.anchor.geometry` (pixel, normalised and
world boxes), :mod:`~medvolcore.anchor.schema` (the file's schema names, limits and field types),
:mod:`~medvolcore.anchor.parsing` (reading an anchor object or file),
:mod:`~medvolcore.anchor.evidence` (:class:`EvidenceAnchor`) and :mod:`~medvolcore.anchor.targets`
(the anchor of a mask). Every name is importable from ``medvolcore.anchor``.
"""

from .evidence import EvidenceAnchor
from .geometry import (MAX_COORD, MAX_WORLD_MM, NORM, Box, box_iou, box_to_norm, box_to_ras,  # noqa: F401
                       check_box, norm_to_box, ras_to_box, ras_to_prompt)
from .schema import (MAX_ANCHOR_FILE_BYTES, MAX_BOXES, SCHEMA, SCHEMA_V2, SCHEMA_V3, SCHEMA_V4,  # noqa: F401
                     SCHEMAS, SOURCES, dumps)
from .targets import (MIN_COMPONENT_FRACTION, MIN_COMPONENT_PIXELS, anchor_from_mask,  # noqa: F401
                      boxes_from_slice_mask, rank_slices, slice_areas)

__all__ = [
    "SCHEMA", "SCHEMA_V2", "SCHEMA_V3", "SCHEMA_V4", "SCHEMAS", "EvidenceAnchor", "anchor_from_mask", "boxes_from_slice_mask", "rank_slices", "slice_areas",
    "check_box", "box_to_norm", "norm_to_box", "box_iou", "box_to_ras", "ras_to_box", "ras_to_prompt",
]
