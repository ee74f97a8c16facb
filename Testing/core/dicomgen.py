"""Small CT series built with pydicom, varying what series from the wild vary: the character set
(missing, empty, one value, ISO 2022 with code extensions), Type 2 attributes empty or missing,
UIDs blanked, instances that disagree on the patient, study or frame of reference, positions (a
tilt, a gap, a duplicate), a rescale per slice, the transfer syntax. :func:`series_spec` is the
Hypothesis strategy; :func:`write_series` writes one spec; :func:`expected` says what a reader
must do with it (read it, or refuse it naming an attribute)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

ROWS = COLS = 32
SLICES = 5
SPACING = (0.8, 0.8, 2.0)  # mm: between columns, between rows, between slices
ROOT = "1.2.826.0.1.3680043.8.498.4242"

# (SpecificCharacterSet value or None for missing, a patient name that the set can encode)
CHARSETS = [
    (None, "Doe^John"),
    ("", "Doe^John"),
    ("ISO_IR 100", "Müller^Jürgen"),
    ("ISO_IR 192", "Иванов^Пётр"),
    (["", "ISO 2022 IR 87"], "Yamada^Tarou=山田^太郎"),
    (["ISO 2022 IR 6", "ISO 2022 IR 100"], "Lévy^Anaïs"),
    ("ISO_IR 6", "Doe^Jane"),
]
TYPE2 = ["PatientName", "PatientID", "PatientBirthDate", "PatientSex", "StudyDate", "StudyTime",
         "ReferringPhysicianName", "StudyID", "AccessionNumber", "SeriesNumber", "InstanceNumber",
         "Manufacturer", "PatientPosition"]
SYNTAXES = ["1.2.840.10008.1.2.1", "1.2.840.10008.1.2", "1.2.840.10008.1.2.2", "1.2.840.10008.1.2.5"]
DISAGREE = [None, None, None, "PatientID", "PatientName", "StudyInstanceUID", "FrameOfReferenceUID"]
POSITIONS = ["even", "even", "even", "tilt", "gap", "duplicate"]


def series_spec():
    """The Hypothesis strategy of one series' description (a dict)."""
    from hypothesis import strategies as st

    return st.fixed_dictionaries({
        "charset": st.sampled_from(range(len(CHARSETS))),
        "type2": st.dictionaries(st.sampled_from(TYPE2), st.sampled_from(["empty", "missing"]), max_size=4),
        "blank": st.lists(st.sampled_from(["SOPInstanceUID", "StudyInstanceUID", "FrameOfReferenceUID"]),
                          max_size=1, unique=True),
        "disagree": st.sampled_from(DISAGREE),
        "positions": st.sampled_from(POSITIONS),
        "rescale": st.sampled_from(["same", "per_slice"]),
        "syntax": st.sampled_from(SYNTAXES),
    })


def expected(spec: dict) -> dict:
    """``{"refused": the attribute or "gap"/"duplicate", or None; "seg": why no DICOM-SEG can be
    written (a blanked UID, a tilt), or None}``."""
    disagree = spec["disagree"]
    if disagree == "PatientName" and spec["type2"].get("PatientName"):
        disagree = None  # the other slices have no name: a name is compared only where both have one
    if disagree:
        return {"refused": disagree, "seg": None}
    if spec["positions"] in ("gap", "duplicate"):
        return {"refused": spec["positions"], "seg": None}
    blanked = [b for b in spec["blank"] if b != "SOPInstanceUID"]  # the file meta keeps the SOP Instance UID
    seg = blanked[0] if blanked else ("tilt" if spec["positions"] == "tilt" else None)
    return {"refused": None, "seg": seg}


def write_series(spec: dict, folder: Path, seed: int = 0) -> list:
    """Write the series ``spec`` describes into ``folder`` (created); returns the files written."""
    import pydicom
    from pydicom.dataset import Dataset, FileMetaDataset
    from pydicom.uid import RLELossless

    folder = Path(folder)
    folder.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    charset, name = CHARSETS[spec["charset"]]
    z = [k * SPACING[2] for k in range(SLICES)]
    if spec["positions"] == "gap":
        z[3:] = [v + SPACING[2] for v in z[3:]]
    elif spec["positions"] == "duplicate":
        z[2] = z[1]
    files = []
    for k in range(SLICES):
        meta = FileMetaDataset()
        meta.MediaStorageSOPClassUID = "1.2.840.10008.5.1.4.1.1.2"
        meta.MediaStorageSOPInstanceUID = f"{ROOT}.3.{k + 1}"
        meta.TransferSyntaxUID = spec["syntax"] if spec["syntax"] != RLELossless else "1.2.840.10008.1.2.1"
        ds = Dataset()
        ds.file_meta = meta
        if charset is not None:
            ds.SpecificCharacterSet = charset
        ds.SOPClassUID = meta.MediaStorageSOPClassUID
        ds.SOPInstanceUID = meta.MediaStorageSOPInstanceUID
        ds.Modality = "CT"
        ds.PatientName, ds.PatientID = name, "PAT-A"
        ds.PatientBirthDate, ds.PatientSex = "19700101", "O"
        ds.StudyDate, ds.StudyTime, ds.ReferringPhysicianName = "20240102", "101500", ""
        ds.StudyID, ds.AccessionNumber, ds.Manufacturer, ds.PatientPosition = "1", "ACC1", "Generated", "HFS"
        ds.SeriesNumber, ds.InstanceNumber = 3, k + 1
        ds.StudyInstanceUID, ds.SeriesInstanceUID, ds.FrameOfReferenceUID = f"{ROOT}.1", f"{ROOT}.2", f"{ROOT}.4"
        ds.ImageType = ["ORIGINAL", "PRIMARY", "AXIAL"]
        ds.ImageOrientationPatient = [1, 0, 0, 0, 1, 0]
        drift = 0.4 * k if spec["positions"] == "tilt" else 0.0
        ds.ImagePositionPatient = [-12.0, -12.0 + drift, z[k]]
        ds.PixelSpacing = [SPACING[1], SPACING[0]]
        ds.SliceThickness = SPACING[2]
        ds.Rows, ds.Columns = ROWS, COLS
        ds.SamplesPerPixel, ds.PhotometricInterpretation = 1, "MONOCHROME2"
        ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 16, 16, 15, 1
        slope, intercept = (1.0, -1024.0) if spec["rescale"] == "same" else (1.0 + 0.5 * k, -1024.0 + k)
        ds.RescaleSlope, ds.RescaleIntercept, ds.RescaleType = slope, intercept, "HU"
        hu = np.full((ROWS, COLS), -1000.0)  # air around a soft-tissue disc with a brighter core
        yy, xx = np.mgrid[:ROWS, :COLS]
        r = np.hypot(yy - ROWS / 2, xx - COLS / 2)
        hu[r < 13] = 40.0
        hu[r < 5] = 300.0
        hu += rng.integers(-30, 31, hu.shape)
        pixels = np.rint((hu - intercept) / slope).astype(np.int16)
        for attr, how in spec["type2"].items():
            if how == "missing" and attr in ds:
                del ds[attr]
            elif how == "empty":
                setattr(ds, attr, None)
        for attr in spec["blank"]:
            setattr(ds, attr, "")
        if k == SLICES - 1 and spec["disagree"]:
            other = {"PatientID": "PAT-B", "PatientName": "Other^Patient",
                     "StudyInstanceUID": f"{ROOT}.11", "FrameOfReferenceUID": f"{ROOT}.14"}[spec["disagree"]]
            setattr(ds, spec["disagree"], other)
        if spec["syntax"] == RLELossless:
            ds.compress(RLELossless, pixels, encoding_plugin="pydicom")
        else:
            ds.PixelData = pixels.tobytes()
            if spec["syntax"] == "1.2.840.10008.1.2.2":
                ds.PixelData = pixels.byteswap().tobytes()
            ds["PixelData"].VR = "OW"
        path = folder / f"slice{(k * 3) % SLICES:02d}.dcm"
        little = spec["syntax"] != "1.2.840.10008.1.2.2"
        implicit = spec["syntax"] == "1.2.840.10008.1.2"
        pydicom.dcmwrite(path, ds, implicit_vr=implicit, little_endian=little, enforce_file_format=True)
        files.append(path)
    return files
