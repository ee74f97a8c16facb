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

What the source must give is known as soon as the series is read, before any model loads
(:func:`seg_refusal`): the record's UIDs and geometry, then a trial SEG of its first slice built in
memory (:func:`trial_refusal`), so whatever highdicom or the standard need of the source is tried
once. What can be supplied is: the SEG's text is UTF-8 whatever the source's SpecificCharacterSet
(missing, empty — the default repertoire —, ISO 2022 with code extensions), and a Type 2 patient or
study attribute the source lacks is written empty (:data:`TYPE2_COPIED`). BINARY by default;
``seg_type="labelmap"`` opts in to one LABELMAP frame set. Control and bidirectional-control
characters are removed from every text the SEG carries.
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


def check_dicom_source(volume_path, what: str = "--out", record=None) -> None:
    """A ``.dcm`` (DICOM-SEG) output needs a DICOM series folder as the volume: one clear error
    otherwise (a NIfTI, NRRD or MetaImage CT has no series to reference). ``record``: the
    volume's :class:`~medvolcore.dicomrecord.DicomRecord` when it is read already; one read from
    a private copy the worker owns (a retrieved series, a ``--data-dir`` folder's copy, removed
    since) stands for the folder."""
    if record is not None and getattr(record, "private", False):
        return
    if volume_path is None or not Path(str(volume_path)).is_dir():
        raise InputError(f"{what}: a DICOM Segmentation (.dcm) references the DICOM series it segments, so the volume "
                         "must be a DICOM series folder; for a NIfTI/NRRD/MetaImage CT write .seg.nrrd or .nii.gz")


def source_record(source):
    """The :class:`~medvolcore.dicomrecord.DicomRecord` of ``source`` (a volume read from a DICOM
    folder, or the record itself): what was read, never a second read of the folder."""
    from .dicomrecord import DicomRecord

    record = source if isinstance(source, DicomRecord) else getattr(source, "dicom", None)
    if record is None:
        raise InputError("a DICOM Segmentation (.dcm) references the DICOM series it segments, so the volume must be "
                         "read from a DICOM series folder; for a NIfTI/NRRD/MetaImage CT write .seg.nrrd or .nii.gz")
    return record


def seg_refusal(source) -> Optional[str]:
    """Why a DICOM Segmentation of ``source`` (a volume or its record) cannot be written, or None;
    known as soon as the series is read, before any model loads."""
    record = getattr(source, "dicom", source)
    if record is None:
        return "the volume was not read from a DICOM series folder"
    return record.seg_refusal() or trial_refusal(record)


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


def referenceable_outputs(outputs, volume):
    """``(outputs, notes)``: ``outputs`` (a :class:`medvolcore.jobs.SegmentOutputs`) without the
    DICOM-SEG outputs that the series ``volume`` was read from cannot be referenced by (no Study
    or Series Instance UID: :func:`seg_refusal`), and a note for each. Known once the series is
    read, before any model loads; refused (one line) when no mask output is left."""
    from dataclasses import replace

    kept, refused = [], []
    for path in outputs.masks:
        why = seg_refusal(volume) if is_dicom_output(path) else None
        if why:
            refused.append(f"{outputs.names[0]} {path} was not written: {why}; the other outputs were")
        else:
            kept.append(path)
    if not refused:
        return outputs, []
    if not kept:
        raise InputError(f"{outputs.names[0]} {outputs.masks[0]}: {seg_refusal(volume)}; write .seg.nrrd or .nii.gz "
                         "instead")
    return replace(outputs, mask=kept if len(kept) > 1 else kept[0]), refused


def _label(query: str) -> str:
    """SegmentLabel (a DICOM LO): no backslash, no control character, 64 characters at most."""
    short = _clean(query).replace("\\", "/")
    return short if len(short) <= MAX_LABEL else short[: MAX_LABEL - 1] + "…"


def _text(value, limit: int) -> str:
    return _clean(value)[:limit]


SEG_TYPES = ("binary", "labelmap")  # --seg-type: BINARY (every reader takes it) or one LABELMAP frame set (opt-in)
# bidirectional-text controls (LRM, RLM, ALM, the embeddings, overrides and isolates): they reorder what a reader
# shows, so a label could display as another; removed from SEG text like the other control characters
_BIDI = dict.fromkeys([0x061C, 0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x2066, 0x206A)])


def _clean(text) -> str:
    """One line of text for a DICOM string: control and bidirectional-control characters removed,
    runs of white space made one space."""
    s = "".join(ch for ch in str(text or "").translate(_BIDI) if ch.isprintable() or ch.isspace())
    return " ".join(s.split())


# Type 2 attributes of the patient and study a SEG copies from its source: present, empty allowed; a source that
# lacks one (an anonymiser deleted it) gets it empty, as the standard's "unknown"
TYPE2_COPIED = ("PatientName", "PatientID", "PatientBirthDate", "PatientSex", "AccessionNumber", "StudyID",
                "StudyDate", "StudyTime", "ReferringPhysicianName")


def _supplied(ds):
    """A copy of the source header ``ds`` with the Type 2 attributes of :data:`TYPE2_COPIED` it
    lacks supplied empty."""
    from copy import deepcopy

    out = deepcopy(ds)
    for name in TYPE2_COPIED:
        if name not in out:
            setattr(out, name, None)
    return out


def _segmentation(datasets, frames: np.ndarray, segments: List[dict], *, algorithm: str, version: str,
                  notes: Optional[list] = None, seg_type: str = "binary"):
    """The highdicom Segmentation of ``frames`` (label values, one frame per dataset of ``datasets``)."""
    import highdicom as hd
    from pydicom.sr.codedict import codes
    from pydicom.uid import ExplicitVRLittleEndian, RLELossless

    from .terminology import generic

    descriptions, values = [], []
    for i, seg in enumerate(segments, start=1):
        term = seg.get("term") or generic(i)
        query = _clean(seg["name"]) or f"Segment_{i}"
        label = _label(query)
        desc = hd.seg.SegmentDescription(
            segment_number=i, segment_label=label, segmented_property_category=_code(term.category),
            segmented_property_type=_code(term.type), algorithm_type=hd.seg.SegmentAlgorithmTypeValues.AUTOMATIC,
            algorithm_identification=hd.AlgorithmIdentificationSequence(
                name=_clean(algorithm)[:64], family=codes.cid7162.ArtificialIntelligence,
                version=_clean(version)[:64]),
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
    as_labelmap = getattr(hd.seg.SegmentationTypeValues, "LABELMAP", None) if seg_type == "labelmap" else None
    if seg_type == "labelmap" and as_labelmap is None:
        raise InputError("a LABELMAP DICOM Segmentation needs highdicom>=0.24; write the default BINARY one")
    if as_labelmap is not None:  # one frame per source slice holding every segment's number
        pixel = np.zeros(frames.shape, np.uint8)
        for number, v in enumerate(values, start=1):
            pixel[frames == v] = number
        kind, syntax = as_labelmap, RLELossless
    else:  # one binary frame set per segment, in segment order: (frames, rows, cols, segments)
        pixel = np.stack([(frames == v) for v in values], axis=-1).astype(np.uint8)
        kind, syntax = hd.seg.SegmentationTypeValues.BINARY, ExplicitVRLittleEndian
    ref = datasets[0]
    source_desc = _text(ref.get("SeriesDescription"), 40)
    seg_ds = hd.seg.Segmentation(
        source_images=[_supplied(ref)] + list(datasets[1:]), pixel_array=pixel, segmentation_type=kind,
        segment_descriptions=descriptions, series_instance_uid=hd.UID(), series_number=9901,
        sop_instance_uid=hd.UID(), instance_number=1, manufacturer="MedVol-R1 for 3D Slicer (research use only)",
        manufacturer_model_name=_clean(algorithm)[:64], software_versions=_clean(version)[:64],
        device_serial_number="none",
        content_description="AI-made, not confirmed by a person; research use only"[:64],
        content_creator_name="MedVol^AI", content_label="MEDVOL_AI",
        series_description=(f"AI seg (unconfirmed) of {source_desc}" if source_desc else
                            "AI segmentation (unconfirmed)")[:64],
        omit_empty_frames=False, transfer_syntax_uid=syntax,
        # the SEG's own text is UTF-8 whatever the source's set (missing, empty = the default repertoire, ISO 2022
        # with code extensions): pydicom decoded the source's values, so none is lost, and no '??'
        specific_character_set="ISO_IR 192")
    if str(seg_ds.StudyInstanceUID) != str(ref.StudyInstanceUID):
        raise VolumeError("the segmentation did not keep the source study")  # highdicom's promise, checked
    return seg_ds


def _one_line(exc: Exception) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 200 else text[:199] + "…"


def trial_refusal(record) -> Optional[str]:
    """Why highdicom cannot build a DICOM Segmentation of ``record``'s series, or None: a SEG of
    its first slice with every pixel set is built in memory (nothing is written), so whatever the
    source lacks that highdicom or the standard need is known before any model loads. Kept on the
    record: tried once."""
    cached = getattr(record, "_seg_trial", False)
    if cached is not False:
        return cached
    why = None
    try:
        import highdicom  # noqa: F401
    except ImportError:
        why = None  # the writer says which package is missing, in one line
    else:
        h = record.headers[0]
        try:
            frames = np.ones((1, int(h.Rows), int(h.Columns)), np.uint8)
            _segmentation(record.headers[:1], frames, [{"name": "trial", "value": 1}], algorithm="MedVol",
                          version="0", seg_type="binary")
        except Exception as exc:  # noqa: BLE001 - any reason the source cannot be referenced becomes one line
            why = f"a DICOM Segmentation cannot be built on it ({_one_line(exc)})"
    record._seg_trial = why
    return why


def save_dicom_seg(labels: np.ndarray, affine: np.ndarray, source, out, segments: List[dict], *,
                   algorithm: str, version: str, overwrite: bool = False, notes: Optional[list] = None,
                   seg_type: str = "binary") -> Path:
    """Write ``labels`` (label value per voxel; x, y, z on ``affine``'s grid) as a DICOM
    Segmentation of the series ``source`` was read from (a volume read from a DICOM folder, or its
    :class:`~medvolcore.dicomrecord.DicomRecord`): the instances it references and the patient and
    study it names are those of the record, never of a second read; a folder whose files changed
    since is refused. ``segments``: dicts with ``name`` (the query), ``value`` and optionally
    ``term`` (:class:`medvolcore.terminology.Term`). ``notes`` (a list) gets a line per segment
    coded generically. ``seg_type``: ``"binary"`` (the default: one BINARY frame set per segment,
    which every PACS, viewer and validator takes) or ``"labelmap"`` (one LABELMAP frame set holding
    every segment's number, RLE compressed: smaller, but newer than many readers). Written
    atomically, text in UTF-8 (SpecificCharacterSet ISO_IR 192)."""
    try:
        import highdicom  # noqa: F401
    except ImportError:
        from .errors import DependencyError

        raise DependencyError("writing a DICOM Segmentation (.dcm) needs highdicom: pip install 'medvolcore[dicom]' "
                              "(or highdicom>=0.27); .seg.nrrd and .nii.gz need nothing more") from None
    if seg_type not in SEG_TYPES:
        raise InputError(f"--seg-type {seg_type!r}: expected one of {', '.join(SEG_TYPES)}")

    from .fileio import atomic_path

    record = source_record(source)
    why = record.seg_refusal() or trial_refusal(record)
    if why:
        raise InputError(f"{Path(out).name}: {why}; write .seg.nrrd or .nii.gz instead")
    frames = frames_from_mask(np.asarray(labels), affine, record.headers)
    seg_ds = _segmentation(record.headers, frames, segments, algorithm=algorithm, version=version, notes=notes,
                           seg_type=seg_type)
    out = Path(out)
    record.check_unchanged()  # the instances referenced are the ones read, or nothing is written
    with atomic_path(out, overwrite) as tmp:
        seg_ds.save_as(str(tmp), enforce_file_format=True)
    return out


__all__ = ["SEG_TYPES", "check_dicom_source", "frames_from_mask", "is_dicom_output", "referenceable_outputs",
           "save_dicom_seg", "seg_refusal", "source_record", "trial_refusal"]
