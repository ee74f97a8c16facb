"""Helpers of the hostile-input probes (``@pytest.mark.probe``): payloads, process figures, checks.

The probes themselves live with the tests of the module they probe (``test_serve_probes.py``,
``test_volume_probes.py``, ``test_dicom.py``, ``test_fileio.py``, …); ``Testing/benchmarks/abuse.py`` runs
every test marked ``probe`` and prints probe → outcome. Imported by those tests as ``core.probes``
(pytest puts ``Testing/`` on ``sys.path``).
"""

from __future__ import annotations

import base64
import functools
import gzip
import json
import os
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

import medvolcore
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


# ---- memory figures of a fresh process, and gzip streams of many zeros (the readers' bombs) ------------

PACKAGE_ROOT = str(Path(medvolcore.__file__).resolve().parents[1])


def peak_mb(code: str, imports: str, timeout: float = 120, warm: Path | None = None) -> dict:
    """Run ``code`` in a fresh Python, after ``imports`` (the libraries the reader uses, so that
    ``start`` is the peak before reading), and return the peaks (MB) it recorded with
    ``mark(name)``, plus ``children``: the largest resident size of a child it waited for, and
    whatever it put in the dict ``out``. ``warm``, a small volume of the format under test, is
    read before ``start`` so that what the first read of a format imports (about 7 MB for NRRD)
    is not counted as the bomb's."""
    prelude = textwrap.dedent("""
        import json, resource, numpy
        import IMPORTS
        from medvolcore.volume import load_volume
        out = {}
        def mark(name):
            with open("/proc/self/status") as fh:
                out[name] = next(int(l.split()[1]) for l in fh if l.startswith("VmHWM:")) / 1024
        def error(call):
            try:
                call()
            except Exception as exc:
                return type(exc).__name__ + ": " + str(exc)
            return "no error"
        WARM
        mark("start")
    """).replace("IMPORTS", imports).replace("WARM", f"load_volume({str(warm)!r})" if warm else "pass")
    coda = '\nout["children"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024\nprint(json.dumps(out))\n'
    env = dict(os.environ, PYTHONPATH=PACKAGE_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code) + coda], capture_output=True,
                         text=True, timeout=timeout, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


_ZEROS = 16 << 20


@functools.lru_cache(maxsize=1)
def _zero_member() -> bytes:
    return zlib.compress(b"\0" * _ZEROS, 6, 31)  # wbits 31: a gzip member


def gzip_of(*parts) -> bytes:
    """A gzip file of ``parts``: bytes, or an int for that many zero bytes, as one gzip member
    per 16 MB of zeros (gzip readers read concatenated members as one stream; zeros compress
    about 1000:1, and are neither held in memory nor compressed again here)."""
    out, pending = [], b""
    for part in parts:
        if isinstance(part, bytes):
            pending += part
            continue
        whole, rest = divmod(part, _ZEROS)
        if whole:
            out += [zlib.compress(pending, 6, 31)] * bool(pending) + [_zero_member()] * whole
            pending = b""
        pending += b"\0" * rest
    return b"".join(out + [zlib.compress(pending, 6, 31)])
