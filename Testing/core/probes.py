"""Helpers of the hostile-input probes (``@pytest.mark.probe``): payloads, process figures, checks.

The probes themselves live beside the code they test (``test_serve_hardening.py``,
``test_volume_hardening.py``, ``test_cli_outputs.py``, …); ``Testing/benchmarks/abuse.py`` runs
every test marked ``probe`` and prints probe → outcome. Imported by those tests as ``core.probes``
(pytest puts ``Testing/`` on ``sys.path``).
"""

from __future__ import annotations

import base64
import gzip
import os
import zlib
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

from medvolcore.cli import main as cli_main

ANCHOR = {"schema": "medvol.anchor/1", "slice": 12, "boxes": [[30, 30, 90, 80]], "source": "user"}
LONG_ANCHOR = {"schema": "medvol.anchor/1", "slice": 56, "boxes": [[30, 30, 90, 80]], "source": "user"}


def b64(path: Path) -> str:
    return base64.b64encode(Path(path).read_bytes()).decode()


def bomb(shape=(2048, 2048, 1000), complete: bool = False) -> bytes:
    """A small .nii.gz whose header declares ``shape`` int16 voxels of value 0.

    ``complete``: the gzip stream holds every declared voxel (zeros compress about 1000:1, so
    512×512×1000 is about 0.5 MB), else only the first MB (enough for a header check).
    """
    hdr = nib.Nifti1Header()
    hdr.set_data_shape(shape)
    hdr.set_data_dtype(np.int16)
    hdr["vox_offset"] = 352
    z = zlib.compressobj(9, zlib.DEFLATED, 31)  # gzip container
    parts = [z.compress(hdr.binaryblock + b"\0" * 4)]
    left = 2 * int(np.prod(shape)) if complete else 1 << 20
    zeros = b"\0" * (16 << 20)
    while left > 0:
        parts.append(z.compress(zeros[:min(left, len(zeros))]))
        left -= len(zeros)
    parts.append(z.flush())
    return b"".join(parts)


def proc_status(pid: int, key: str) -> float:
    """A field of /proc/PID/status: memory fields in MB (VmRSS, VmHWM), counts as they are (Threads)."""
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                v = float(line.split()[1])
                return v / 1024 if key.startswith("Vm") else v
    return float("nan")


def rss_mb(pid: int) -> float:
    return proc_status(pid, "VmRSS")


heavy = pytest.mark.skipif(os.environ.get("MEDVOL_HEAVY_PROBES") != "1",
                           reason="heavy probe: run Testing/benchmarks/abuse.py (or set MEDVOL_HEAVY_PROBES=1)")


def ct_with_patient_text(src: Path, dst: Path) -> Path:
    img = nib.load(str(src))
    hdr = img.header.copy()
    hdr["descrip"] = b"DOE^JOHN 1970-01-01"
    hdr["aux_file"] = b"MRN 123456"
    hdr["intent_name"] = b"John"
    hdr["db_name"] = b"Hospital X"
    hdr.extensions.append(nib.nifti1.Nifti1Extension(2, b"DICOM header with PatientName DOE^JOHN"))
    nib.save(nib.Nifti1Image(np.asarray(img.dataobj), img.affine, header=hdr), str(dst))
    return dst


def assert_no_patient_text(mask_path: Path) -> None:
    h = nib.load(str(mask_path)).header
    for name in ("descrip", "aux_file", "intent_name", "db_name"):
        assert bytes(h[name].item()).strip(b"\0") == b"", name
    assert len(h.extensions) == 0
    raw = gzip.decompress(Path(mask_path).read_bytes()) if str(mask_path).endswith(".gz") else Path(mask_path).read_bytes()
    assert b"DOE" not in raw and b"123456" not in raw


def run_cli(capsys, *argv):
    code = cli_main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def one_line(code, err, *needles):
    assert code == 2, err
    lines = [line for line in err.strip().splitlines() if ": warning:" not in line]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[0], lines[0]
