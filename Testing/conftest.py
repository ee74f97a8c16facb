"""Shared fixtures: the real CT material in ``Testing/data`` (see its README; ``$MEDVOL_REAL_DATA``
reads the same layout from elsewhere).

``Testing/`` is on ``sys.path`` (pytest puts it there for this file; said again below), so tests
import the yardsticks of ``Testing/reference`` (``reference.medsam2``, ``reference.controlled_masks``)
and the helpers of ``Testing/core`` (``core.probes``) as modules, never a script by its path."""

from __future__ import annotations

import locale
import os
import sys
import tempfile
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

# The real-MRML tier puts Slicer's own `slicer` package and stand-ins for its Qt parts into
# sys.modules, and the Qt tier also PythonQt's `qt` over PyQt5 (it changes attribute access on
# every QObject), so each runs in a pytest process of its own: `pytest Testing/slicer_mrml`,
# `pytest Testing/slicer_qt` (their shared stand-ins are in slicer_standins/).
collect_ignore = ["slicer_mrml", "slicer_qt", "slicer_standins"]

REPO = Path(__file__).resolve().parent.parent
if str(REPO / "Testing") not in sys.path:
    sys.path.insert(0, str(REPO / "Testing"))
REAL = Path(os.environ.get("MEDVOL_REAL_DATA", REPO / "Testing" / "data"))
TS = REAL / "totalsegmentator"


@pytest.fixture(scope="session", autouse=True)
def isolated_medvol_home(tmp_path_factory):
    """Tests never read or write the user's ~/.medvol and never reach the Hugging Face hub."""
    home = tmp_path_factory.mktemp("medvol_home")
    mp = pytest.MonkeyPatch()
    mp.setenv("MEDVOL_HOME", str(home))
    mp.setenv("HF_HUB_OFFLINE", "1")
    mp.delenv("MEDVOL_MODELS_JSON", raising=False)  # the shipped preset manifest, whatever the shell has set
    # temp folders of this process and of the workers it starts (some are killed on purpose) stay
    # inside pytest's own temp tree, which pytest prunes, never in the system's /tmp
    scratch = tmp_path_factory.mktemp("tmp")
    mp.setenv("TMPDIR", str(scratch))
    mp.setattr(tempfile, "tempdir", str(scratch))
    yield home
    mp.undo()


_SESSION_LOCALE = locale.setlocale(locale.LC_ALL, None)


@pytest.fixture(autouse=True)
def locale_restored():
    """GDCM's DICOM writer (SimpleITK, in this process) sets the process locale to "C" (ASCII) and
    leaves it so: every later subprocess read as text would then fail on a non-ASCII character,
    whichever test file runs next. The next test starts from the locale the session began with."""
    yield
    if locale.setlocale(locale.LC_ALL, None) != _SESSION_LOCALE:
        locale.setlocale(locale.LC_ALL, _SESSION_LOCALE)


@pytest.fixture(autouse=True)
def engine_logging_restored():
    """A server command run in-process (``medvol serve``, ``medvol mcp``) sets up its own stderr
    logging on the ``medvolcore`` logger, as its process owns stderr; the next test starts from the
    logger as it was, so a later command's one-line error is not preceded by a server's info line."""
    import logging

    log = logging.getLogger("medvolcore")
    before = (list(log.handlers), log.level, log.propagate)
    yield
    if (list(log.handlers), log.level, log.propagate) != before:
        log.handlers[:] = before[0]
        log.setLevel(before[1])
        log.propagate = before[2]


@pytest.fixture(autouse=True)
def torch_threads_restored():
    """A command run in-process sets torch's thread count (medvolcore.cpu); the next test starts
    from the count the session began with, whatever the machine's load was at that moment."""
    import sys

    torch = sys.modules.get("torch")
    before = torch.get_num_threads() if torch is not None else None
    yield
    torch = sys.modules.get("torch")
    if torch is not None:  # torch imported during the test: back to its own default, one per CPU
        torch.set_num_threads(before if before is not None else len(os.sched_getaffinity(0)))


def _require(path: Path) -> Path:
    """A test that needs a data file skips, naming it, when the file is absent (a folder given by
    ``$MEDVOL_REAL_DATA`` may hold less). The files the repository carries are checked on their own by
    ``core/test_test_data.py``, which fails instead, so a damaged checkout does not pass by skipping."""
    if not path.exists():
        pytest.skip(f"test data file not found: {path} (Testing/data in the repository, or $MEDVOL_REAL_DATA)")
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


@pytest.fixture(scope="session")
def small_ct(tmp_path_factory, ct_sm_path, seg_sm_path):
    """8 slices of the real upper-abdomen CT (every voxel kept, affine shifted accordingly)."""
    d = tmp_path_factory.mktemp("small")
    ct, seg = nib.load(str(ct_sm_path)), nib.load(str(seg_sm_path))
    k0 = 11
    aff = ct.affine.copy()
    aff[:3, 3] = ct.affine[:3, :3] @ [0, 0, k0] + ct.affine[:3, 3]
    ct_arr = np.asarray(ct.dataobj)[:, :, k0:k0 + 8]
    seg_arr = np.asarray(seg.dataobj)[:, :, k0:k0 + 8]
    nib.save(nib.Nifti1Image(ct_arr, aff, ct.header), str(d / "ct.nii.gz"))
    nib.save(nib.Nifti1Image(seg_arr, aff, seg.header), str(d / "seg.nii.gz"))
    return d / "ct.nii.gz", d / "seg.nii.gz"


def _write_dicom_series(sitk, img, folder, uid: str = "1.2.826.0.1.3680043.2.1125.7731"):
    """Write a SimpleITK 3-D image as a CT DICOM series (one file per slice, names out of order).

    GDCM's writer sets the process locale to "C" (ASCII): restored after, or every later
    subprocess read as text in this pytest process fails on a non-ASCII character."""
    import locale

    saved = locale.setlocale(locale.LC_ALL, None)
    try:
        _write_dicom_slices(sitk, img, folder, uid)
    finally:
        locale.setlocale(locale.LC_ALL, saved)


def _write_dicom_slices(sitk, img, folder, uid):
    folder.mkdir()
    writer = sitk.ImageFileWriter()
    writer.KeepOriginalImageUIDOn()
    d = img.GetDirection()
    orientation = "\\".join(str(v) for v in (d[0], d[3], d[6], d[1], d[4], d[7]))
    for k in range(img.GetDepth()):
        s = img[:, :, k]
        tags = {
            "0008|0060": "CT",
            "0008|0016": "1.2.840.10008.5.1.4.1.1.2",
            "0008|0018": f"{uid}.3.{k + 1}",
            "0020|000d": f"{uid}.1",
            "0020|000e": f"{uid}.2",
            "0020|0052": f"{uid}.4",  # FrameOfReferenceUID: a DICOM-SEG of the series shares it
            "0020|0037": orientation,
            "0020|0032": "\\".join(str(v) for v in img.TransformIndexToPhysicalPoint((0, 0, k))),
            "0020|0013": str(k + 1),
            "0018|0050": str(img.GetSpacing()[2]),
        }
        for tag, val in tags.items():
            s.SetMetaData(tag, val)
        writer.SetFileName(str(folder / f"{(k * 7) % 11:03d}_{k}.dcm"))  # file names out of order on purpose
        writer.Execute(s)


@pytest.fixture(scope="session")
def write_dicom_series():
    """``write(sitk, image, folder, uid=...)``: a DICOM series of a SimpleITK image."""
    return _write_dicom_series
