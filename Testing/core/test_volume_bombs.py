"""Memory bombs in the volume readers (second review, II.9 and II.10): a truncated JPEG 2000
DICOM series, 2-D/4-D/vector headers over ``--max-voxels``, and NIfTI header extensions.

The memory figures come from a fresh Python process (:func:`_peak_mb`): its peak resident size
(``VmHWM``) and that of the children it waited for, in MB, each recorded with
``record_property``. Where a test also measures what the unguarded library call does (GDCM's
series scan, SimpleITK's ``ReadImage``, ``nibabel.load``), it does so after the guarded read in
the same process, so the two peaks are comparable.
"""

from __future__ import annotations

import functools
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
from medvolcore.errors import CancelledError, LimitError, VolumeError
from medvolcore.volume import MAX_NIFTI_EXTENSIONS, load_label_map, load_volume

from core.probes import heavy, one_line, run_cli

PACKAGE_ROOT = str(Path(medvolcore.__file__).resolve().parents[1])


def _peak_mb(code: str, imports: str, timeout: float = 120, warm: Path | None = None) -> dict:
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


def _gzip(*parts) -> bytes:
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
    fig = _peak_mb(f"""
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
    fig = _peak_mb(f"""
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


# ---- II.10a: the voxel limit counts every dimension and component, from the header ---------------------

def _nhdr(folder: Path, name: str, sizes, kinds=None) -> Path:
    """A detached NRRD header whose data file is empty: only a header check can answer."""
    (folder / "empty.raw").touch()
    p = folder / name
    lines = ["NRRD0004", "type: short", f"dimension: {len(sizes)}", "sizes: " + " ".join(map(str, sizes)),
             "encoding: raw", "endian: little", "data file: empty.raw"]
    if kinds:
        lines.insert(4, "kinds: " + " ".join(kinds))
    p.write_text("\n".join(lines) + "\n")
    return p


def _mhd(folder: Path, name: str, sizes, channels=1) -> Path:
    """A MetaImage header whose data file exists but is empty: the header alone must be refused."""
    p = folder / name
    (folder / "empty.raw").touch()
    p.write_text(f"ObjectType = Image\nNDims = {len(sizes)}\nDimSize = {' '.join(map(str, sizes))}\n"
                 f"ElementNumberOfChannels = {channels}\nElementType = MET_SHORT\nElementDataFile = empty.raw\n")
    return p


def _nifti_header_only(folder: Path, name: str, shape) -> Path:
    """A .nii whose header declares ``shape`` int16 voxels, with none of them in the file."""
    hdr = nib.Nifti1Header()
    hdr.set_data_shape(shape)
    hdr.set_data_dtype(np.int16)
    hdr["vox_offset"] = 352
    p = folder / name
    p.write_bytes(hdr.binaryblock + b"\0" * 4)
    return p


HEADERS = {  # name: (writer, declared shape with components), every one over a limit of 2,000 voxels
    "nrrd 2-D": (lambda d: _nhdr(d, "a.nhdr", (50, 50)), "50×50 = 2,500"),
    "nrrd 4-D": (lambda d: _nhdr(d, "b.nhdr", (10, 10, 10, 3)), "10×10×10×3 = 3,000"),
    "nrrd vector": (lambda d: _nhdr(d, "c.nhdr", (3, 10, 10, 10), ["vector", "domain", "domain", "domain"]),
                    "10×10×10×3 = 3,000"),
    "mhd 4-D": (lambda d: _mhd(d, "d.mhd", (10, 10, 10, 3)), "10×10×10×3 = 3,000"),
    "mhd vector": (lambda d: _mhd(d, "e.mhd", (10, 10, 10), channels=3), "10×10×10×3 = 3,000"),
    "nifti 2-D": (lambda d: _nifti_header_only(d, "f.nii", (50, 50)), "50×50 = 2,500"),
    "nifti 4-D": (lambda d: _nifti_header_only(d, "g.nii", (10, 10, 10, 3)), "10×10×10×3 = 3,000"),
    "nifti vector": (lambda d: _nifti_header_only(d, "h.nii", (10, 10, 10, 1, 3)), "10×10×10×1×3 = 3,000"),
}


@pytest.mark.probe("II.10", "2-D/4-D/vector NRRD, MetaImage and NIfTI headers over --max-voxels")
@pytest.mark.parametrize("kind", sorted(HEADERS))
def test_voxel_limit_counts_every_dimension_and_component(tmp_path, kind):
    pytest.importorskip("SimpleITK")
    write, declared = HEADERS[kind]
    with pytest.raises(LimitError, match=f"declares {declared} voxels.*over the limit of 2,000"):
        load_volume(write(tmp_path), max_voxels=2000)


@pytest.mark.probe("II.10", "2-D/4-D/vector headers within --max-voxels")
@pytest.mark.parametrize("kind", sorted(HEADERS))
def test_not_a_3d_scalar_ct_is_refused_from_the_header(tmp_path, kind):
    pytest.importorskip("SimpleITK")
    write, _ = HEADERS[kind]
    with pytest.raises(VolumeError, match="not a 3-D scalar CT: the header declares a"):
        load_volume(write(tmp_path), max_voxels=10_000)


@pytest.mark.probe("II.10", "4-D NRRD of 256×256×128×4 zeros (67 MB) over --max-voxels")
def test_4d_nrrd_over_the_limit_is_not_read(tmp_path, record_property):
    pytest.importorskip("SimpleITK")
    sizes = (256, 256, 128, 4)
    head = ("NRRD0004\ntype: short\ndimension: 4\nsizes: " + " ".join(map(str, sizes))
            + "\nencoding: gzip\nendian: little\n\n").encode()
    p = tmp_path / "bomb4d.nrrd"
    p.write_bytes(head + _gzip(2 * int(np.prod(sizes))))
    import SimpleITK as sitk
    warm = tmp_path / "warm.nrrd"
    sitk.WriteImage(sitk.Image(4, 4, 4, sitk.sitkInt16), str(warm), True)
    fig = _peak_mb(f"""
        out["error"] = error(lambda: load_volume({str(p)!r}, max_voxels=256 * 256 * 128))
        mark("guarded")
        SimpleITK.ReadImage({str(p)!r})
        mark("unguarded")
    """, "SimpleITK", warm=warm)
    record_property("file_kb", round(p.stat().st_size / 1024))
    record_property("load_volume_rss_growth_mb", round(fig["guarded"] - fig["start"]))
    record_property("sitk_readimage_rss_growth_mb", round(fig["unguarded"] - fig["start"]))
    assert fig["error"].startswith("LimitError: bomb4d.nrrd declares 256×256×128×4"), fig["error"]
    assert fig["guarded"] - fig["start"] < 10, fig
    assert fig["unguarded"] - fig["guarded"] > 50, fig  # what the reader used to read before refusing


def test_nifti_with_a_trailing_singleton_is_still_read(tmp_path):
    data = np.arange(24, dtype=np.int16).reshape(2, 3, 4, 1, 1)
    p = tmp_path / "five.nii.gz"
    nib.save(nib.Nifti1Image(data, np.eye(4)), str(p))
    v = load_label_map(p)
    assert v.shape == (2, 3, 4) and np.array_equal(v.array, data[..., 0, 0])


# ---- II.10b: NIfTI header extensions ---------------------------------------------------------------------

def _nifti_with_extension(path: Path, esize: int, vox_offset: int) -> np.ndarray:
    """A 4×4×4 int16 .nii.gz with one extension whose header claims ``esize`` bytes, the voxels
    (1 … 64) at ``vox_offset`` and zeros up to the end of what the extension claims."""
    data = np.arange(1, 65, dtype=np.int16).reshape(4, 4, 4)
    hdr = nib.Nifti1Header()
    hdr.set_data_shape(data.shape)
    hdr.set_data_dtype(np.int16)
    hdr["vox_offset"] = vox_offset
    head = hdr.binaryblock + b"\1\0\0\0" + np.array([esize, 40], "<i4").tobytes()
    tail = max(0, len(head) + esize - 8 - vox_offset - data.nbytes)
    path.write_bytes(_gzip(head, vox_offset - len(head), data.tobytes(order="F"), tail))
    return data


@pytest.mark.probe("II.10", "NIfTI whose vox_offset leaves 64 MB of header extensions")
def test_nifti_extension_region_over_the_cap_is_refused(tmp_path):
    p = tmp_path / "ext.nii.gz"
    _nifti_with_extension(p, 64 << 20, 352 + (64 << 20))
    with pytest.raises(LimitError, match=r"67,109,216 bytes into the file, after 64\.0 MB of header extensions "
                                         rf"\(at most {MAX_NIFTI_EXTENSIONS >> 20} MB\)"):
        load_volume(p)


@pytest.mark.probe("II.10", "NIfTI extension claiming 128 MB (a 130 kB .nii.gz)")
def test_nifti_extensions_are_never_read(tmp_path, record_property):
    p = tmp_path / "esize.nii.gz"
    data = _nifti_with_extension(p, 128 << 20, 368)  # vox_offset small, the extension's claimed size huge
    warm = tmp_path / "warm.nii.gz"
    nib.save(nib.Nifti1Image(np.zeros((4, 4, 4), np.int16), np.eye(4)), str(warm))
    fig = _peak_mb(f"""
        v = load_volume({str(p)!r})
        out["values"] = v.array.ravel(order="F").tolist()
        mark("guarded")
        nibabel.load({str(p)!r})
        mark("unguarded")
    """, "nibabel", warm=warm)
    record_property("file_kb", round(p.stat().st_size / 1024))
    record_property("load_volume_rss_growth_mb", round(fig["guarded"] - fig["start"]))
    record_property("nibabel_load_rss_growth_mb", round(fig["unguarded"] - fig["start"]))
    assert fig["values"] == data.ravel(order="F").tolist()
    assert fig["guarded"] - fig["start"] < 10, fig
    assert fig["unguarded"] - fig["guarded"] > 100, fig  # what nibabel (and so the reader, before) held
