"""Quality-control picture of a segmentation: the key slice with the evidence boxes and the
mask outline, next to the query, the model that made it and its reasoning, with the research-use
notice as its last line. The PNG also carries them as text chunks (``Source``: the model line,
``Warning``: the banner, ``Disclaimer``: the notice), so a picture read back says what made it."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Optional

import numpy as np

from . import RESEARCH_USE_NOTICE, __version__
from .fileio import atomic_path

_BOX_COLOURS = [(255, 215, 0), (0, 200, 255), (255, 80, 200), (120, 255, 120),
                (255, 140, 0), (180, 120, 255), (255, 255, 255), (0, 255, 180)]
_MASK_COLOUR = (255, 40, 40)


def _outline(mask2d: np.ndarray) -> np.ndarray:
    from scipy import ndimage

    m = np.asarray(mask2d, dtype=bool)
    return m & ~ndimage.binary_erosion(m, structure=np.ones((3, 3), bool), border_value=0)


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


def render_qc(stack, anchor, mask_stack: Optional[np.ndarray] = None, *, title: str = "", reasoning: str = "",
              banner: str = "", model: str = "", footer: str = RESEARCH_USE_NOTICE, window=None,
              scale: Optional[int] = None, panel_width: int = 360):
    """A PIL image: the key slice (radiological view, patient right on the left) with each box
    and the mask outline of that slice, and a text panel (banner, title, ``model`` — which model
    made it —, reasoning) whose last line is always ``footer`` (the research-use notice). For an
    absent anchor (the model answered that the target is not in this CT) it shows the middle slice,
    with no box and no outline, and the panel says so."""
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
    title, banner, model, reasoning, footer = (_drawable(t, font) for t in (title, banner, model, reasoning, footer))
    lines = []
    if banner:
        for ln in textwrap.wrap(banner, chars):
            lines.append((ln, (255, 90, 90)))
        lines.append(("", None))
    for ln in textwrap.wrap(title, chars):
        lines.append((ln, (255, 255, 255)))
    for ln in textwrap.wrap(model, chars):
        lines.append((ln, (255, 200, 120)))
    if absent:
        for ln in textwrap.wrap("NOT FOUND: the model answered that the target is not in this CT", chars):
            lines.append((ln, (255, 200, 60)))
        for ln in textwrap.wrap(f"no key slice; showing the middle slice z={z} of {stack.depth}", chars):
            lines.append((ln, (200, 200, 200)))
    else:
        lines.append((f"key slice z={z} of {stack.depth}; {len(anchor.boxes)} box(es)", (200, 200, 200)))
    for ln in textwrap.wrap(signal_text(anchor), chars):
        lines.append((ln, (255, 220, 120)))
    lines.append(("", None))
    if reasoning:
        lines.append(("reasoning:", (200, 200, 200)))
        for para in reasoning.splitlines():
            for ln in textwrap.wrap(para, chars) or [""]:
                lines.append((ln, (230, 230, 230)))
    foot = textwrap.wrap(footer, chars)
    bottom = canvas.height - 16 * len(foot) - 6  # the footer's lines are never cut
    for text, colour in lines:
        if y > bottom - 14:
            d.text((x, y), "…", fill=(200, 200, 200), font=font)
            break
        if colour:
            d.text((x, y), text, fill=colour, font=font)
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
    if kw.get("banner"):
        info.add_text("Warning", kw["banner"])
    info.add_text("Disclaimer", kw.get("footer", RESEARCH_USE_NOTICE))
    with atomic_path(path, overwrite) as tmp:
        img.save(str(tmp), format="PNG", pnginfo=info)
    return Path(path)
