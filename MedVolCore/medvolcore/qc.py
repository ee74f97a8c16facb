"""Quality-control picture of a segmentation: the key slice with the evidence boxes, the mask
outline and, when given, the ground-truth contour, with the orientation letters on its edges, next
to a panel: the query, the model that made it, the key slice (index and S position in mm), the
window/level, a legend of the colours, duplicate boxes flagged, the reasoning, and the research-use
notice as its last line. The PNG also carries text chunks (``Source``: the model line,
``Warning``: the banner, ``Disclaimer``: the notice), so a picture read back says what made it.

What the picture draws (all in display pixels, after the slice is enlarged ``scale`` times with
nearest neighbour):

* the mask: a translucent fill and a 2 px outline along the mask's own edge, inside it, where the
  image's edge counts as an edge: a mask that reaches the border of the slice is outlined along
  the border, so a mask that covers almost the whole slice shows as a frame around it;
* the ground-truth contour (``gt_mask``): a 2 px ring just *outside* the ground truth's edge (and,
  where the ground truth reaches the border of the slice, inside it along the border), so a perfect
  mask shows the two colours side by side rather than one over the other;
* each evidence box: a 2 px (or ``scale // 2``) frame outside the box's inclusive pixels, beyond
  the ground-truth ring, numbered from 1 as in the anchor file (numbers that would overlap are set
  side by side);
* the orientation letters on the four edges, from the stack's direction (radiological view:
  the patient's right on the image's left).

The panel states the mask's share of the key slice (and of the body on it: voxels above
:data:`BODY_HU`) and of the volume, and flags a mask that covers more than
:data:`PLAUSIBLE_BODY_SHARE` of the body on the key slice or in the volume; a volume that does not
look like CT (``warnings``) is named in the banner. Every text block has a line budget (the title,
banner and model line are cut with "…"), so the model line, the key slice, the legend and the
notice always show, whatever the query's length.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from . import RESEARCH_USE_NOTICE, __version__
from .fileio import atomic_path

# Box colours leave out the outline's red and the ground truth's cyan.
_BOX_COLOURS = [(255, 215, 0), (255, 80, 200), (120, 255, 120), (255, 140, 0),
                (180, 120, 255), (255, 255, 255), (80, 130, 255), (200, 160, 100)]
_MASK_COLOUR = (255, 40, 40)
_GT_COLOUR = (0, 220, 255)
_LETTER_COLOUR = (255, 255, 120)
_BACKGROUND = (20, 20, 20)
RING_PX = 2  # width of the mask outline and of the ground-truth contour, in display pixels
FILL_ALPHA = 0.3  # opacity of the mask's fill
BODY_HU = -500.0  # a voxel above this is body (not air) when the mask's share of the body is stated
PLAUSIBLE_BODY_SHARE = 0.5  # a mask over this share of the body (key slice or volume) is flagged
MARGIN_PX = 22  # the band around the slice that holds the orientation letters
DUPLICATE_IOU = 0.9  # boxes with an IoU above this (or identical) are flagged as duplicates
# A direction's secondary letter is shown when its component is at least this large (about 17°
# off the main axis), as DICOM viewers write "RA" for an oblique edge.
_OBLIQUE_COMPONENT = 0.3


def _ring(mask2d: np.ndarray, inside: bool) -> np.ndarray:
    """The :data:`RING_PX`-wide band along a mask's edge: just outside it or just inside it (where
    the image's border counts as the mask's edge: a mask reaching the border is outlined along it)."""
    from scipy import ndimage

    m = np.asarray(mask2d, dtype=bool)
    square = np.ones((3, 3), bool)
    if inside:
        return m & ~ndimage.binary_erosion(m, structure=square, iterations=RING_PX, border_value=0)
    return ndimage.binary_dilation(m, structure=square, iterations=RING_PX) & ~m


def _edge_band(shape) -> np.ndarray:
    """The pixels within :data:`RING_PX` of the image's border."""
    band = np.zeros(shape, bool)
    band[:RING_PX], band[-RING_PX:], band[:, :RING_PX], band[:, -RING_PX:] = True, True, True, True
    return band


def mask_shares(stack, mask_stack, z: int) -> Dict[str, float]:
    """The mask's share of slice ``z``, of the body on it (voxels above :data:`BODY_HU`), of the
    volume and of the body in the volume (0..1; a share of no body is 0)."""
    m = np.asarray(mask_stack, bool)
    body = np.asarray(stack.data) > BODY_HU
    key, key_body = m[z], body[z]
    return {"slice": float(key.mean()), "slice_body": float((key & key_body).sum() / max(1, key_body.sum())),
            "volume": float(m.mean()), "volume_body": float((m & body).sum() / max(1, body.sum()))}


def implausible_size(shares: Dict[str, float]) -> str:
    """A warning when the mask covers more than :data:`PLAUSIBLE_BODY_SHARE` of the body on the
    key slice or in the volume (no organ does), else ''."""
    where = [f"{shares[k]:.0%} of the body {name}" for k, name in (("slice_body", "on the key slice"),
                                                                    ("volume_body", "in the volume"))
             if shares[k] > PLAUSIBLE_BODY_SHARE]
    if not where:
        return ""
    return f"IMPLAUSIBLE SIZE: the mask covers {' and '.join(where)}; check it against the image"


def _direction_letters(v: Sequence[float]) -> str:
    """The side of the patient a RAS direction points to: ``R``/``L``, ``A``/``P``, ``S``/``I``,
    the largest component first, a second letter for an oblique direction."""
    v = np.asarray(v, dtype=np.float64)
    v = v / np.linalg.norm(v)
    order = np.argsort(-np.abs(v), kind="stable")
    letters = ("RL", "AP", "SI")
    out = [letters[a][0 if v[a] > 0 else 1] for a in order[:2]
           if a == order[0] or abs(v[a]) >= _OBLIQUE_COMPONENT]
    return "".join(out)


def orientation_letters(stack) -> Dict[str, str]:
    """The patient sides at the picture's ``left``, ``right``, ``top`` and ``bottom`` edges, from
    the stack's direction (``stack.index_to_ras``: the RAS direction of its columns and rows), not
    assumed: ``{"left": "R", "right": "L", "top": "A", "bottom": "P"}`` for the canonical axial
    view whatever the file's axis order; an oblique grid gets two letters (e.g. ``"RA"``)."""
    m = np.asarray(stack.index_to_ras, dtype=np.float64)
    cols, rows = m[:3, 2], m[:3, 1]  # RAS direction of increasing x (columns) and y (rows)
    return {"left": _direction_letters(-cols), "right": _direction_letters(cols),
            "top": _direction_letters(-rows), "bottom": _direction_letters(rows)}


def duplicate_boxes(boxes, threshold: float = DUPLICATE_IOU) -> List[Tuple[int, int, float]]:
    """Pairs ``(i, j, iou)`` (0-based, ``i < j``) of inclusive pixel boxes ``[x0, y0, x1, y1]``
    that are identical or overlap with IoU above ``threshold``."""
    from .anchor import box_iou

    cont = [(b[0], b[1], b[2] + 1, b[3] + 1) for b in boxes]  # inclusive pixels → continuous extent
    pairs = []
    for i in range(len(cont)):
        for j in range(i + 1, len(cont)):
            iou = 1.0 if list(boxes[i]) == list(boxes[j]) else box_iou(cont[i], cont[j])
            if iou > threshold or iou == 1.0:
                pairs.append((i, j, float(iou)))
    return pairs


def slice_position_mm(stack, z: int) -> Tuple[float, bool]:
    """The S coordinate (RAS mm) of slice ``z`` at its centre, and whether S varies across the
    slice by more than 0.5 mm (an oblique grid: the value is then the centre's)."""
    h, w = stack.height, stack.width
    centre_and_corners = [[z, (h - 1) / 2, (w - 1) / 2], [z, 0, 0], [z, 0, w - 1], [z, h - 1, 0], [z, h - 1, w - 1]]
    pts = stack.stack_to_ras(centre_and_corners)
    s = pts[:, 2]
    return float(s[0]), bool(np.ptp(s[1:]) > 0.5)


def _file_index(stack, z: int) -> str:
    """Which index of the source the stack slice ``z`` is, for other viewers: ``file index k=74`` of
    a file; of a DICOM series, its slice in the series sorted by position (``DICOM series slice 75 of
    112, by position``: 1-based, as viewers count; a file name or InstanceNumber may differ)."""
    axis = stack.perm[0]
    idx = round(float(stack.stack_to_source_index([z, 0, 0])[axis]))
    if getattr(stack.volume, "source_format", "") == "dicom":
        return f"DICOM series slice {idx + 1} of {stack.volume.shape[axis]}, by position"
    return f"file index {'ijk'[axis]}={idx}"


def signal_text(anchor) -> str:
    """One line on how sure the model was: the consensus's confidence, else the answer's token
    signal, else ''; each says what it is not."""
    if getattr(anchor, "confidence", None) is not None:
        n = len(anchor.samples or [])
        return (f"confidence {anchor.confidence:.2f}: agreement of {n} samples of the model (mean pairwise Dice), "
                "not the chance that it is right")
    sig = getattr(anchor, "signal", None) or {}
    if sig.get("answer_mean_prob") is not None:
        return (f"answer signal {sig['answer_mean_prob']:.2f}: geometric-mean probability of the answer's tokens, "
                "not the chance that it is right")
    return ""


_ASCII = {"—": "-", "–": "-", "≥": ">=", "≤": "<=", "×": "x", "“": '"', "”": '"', "‘": "'", "’": "'"}


def _drawable(text: str, font) -> str:
    """``text`` with the characters ``font`` has no glyph for (it would draw an empty box) written
    in ASCII where there is a plain equivalent: dashes, ``≥``, quotes, accented letters (``é`` →
    ``e``). Other missing characters are kept (they show as boxes; the PNG's text chunks keep the
    exact text)."""
    import unicodedata

    from PIL import Image, ImageDraw

    def picture(c):
        im = Image.new("L", (24, 24))
        ImageDraw.Draw(im).text((2, 2), c, font=font, fill=255)
        return im.tobytes()

    missing = picture("\u25a1")  # what the font draws for a character it lacks
    out = []
    for c in text:
        if c.isascii() or picture(c) != missing:
            out.append(c)
        elif c in _ASCII:
            out.append(_ASCII[c])
        else:
            plain = unicodedata.normalize("NFKD", c).encode("ascii", "ignore").decode()
            out.append(plain or c)
    return "".join(out)


def _font(size: int):
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=size)  # scalable (Pillow ≥ 10.1)
    except TypeError:
        return ImageFont.load_default()


def _window_text(window) -> str:
    name = "" if window.name == "custom" else f" ({window.name.replace('_', ' ')})"
    return f"window/level {window.width:g}/{window.center:g} HU{name}"


def _groups(n: int, pairs) -> List[List[int]]:
    """Boxes 0..n-1 joined through the duplicate pairs, each group in anchor order."""
    parent = list(range(n))

    def root(i):
        while parent[i] != i:
            i = parent[i]
        return i

    for i, j, _ in pairs:
        parent[root(j)] = root(i)
    groups: Dict[int, List[int]] = {}
    for i in range(n):
        groups.setdefault(root(i), []).append(i)
    return sorted(groups.values())


def render_qc(stack, anchor, mask_stack: Optional[np.ndarray] = None, *, gt_mask: Optional[np.ndarray] = None,
              title: str = "", reasoning: str = "", banner: str = "", model: str = "",
              footer: str = RESEARCH_USE_NOTICE, window=None, scale: Optional[int] = None, panel_width: int = 360,
              warnings: Sequence[str] = (), empty_note: str = ""):
    """A PIL image: the key slice (radiological view, patient right on the left) with each box,
    the mask outline and the ground-truth contour of that slice (see the module docstring for
    how each is drawn), orientation letters on its edges, and a text panel (banner, title,
    ``model`` — which model made it —, key slice and S position, window/level, legend, duplicate
    boxes, reasoning) whose last line is always ``footer`` (the research-use notice).
    ``warnings``: lines shown under the banner, in its colour (a volume that does not look like
    CT). ``empty_note``: the legend's words when the mask has nothing on the key slice (by default
    "mask: none on this slice").

    ``mask_stack``: the mask on the stack (``(z, y, x)``, as ``Segmentation.mask_stack``).
    ``gt_mask``: a ground-truth mask on the volume's own grid (the volume's shape, as
    ``SegmentRequest.reference``). For an absent anchor (the model answered that the target is not
    in this CT) it shows the middle slice, with no box and no outline (the ground truth still, when
    given), and the panel says so."""
    from PIL import Image, ImageDraw

    from .windowing import get_window

    absent = bool(getattr(anchor, "absent", False))
    z = stack.depth // 2 if absent else anchor.slice
    win = get_window(window)
    gray = stack.windowed(z, win)
    h, w = gray.shape
    s = scale or max(1, int(np.ceil(512 / max(h, w))))
    rgb = np.repeat(np.repeat(np.repeat(gray[:, :, None], 3, axis=2), s, axis=0), s, axis=1)

    def enlarged(m2d):
        return np.repeat(np.repeat(np.asarray(m2d, bool), s, axis=0), s, axis=1)

    boxes = [] if absent else [list(map(int, b)) for b in anchor.boxes]
    pairs = duplicate_boxes(boxes)
    bw = max(2, s // 2)
    has_gt = gt_mask is not None
    gt_here = mask_here = False
    shares = None
    if mask_stack is not None and not absent:  # the fill first, under the boxes and the outlines
        mask_here = bool(np.any(mask_stack[z]))
        big_mask = enlarged(mask_stack[z])
        rgb[big_mask] = (rgb[big_mask] * (1 - FILL_ALPHA) + np.array(_MASK_COLOUR) * FILL_ALPHA).astype(np.uint8)
        shares = mask_shares(stack, mask_stack, z)
    img = Image.fromarray(rgb)
    draw = ImageDraw.Draw(img)
    small = _font(11)
    gap = RING_PX + 1  # a box's frame sits outside the ground-truth ring drawn outside its edge
    groups = _groups(len(boxes), pairs)
    for group in groups:
        for i in group:
            x0, y0, x1, y1 = boxes[i]
            c = _BOX_COLOURS[i % len(_BOX_COLOURS)]
            # clamped to the slice: a box at its border keeps a visible frame (over its edge pixels)
            draw.rectangle([max(0, x0 * s - gap - bw), max(0, y0 * s - gap - bw),
                            min(w * s - 1, (x1 + 1) * s - 1 + gap + bw), min(h * s - 1, (y1 + 1) * s - 1 + gap + bw)],
                           outline=c, width=bw)
    placed: list = []  # the number labels' rectangles, so none is drawn over another
    for group in groups:  # after every frame, so no frame covers a number
        x0, y0 = boxes[group[0]][:2]
        label = "=".join(str(i + 1) for i in group)
        tw = int(draw.textlength(label, font=small)) + 3
        ly = y0 * s - gap - bw - 13
        lx, ly = max(0, x0 * s - gap - bw), (ly if ly >= 0 else y0 * s + 2)
        while any(lx < px1 and px0 < lx + tw and ly < py1 and py0 < ly + 13 for px0, py0, px1, py1 in placed):
            lx += tw  # another number is there: beside it
        placed.append((lx, ly, lx + tw, ly + 13))
        draw.text((lx, ly), label, fill=_BOX_COLOURS[group[0] % len(_BOX_COLOURS)], font=small)
    rgb = np.asarray(img).copy()
    if mask_here:
        rgb[_ring(enlarged(mask_stack[z]), inside=True)] = _MASK_COLOUR
    if has_gt:
        gt_slice = enlarged(np.asarray(stack.to_stack(np.asarray(gt_mask))[z], bool))
        gt_here = bool(gt_slice.any())
        rgb[_ring(gt_slice, inside=False) | (_ring(gt_slice, inside=True) & _edge_band(gt_slice.shape))] = _GT_COLOUR
    img = Image.fromarray(rgb)

    font, big = _font(13), _font(16)
    mg = MARGIN_PX
    canvas = Image.new("RGB", (img.width + 2 * mg + panel_width, max(img.height + 2 * mg, 200)), _BACKGROUND)
    canvas.paste(img, (mg, mg))
    d = ImageDraw.Draw(canvas)
    letters = orientation_letters(stack)
    cx, cy = mg + img.width // 2, mg + img.height // 2
    for side, (ax, ay) in {"left": (mg // 2, cy), "right": (mg + img.width + mg // 2, cy),
                           "top": (cx, mg // 2), "bottom": (cx, mg + img.height + mg // 2)}.items():
        d.text((ax, ay), letters[side], fill=_LETTER_COLOUR, font=big, anchor="mm")

    x, y = img.width + 2 * mg + 10, 8
    chars = max(20, (panel_width - 20) // 7)
    title, banner, model, reasoning, footer = (_drawable(t, font) for t in (title, banner, model, reasoning, footer))
    lines: list = []  # (text, colour) or ("", None) for a gap, or a legend row: [(swatch colour, text), ...]

    def add(text, colour, most: int = 4):
        """``text`` wrapped to the panel, at most ``most`` lines (the last cut with "…")."""
        wrapped = textwrap.wrap(text, chars)
        if len(wrapped) > most:
            wrapped = wrapped[:most]
            wrapped[-1] = wrapped[-1][: chars - 1].rstrip() + "…"
        for ln in wrapped:
            lines.append((ln, colour))

    size_flag = implausible_size(shares) if shares else ""
    for text in [banner] + [_drawable(w, font) for w in warnings] + [size_flag]:
        if text:
            add(text, (255, 90, 90), most=3)
    if banner or warnings or size_flag:
        lines.append(("", None))
    add(title, (255, 255, 255), most=3)
    add(model, (255, 200, 120), most=2)
    pos, oblique = slice_position_mm(stack, z)
    centre = "centre, oblique slice" if oblique else "slice centre"
    where = f"S {pos:+.1f} mm ({centre}), {_file_index(stack, z)}"
    if absent:
        add("NOT FOUND: the model answered that the target is not in this CT", (255, 200, 60))
        add(f"no key slice; showing the middle slice z={z} of {stack.depth} (z=0 at the head end)", (200, 200, 200))
    else:
        add(f"key slice z={z} of {stack.depth} (z=0 at the head end)", (200, 200, 200))
    add(where, (200, 200, 200))
    add(_window_text(win), (200, 200, 200))
    if shares is not None:
        add(f"mask: {shares['slice']:.1%} of this slice ({shares['slice_body']:.1%} of the body on it), "
            f"{shares['volume']:.1%} of the volume", (255, 120, 120) if size_flag else (200, 200, 200))
    add(signal_text(anchor), (255, 220, 120))
    lines.append(("", None))
    legend = []
    if boxes:
        legend.append([(_BOX_COLOURS[i % len(_BOX_COLOURS)], str(i + 1)) for i in range(len(boxes))]
                      + [(None, "evidence box(es)")])
    if mask_stack is not None and not absent:
        legend.append([(_MASK_COLOUR, "mask: outline along its edge, translucent fill" if mask_here
                        else (empty_note or "mask: none on this slice"))])
    if has_gt:
        gt_text = "ground truth, outside its edge" if gt_here else "ground truth: none on this slice"
        legend.append([(_GT_COLOUR, gt_text)])
    if legend:
        lines.append(("legend:", (200, 200, 200)))
        lines.extend(legend)
    for i, j, iou in pairs:
        kind = "identical" if iou == 1.0 else f"IoU {iou:.2f}"
        lines.append((f"duplicate boxes {i + 1} and {j + 1} ({kind})", (255, 200, 60)))
    if pairs:
        add("flagged, not merged: all drawn, labelled together; the anchor keeps every box", (255, 200, 60))
    lines.append(("", None))
    if reasoning:
        lines.append(("reasoning:", (200, 200, 200)))
        for para in reasoning.splitlines():
            for ln in textwrap.wrap(para, chars) or [""]:
                lines.append((ln, (230, 230, 230)))
    foot = textwrap.wrap(footer, chars)
    bottom = canvas.height - 16 * len(foot) - 6  # the footer's lines are never cut
    for n, entry in enumerate(lines):
        if y + 16 > bottom or (n < len(lines) - 1 and y + 32 > bottom):  # no room for this line and a next
            if y + 16 <= bottom:
                d.text((x, y), "…", fill=(200, 200, 200), font=font)
            break
        if isinstance(entry, list):  # a legend row: a swatch, then its text, left to right
            xx = x
            for colour, text in entry:
                if colour is not None:
                    d.rectangle([xx, y + 3, xx + 9, y + 12], fill=colour)
                    xx += 13
                d.text((xx, y), text, fill=(230, 230, 230), font=font)
                xx += int(d.textlength(text, font=font)) + 8
        elif entry[1]:
            d.text((x, y), entry[0], fill=entry[1], font=font)
        y += 16
    for i, ln in enumerate(foot):
        d.text((x, bottom + 16 * i), ln, fill=(255, 255, 160), font=font)
    return canvas


def save_qc(path, stack, anchor, mask_stack=None, overwrite: bool = False, **kw) -> Path:
    """Write :func:`render_qc`'s picture as a PNG whose text chunks repeat the model line, the
    banner and the notice (read them back with ``PIL.Image.open(path).text``)."""
    from PIL.PngImagePlugin import PngInfo

    img = render_qc(stack, anchor, mask_stack, **kw)
    info = PngInfo()
    info.add_text("Software", f"medvolcore {__version__}")
    if kw.get("model"):
        info.add_text("Source", kw["model"])
    warning = " | ".join(t for t in [kw.get("banner", "")] + list(kw.get("warnings") or ()) if t)
    if warning:
        info.add_text("Warning", warning)
    info.add_text("Disclaimer", kw.get("footer", RESEARCH_USE_NOTICE))
    with atomic_path(path, overwrite) as tmp:
        img.save(str(tmp), format="PNG", pnginfo=info)
    return Path(path)
