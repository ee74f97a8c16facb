"""Reading an anchor: a JSON object (boxes in pixel, normalised or world form; corrections; an absent
anchor) or a file (bounded in size, strict JSON). Each reader takes the anchor class as its first
argument (:meth:`EvidenceAnchor.from_dict` and :meth:`EvidenceAnchor.load` are these)."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import AnchorError, InputError, LimitError
from ..prompts import MAX_POINTS, MAX_PROMPTS, check_prompt_fields, check_z_range
from ..strictjson import DuplicateKeyError, unique_keys
from .geometry import _pixel_prompt, _ras_array, _ras_points_to_stack, _show, ras_to_prompt
from .schema import MAX_ANCHOR_FILE_BYTES, SCHEMA_V2, SCHEMA_V3, SCHEMA_V4, SCHEMAS, _check_fields


def anchor_from_dict(cls, d: dict, stack=None, origin: str = "anchor"):
    """Read an anchor object. ``boxes``, ``boxes_norm`` or ``world`` may carry the boxes.

    With a ``stack``, ``world`` is used when ``boxes`` is absent, and both are checked
    against each other when both are present (an error names the disagreement).
    """
    if not isinstance(d, dict):
        raise AnchorError(f"{origin}: expected a JSON object, got {type(d).__name__}")
    if d.get("schema") not in SCHEMAS:
        raise AnchorError(f"{origin}: schema is {_show(d.get('schema'))}, expected one of {', '.join(SCHEMAS)}")
    _check_fields(d, origin)
    kw = dict(query=str(d.get("query") or ""), reasoning=str(d.get("reasoning") or ""),
              source=d.get("source") or "user", notes=list(d.get("notes") or []))
    if d.get("absent", False) is not False or d.get("schema") == SCHEMA_V3:  # "absent": false is an ordinary anchor
        return _absent_from_dict(cls, d, stack, origin, kw)
    world = d.get("world")
    kw.update(_read_corrections(d, stack, origin))
    has_boxes = d.get("boxes") is not None or d.get("boxes_norm") is not None
    if not has_boxes and world is None:
        raise AnchorError(f"{origin}: has neither 'boxes' nor 'world'")
    if not has_boxes:
        if stack is None:
            raise AnchorError(f"{origin}: has only 'world' boxes; the volume is needed to place them")
        return cls.from_world(world, stack, **kw)
    image_size = d.get("image_size")
    if image_size is None and stack is not None:
        image_size = [stack.width, stack.height]
    if image_size is None:
        raise AnchorError(f"{origin}: has no 'image_size'")
    if "slice" not in d:
        raise AnchorError(f"{origin}: has no 'slice'")
    try:
        if d.get("boxes") is not None:
            anchor = cls(d["slice"], d["boxes"], image_size, **kw)
        else:
            anchor = cls.from_norm(d["slice"], d["boxes_norm"], image_size, **kw)
    except (InputError, TypeError) as e:
        raise AnchorError(f"{origin}: {e}") from None
    except AnchorError as e:
        raise AnchorError(f"{origin}: {e}") from None
    if stack is not None:
        try:
            anchor.with_world(stack)
        except AnchorError as e:
            raise AnchorError(f"{origin}: {e}") from None
        if world is not None and world.get("boxes_ras"):
            other = cls.from_world(world, stack, **kw)
            if other.slice != anchor.slice or other.boxes != anchor.boxes:
                raise AnchorError(
                    f"{origin}: 'boxes' (slice {anchor.slice}, {anchor.boxes}) and 'world' (slice {other.slice}, "
                    f"{other.boxes}) disagree; remove the stale one"
                )
    elif world is not None:
        anchor.world = world
    return anchor


def _absent_from_dict(cls, d: dict, stack, origin: str, kw: dict):
    if d.get("absent") is not True:
        raise AnchorError(f"{origin}: 'absent' must be true in a {SCHEMA_V3!r} anchor, got {_show(d.get('absent'))}"
                          if d.get("schema") == SCHEMA_V3 else
                          f"{origin}: 'absent' needs schema {SCHEMA_V3!r}, not {_show(d.get('schema'))}")
    if d.get("schema") != SCHEMA_V3:
        raise AnchorError(f"{origin}: 'absent' needs schema {SCHEMA_V3!r}, not {_show(d.get('schema'))}")
    for name in ("boxes", "boxes_norm", "prompts"):
        if d.get(name):
            raise AnchorError(f"{origin}: an absent anchor has no {name!r}; remove them or 'absent'")
    if d.get("slice") is not None or d.get("z_range") is not None:
        raise AnchorError(f"{origin}: an absent anchor has no 'slice' or 'z_range'; remove them or 'absent'")
    image_size = d.get("image_size")
    if image_size is None and stack is not None:
        image_size = [stack.width, stack.height]
    if image_size is None:
        raise AnchorError(f"{origin}: has no 'image_size'")
    try:
        anchor = cls.absent_for(image_size, **kw)
        return anchor.with_world(stack) if stack is not None else anchor
    except AnchorError as e:
        raise AnchorError(f"{origin}: {e}") from None


def load_anchor(cls, path, stack=None):
    """Read an anchor file: at most :data:`MAX_ANCHOR_FILE_BYTES` (checked before reading),
    strict JSON (no key twice in an object, no NaN or Infinity), then :meth:`from_dict`."""
    p = Path(path)
    if not p.is_file():
        raise AnchorError(f"{p} does not exist" if not p.exists() else f"{p} is not a file")
    try:
        size = p.stat().st_size
        if size > MAX_ANCHOR_FILE_BYTES:
            raise LimitError(f"{p} is {size / 2**20:.1f} MB; an anchor file is at most "
                             f"{MAX_ANCHOR_FILE_BYTES // 2**20} MB (is it an anchor?)")
        with open(p, "rb") as f:
            raw = f.read(MAX_ANCHOR_FILE_BYTES + 1)  # a file growing after the stat is still bounded
    except OSError as e:
        raise AnchorError(f"cannot read {p}: {e.strerror or e}") from None
    if len(raw) > MAX_ANCHOR_FILE_BYTES:
        raise LimitError(f"{p} is over {MAX_ANCHOR_FILE_BYTES // 2**20} MB; an anchor file is at most that")
    try:
        d = json.loads(raw.decode("utf-8"), object_pairs_hook=unique_keys, parse_constant=_no_constant)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AnchorError(f"{p} is not valid JSON: {e}") from None
    except DuplicateKeyError as e:
        raise AnchorError(f"{p}: the key {_show(e.key)} appears more than once in one object; give each field "
                          "once") from None
    except _JSONProblem as e:
        raise AnchorError(f"{p}: {e}") from None
    except (ValueError, RecursionError) as e:  # an integer over Python's digit limit; nesting too deep
        raise AnchorError(f"{p} is not usable JSON: {_show(str(e), 120)}") from None
    return cls.from_dict(d, stack, origin=str(p))


class _JSONProblem(ValueError):
    pass


def _no_constant(name: str):
    raise _JSONProblem(f"holds {name}, which is not a finite number")


def _check_counts(prompts: list, origin: str) -> None:
    """The prompt and point limits, checked before any prompt is read (a huge list costs nothing)."""
    if len(prompts) > MAX_PROMPTS:
        raise AnchorError(f"{origin}: {len(prompts)} prompts; at most {MAX_PROMPTS} are allowed")
    n_points = 0
    for pr in prompts:
        if isinstance(pr, dict):
            for pts in (pr.get("points"), (pr.get("world") or {}).get("points_ras") if isinstance(pr.get("world"), dict) else None):
                n_points += len(pts) if isinstance(pts, list) else 0
    if n_points > 2 * MAX_POINTS:  # pixel and world forms together
        raise AnchorError(f"{origin}: too many points in the prompts; at most {MAX_POINTS} are allowed")


def _read_corrections(d: dict, stack, origin: str) -> dict:
    """``prompts`` and ``z_range`` of an anchor object, each from its pixel form, its world form or both
    (which must then agree); the world form needs the volume."""
    world = d.get("world") if isinstance(d.get("world"), dict) else {}
    prompts, z_range = d.get("prompts"), d.get("z_range")
    z_range_ras = world.get("z_range_ras")
    if d.get("schema") not in (SCHEMA_V2, SCHEMA_V4):
        if prompts or z_range is not None or z_range_ras is not None:
            raise AnchorError(f"{origin}: prompts and z_range need schema {SCHEMA_V2!r}, not {d.get('schema')!r}")
        return {}
    if d.get("schema") == SCHEMA_V2 and isinstance(prompts, list) and any(
            isinstance(p, dict) and p.get("mask") is not None for p in prompts):
        raise AnchorError(f"{origin}: mask prompts need schema {SCHEMA_V4!r}, not {SCHEMA_V2!r}")
    out = {}
    if z_range_ras is not None:
        if stack is None:
            if z_range is None:
                raise AnchorError(f"{origin}: has only a world z_range (z_range_ras); the volume is needed to place it")
        else:
            ras = _ras_array(z_range_ras, 3, f"{origin}: world z_range_ras", "two RAS points [[r, a, s], [r, a, s]]")
            if len(ras) != 2:
                raise AnchorError(f"{origin}: world z_range_ras must be two RAS points, one on each end slice")
            ends = sorted(_ras_points_to_stack(stack, [r], f"{origin}: z_range_ras end {i + 1}")[0] for i, r in enumerate(ras))
            if z_range is not None and list(check_z_range(z_range, None, AnchorError)) != ends:
                raise AnchorError(f"{origin}: 'z_range' {list(z_range)} and world z_range_ras (slices {ends}) disagree; "
                                  "remove the stale one")
            z_range = ends
    if z_range is not None:
        out["z_range"] = z_range
    if prompts is None:
        return out
    if not isinstance(prompts, list):
        raise AnchorError(f"{origin}: 'prompts' must be a list, got {type(prompts).__name__}")
    _check_counts(prompts, origin)
    read = []
    for i, p in enumerate(prompts):
        what = f"{origin}: prompt {i + 1}"
        if not isinstance(p, dict):
            raise AnchorError(f"{what} must be an object, got {type(p).__name__}")
        has_pixels = p.get("slice") is not None
        pw = p.get("world")
        if p.get("mask") is not None:
            read.append(_read_mask_prompt(p, i, stack, what))
            continue
        if not has_pixels and pw is None:
            raise AnchorError(f"{what} has neither 'slice' (with 'box'/'points') nor 'world'")
        if pw is not None and stack is not None:
            placed = ras_to_prompt(stack, pw, what)
            if has_pixels:
                mine = _pixel_prompt(p, i, stack.width, stack.height, what)
                if [mine["slice"], mine["box"], mine["points"]] != [placed["slice"], placed["box"], placed["points"]]:
                    raise AnchorError(f"{what}: its pixel form (slice {mine['slice']}, box {mine['box']}, points "
                                      f"{mine['points']}) and its world form (slice {placed['slice']}, box "
                                      f"{placed['box']}, points {placed['points']}) disagree; remove the stale one")
            read.append(dict(placed, object=p.get("object")))
        elif not has_pixels:
            raise AnchorError(f"{what} has only a world form; the volume is needed to place it")
        else:
            read.append({k: p.get(k) for k in ("slice", "object", "box", "points")})
    out["prompts"] = read
    return out


def _read_mask_prompt(p: dict, i: int, stack, what: str) -> dict:
    """A mask prompt of a ``/4`` anchor: its pixel slice and runs; a ``world.slice_center_ras`` must
    lie on that slice (with the volume), or gives it when the slice is absent."""
    pw = p.get("world")
    centre = pw.get("slice_center_ras") if isinstance(pw, dict) else None
    if pw is not None and centre is None:
        raise AnchorError(f"{what}: a mask prompt's 'world' is {{'slice_center_ras': [r, a, s]}}, got {_show(pw)}")
    out = {k: p.get(k) for k in ("slice", "object", "box", "points", "mask")}
    if centre is not None and stack is not None:
        z = _ras_points_to_stack(stack, _ras_array([centre], 3, what + " slice_center_ras", "[r, a, s]"), what)[0]
        if out["slice"] is not None and check_prompt_fields(out, i, AnchorError)["slice"] != z:
            raise AnchorError(f"{what}: its slice {out['slice']} and its world slice_center_ras (slice {z}) disagree; "
                              "remove the stale one")
        out["slice"] = z
    elif out["slice"] is None:
        raise AnchorError(f"{what} has no 'slice'" + (" (its world form needs the volume to place it)" if centre else ""))
    return out
