"""Cases for training: manifests of NIfTI files and the M3D-Seg folder format.

A **case** is a CT (HU), a label map on the same grid, a mapping target name → label id(s) and a
split (``train``/``test``).

Manifest (``CASES.csv`` or ``CASES.jsonl``), one case per row; relative paths are relative to the
manifest's folder:

============ ==============================================================================
``id``       unique case id (used as the folder name, sanitised)
``volume``   CT file (NIfTI, NRRD, …) in HU — or an M3D-Seg ``image.npy``
``labels``   label map on the volume's grid — or an M3D-Seg ``mask_(C, H, W, D).npz``
``targets``  JSON object target name → label id or list of ids, e.g. ``{"liver": 5, "kidneys": [2, 3]}``
``dataset``  instead of (or besides) ``targets``: an M3D-Seg code (``0003``, ``0004``, ``0012``, …) whose
             label list is known (``Resources/training/m3d_seg_dataset_info.json``): label id ``c + 1``
             is the ``c``-th label name. Explicit ``targets`` win when both are given.
``split``    ``train`` or ``test``
``absent``   optional: structures known **not** to be in this CT (e.g. ``["brain"]`` for an abdominal
             CT), each a key of M3D's term dictionary; ``prepare`` may ask for them as negative
             (not present) samples. A JSON list (in a CSV cell too).
============ ==============================================================================

M3D-Seg (``<root>/<code>/<code>.json`` with ``{"train": [{"image": …, "label": …}], "test": […]}``,
``<code>/<case>/image.npy`` of shape ``(1, H, W, D)`` and a scipy.sparse ``mask_(C, H, W, D).npz``
of shape ``(C, H·W·D)``): :func:`m3dseg_rows` turns a dataset into manifest rows.

.. warning:: M3D-Seg images are **not HU**: M3D's preprocessing normalised their intensities.
   A HU window cannot be applied, so they are rendered with a percentile window (0.5–99.5 %) and
   their pictures differ from what the grounder sees at inference (soft-tissue window on HU).
   Prefer the original datasets' NIfTI files (CT-ORG, AbdomenCT-1K, KiTS23 are distributed as HU
   NIfTI) with M3D-Seg's splits and label lists: give :func:`m3dseg_rows` a ``nifti_map`` CSV with
   columns ``case`` (the M3D-Seg case folder name), ``volume`` and ``labels`` (the original NIfTI
   files). The original label maps use ids ``1..C`` in M3D-Seg's label order for these three
   datasets (CT-ORG 1 liver … 6 brain; AbdomenCT-1K 1 liver, 2 kidney, 3 spleen, 4 pancreas; KiTS23
   1 kidney, 2 tumor, 3 cyst), so the row keeps ``dataset`` = the code.
   M3D-Seg arrays carry no affine either: they are read as orientation ``RAS`` (axis 0 → patient
   right, 1 → anterior, 2 → superior) with 1 mm voxels unless a row says ``orientation`` (three
   nibabel axis codes); check a few rendered slices of a prepared set before training on them.
"""

from __future__ import annotations

import ast
import csv
import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np

from medvolcore.strictjson import DuplicateKeyError, unique_keys

from . import resources
from .errors import CaseError, DataError

log = logging.getLogger(__name__)

SPLITS = ("train", "test")
M3D_WARNING = ("M3D-Seg images are intensity-normalised, not HU: they are rendered with a percentile window "
               "and look different from the soft-tissue HU images the grounder sees at inference; prefer the "
               "original NIfTI files (see Training/README.md, 'M3D-Seg and the original NIfTI')")
_M3D_MASK_RE = re.compile(r"mask_(\([0-9,\s]+\))\.npz$")


@dataclass
class Case:
    """One manifest row, checked for form (files are checked when the case is loaded)."""

    id: str
    volume: Path
    labels: Path
    targets: Dict[str, List[int]]
    split: str
    dataset: Optional[str] = None
    row: int = 0
    orientation: Optional[str] = None
    raw: dict = field(default_factory=dict)
    absent: List[str] = field(default_factory=list)  # term-dictionary names the row says are not in this CT

    @property
    def is_m3dseg(self) -> bool:
        return self.volume.name.lower().endswith(".npy")

    @property
    def folder_name(self) -> str:
        return safe_name(self.id)


def safe_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", str(text)).strip("._") or "case"


# ---- manifests ------------------------------------------------------------------------------

def _read_rows(path: Path) -> List[dict]:
    if not path.is_file():
        raise DataError(f"manifest {path} does not exist")
    suffix = path.suffix.lower()
    try:
        text = path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"cannot read manifest {path}: {e}") from None
    if suffix == ".csv":
        return [dict(r) for r in csv.DictReader(text.splitlines())]
    if suffix in (".jsonl", ".ndjson"):
        rows = []
        for n, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line, object_pairs_hook=unique_keys)
            except DuplicateKeyError as e:
                rows.append({"__error__": f"line {n} names {e.key!r} twice in one object; give each key once"})
                continue
            except ValueError as e:
                rows.append({"__error__": f"line {n} is not JSON ({e})"})
                continue
            rows.append(obj if isinstance(obj, dict) else {"__error__": f"line {n} is not a JSON object"})
        return rows
    raise DataError(f"manifest {path}: use a .csv or .jsonl file")


def _parse_targets(value, dataset: Optional[str]) -> Dict[str, List[int]]:
    if value is None or (isinstance(value, str) and not value.strip()):
        if not dataset:
            raise CaseError("bad_row", "the row has neither 'targets' nor 'dataset'")
        return {name: [i] for i, name in resources.dataset_labels(dataset).items()}
    if isinstance(value, str):
        try:
            value = json.loads(value, object_pairs_hook=unique_keys)
        except DuplicateKeyError as e:
            raise CaseError("bad_row", f"'targets' names the target {e.key!r} twice; give each target once") from None
        except ValueError as e:
            raise CaseError("bad_row", f"'targets' is not JSON ({e})") from None
    if not isinstance(value, dict) or not value:
        raise CaseError("bad_row", "'targets' must be a JSON object from target name to label id(s)")
    from .queries import label_key

    out, by_key, by_file = {}, {}, {}
    for name, ids in value.items():
        ids = ids if isinstance(ids, list) else [ids]
        if not ids or any(isinstance(i, bool) or not isinstance(i, int) or i <= 0 for i in ids):
            raise CaseError("bad_row", f"target {name!r}: label ids must be positive integers, got {value[name]!r}")
        clean = str(name).strip()
        key, file = label_key(clean), safe_name(clean)
        if not key:
            raise CaseError("bad_row", f"target {name!r} has no name")
        # two names the queries cannot tell apart, or whose masks would be one file: one would
        # silently train on the other's label
        if key in by_key:
            raise CaseError("bad_row", f"targets {by_key[key]!r} and {name!r} are one target once normalised as the "
                                       f"queries are ({key!r}); give each target once")
        if file in by_file:
            raise CaseError("bad_row", f"targets {by_file[file]!r} and {name!r} would share one mask file "
                                       f"({file}.npz); rename one")
        by_key[key], by_file[file] = name, name
        out[clean] = [int(i) for i in ids]
    return out


def _parse_absent(value) -> List[str]:
    """The row's ``absent`` names: a JSON list of term-dictionary names (or its JSON text)."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return []
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise CaseError("bad_row", f"'absent' is not JSON ({e}); give a list such as [\"brain\"]") from None
    if not isinstance(value, list) or not all(isinstance(v, str) and v.strip() for v in value):
        raise CaseError("bad_row", "'absent' must be a list of structure names, e.g. [\"brain\"]")
    from .queries import term_key

    terms = resources.term_dictionary()
    out = []
    for name in value:
        if term_key(name, terms) is None:
            raise CaseError("bad_row", f"'absent': {name.strip()!r} is not in M3D's term dictionary "
                                       "(Resources/training/m3d_term_dictionary.json), so no query can describe it")
        out.append(name.strip())
    return list(dict.fromkeys(out))


def read_manifest(path) -> Tuple[List[Case], List[dict]]:
    """Cases of a manifest and the rows refused for their form (``{"case", "row", "reason", "message"}``)."""
    path = Path(path)
    rows = _read_rows(path)
    if not rows:
        raise DataError(f"manifest {path} has no rows")
    cases, bad, seen = [], [], set()
    for n, row in enumerate(rows, start=1):
        cid = str(row.get("id") or "").strip() if isinstance(row, dict) else ""
        try:
            if "__error__" in row:
                raise CaseError("bad_row", row["__error__"])
            if not cid:
                raise CaseError("bad_row", "the row has no 'id'")
            if cid in seen or safe_name(cid) in {safe_name(s) for s in seen}:
                raise CaseError("duplicate_id", f"case id {cid!r} appears twice")
            for key in ("volume", "labels"):
                if not str(row.get(key) or "").strip():
                    raise CaseError("bad_row", f"the row has no {key!r}")
            split = str(row.get("split") or "").strip().lower()
            if split not in SPLITS:
                raise CaseError("bad_row", f"split must be train or test, got {row.get('split')!r}")
            dataset = str(row.get("dataset") or "").strip() or None
            if dataset is not None:
                try:
                    resources.dataset_labels(dataset)
                except DataError as e:
                    raise CaseError("bad_row", str(e)) from None
            targets = _parse_targets(row.get("targets"), dataset)
            base = path.parent
            vol, lab = (Path(str(row[k]).strip()).expanduser() for k in ("volume", "labels"))
            cases.append(Case(cid, vol if vol.is_absolute() else base / vol, lab if lab.is_absolute() else base / lab,
                              targets, split, dataset, n, str(row.get("orientation") or "").strip() or None,
                              {k: v for k, v in row.items() if not k.startswith("__")},
                              _parse_absent(row.get("absent"))))
            seen.add(cid)
        except CaseError as e:
            bad.append({"case": cid or f"row {n}", "row": n, "target": None, "reason": e.reason, "message": str(e)})
    return cases, bad


# ---- loading a case ---------------------------------------------------------------------------

class LabelSource:
    """Target masks of a case on the canonical stack: a label map or M3D-Seg channels."""

    def __init__(self, label_stack: Optional[np.ndarray] = None, channels: Optional[np.ndarray] = None):
        self.label_stack = label_stack  # (D, H, W) ints
        self.channels = channels  # (C, D, H, W) bool

    def known_ids(self) -> Optional[set]:
        """Ids the source can hold (M3D: 1..C); None for a label map (any id it contains)."""
        return set(range(1, self.channels.shape[0] + 1)) if self.channels is not None else None

    def present_ids(self) -> set:
        if self.channels is not None:
            return {c + 1 for c in range(self.channels.shape[0]) if self.channels[c].any()}
        return {int(v) for v in np.unique(self.label_stack) if v != 0}

    def mask(self, ids: List[int]) -> np.ndarray:
        if self.channels is not None:
            return np.any(self.channels[[i - 1 for i in ids]], axis=0)
        return np.isin(self.label_stack, ids)


def _percentile_window(array: np.ndarray):
    from medvolcore.windowing import Window

    sample = array[:: max(1, array.shape[0] // 32)]
    lo, hi = (float(v) for v in np.percentile(sample, [0.5, 99.5]))
    if not hi > lo:
        hi = lo + 1.0
    return Window((lo + hi) / 2.0, hi - lo, "custom")


def _m3d_affine(orientation: Optional[str]) -> np.ndarray:
    import nibabel.orientations as nio

    code = (orientation or "RAS").upper()
    try:
        ornt = nio.axcodes2ornt(tuple(code), labels=(("L", "R"), ("P", "A"), ("I", "S")))
    except Exception:
        raise CaseError("bad_row", f"orientation {orientation!r} is not three axis codes such as RAS or LPS") from None
    if len(code) != 3 or np.isnan(ornt).any():
        raise CaseError("bad_row", f"orientation {orientation!r} is not three axis codes such as RAS or LPS")
    aff = np.zeros((4, 4))
    aff[3, 3] = 1.0
    for src, (world, sign) in enumerate(ornt):
        aff[int(world), src] = sign
    return aff


def load_case(case: Case):
    """``(stack, labels, window, intensity)`` of a case, or :class:`CaseError` with a reason.

    ``stack`` is the :class:`~medvolcore.stack.AxialStack` of the CT, ``labels`` a
    :class:`LabelSource` on that stack, ``window`` the rendering window (None: the default
    soft-tissue window on HU; a percentile window for M3D-Seg) and ``intensity`` ``"hu"`` or
    ``"m3d_normalised"``.
    """
    from medvolcore.errors import MedVolError
    from medvolcore.geometry import gt_on_grid
    from medvolcore.stack import AxialStack
    from medvolcore.volume import CTVolume, load_label_map, load_volume

    for what, p in (("volume", case.volume), ("labels", case.labels)):
        if not p.exists():
            raise CaseError("missing_file", f"{what} file {p} does not exist")
    if case.is_m3dseg:
        try:
            img = np.load(case.volume, allow_pickle=False)
        except Exception as e:
            raise CaseError("unreadable", f"cannot read {case.volume}: {e}") from None
        if img.ndim == 4 and img.shape[0] == 1:
            img = img[0]
        if img.ndim != 3:
            raise CaseError("unreadable", f"{case.volume}: expected (1, H, W, D), got shape {img.shape}")
        channels = read_m3d_mask(case.labels)
        if channels.shape[1:] != img.shape:
            raise CaseError("shape_mismatch", f"image {img.shape} and mask {channels.shape[1:]} differ in shape")
        vol = CTVolume(np.asarray(img, dtype=np.float32), _m3d_affine(case.orientation), path=str(case.volume))
        stack = AxialStack(vol)
        ch = np.stack([stack.to_stack(c) for c in channels])
        return stack, LabelSource(channels=ch), _percentile_window(vol.array), "m3d_normalised"
    try:
        vol = load_volume(case.volume)
        lab = load_label_map(case.labels)
    except MedVolError as e:
        raise CaseError("unreadable", str(e)) from None
    try:  # by geometry, as medvol metrics and batch compare (medvolcore.geometry): flipped or reordered axes are fine
        on = gt_on_grid(vol, lab)
    except MedVolError as e:
        raise CaseError("grid_mismatch", str(e)) from None
    if on.note:
        log.info("case %s: label map %s", case.id, on.note)
    stack = AxialStack(vol)
    return stack, LabelSource(label_stack=np.ascontiguousarray(stack.to_stack(on.array))), None, "hu"


def read_m3d_mask(path: Path) -> np.ndarray:
    """An M3D-Seg ``mask_(C, H, W, D).npz`` (scipy.sparse ``(C, H·W·D)``) as a bool ``(C, H, W, D)`` array."""
    m = _M3D_MASK_RE.search(Path(path).name)
    if not m:
        raise CaseError("unreadable_npz", f"{path}: an M3D-Seg mask is named mask_(C, H, W, D).npz")
    shape = tuple(int(v) for v in ast.literal_eval(m.group(1)))
    try:
        from scipy import sparse

        mat = sparse.load_npz(str(path))
    except Exception as e:
        raise CaseError("unreadable_npz", f"cannot read {path}: {type(e).__name__}: {e}") from None
    if len(shape) != 4 or mat.shape != (shape[0], int(np.prod(shape[1:]))):
        raise CaseError("unreadable_npz", f"{path}: sparse matrix {mat.shape} does not fit the shape {shape} "
                                          "in its name")
    return (mat.toarray() != 0).reshape(shape)


# ---- M3D-Seg → manifest rows -----------------------------------------------------------------

def _split_file(root: Path, code: str) -> Path:
    for p in (root / code / f"{code}.json", root / f"{code}.json"):
        if p.is_file():
            return p
    raise DataError(f"no split file {code}.json in {root / code} or {root}")


def _read_nifti_map(path: Path) -> Dict[str, dict]:
    try:
        rows = list(csv.DictReader(Path(path).read_text(encoding="utf-8-sig").splitlines()))
    except OSError as e:
        raise DataError(f"cannot read {path}: {e}") from None
    need = {"case", "volume", "labels"}
    if not rows or not need <= set(rows[0]):
        raise DataError(f"{path}: a NIfTI map is a CSV with columns case, volume, labels")
    base = Path(path).parent
    out = {}
    for r in rows:
        out[r["case"].strip()] = {k: str(Path(r[k].strip()) if Path(r[k].strip()).is_absolute()
                                      else base / r[k].strip()) for k in ("volume", "labels")}
    return out


def _resolve_entry(p: Path, root: Path, json_dir: Path) -> Path:
    """A split-file path: absolute, or relative to the M3D-Seg root (as M3D writes them) or the json."""
    if p.is_absolute():
        return p
    return root / p if (root / p).exists() or not (json_dir / p).exists() else json_dir / p


def m3dseg_rows(root, code: str, nifti_map=None, orientation: Optional[str] = None) -> List[dict]:
    """Manifest rows (dicts) of one M3D-Seg dataset with its train/test split.

    With ``nifti_map`` (CSV: case, volume, labels) a case's original NIfTI files replace the M3D
    arrays, keeping M3D-Seg's split and label list; cases missing from the map keep the arrays.
    """
    root = Path(root)
    code = str(code).strip()
    resources.dataset_labels(code)  # a known code
    split_path = _split_file(root, code)
    try:
        splits = json.loads(split_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise DataError(f"cannot read {split_path}: {e}") from None
    mapping = _read_nifti_map(Path(nifti_map)) if nifti_map else {}
    rows, used_arrays = [], 0
    for split in SPLITS:
        for entry in splits.get(split, []) or []:
            if not isinstance(entry, dict) or "image" not in entry or "label" not in entry:
                raise DataError(f"{split_path}: entries of {split!r} must have 'image' and 'label'")
            image, label = (_resolve_entry(Path(entry[k]), root, split_path.parent) for k in ("image", "label"))
            case = image.parent.name
            row = {"id": f"{code}_{case}", "dataset": code, "split": split}
            if case in mapping:
                row.update(mapping[case])
            else:
                row.update(volume=str(image), labels=str(label))
                used_arrays += 1
                if orientation:
                    row["orientation"] = orientation
            rows.append(row)
    if not rows:
        raise DataError(f"{split_path} lists no train or test cases")
    if used_arrays:
        log.warning("%d of %d cases of M3D-Seg %s use the M3D arrays: %s", used_arrays, len(rows), code, M3D_WARNING)
    return rows


def write_manifest(rows: List[dict], path, overwrite: bool = False) -> Path:
    """Write manifest rows as JSONL (atomically)."""
    from medvolcore.fileio import write_text_atomic

    text = "".join(json.dumps(r) + "\n" for r in rows)
    return write_text_atomic(path, text, overwrite=overwrite)


__all__ = ["Case", "LabelSource", "read_manifest", "load_case", "read_m3d_mask", "m3dseg_rows", "write_manifest",
           "M3D_WARNING", "safe_name"]
