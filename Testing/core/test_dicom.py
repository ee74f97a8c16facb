"""A DICOM series folder as a volume (medvolcore.dicom, read through medvolcore.volume), under hostile
or broken input (probes, ``@pytest.mark.probe``): a truncated JPEG 2000 series read by GDCM within a
memory cap (second review, II.9), series that are not one evenly spaced stack (item 13), a folder
of too many files (item 3).

The memory figures come from a fresh Python process (:func:`core.probes.peak_mb`): its peak resident
size (``VmHWM``) and that of the children it waited for, in MB, each recorded with
``record_property``. Where a test also measures what the unguarded library call does (GDCM's
series scan), it does so after the guarded read in the same process, so the two peaks are comparable.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest

from medvolcore.errors import CancelledError, LimitError, VolumeError
from medvolcore.stack import AxialStack, axis_codes
from medvolcore.volume import load_volume

from core.probes import heavy, one_line, peak_mb, run_cli
from core.test_volume import _expected_ras_affine, _sitk_image


# ---- II.9: a truncated JPEG 2000 DICOM series --------------------------------------------------------

def _jpeg2000_series(folder: Path, size: int, n: int = 4, seed: int = 0) -> np.ndarray:
    """``n`` CT slices of ``size``² noise as JPEG 2000 DICOM (GDCM's lossless coder); returns the
    voxels in SimpleITK's (k, j, i) order."""
    sitk = pytest.importorskip("SimpleITK")
    arr = np.random.default_rng(seed).normal(0, 300, (n, size, size)).astype(np.int16)
    img = sitk.GetImageFromArray(arr)
    img.SetSpacing((0.7, 0.7, 2.0))
    folder.mkdir()
    w = sitk.ImageFileWriter()
    w.KeepOriginalImageUIDOn()
    w.SetImageIO("GDCMImageIO")
    w.UseCompressionOn()
    w.SetCompressor("JPEG2000")
    uid = "1.2.826.0.1.3680043.2.1125.7731.9"
    for k in range(n):
        s = img[:, :, k]
        for tag, val in {"0008|0060": "CT", "0008|0016": "1.2.840.10008.5.1.4.1.1.2", "0008|0018": f"{uid}.3.{k + 1}",
                         "0020|000d": f"{uid}.1", "0020|000e": f"{uid}.2", "0020|0037": "1\\0\\0\\0\\1\\0",
                         "0020|0032": f"0\\0\\{2.0 * k}", "0020|0013": str(k + 1)}.items():
            s.SetMetaData(tag, val)
        w.SetFileName(str(folder / f"{k:03d}.dcm"))
        w.Execute(s)
    return arr


@pytest.fixture(scope="module")
def truncated_jpeg2000(tmp_path_factory):
    """Four 512×512 JPEG 2000 CT slices cut to 80,000 bytes each, inside their pixel data (GDCM's
    header scan alone then allocates about 1.8 GB per file)."""
    folder = tmp_path_factory.mktemp("j2k") / "truncated"
    _jpeg2000_series(folder, 512)
    for f in folder.iterdir():
        assert f.stat().st_size > 80_000
        os.truncate(f, 80_000)
    return folder


@pytest.mark.probe("II.9", "four truncated 80 kB JPEG 2000 DICOM files")
def test_truncated_jpeg2000_series_is_refused_within_a_memory_cap(truncated_jpeg2000, record_property):
    fig = peak_mb(f"""
        out["error"] = error(lambda: load_volume({str(truncated_jpeg2000)!r}))
        mark("after")
    """, "SimpleITK")
    record_property("reader_rss_start_mb", round(fig["start"]))
    record_property("reader_rss_peak_mb", round(fig["after"]))
    record_property("gdcm_child_rss_peak_mb", round(fig["children"]))
    assert fig["error"].startswith("VolumeError: ") and "truncated" in fig["error"], fig["error"]
    assert fig["after"] - fig["start"] < 30, fig       # the caller's process does not grow (was +2,100 MB)
    assert fig["children"] < 600, fig                   # GDCM's child stays under its cap (start-up + 256 MB + 2x the folder)


@heavy
@pytest.mark.probe("II.9", "truncated JPEG 2000 files: GDCM's scan unguarded vs load_volume")
def test_truncated_jpeg2000_unguarded_gdcm_figure(truncated_jpeg2000, record_property):
    fig = peak_mb(f"""
        out["error"] = error(lambda: load_volume({str(truncated_jpeg2000)!r}))
        mark("guarded")
        SimpleITK.ImageSeriesReader.GetGDCMSeriesIDs({str(truncated_jpeg2000)!r})
        mark("unguarded")
    """, "SimpleITK")
    record_property("load_volume_rss_peak_mb", round(fig["guarded"]))
    record_property("gdcm_scan_unguarded_rss_peak_mb", round(fig["unguarded"]))
    assert fig["unguarded"] - fig["guarded"] > 1000, fig  # what the reader did in-process before


@pytest.mark.probe("II.9", "a valid JPEG 2000 DICOM series")
def test_valid_jpeg2000_series_reads_exactly(tmp_path, monkeypatch):
    from medvolcore import dicom

    arr = _jpeg2000_series(tmp_path / "j2k", 64, n=5)
    v = load_volume(tmp_path / "j2k")
    assert v.shape == (64, 64, 5) and v.source_format == "dicom"
    assert np.array_equal(v.array, arr.transpose(2, 1, 0).astype(np.float32))  # lossless, (k, j, i) -> (i, j, k)
    assert v.spacing == pytest.approx((0.7, 0.7, 2.0), abs=1e-4)
    with monkeypatch.context() as m:  # where RLIMIT_AS is not enforced, the same read in this process
        m.setattr(dicom, "_IN_CHILD", False)
        here = load_volume(tmp_path / "j2k")
    assert np.array_equal(here.array, v.array) and np.allclose(here.affine, v.affine)
    with pytest.raises(LimitError, match="64×64×5 = 20,480 voxels"):
        load_volume(tmp_path / "j2k", max_voxels=64 * 64 * 5 - 1)
    import threading

    cancel = threading.Event()
    cancel.set()
    with pytest.raises(CancelledError):
        load_volume(tmp_path / "j2k", cancel=cancel)


@pytest.mark.probe("II.9", "medvol info on a truncated JPEG 2000 series")
def test_cli_truncated_series_is_one_line(capsys, tmp_path):
    folder = tmp_path / "cut"
    _jpeg2000_series(folder, 64, n=3)
    for f in folder.iterdir():
        os.truncate(f, f.stat().st_size // 2)
    code, _, err = run_cli(capsys, "info", folder)
    one_line(code, err, "no file in it could be read as DICOM")


# ---- DICOM series that are not one evenly spaced stack (item 13) ---------------------------------------

@pytest.fixture
def dicom_series(tmp_path, ct_sm_path, write_dicom_series):
    sitk = pytest.importorskip("SimpleITK")
    img = sitk.ReadImage(str(ct_sm_path))
    folder = tmp_path / "series"
    write_dicom_series(sitk, sitk.Cast(img, sitk.sitkInt16), folder)
    return sitk, img, folder


def _by_position(folder):
    import SimpleITK as sitk

    r = sitk.ImageFileReader()
    pos = []
    for f in sorted(folder.iterdir()):
        r.SetFileName(str(f))
        r.ReadImageInformation()
        pos.append((float(r.GetMetaData("0020|0032").split("\\")[2]), f))
    return [f for _, f in sorted(pos)]


@pytest.mark.probe("13", "complete DICOM series: 3.000 mm")
def test_dicom_series_reads_with_its_real_spacing(dicom_series):
    _, img, folder = dicom_series
    v = load_volume(folder)
    assert v.shape == (122, 101, 30)
    assert v.spacing == pytest.approx((3.0, 3.0, 3.0), abs=1e-3)


@pytest.mark.probe("13", "DICOM series with one slice missing")
def test_dicom_gap_is_refused_and_named(dicom_series):
    _, _, folder = dicom_series
    files = _by_position(folder)
    files[14].unlink()
    with pytest.raises(VolumeError, match=r"not evenly spaced.*6\.00 mm.*3\.00 mm apart; about 1 slice missing"):
        load_volume(folder)
    from medvolcore.pipeline import as_stack

    with pytest.raises(VolumeError):
        as_stack(folder)


@pytest.mark.probe("13", "DICOM series with a duplicated position")
def test_dicom_duplicate_position_is_refused(dicom_series, write_dicom_series):
    sitk, img, folder = dicom_series
    files = _by_position(folder)
    r = sitk.ImageFileReader()
    r.SetFileName(str(files[3]))
    r.LoadPrivateTagsOn()
    one = r.Execute()
    r.SetFileName(str(files[4]))
    r.ReadImageInformation()
    one.SetMetaData("0020|0032", r.GetMetaData("0020|0032"))   # slice 3 now claims slice 4's position
    one.SetMetaData("0008|0018", "1.2.826.0.1.3680043.2.1125.7731.9.9")
    w = sitk.ImageFileWriter()
    w.KeepOriginalImageUIDOn()
    w.SetFileName(str(files[3]))
    w.Execute(one)
    with pytest.raises(VolumeError, match="same position"):
        load_volume(folder)


@pytest.mark.probe("13", "two DICOM series in one folder")
def test_dicom_two_series_in_one_folder_is_refused(tmp_path, dicom_series, write_dicom_series):
    sitk, img, folder = dicom_series
    write_dicom_series(sitk, sitk.Cast(img, sitk.sitkInt16)[:, :, :5], tmp_path / "other", uid="1.2.826.0.1.3680043.2.1125.99")
    for f in (tmp_path / "other").iterdir():
        f.rename(folder / ("b_" + f.name))
    with pytest.raises(VolumeError, match="2 DICOM series"):
        load_volume(folder)


def test_a_series_without_a_uid_among_others_is_named_not_printed_empty(tmp_path, dicom_series, write_dicom_series):
    """Anonymisation can blank the Series Instance UID: the mixed-series error then says so instead of
    listing an empty UID."""
    import pydicom

    sitk, img, folder = dicom_series
    write_dicom_series(sitk, sitk.Cast(img, sitk.sitkInt16)[:, :, :5], tmp_path / "other", uid="1.2.826.0.1.3680043.2.1125.98")
    for f in (tmp_path / "other").iterdir():
        ds = pydicom.dcmread(f)
        ds.SeriesInstanceUID = ""
        ds.save_as(folder / ("b_" + f.name))
    with pytest.raises(VolumeError) as err:
        load_volume(folder)
    msg = str(err.value)
    assert "2 DICOM series" in msg and "one with no Series Instance UID" in msg
    assert "(, " not in msg and ", )" not in msg and ", ," not in msg


@pytest.mark.probe("13", "medvol info on a gapped series")
def test_cli_dicom_gap_is_one_line(capsys, dicom_series):
    _, _, folder = dicom_series
    _by_position(folder)[20].unlink()
    code, _, err = run_cli(capsys, "info", folder)
    one_line(code, err, "not evenly spaced", "slice missing")


# ---- a folder as a volume (item 3) --------------------------------------------------------------------

@pytest.mark.probe("3", "folder of 10,001 files as a volume")
def test_folder_with_too_many_files_is_refused_before_reading(tmp_path):
    from medvolcore.volume import MAX_DICOM_FILES

    big = tmp_path / "big"
    big.mkdir()
    for i in range(MAX_DICOM_FILES + 1):
        (big / f"{i}.dcm").touch()
    t = time.perf_counter()
    with pytest.raises(LimitError, match="more than"):
        load_volume(big)
    from medvolcore.serve import file_sha256

    with pytest.raises(LimitError):
        file_sha256(big)
    assert time.perf_counter() - t < 10


# ---- a DICOM series' geometry --------------------------------------------------------------------------

def test_dicom_series_geometry_matches_nifti(tmp_path, write_dicom_series):
    sitk = pytest.importorskip("SimpleITK")
    img, arr = _sitk_image(sitk)
    write_dicom_series(sitk, img, tmp_path / "series")
    sitk.WriteImage(img, str(tmp_path / "same.nii.gz"))
    dcm = load_volume(tmp_path / "series")
    nii = load_volume(tmp_path / "same.nii.gz")  # read by nibabel
    assert dcm.source_format == "dicom"
    assert dcm.shape == nii.shape == (11, 9, 7)
    assert np.array_equal(dcm.array, arr.transpose(2, 1, 0).astype(np.float32))
    assert np.array_equal(dcm.array, nii.array)
    assert np.allclose(dcm.affine, _expected_ras_affine(img), atol=1e-4)
    assert np.allclose(dcm.affine, nii.affine, atol=1e-4)
    assert dcm.spacing == pytest.approx((0.7, 0.8, 2.5), abs=1e-4)
    # both give the same canonical stack
    assert np.array_equal(AxialStack(dcm).data, AxialStack(nii).data)
    assert axis_codes(AxialStack(dcm)) == "LSA"


def test_empty_folder_is_not_a_dicom_series(tmp_path):
    pytest.importorskip("SimpleITK")
    (tmp_path / "empty").mkdir()
    with pytest.raises(VolumeError):
        load_volume(tmp_path / "empty")
