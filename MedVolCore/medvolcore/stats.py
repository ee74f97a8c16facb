"""Statistics of a segmented target (``--stats FILE.json|.csv``, and ``stats`` in every result).

Per target: ``query``, ``voxels``, ``volume_ml`` (voxels × the voxel volume from the CT's affine),
the HU inside the mask (``mean_hu``, ``std_hu``, ``min_hu``, ``max_hu``; null for an empty mask),
the anchor's key slice (index in the canonical axial stack, 0 = most superior) and its S position
in mm (RAS), and the mask's bounding box in RAS millimetres (the voxel centres at its corners,
``[[r_min, a_min, s_min], [r_max, a_max, s_max]]``). Numbers only: what the mask holds, not
whether it is right.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import List, Optional

import numpy as np

from .errors import InputError

STATS_SUFFIXES = (".json", ".csv")
COLUMNS = ("query", "voxels", "volume_ml", "mean_hu", "std_hu", "min_hu", "max_hu", "key_slice", "key_slice_s_mm",
           "bbox_ras_min", "bbox_ras_max")


def _r(x, nd=3):
    return None if x is None else round(float(x), nd)


_STATS_SLAB = 1 << 20  # voxels per slab of the HU statistics: their memory does not grow with the volume


def _hu_stats(m: np.ndarray, hu: np.ndarray) -> dict:
    """Mean, standard deviation (population), min and max of ``hu`` inside ``m``, one slab of the
    last axis at a time (each slab's count, mean and sum of squared deviations combined as Chan
    et al. combine them), so the memory used is a slab's, not the mask's voxel count × 8 bytes."""
    step = max(1, _STATS_SLAB // max(1, m.shape[0] * m.shape[1]))
    count, mean, m2, lo, hi = 0, 0.0, 0.0, np.inf, -np.inf
    for k in range(0, m.shape[2], step):
        v = np.asarray(hu[:, :, k:k + step][m[:, :, k:k + step]], dtype=np.float64)
        if not v.size:
            continue
        c, mu = v.size, float(v.mean())
        d = v - mu
        q = float(np.dot(d, d))
        delta = mu - mean
        total = count + c
        mean += delta * c / total
        m2 += q + delta * delta * count * c / total
        count = total
        lo, hi = min(lo, float(v.min())), max(hi, float(v.max()))
    return {"mean_hu": _r(mean, 2), "std_hu": _r((m2 / count) ** 0.5, 2), "min_hu": _r(lo, 2), "max_hu": _r(hi, 2)}


def target_stats(mask: np.ndarray, hu: np.ndarray, affine: np.ndarray, query: str = "",
                 key_slice: Optional[int] = None, key_slice_s_mm: Optional[float] = None) -> dict:
    """The statistics of one target (``mask`` and ``hu`` on one grid, ``affine`` its voxel → RAS)."""
    m = np.asarray(mask) > 0
    if m.shape != np.asarray(hu).shape:
        raise InputError(f"mask {m.shape} and CT {np.asarray(hu).shape} are not on one grid")
    voxel_ml = abs(float(np.linalg.det(np.asarray(affine, dtype=np.float64)[:3, :3]))) / 1000.0
    n = int(m.sum())
    out = {"query": query, "voxels": n, "volume_ml": _r(n * voxel_ml), "mean_hu": None, "std_hu": None,
           "min_hu": None, "max_hu": None, "key_slice": key_slice, "key_slice_s_mm": _r(key_slice_s_mm, 2),
           "bbox_ras_min": None, "bbox_ras_max": None}
    if n:
        out.update(_hu_stats(m, np.asarray(hu)))
        lo, hi = [], []
        for axis in range(3):  # the mask's extent along each axis, from its projections (no index arrays)
            hit = np.flatnonzero(m.any(axis=tuple(a for a in range(3) if a != axis)))
            lo.append(int(hit[0]))
            hi.append(int(hit[-1]))
        corners = np.array([[i, j, k, 1.0] for i in (lo[0], hi[0]) for j in (lo[1], hi[1]) for k in (lo[2], hi[2])])
        ras = (np.asarray(affine, dtype=np.float64) @ corners.T).T[:, :3]
        out["bbox_ras_min"] = [_r(x, 2) for x in ras.min(axis=0)]
        out["bbox_ras_max"] = [_r(x, 2) for x in ras.max(axis=0)]
    return out


def check_stats_path(path) -> None:
    if not str(path).lower().endswith(STATS_SUFFIXES):
        raise InputError(f"--stats: write .json or .csv, got {Path(str(path)).name!r}")


def stats_cell(value) -> str:
    """One statistic as a CSV cell: empty for None, a bounding-box corner as ``r a s``."""
    if value is None:
        return ""
    return " ".join(str(x) for x in value) if isinstance(value, (list, tuple)) else str(value)


_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def _numbers(text: str) -> bool:
    words = text.split()
    try:
        return bool(words) and all(isinstance(float(w), float) for w in words)
    except ValueError:
        return False


def spreadsheet_cell(value) -> str:
    """A CSV cell a spreadsheet shows as text: a cell that starts with ``=``, ``+``, ``-``, ``@``,
    a tab or a carriage return, and is not a number (or numbers separated by spaces, such as a
    bounding-box corner ``-12.5 4 3``), gets a leading apostrophe, so a query such as
    ``=HYPERLINK(…)`` or ``@SUM(…)`` is never taken for a formula."""
    text = "" if value is None else str(value)
    if text.startswith(_FORMULA_START) and not _numbers(text):
        return "'" + text
    return text


def spreadsheet_rows(rows) -> list:
    """Every cell of ``rows`` through :func:`spreadsheet_cell`."""
    return [[spreadsheet_cell(c) for c in row] for row in rows]


def stats_text(rows: List[dict], path) -> str:
    """``rows`` as the file ``path`` wants: a JSON list, or CSV with :data:`COLUMNS` (boxes as
    ``r a s`` triples, :func:`stats_cell`; text cells made safe for spreadsheets,
    :func:`spreadsheet_cell`)."""
    if str(path).lower().endswith(".json"):
        return json.dumps(rows, indent=1) + "\n"
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(COLUMNS)
    for r in rows:
        w.writerow([spreadsheet_cell(stats_cell(r.get(c))) for c in COLUMNS])
    return buf.getvalue()


__all__ = ["target_stats", "stats_text", "stats_cell", "spreadsheet_cell", "spreadsheet_rows", "check_stats_path", "COLUMNS", "STATS_SUFFIXES"]
