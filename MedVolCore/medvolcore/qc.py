"""Quality-control picture of a segmentation: the key slice with the evidence boxes and the
mask outline, next to the query and the model's reasoning."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Optional

import numpy as np

from .fileio import atomic_path

_BOX_COLOURS = [(255, 215, 0), (0, 200, 255), (255, 80, 200), (120, 255, 120),
                (255, 140, 0), (180, 120, 255), (255, 255, 255), (0, 255, 180)]
_MASK_COLOUR = (255, 40, 40)


def _outline(mask2d: np.ndarray) -> np.ndarray:
    from scipy import ndimage

    m = np.asarray(mask2d, dtype=bool)
    return m & ~ndimage.binary_erosion(m, structure=np.ones((3, 3), bool), border_value=0)


def render_qc(stack, anchor, mask_stack: Optional[np.ndarray] = None, *, title: str = "", reasoning: str = "",
              banner: str = "", window=None, scale: Optional[int] = None, panel_width: int = 360):
    """A PIL image: the key slice (radiological view, patient right on the left) with each box
    and the mask outline of that slice, and a text panel (title, banner, reasoning). For an absent
    anchor (the model answered that the target is not in this CT) it shows the middle slice, with
    no box and no outline, and the panel says so."""
    from PIL import Image, ImageDraw, ImageFont

    absent = bool(getattr(anchor, "absent", False))
    z = stack.depth // 2 if absent else anchor.slice
    gray = stack.windowed(z, window)
    h, w = gray.shape
    s = scale or max(1, int(np.ceil(512 / max(h, w))))
    rgb = np.repeat(gray[:, :, None], 3, axis=2)
    if mask_stack is not None and not absent:
        rgb[_outline(mask_stack[z])] = _MASK_COLOUR
    img = Image.fromarray(rgb).resize((w * s, h * s), Image.NEAREST)
    draw = ImageDraw.Draw(img)
    for i, (x0, y0, x1, y1) in enumerate(anchor.boxes):
        c = _BOX_COLOURS[i % len(_BOX_COLOURS)]
        draw.rectangle([x0 * s, y0 * s, (x1 + 1) * s - 1, (y1 + 1) * s - 1], outline=c, width=max(1, s // 2))
    try:
        font = ImageFont.load_default(size=13)  # scalable (Pillow ≥ 10.1)
    except TypeError:
        font = ImageFont.load_default()
    canvas = Image.new("RGB", (img.width + panel_width, max(img.height, 200)), (20, 20, 20))
    canvas.paste(img, (0, 0))
    d = ImageDraw.Draw(canvas)
    x, y = img.width + 10, 8
    chars = max(20, (panel_width - 20) // 7)
    lines = []
    if banner:
        for ln in textwrap.wrap(banner, chars):
            lines.append((ln, (255, 90, 90)))
        lines.append(("", None))
    for ln in textwrap.wrap(title, chars):
        lines.append((ln, (255, 255, 255)))
    if absent:
        for ln in textwrap.wrap("NOT FOUND: the model answered that the target is not in this CT", chars):
            lines.append((ln, (255, 200, 60)))
        for ln in textwrap.wrap(f"no key slice; showing the middle slice z={z} of {stack.depth}", chars):
            lines.append((ln, (200, 200, 200)))
    else:
        lines.append((f"key slice z={z} of {stack.depth}; {len(anchor.boxes)} box(es)", (200, 200, 200)))
    lines.append(("", None))
    if reasoning:
        lines.append(("reasoning:", (200, 200, 200)))
        for para in reasoning.splitlines():
            for ln in textwrap.wrap(para, chars) or [""]:
                lines.append((ln, (230, 230, 230)))
    for text, colour in lines:
        if y > canvas.height - 14:
            d.text((x, y), "…", fill=(200, 200, 200), font=font)
            break
        if colour:
            d.text((x, y), text, fill=colour, font=font)
        y += 16
    return canvas


def save_qc(path, stack, anchor, mask_stack=None, overwrite: bool = False, **kw) -> Path:
    img = render_qc(stack, anchor, mask_stack, **kw)
    with atomic_path(path, overwrite) as tmp:
        img.save(str(tmp), format="PNG")
    return Path(path)
