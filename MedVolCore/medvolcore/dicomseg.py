"""DICOM Segmentation output (``--out result.dcm``), written with highdicom.

A DICOM-SEG needs the DICOM series it segments: it references the source series and each of its
instances, and shares their StudyInstanceUID and FrameOfReferenceUID, so a PACS or Slicer's DICOM
module files it with the CT. So a ``.dcm`` output is allowed only when the volume is a DICOM series
folder (:func:`check_dicom_source`, before any model loads).

The mask (on the CT's grid as :func:`medvolcore.volume.load_volume` read it) is put into the
source instances' frames **by geometry**: every pixel of every source slice is located in the
world (ImagePositionPatient, ImageOrientationPatient, PixelSpacing) and looked up in the mask at
that position; a slice whose pixels do not fall on the mask's voxel centres is an error, not a
resampling. Each segment (one per query) carries SegmentLabel = the query, shortened to DICOM's 64
characters, SegmentDescription = the whole query, the segmented property category and type (and
laterality, and anatomic region) from :mod:`medvolcore.terminology` — the generic *Anatomical
structure* code when the query names no known structure, said in the notes — its colour, and the
algorithm identification (name = the model that ran, version, family Artificial Intelligence).
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional, Sequence

import numpy as np

from .errors import InputError, VolumeError

MAX_LABEL = 64  # SegmentLabel is a DICOM LO: 64 characters
POSITION_TOLERANCE = 0.05  # voxels: how far a source pixel may sit from a mask voxel centre


def is_dicom_output(path) -> bool:
    return str(path).lower().endswith(".dcm")


def check_dicom_source(volume_path, what: str = "--out") -> None:
    """A ``.dcm`` (DICOM-SEG) output needs a DICOM series folder as the volume: one clear error
    otherwise (a NIfTI, NRRD or MetaImage CT has no series to reference)."""
    if volume_path is None or not Path(str(volume_path)).is_dir():
        raise InputError(f"{what}: a DICOM Segmentation (.dcm) references the DICOM series it segments, so the volume "
                         "must be a DICOM series folder; for a NIfTI/NRRD/MetaImage CT write .seg.nrrd or .nii.gz")


def source_datasets(folder) -> list:
    """The CT series' instances in ``folder`` (pydicom datasets with pixel data), one series only."""
    import pydicom

    out = []
    for f in sorted(Path(folder).iterdir()):
        if not f.is_file():
            continue
        try:
            ds = pydicom.dcmread(str(f))
        except Exception:  # noqa: BLE001 - not DICOM: the reader skipped it too
            continue
        if "PixelData" in ds and "ImagePositionPatient" in ds:
            out.append(ds)
    series = {str(ds.SeriesInstanceUID) for ds in out}
    if not out or len(series) != 1:
        raise VolumeError(f"{folder}: expected one DICOM image series for the segmentation's source, found "
                          f"{len(series)}")
    return out


def frames_from_mask(labels: np.ndarray, affine: np.ndarray, datasets: Sequence) -> np.ndarray:
    """``(len(datasets), rows, columns)``: for each source instance, the label values at its pixels'
    world positions (``labels`` in x, y, z order on the grid ``affine`` maps to RAS)."""
    to_voxel = np.linalg.inv(np.asarray(affine, dtype=np.float64))
    frames = []
    for ds in datasets:
        try:
            rows, cols = int(ds.Rows), int(ds.Columns)
            ipp = np.asarray(ds.ImagePositionPatient, dtype=np.float64).reshape(3)
            iop = np.asarray(ds.ImageOrientationPatient, dtype=np.float64).reshape(6)
            row_sp, col_sp = (float(v) for v in ds.PixelSpacing)  # (between rows, between columns)
        except (AttributeError, TypeError, ValueError):
            raise VolumeError("a source DICOM slice lacks a usable position, orientation or pixel spacing: its "
                              "frames cannot be placed; write .seg.nrrd or .nii.gz instead") from None
        r, c = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
        lps = ipp[None, None, :] + c[..., None] * col_sp * iop[None, None, :3] + r[..., None] * row_sp * iop[None, None, 3:]
        ras = lps * np.array([-1.0, -1.0, 1.0])
        vox = ras @ to_voxel[:3, :3].T + to_voxel[:3, 3]
        idx = np.rint(vox)
        if np.abs(vox - idx).max() > POSITION_TOLERANCE:
            raise VolumeError("the mask is not on the grid of the source DICOM series (a source pixel lies between "
                              "mask voxels): write .seg.nrrd or .nii.gz instead")
        idx = idx.astype(np.int64)
        inside = np.all((idx >= 0) & (idx < np.array(labels.shape)), axis=-1)
        if not inside.all():
            raise VolumeError("a source DICOM slice lies outside the mask's grid")
        frames.append(labels[idx[..., 0], idx[..., 1], idx[..., 2]])
    return np.stack(frames).astype(np.uint8)


def _code(code):
    from pydicom.sr.coding import Code

    return Code(code[1], code[0], code[2])


def save_dicom_seg(labels: np.ndarray, affine: np.ndarray, source_folder, out, segments: List[dict], *,
                   algorithm: str, version: str, overwrite: bool = False, notes: Optional[list] = None) -> Path:
    """Write ``labels`` (label value per voxel; x, y, z on ``affine``'s grid) as a DICOM
    Segmentation of the series in ``source_folder``. ``segments``: dicts with ``name`` (the query),
    ``value`` and optionally ``term`` (:class:`medvolcore.terminology.Term`). ``notes`` (a list)
    gets a line per segment coded generically. Written atomically."""
    try:
        import highdicom as hd
        from pydicom.sr.codedict import codes
    except ImportError:
        from .errors import DependencyError

        raise DependencyError("writing a DICOM Segmentation (.dcm) needs highdicom: pip install 'medvolcore[dicom]' "
                              "(or highdicom>=0.27); .seg.nrrd and .nii.gz need nothing more") from None

    from .fileio import atomic_path
    from .terminology import generic

    datasets = source_datasets(source_folder)
    frames = frames_from_mask(np.asarray(labels), affine, datasets)
    descriptions, values = [], []
    for i, seg in enumerate(segments, start=1):
        term = seg.get("term") or generic(i)
        query = " ".join(str(seg["name"]).split())
        short = query.replace("\\", "/")  # SegmentLabel is a DICOM LO: no backslash, 64 characters at most
        label = short if len(short) <= MAX_LABEL else short[: MAX_LABEL - 1] + "…"
        desc = hd.seg.SegmentDescription(
            segment_number=i, segment_label=label, segmented_property_category=_code(term.category),
            segmented_property_type=_code(term.type), algorithm_type=hd.seg.SegmentAlgorithmTypeValues.AUTOMATIC,
            algorithm_identification=hd.AlgorithmIdentificationSequence(
                name=algorithm[:64], family=codes.cid7162.ArtificialIntelligence, version=version[:64]),
            anatomic_regions=[_code(term.region)] if term.region else None,
            display_color=hd.color.CIELabColor.from_rgb(*term.color))
        desc.SegmentDescription = query[:1024]
        if term.modifier:
            from pydicom.dataset import Dataset

            mod = Dataset()
            mod.CodeValue, mod.CodingSchemeDesignator, mod.CodeMeaning = term.modifier[1], term.modifier[0], \
                term.modifier[2]
            desc.SegmentedPropertyTypeCodeSequence[0].SegmentedPropertyTypeModifierCodeSequence = [mod]
        if term.how == "generic" and notes is not None:
            notes.append(f"DICOM-SEG segment {i} ('{label}') has the generic code 'Anatomical structure': {term.note}")
        descriptions.append(desc)
        values.append(int(seg["value"]))
    # one binary frame set per segment, in segment order: (frames, rows, cols, segments)
    pixel = np.stack([(frames == v) for v in values], axis=-1).astype(np.uint8)
    ref = datasets[0]
    seg_ds = hd.seg.Segmentation(
        source_images=datasets, pixel_array=pixel, segmentation_type=hd.seg.SegmentationTypeValues.BINARY,
        segment_descriptions=descriptions, series_instance_uid=hd.UID(), series_number=9901,
        sop_instance_uid=hd.UID(), instance_number=1, manufacturer="MedVol-R1 for 3D Slicer (research use only)",
        manufacturer_model_name=algorithm[:64], software_versions=version, device_serial_number="none",
        content_description="Research use only, not a medical device"[:64], series_description="MedVol segmentation",
        omit_empty_frames=False)
    if str(seg_ds.StudyInstanceUID) != str(ref.StudyInstanceUID):
        raise VolumeError("the segmentation did not keep the source study")  # highdicom's promise, checked
    out = Path(out)
    with atomic_path(out, overwrite) as tmp:
        seg_ds.save_as(str(tmp))
    return out


__all__ = ["check_dicom_source", "save_dicom_seg", "frames_from_mask", "source_datasets", "is_dicom_output"]
