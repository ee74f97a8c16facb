"""Reading volumes and writing masks (:mod:`medvolcore.volume`) under hostile or broken input:
folders of too many files, cancel while reading, a header declaring a bomb, patient text in
header fields, DICOM series that are not one evenly spaced stack (probes, as in
``test_serve_hardening.py``)."""

from __future__ import annotations

import threading
import time

import nibabel as nib
import numpy as np
import pytest

from medvolcore.errors import CancelledError, LimitError, VolumeError
from medvolcore.volume import load_volume, save_mask

from core.probes import (assert_no_patient_text, bomb, ct_with_patient_text, one_line,
                    run_cli)


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


@pytest.mark.probe("3", "cancel while reading a volume")
def test_reading_honours_cancel(ct_path):
    ev = threading.Event()
    ev.set()
    with pytest.raises(CancelledError):
        load_volume(ct_path, cancel=ev)



@pytest.mark.probe("10", "save_mask clears descrip/aux_file/intent_name/db_name")
def test_save_mask_clears_free_text_but_keeps_geometry(tmp_path, ct_sm_path):
    ct = load_volume(ct_with_patient_text(ct_sm_path, tmp_path / "named.nii.gz"))
    out = save_mask(np.zeros(ct.shape, np.uint8), ct, tmp_path / "m.nii.gz")
    assert_no_patient_text(out)
    assert np.allclose(nib.load(str(out)).affine, ct.affine)


# ---- DICOM series that are not one evenly spaced stack ---------------------------------------------

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


@pytest.mark.probe("13", "medvol info on a gapped series")
def test_cli_dicom_gap_is_one_line(capsys, dicom_series):
    _, _, folder = dicom_series
    _by_position(folder)[20].unlink()
    code, _, err = run_cli(capsys, "info", folder)
    one_line(code, err, "not evenly spaced", "slice missing")



# ---- unit-level limits --------------------------------------------------------------------------------

@pytest.mark.probe("4", "load_volume of the bomb with the default limit")
def test_voxel_limit_checked_in_the_header(tmp_path):
    p = tmp_path / "bomb.nii.gz"
    p.write_bytes(bomb())
    t = time.perf_counter()
    with pytest.raises(LimitError, match="over the limit"):
        load_volume(p, max_voxels=1024 * 1024 * 2000)
    assert time.perf_counter() - t < 1
