"""medvolcore.stats: a target's numbers, checked against hand-computed values."""

from __future__ import annotations

import csv
import io
import json

import numpy as np
import pytest

from medvolcore.errors import InputError
from medvolcore.stats import COLUMNS, check_stats_path, stats_text, target_stats


def test_stats_by_hand():
    affine = np.diag([2.0, 0.5, 3.0, 1.0])  # voxels of 2 × 0.5 × 3 mm = 3 mm³
    affine[:3, 3] = [10.0, -20.0, 100.0]
    hu = np.zeros((10, 10, 10), np.float32)
    mask = np.zeros_like(hu, dtype=np.uint8)
    mask[2:4, 5:10, 1:3] = 1  # 2 × 5 × 2 = 20 voxels
    hu[2:4, 5:10, 1] = 40.0
    hu[2:4, 5:10, 2] = 60.0
    s = target_stats(mask, hu, affine, "the liver", key_slice=7, key_slice_s_mm=103.0)
    assert s["voxels"] == 20 and s["volume_ml"] == pytest.approx(20 * 3 / 1000)
    assert (s["mean_hu"], s["std_hu"], s["min_hu"], s["max_hu"]) == (50.0, 10.0, 40.0, 60.0)
    assert s["bbox_ras_min"] == [14.0, -17.5, 103.0] and s["bbox_ras_max"] == [16.0, -15.5, 106.0]
    assert (s["query"], s["key_slice"], s["key_slice_s_mm"]) == ("the liver", 7, 103.0)
    empty = target_stats(np.zeros_like(mask), hu, affine, "nothing")
    assert empty["voxels"] == 0 and empty["volume_ml"] == 0 and empty["mean_hu"] is None and empty["bbox_ras_min"] is None
    with pytest.raises(InputError, match="not on one grid"):
        target_stats(mask[:5], hu, affine)


def test_stats_files():
    row = target_stats(np.ones((2, 2, 2)), np.full((2, 2, 2), 7.0), np.eye(4), "a, \"quoted\" query")
    assert json.loads(stats_text([row], "s.json")) == [row]
    got = list(csv.DictReader(io.StringIO(stats_text([row], "s.CSV"))))
    assert list(got[0]) == list(COLUMNS) and got[0]["query"] == 'a, "quoted" query' and got[0]["voxels"] == "8"
    assert got[0]["bbox_ras_max"] == "1.0 1.0 1.0" and got[0]["key_slice"] == ""
    with pytest.raises(InputError, match="--stats: write .json or .csv"):
        check_stats_path("stats.txt")


FORMULAS = ["=HYPERLINK(\"http://x\",\"liver\")", "@SUM(A1:A9)", "+1+cmd|' /C calc'!A0", "-2+3+cmd|' /C calc'!A0",
            "\t=1+1"]


@pytest.mark.probe("43.5", "--stats x.csv with queries =HYPERLINK(…), @SUM(…), +…, -…, a leading tab")
@pytest.mark.parametrize("query", FORMULAS)
def test_stats_csv_cells_are_never_formulas(query):
    row = target_stats(np.ones((2, 2, 2)), np.full((2, 2, 2), -7.0), np.diag([-1.0, -1.0, 1.0, 1.0]), query)
    got = list(csv.DictReader(io.StringIO(stats_text([row], "s.csv"))))[0]
    assert got["query"] == "'" + query
    # numbers stay numbers, negative ones included
    assert got["mean_hu"] == "-7.0" and got["bbox_ras_min"].startswith("-1.0 ") and got["voxels"] == "8"


def test_spreadsheet_cell():
    from medvolcore.stats import spreadsheet_cell

    assert [spreadsheet_cell(v) for v in ("liver", "-12.5", "-1 2 -3", "-", "=", None, 5, "-inf", "a=b")] == [
        "liver", "-12.5", "-1 2 -3", "'-", "'=", "", "5", "-inf", "a=b"]


def test_statistics_by_slab_equal_the_whole_array_ones(monkeypatch):
    import medvolcore.stats as stats

    rng = np.random.default_rng(3)
    hu = rng.normal(40, 300, size=(20, 30, 50)).astype(np.float32)
    mask = rng.random((20, 30, 50)) > 0.3
    mask[:, :, 7] = False
    affine = np.diag([0.7, 0.8, 2.5, 1.0])
    monkeypatch.setattr(stats, "_STATS_SLAB", 20 * 30 * 3)  # 3 slices a slab: 17 slabs combined
    s = target_stats(mask, hu, affine)
    v = hu[mask].astype(np.float64)
    idx = np.nonzero(mask)
    corners = [[i, j, k, 1.0] for i in (idx[0].min(), idx[0].max()) for j in (idx[1].min(), idx[1].max())
               for k in (idx[2].min(), idx[2].max())]
    ras = (affine @ np.array(corners).T).T[:, :3]
    assert (s["mean_hu"], s["std_hu"], s["min_hu"], s["max_hu"]) == tuple(
        round(float(x), 2) for x in (v.mean(), v.std(), v.min(), v.max()))
    assert s["bbox_ras_min"] == [round(float(x), 2) for x in ras.min(axis=0)]
    assert s["bbox_ras_max"] == [round(float(x), 2) for x in ras.max(axis=0)]
