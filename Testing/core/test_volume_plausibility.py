"""Whether a volume looks like CT in HU (:func:`medvolcore.volume.ct_plausibility`): a label map used
as the CT, an MR-like range and an all-air volume, on real CT material; the warning in a job's
result and QC picture, ``--strict-ct`` (``strict_ct``) refusing before any model loads."""

from __future__ import annotations

import nibabel as nib
import numpy as np
import pytest
from PIL import Image

from medvolcore.cli import main
from medvolcore.errors import VolumeError
from medvolcore.jobs import SegmentOutputs, SegmentRequest, run_segment_job
from medvolcore.volume import ct_plausibility, load_volume

from core.test_jobs import BOX, calls, propagator  # noqa: F401  (fixtures)


def _save(tmp_path, name, array, like):
    img = nib.load(str(like))
    path = tmp_path / name
    nib.save(nib.Nifti1Image(array, img.affine), str(path))
    return path


def test_a_real_ct_gets_no_warning(small_ct):
    assert ct_plausibility(load_volume(small_ct[0]).array) == []


def test_a_label_map_and_an_mr_range_are_named_and_all_air_is_refused(small_ct):
    labels = np.asarray(nib.load(str(small_ct[1])).dataobj).astype(np.uint8)
    [w] = ct_plausibility(labels.astype(np.float32), "seg.nii.gz")
    assert w.startswith("seg.nii.gz does not look like CT in Hounsfield units")
    assert "no voxel below -500 HU" in w and "distinct whole values (a label map?)" in w
    ct = load_volume(small_ct[0]).array
    mr = np.round((ct - ct.min()) / np.ptp(ct) * 4095).astype(np.float32)  # 0..4095, like an MR
    [w] = ct_plausibility(mr)
    assert "values 0 to 4095: no air, the range of MR" in w and "label map" not in w
    with pytest.raises(VolumeError, match="all air"):
        ct_plausibility(np.full((8, 8, 4), -1000.0, np.float32))
    with pytest.raises(VolumeError, match="all air"):
        ct_plausibility(np.full((8, 8, 4), np.nan, np.float32))


def test_a_label_map_as_the_ct_warns_in_the_result_and_the_qc(tmp_path, small_ct, calls):  # noqa: F811
    labels = np.asarray(nib.load(str(small_ct[1])).dataobj).astype(np.uint8)
    vol = _save(tmp_path, "labels_as_ct.nii.gz", labels, small_ct[0])
    out = tmp_path / "out"
    res = run_segment_job(calls, vol, SegmentRequest(key_slice=3, boxes=[BOX]),
                          SegmentOutputs(out / "m.nii.gz", qc=out / "m.png"))
    assert res["notes"][0].startswith("labels_as_ct.nii.gz does not look like CT in Hounsfield units")
    assert "strict_ct refuses such a volume" in res["notes"][0]
    with Image.open(out / "m.png") as im:
        assert "does not look like CT" in im.text["Warning"]


def test_strict_ct_refuses_before_the_models_and_writes_nothing(tmp_path, small_ct, calls):  # noqa: F811
    labels = np.asarray(nib.load(str(small_ct[1])).dataobj).astype(np.uint8)
    vol = _save(tmp_path, "labels_as_ct.nii.gz", labels, small_ct[0])
    out = tmp_path / "out"
    with pytest.raises(VolumeError, match=r"does not look like CT.*\(refused: strict_ct\)"):
        run_segment_job(calls, vol, SegmentRequest(key_slice=3, boxes=[BOX], strict_ct=True),
                        SegmentOutputs(out / "m.nii.gz"))
    air = _save(tmp_path, "air.nii.gz", np.full((64, 64, 4), -1000, np.int16), small_ct[0])
    with pytest.raises(VolumeError, match="all air"):
        run_segment_job(calls, air, SegmentRequest(key_slice=1, boxes=[BOX]), SegmentOutputs(out / "m.nii.gz"))
    assert calls.made == [] and list(out.iterdir()) == []


def test_the_cli_option_and_the_wire_key(tmp_path, small_ct, capsys):
    labels = np.asarray(nib.load(str(small_ct[1])).dataobj).astype(np.uint8)
    vol = _save(tmp_path, "labels_as_ct.nii.gz", labels, small_ct[0])
    code = main(["propagate", "--volume", str(vol), "--slice", "3", "--box", *map(str, BOX), "--out",
                 str(tmp_path / "m.nii.gz"), "--random-weights", "0", "--image-size", "64", "--strict-ct"])
    err = capsys.readouterr().err
    assert code != 0 and "(refused: --strict-ct)" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "m.nii.gz").exists()
    req = SegmentRequest.from_wire({"op": "propagate", "anchor": {"slice": 1, "boxes": [BOX]}, "strict_ct": True})
    assert req.strict_ct is True
