"""What a DICOM series read was made of: each instance's identity, position and content digest.

The series reader (:mod:`medvolcore.dicom`) scans every file of the series once, before GDCM
decodes a voxel (:func:`scan_instances`): it reads the file's bytes, takes their sha256, parses
the header with pydicom and checks it:

- the pixel data of an uncompressed file holds at least the bytes its Rows, Columns, samples,
  bits and frames declare (a 12 kB file declaring 8192×8192 pixels is refused, not zero-filled);
- every slice is of one patient, study, series and frame of reference (:func:`check_one_series`:
  a disagreement is refused, naming the attribute and two files);
- every slice has the same Rows, Columns, PixelSpacing and ImageOrientationPatient;
- the positions along the slice normal step evenly, without a gap or a duplicate; positions that
  drift in-plane (a gantry-tilted or sheared stack) are measured (``DicomRecord.tilt``) and the
  series is resampled onto the orthogonal grid of its first slice (:func:`orthogonal_grid`, with a
  note), never read as a box with the distance between positions as its spacing;
- an empty SOP Instance or SOP Class UID (anonymisers blank them) is taken from the file meta
  information, which keeps them.

The result is a :class:`DicomRecord`: per instance (in the series' slice order) its SOP Instance
UID, SOP Class UID, position, sha256 and file identity (device, inode, size, mtime, ctime), and
each instance's header without pixel data (what a DICOM Segmentation copies: patient, study,
frame of reference). The DICOM-SEG writer (:mod:`medvolcore.dicomseg`) uses this record only and
never reads the folder again; :meth:`DicomRecord.check_unchanged` refuses, in one line, a series
whose files were replaced or rewritten since they were read.
"""

from __future__ import annotations

import hashlib
import io
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional, Sequence

import numpy as np

from .errors import VolumeError

MAX_KEPT_VALUE = 4096  # bytes: header values longer than this (icons, overlays, curves) are not kept
# positions may drift in-plane by this much (mm, or this fraction of a pixel) before the stack is called tilted
DRIFT_MM, DRIFT_PIXELS = 0.02, 0.05

_NATIVE = {"1.2.840.10008.1.2", "1.2.840.10008.1.2.1", "1.2.840.10008.1.2.2", "1.2.840.10008.1.2.1.99"}


@dataclass(frozen=True)
class Instance:
    """One file of the series, as it was when read."""

    file: str
    sop_instance_uid: str
    sop_class_uid: str
    position: tuple
    sha256: str
    identity: tuple  # (device, inode, size, mtime_ns, ctime_ns)


@dataclass
class DicomRecord:
    """The instances a series read was made of, in slice order, and their headers (no pixel data)."""

    folder: str
    instances: List[Instance]
    headers: list = field(repr=False)  # pydicom Datasets, one per instance
    notes: List[str] = field(default_factory=list)
    tilt: Optional[dict] = None  # positions drifting in-plane: see check_stack; the volume is resampled
    frames: Optional[list] = None  # an enhanced (multi-frame) instance: each frame's position, as stored
    # read from a private copy the worker owns (content-addressed: its cache key is the sha256 of the bytes
    # read), removed once read: nothing else can change it, so there is nothing to check again. Never
    # serialised: a record read back from JSON is checked against its files.
    private: bool = False

    def to_json(self) -> dict:
        return {"folder": self.folder, "notes": self.notes, "tilt": self.tilt, "frames": self.frames,
                "instances": [[i.file, i.sop_instance_uid, i.sop_class_uid, list(i.position), i.sha256,
                               list(i.identity)] for i in self.instances],
                "headers": [ds.to_json_dict(bulk_data_threshold=MAX_KEPT_VALUE,
                                            bulk_data_element_handler=lambda _e: "") for ds in self.headers]}

    @classmethod
    def from_json(cls, obj: dict) -> "DicomRecord":
        from pydicom.dataset import Dataset

        inst = [Instance(f, uid, cls_uid, tuple(pos), digest, tuple(ident))
                for f, uid, cls_uid, pos, digest, ident in obj["instances"]]
        return cls(obj["folder"], inst, [Dataset.from_json(h) for h in obj["headers"]], list(obj.get("notes") or []),
                   obj.get("tilt"), obj.get("frames"))

    def seg_refusal(self) -> Optional[str]:
        """Why a DICOM Segmentation cannot reference this series (None when it can)."""
        if self.tilt is not None:
            return (f"the source series is gantry-tilted ({self.tilt['degrees']:.1f}°) and was resampled onto an "
                    "orthogonal grid, so a DICOM Segmentation's frames cannot lie on its slices")
        if self.frames is not None:
            return ("the source is one enhanced multi-frame instance; MedVol writes DICOM Segmentations of series of "
                    "single-frame slices only")
        ref = self.headers[0]
        missing = [k for k in ("StudyInstanceUID", "SeriesInstanceUID", "FrameOfReferenceUID")
                   if not str(ref.get(k, "") or "").strip()]
        if not any(i.sop_instance_uid for i in self.instances) or not all(i.sop_instance_uid for i in self.instances):
            missing.append("SOPInstanceUID")
        if not all(i.sop_class_uid for i in self.instances):
            missing.append("SOPClassUID")
        if not all(i.position for i in self.instances) or any(
                _floats(h, "ImageOrientationPatient", 6) is None or _floats(h, "PixelSpacing", 2) is None
                for h in self.headers):
            missing.append("ImagePositionPatient, ImageOrientationPatient or PixelSpacing on every slice")
        if missing:
            return (f"the source series has no {', '.join(missing)} (blanked by anonymisation?), so a DICOM "
                    "Segmentation cannot reference it")
        return None

    def describes(self, folder) -> bool:
        """Whether ``folder`` (a copy of the series' folder) holds exactly the bytes this record was
        read from: each instance's file, at its place relative to the record's folder, has its sha256."""
        for inst in self.instances:
            try:
                rel = Path(inst.file).relative_to(self.folder)
                digest = hashlib.sha256((Path(folder) / rel).read_bytes()).hexdigest()
            except (OSError, ValueError):
                return False
            if digest != inst.sha256:
                return False
        return True

    def check_unchanged(self) -> None:
        """Refuse (one :class:`VolumeError`) when a file read is gone, replaced or rewritten since
        (nothing to check for a :attr:`private` copy: what was read is what is referenced)."""
        if self.private:
            return
        for inst in self.instances:
            try:
                st = os.stat(inst.file)
            except OSError:
                raise VolumeError(f"the DICOM series changed since it was read ({Path(inst.file).name} is gone); "
                                  "nothing was written from it: run again on a folder that nothing else writes") from None
            if _identity(st) == tuple(inst.identity):
                continue
            digest = hashlib.sha256(Path(inst.file).read_bytes()).hexdigest()
            if digest != inst.sha256:
                raise VolumeError(f"the DICOM series changed since it was read ({Path(inst.file).name} was replaced "
                                  "or rewritten); nothing was written from it: run again on a folder that nothing "
                                  "else writes")


def _identity(st: os.stat_result) -> tuple:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _slim(ds):
    """The header without pixel data, private elements, group 0x0002 or long values."""
    from pydicom.dataset import Dataset

    out = Dataset()
    for elem in ds:
        if elem.tag.is_private or elem.tag.group in (0x0002, 0x7FE0, 0xFFFE) or elem.tag.group >> 8 == 0x60:
            continue
        if elem.VR in ("OB", "OW", "OF", "OD", "OL", "OV", "UN"):
            continue
        out.add(elem)
    return out


def _floats(ds, name: str, n: int) -> Optional[np.ndarray]:
    try:
        v = np.asarray([float(x) for x in ds.get(name)], dtype=np.float64)
    except (TypeError, ValueError):
        return None
    return v if v.size == n and np.all(np.isfinite(v)) else None


def _check_pixel_length(ds, name: str) -> None:
    """An uncompressed file's pixel data must hold what its header declares (checked before any allocation)."""
    ts = str(getattr(getattr(ds, "file_meta", None), "TransferSyntaxUID", "") or "")
    if "PixelData" not in ds or ts not in _NATIVE:
        return
    try:
        rows, cols = int(ds.Rows), int(ds.Columns)
        samples, bits = int(ds.get("SamplesPerPixel", 1) or 1), int(ds.BitsAllocated)
        frames = int(ds.get("NumberOfFrames", 1) or 1)
    except (AttributeError, TypeError, ValueError):
        raise VolumeError(f"{name}: its header lacks Rows, Columns or BitsAllocated; a damaged file?") from None
    need = rows * cols * samples * frames * bits // 8
    have = len(ds.PixelData)
    if have < need:
        raise VolumeError(f"{name} declares {cols}×{rows} pixels ({need / 1e6:.1f} MB) but holds {have / 1e6:.3f} MB "
                          "of pixel data: a damaged or truncated file; refused before reading its voxels")


def read_instance(path: str):
    """``(dataset, sha256, identity)`` of one file, its bytes read once (the dataset keeps its pixel data)."""
    import pydicom

    with open(path, "rb") as fh:
        st0 = os.fstat(fh.fileno())
        data = fh.read()
        st1 = os.fstat(fh.fileno())
    if _identity(st0) != _identity(st1):
        raise VolumeError(f"{Path(path).name} changed while it was being read; run again on a folder that nothing "
                          "else writes")
    try:
        ds = pydicom.dcmread(io.BytesIO(data))
    except Exception as exc:  # noqa: BLE001 - GDCM took it as DICOM; pydicom's reason is the useful one
        raise VolumeError(f"cannot read the DICOM header of {Path(path).name}: {str(exc).strip()[:200]}") from None
    return ds, hashlib.sha256(data).hexdigest(), _identity(st1)


def _uid(ds, name: str, meta_name: str) -> str:
    """The data set's UID, or the file meta's when the data set's is empty or missing."""
    v = str(ds.get(name, "") or "").strip()
    if not v:
        v = str(getattr(getattr(ds, "file_meta", None), meta_name, "") or "").strip()
        if v:
            setattr(ds, name, v)
    return v


def scan_instances(path, files: Sequence[str]) -> tuple:
    """``(record, float_rescale)``: the :class:`DicomRecord` of ``files`` (the series' slices in
    order) after the checks of the module docstring, and whether the voxels must be decoded as
    floating point (a non-integer or per-slice rescale, applied exactly)."""
    headers, instances, metas = [], [], []
    for f in files:
        ds, digest, ident = read_instance(str(f))
        name = Path(f).name
        _check_pixel_length(ds, name)
        uid = _uid(ds, "SOPInstanceUID", "MediaStorageSOPInstanceUID")
        cls_uid = _uid(ds, "SOPClassUID", "MediaStorageSOPClassUID")
        size = (int(ds.get("Rows", 0) or 0), int(ds.get("Columns", 0) or 0))
        if int(ds.get("NumberOfFrames", 1) or 1) > 1:  # an enhanced (multi-frame) instance: one meta per frame
            if len(files) > 1:
                raise VolumeError(f"{name} is a multi-frame DICOM instance among {len(files)} files; give the folder "
                                  "of that instance alone")
            frames = _frame_metas(ds, name, size)
            metas += frames
            ipp = frames[0][2]
        else:
            iop, ipp = _floats(ds, "ImageOrientationPatient", 6), _floats(ds, "ImagePositionPatient", 3)
            px = _floats(ds, "PixelSpacing", 2)
            rescale = (float(ds.get("RescaleSlope", 1) or 1), float(ds.get("RescaleIntercept", 0) or 0))
            metas.append((name, iop, ipp, px, size, rescale))
        headers.append(_slim(ds))
        instances.append(Instance(str(Path(f).resolve()), uid, cls_uid,
                                  tuple(ipp.tolist()) if ipp is not None else (), digest, ident))
        del ds
    check_one_series(headers, [Path(f).name for f in files])
    tilt = check_stack(metas)
    rescales = {m[5] for m in metas}
    float_rescale = len(rescales) > 1 or any(not (s.is_integer() and i.is_integer()) for s, i in rescales)
    frames = [tuple(m[2].tolist()) for m in metas] if len(metas) > len(instances) else None
    if frames is not None and tilt is not None:
        raise VolumeError(f"{Path(files[0]).name}: the frames of this multi-frame instance drift in-plane (a gantry "
                          f"tilt of {tilt['degrees']:.1f}°); convert it with dcm2niix, which corrects the tilt")
    record = DicomRecord(str(Path(path).resolve()), instances, headers, tilt=tilt, frames=frames)
    if tilt is not None:
        record.notes.append(tilt_note(tilt))
    return record, float_rescale or tilt is not None


# what every instance of one series shares: (attribute, what it names, whether its value may be shown in a message)
SHARED = (("PatientID", "patient", False), ("PatientName", "patient", False), ("StudyInstanceUID", "study", True),
          ("SeriesInstanceUID", "series", True), ("FrameOfReferenceUID", "frame of reference", True))


def check_one_series(headers: Sequence, names: Sequence[str]) -> None:
    """Refuse (one :class:`VolumeError` naming the attribute and two files) instances that are not
    of one patient, study, series and frame of reference: PatientID, StudyInstanceUID,
    SeriesInstanceUID and FrameOfReferenceUID equal on every instance (an empty or missing value is
    one value), PatientName equal where both instances have one. A faulty anonymiser, two exports
    in one folder or a server answering wrongly would otherwise make one volume of two patients,
    and a DICOM-SEG filed under the first that references the images of both."""
    for attr, what, shown in SHARED:
        values = [str(h.get(attr, "") or "").strip() for h in headers]
        for i in range(1, len(values)):
            a, b = values[0], values[i]
            if attr == "PatientName" and (not a or not b):
                continue
            if a != b:
                said = f" ({a or 'empty'} and {b or 'empty'})" if shown else ""
                raise VolumeError(f"the DICOM series is not one {what}'s: {attr} differs between {names[0]} and "
                                  f"{names[i]}{said}; a faulty anonymiser or two exports in one folder? Refused: "
                                  "give a folder holding one series of one patient")


def _frame_metas(ds, name: str, size) -> list:
    """Per frame of an enhanced instance: ``(name, iop, ipp, pixel_spacing, size, rescale)`` from its
    per-frame functional groups, falling back on the shared ones and the top level."""
    shared = (ds.get("SharedFunctionalGroupsSequence") or [None])[0]
    per_frame = ds.get("PerFrameFunctionalGroupsSequence") or []
    if len(per_frame) != int(ds.NumberOfFrames):
        raise VolumeError(f"{name}: a multi-frame instance whose per-frame functional groups do not list its "
                          f"{int(ds.NumberOfFrames)} frames; its slices cannot be placed")

    def item(group, seq: str):
        for g in (group, shared):
            if g is not None and seq in g and len(g.get(seq)):
                return g.get(seq)[0]
        return ds

    out = []
    for k, group in enumerate(per_frame):
        iop = _floats(item(group, "PlaneOrientationSequence"), "ImageOrientationPatient", 6)
        ipp = _floats(item(group, "PlanePositionSequence"), "ImagePositionPatient", 3)
        px = _floats(item(group, "PixelMeasuresSequence"), "PixelSpacing", 2)
        t = item(group, "PixelValueTransformationSequence")
        rescale = (float(t.get("RescaleSlope", 1) or 1), float(t.get("RescaleIntercept", 0) or 0))
        if iop is None or ipp is None or px is None:
            raise VolumeError(f"{name}: frame {k + 1} of this multi-frame instance has no position, orientation or "
                              "pixel spacing; its slices cannot be placed")
        out.append((f"{name} frame {k + 1}", iop, ipp, px, size, rescale))
    return out


def frame_geometry(record: "DicomRecord") -> tuple:
    """``(spacing, origin, direction)`` (LPS, SimpleITK's order) of an enhanced instance's frames
    as stored, from their own positions (checked evenly spaced along the normal, no drift)."""
    h = record.headers[0]
    shared = (h.get("SharedFunctionalGroupsSequence") or [None])[0]
    pos = np.asarray(record.frames, dtype=np.float64)
    first = (h.get("PerFrameFunctionalGroupsSequence") or [None])[0]
    iop = px = None
    for g in (first, shared):
        if g is not None and iop is None and "PlaneOrientationSequence" in g:
            iop = _floats(g.PlaneOrientationSequence[0], "ImageOrientationPatient", 6)
        if g is not None and px is None and "PixelMeasuresSequence" in g:
            px = _floats(g.PixelMeasuresSequence[0], "PixelSpacing", 2)
    axis = (pos[-1] - pos[0]) / max(len(pos) - 1, 1)
    step = float(np.linalg.norm(axis)) or 1.0
    third = axis / step if len(pos) > 1 else np.cross(iop[:3], iop[3:])
    direction = np.column_stack([iop[:3], iop[3:], third]).reshape(-1)
    return (float(px[1]), float(px[0]), step), tuple(float(v) for v in pos[0]), tuple(float(v) for v in direction)


def _first_difference(metas, index: int, same) -> Optional[tuple]:
    ref = metas[0][index]
    for m in metas[1:]:
        if not same(m[index], ref):
            return metas[0][0], ref, m[0], m[index]
    return None


def check_stack(metas) -> Optional[dict]:
    """``metas``: per slice ``(name, iop, ipp, pixel_spacing, (rows, cols), rescale)``. Refuse a
    series that is not one evenly spaced stack of equal slices (see the module docstring); return
    its tilt (``degrees``, ``per_slice_mm``, ``spacing_mm``, ``max_mm``, ``offsets_mm`` per slice)
    when its positions drift in-plane, else None."""
    diff = _first_difference(metas, 4, lambda a, b: a == b)
    if diff:
        raise VolumeError(f"the DICOM series mixes slice sizes ({diff[0]}: {diff[1][1]}×{diff[1][0]}, {diff[2]}: "
                          f"{diff[3][1]}×{diff[3][0]} pixels); it is not one stack of equal slices")
    if any(m[1] is None or m[2] is None for m in metas):
        return  # no usable geometry tags: GDCM's own geometry, nothing to check against
    diff = _first_difference(metas, 1, lambda a, b: np.allclose(a, b, atol=1e-4))
    if diff:
        raise VolumeError(f"the DICOM series mixes slice orientations ({diff[0]}: {np.round(diff[1], 4).tolist()}, "
                          f"{diff[2]}: {np.round(diff[3], 4).tolist()}); it is not one stack of parallel slices")
    if all(m[3] is not None for m in metas):
        diff = _first_difference(metas, 3, lambda a, b: np.allclose(a, b, rtol=1e-4, atol=1e-6))
        if diff:
            raise VolumeError(f"the DICOM series mixes pixel spacings ({diff[0]}: {diff[1].tolist()} mm, {diff[2]}: "
                              f"{diff[3].tolist()} mm); reading it as one grid would put voxels in the wrong place")
    if len(metas) < 2:
        return
    iop = metas[0][1]
    normal = np.cross(iop[:3], iop[3:])
    pos = np.array([m[2] for m in metas])
    z = pos @ normal
    order = np.argsort(z, kind="stable")
    zs, names = z[order], [metas[i][0] for i in order]
    steps = np.diff(zs)
    for i, d in enumerate(steps):
        if d < 1e-3:
            raise VolumeError(f"two DICOM slices are at the same position {zs[i]:.2f} mm ({names[i]} and "
                              f"{names[i + 1]}): duplicated slices or two series in one folder")
    spacing = float(np.median(steps))
    bad = np.flatnonzero(np.abs(steps - spacing) > max(0.01, 0.1 * spacing))
    if bad.size:
        i = int(bad[0])
        missing = round(steps[i] / spacing) - 1
        what = f"about {missing} slice{'s' if missing != 1 else ''} missing" if missing >= 1 else "uneven spacing"
        raise VolumeError(
            f"the DICOM series is not evenly spaced: slice positions jump from {zs[i]:.2f} to {zs[i + 1]:.2f} mm "
            f"({steps[i]:.2f} mm, where the other slices are {spacing:.2f} mm apart; {what} between {names[i]} and "
            f"{names[i + 1]})" + (f" and {bad.size - 1} more place(s)" if bad.size > 1 else "")
            + "; reading it would give wrong geometry. Export the complete series again")
    rel = pos - pos[order[0]]
    inplane = rel - np.outer(rel @ normal, normal)
    drift = np.linalg.norm(inplane, axis=1)
    px = metas[0][3]
    tolerance = max(DRIFT_MM, DRIFT_PIXELS * float(np.min(px))) if px is not None else DRIFT_MM
    if drift.max() <= tolerance:
        return None
    if px is None:
        raise VolumeError("the DICOM series' slice positions drift in-plane (a gantry tilt or a sheared stack) and "
                          "its slices have no PixelSpacing, so it cannot be resampled; convert it with dcm2niix")
    span = float(zs[-1] - zs[0])
    far = int(order[-1])
    tilt = float(np.degrees(np.arctan2(drift[far], span)))
    return {"degrees": round(tilt, 2), "per_slice_mm": round(float(drift[far] / span * spacing), 3),
            "spacing_mm": round(spacing, 4), "max_mm": round(float(drift.max()), 3),
            # per slice, in the order given: its in-plane offset along the rows' and the columns' direction (mm)
            "offsets_mm": [[float(v @ iop[:3]), float(v @ iop[3:])] for v in inplane]}


def tilt_note(tilt: dict) -> str:
    return (f"the DICOM series' slice positions drift in-plane ({tilt['per_slice_mm']:.2f} mm per "
            f"{tilt['spacing_mm']:.2f} mm slice, {tilt['max_mm']:.1f} mm in all: a gantry tilt of "
            f"{tilt['degrees']:.1f}° or a sheared stack); its slices were resampled onto an orthogonal grid "
            "(linear interpolation, as dcm2niix and ITK do), so no DICOM-SEG can be written on it")


def orthogonal_grid(array: np.ndarray, record: "DicomRecord", spacing, origin, direction) -> tuple:
    """A tilted series (``record.tilt``) resampled onto the orthogonal grid of its first slice:
    ``(array, spacing, origin, direction)`` in SimpleITK's ``(k, j, i)`` order and LPS geometry.

    Slice k of ``array`` lies at its own position; on the new grid its pixels are shifted back by
    its in-plane offset (bilinear; pixels shifted in from outside take the series' lowest value),
    and the slice axis is the slice normal with the spacing of the positions along it."""
    from scipy import ndimage

    iop = np.asarray(record.headers[0].ImageOrientationPatient, dtype=np.float64)
    px = [float(v) for v in record.headers[0].PixelSpacing]  # (between rows, between columns)
    pos = np.array([inst.position for inst in record.instances], dtype=np.float64)
    normal = np.cross(iop[:3], iop[3:])
    z = pos @ normal
    step = (z[-1] - z[0]) / max(len(z) - 1, 1)
    offsets = np.asarray(record.tilt["offsets_mm"], dtype=np.float64)
    offsets -= offsets[0]
    fill = float(array.min())
    out = np.empty(array.shape, np.float32)
    for k in range(array.shape[0]):
        di, dj = offsets[k][0] / px[1], offsets[k][1] / px[0]  # columns (i) and rows (j) to move by
        ndimage.shift(array[k].astype(np.float32), (dj, di), output=out[k], order=1, mode="constant", cval=fill)
    new_dir = np.column_stack([iop[:3], iop[3:], normal * np.sign(step)]).reshape(-1)
    return out, (px[1], px[0], float(abs(step))), tuple(float(v) for v in pos[0]), tuple(float(v) for v in new_dir)


__all__ = ["DicomRecord", "Instance", "SHARED", "check_one_series", "check_stack", "frame_geometry", "orthogonal_grid", "read_instance", "scan_instances",
           "tilt_note"]
