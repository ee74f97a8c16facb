"""The DICOM conformance corpus: series made from the public files of this folder (README.md
gives their origin and licence), one small folder per case, each with what MedVol must do.

``CASES``: name → (source file, slices, edit, expected) where ``edit(ds, k)`` changes slice k
and ``expected`` is ``"read"`` (read, segmented, written as .dcm, .seg.nrrd and .nii.gz),
``"no-seg"`` (read; its DICOM-SEG is refused: the series cannot be referenced, or a gantry tilt
was resampled so no frame can lie on its slices) or the
start of the one-line refusal. :func:`build` writes a case's folder (a few tens of kB).
"""

from __future__ import annotations

import copy
import zlib
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = "1.2.826.0.1.3680043.8.498.4242"


def _pos(ds, k, step=2.5):
    ds.ImagePositionPatient = [-40.0, -30.0, 10.0 + step * k]


def _tilt(ds, k):
    ds.ImagePositionPatient = [-40.0, -30.0 + 1.5 * k, 10.0 + 2.5 * k]


def _uneven(ds, k):
    _pos(ds, k + (1 if k >= 3 else 0))


def _duplicate(ds, k):
    _pos(ds, min(k, 2))


def _blank_sop(ds, k):
    _pos(ds, k)
    ds.SOPInstanceUID = ""
    ds.SOPClassUID = ""


def _no_study(ds, k):
    _pos(ds, k)
    ds.StudyInstanceUID = ""
    ds.PatientName = ""  # an empty Type 2 attribute as well


def _float_rescale(ds, k):
    _pos(ds, k)
    ds.RescaleSlope, ds.RescaleIntercept = 1, -1024 - 0.25 * (k % 2)


def _oblique(ds, k):
    import math

    c, s = math.cos(math.radians(20)), math.sin(math.radians(20))
    ds.ImageOrientationPatient = [c, s, 0.0, -s, c, 0.0]
    ds.ImagePositionPatient = [-40.0, -30.0, 10.0 + 2.5 * k]


def _non_ascii(ds, k):
    _pos(ds, k)
    ds.SpecificCharacterSet = "ISO_IR 100"
    ds.PatientName = "Müller^Jürgen"
    ds.SeriesDescription = "Abdomen nativ ä"


def _charset_of(source: str):
    """An edit giving the slices the SpecificCharacterSet and patient name of the real file
    ``source`` (pydicom's character-set test files; written again in that set when saved)."""

    def edit(ds, k):
        import pydicom

        _pos(ds, k)
        real = pydicom.dcmread(str(HERE / source))
        ds.SpecificCharacterSet = real.SpecificCharacterSet
        if "PatientName" in real:
            ds.PatientName = real.PatientName
        if not ds.SpecificCharacterSet:  # the empty set is the default repertoire: ASCII text only
            ds.PatientName = "Anonymous^GE"
            ds.SeriesDescription = "Abdomen"

    return edit


def _localizer(ds, k):
    _pos(ds, k)
    if k == 4:  # a scout in the same series: another orientation
        ds.ImageOrientationPatient = [1, 0, 0, 0, 0, -1]
        ds.ImageType = ["ORIGINAL", "PRIMARY", "LOCALIZER"]


def _two_series(ds, k):
    _pos(ds, k % 3)
    if k >= 3:
        ds.SeriesInstanceUID = ds.SeriesInstanceUID + ".2"


def _no_geometry(ds, k):
    _pos(ds, k)
    del ds.ImageOrientationPatient  # GDCM reads it with a default orientation; a SEG cannot place its frames


def _nm_jpeg(ds, k):
    _pos(ds, k)
    ds.ImageOrientationPatient = [1, 0, 0, 0, 1, 0]


def _declared(ds, k):
    _pos(ds, k)
    ds.Rows = ds.Columns = 8192


def _spacing(ds, k):
    _pos(ds, k)
    if k == 2:
        ds.PixelSpacing = [0.7, 0.7]


def _unsigned(ds, k):
    import numpy as np

    _pos(ds, k)
    arr = ds.pixel_array.astype(np.int32)
    ds.PixelRepresentation = 0
    ds.PixelData = (arr - arr.min()).astype(np.uint16).tobytes()
    ds.RescaleIntercept = -1024


CASES = {
    "ct-explicit-le": ("CT_small.dcm", 5, _pos, "read"),
    "ct-deflate": ("CT_small.dcm", 4, _pos, "read"),
    "ct-unsigned": ("CT_small.dcm", 4, _unsigned, "read"),
    "ct-float-rescale": ("CT_small.dcm", 4, _float_rescale, "read"),
    "ct-oblique": ("CT_small.dcm", 4, _oblique, "read"),
    "ct-non-ascii": ("CT_small.dcm", 4, _non_ascii, "read"),
    "ct-blank-sop-uids": ("CT_small.dcm", 4, _blank_sop, "read"),
    "ct-empty-charset": ("CT_small.dcm", 4, _charset_of("empty_charset_LEI.dcm"), "read"),
    "ct-iso2022-japanese": ("CT_small.dcm", 4, _charset_of("chrH31.dcm"), "read"),
    "ct-iso2022-korean": ("CT_small.dcm", 4, _charset_of("chrI2.dcm"), "read"),
    "ct-gb18030": ("CT_small.dcm", 4, _charset_of("chrX2.dcm"), "read"),
    "ct-no-study-uid": ("CT_small.dcm", 4, _no_study, "no-seg"),
    "ct-no-orientation": ("CT_small.dcm", 4, _no_geometry, "no-seg"),
    "ct-enhanced-multiframe": ("CT_small.dcm", 5, _pos, "no-seg"),  # one multi-frame instance, frames reversed
    "ct-dicomdir": ("CT_small.dcm", 4, _pos, "read"),  # a DICOMDIR beside the series
    "nm-jpeg-extended-12bit": ("JPGExtended.dcm", 3, _nm_jpeg, "read"),
    "mr-rle": ("MR_small_RLE.dcm", 4, _pos, "read"),
    "mr-jpeg2000-lossless": ("MR_small_jp2klossless.dcm", 4, _pos, "read"),
    "mr-jpeg-ls-lossless": ("MR_small_jpeg_ls_lossless.dcm", 4, _pos, "read"),
    "mr-big-endian": ("MR_small_bigendian.dcm", 4, _pos, "read"),
    "ct-gantry-tilt": ("CT_small.dcm", 6, _tilt, "no-seg"),  # resampled onto an orthogonal grid
    "ct-uneven-spacing": ("CT_small.dcm", 5, _uneven, "the DICOM series is not evenly spaced"),
    "ct-duplicate-position": ("CT_small.dcm", 4, _duplicate, "two DICOM slices are at the same position"),
    "ct-localizer-mixed-in": ("CT_small.dcm", 5, _localizer, "the DICOM series mixes slice orientations"),
    "ct-two-series": ("CT_small.dcm", 6, _two_series, ""),  # GDCM's message names both series
    "ct-pixel-spacing-differs": ("CT_small.dcm", 4, _spacing, "the DICOM series mixes pixel spacings"),
    "ct-declared-size": ("CT_small.dcm", 3, _declared, "IM0000.dcm declares 8192×8192 pixels"),
}


def build(name: str, folder: Path) -> Path:
    """Write case ``name``'s series into ``folder`` (created) and return it."""
    import pydicom
    from pydicom.uid import DeflatedExplicitVRLittleEndian

    source, n, edit, _ = CASES[name]
    src = pydicom.dcmread(str(HERE / source))
    folder.mkdir(parents=True, exist_ok=True)
    datasets = []
    for k in range(n):
        ds = copy.deepcopy(src)  # a shallow copy would share the data elements that edit() changes
        uid = f"{ROOT}.{zlib.crc32(name.encode())}"
        ds.StudyInstanceUID, ds.SeriesInstanceUID, ds.FrameOfReferenceUID = uid + ".1", uid + ".2", uid + ".3"
        ds.SOPInstanceUID = f"{uid}.4.{k + 1}"
        ds.file_meta.MediaStorageSOPInstanceUID = ds.SOPInstanceUID
        ds.InstanceNumber = k + 1
        ds.SliceThickness = 2.5
        edit(ds, k)
        if name == "ct-deflate":
            ds.file_meta.TransferSyntaxUID = DeflatedExplicitVRLittleEndian
        datasets.append(ds)
    if name == "ct-enhanced-multiframe":  # the slices as one Legacy Converted Enhanced CT instance
        import highdicom as hd

        for k, ds in enumerate(datasets):  # slices told apart, stored in reverse order
            arr = ds.pixel_array.copy()
            arr[:8, :8] = 100 * k
            ds.PixelData = arr.tobytes()
        ds = hd.legacy.LegacyConvertedEnhancedCTImage(
            legacy_datasets=datasets[::-1], series_instance_uid=datasets[0].SeriesInstanceUID, series_number=1,
            sop_instance_uid=datasets[0].SOPInstanceUID + ".0", instance_number=1)
        ds.save_as(str(folder / "ENHANCED.dcm"))
        return folder
    for k, ds in enumerate(datasets):
        ds.save_as(str(folder / f"IM{k:04d}.dcm"))
    if name == "ct-dicomdir":
        import shutil

        shutil.copyfile(HERE / "DICOMDIR", folder / "DICOMDIR")
    return folder
