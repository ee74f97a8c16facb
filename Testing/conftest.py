"""Shared fixtures: the real CT material in ``../shared/data/real`` (see its README)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# The real-MRML tier puts Slicer's own `slicer` package and stand-ins for its Qt parts into
# sys.modules, so it runs in a pytest process of its own: `pytest Testing/slicer_mrml`.
collect_ignore = ["slicer_mrml"]

REPO = Path(__file__).resolve().parent.parent
REAL = Path(os.environ.get("MEDVOL_REAL_DATA", REPO.parent / "shared" / "data" / "real"))
TS = REAL / "totalsegmentator"

# TotalSegmentator v2 label ids used in the tests (class_map_total_v2.json).
SPLEEN, KIDNEY_RIGHT, KIDNEY_LEFT, GALLBLADDER, LIVER, STOMACH = 1, 2, 3, 4, 5, 6
URINARY_BLADDER = 21


@pytest.fixture(scope="session", autouse=True)
def isolated_medvol_home(tmp_path_factory):
    """Tests never read or write the user's ~/.medvol and never reach the Hugging Face hub."""
    home = tmp_path_factory.mktemp("medvol_home")
    mp = pytest.MonkeyPatch()
    mp.setenv("MEDVOL_HOME", str(home))
    mp.setenv("HF_HUB_OFFLINE", "1")
    yield home
    mp.undo()


def _require(path: Path) -> Path:
    if not path.exists():
        pytest.fail(f"real test data missing: {path} (expected ../shared/data/real beside the repository, "
                    "or set MEDVOL_REAL_DATA)", pytrace=False)
    return path


@pytest.fixture(scope="session")
def real_dir() -> Path:
    return _require(REAL)


@pytest.fixture(scope="session")
def ct_path() -> Path:
    return _require(TS / "example_ct.nii.gz")


@pytest.fixture(scope="session")
def seg_path() -> Path:
    return _require(TS / "example_seg_fast_force_split.nii.gz")


@pytest.fixture(scope="session")
def ct_sm_path() -> Path:
    return _require(TS / "example_ct_sm.nii.gz")


@pytest.fixture(scope="session")
def seg_sm_path() -> Path:
    return _require(TS / "example_seg.nii.gz")
