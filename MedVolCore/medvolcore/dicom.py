"""A DICOM series folder read by GDCM (through SimpleITK) in a child process of bounded memory.

GDCM allocates what a file declares before it finds the file short: a JPEG 2000 CT slice
truncated inside its pixel data makes even the header scan allocate about 1.8 GB, per file. So
on Linux every GDCM call on the folder's files runs in a child process (``python -m
medvolcore.dicom``) whose address space (``RLIMIT_AS``) is capped: its size after start-up plus
:data:`HEADER_BUDGET` and twice the folder's bytes (GDCM keeps each file it scans) while the
headers are scanned, then plus what the declared series needs
(:func:`pixel_budget`) while the voxels are decoded. An allocation over the cap fails inside the
child (GDCM skips that file, or the read fails); the caller's process never grows. Elsewhere
(no ``RLIMIT_AS``) the series is read in the calling process.

Before any voxel is decoded every file's header is read once and checked
(:func:`medvolcore.dicomrecord.scan_instances`: sizes, spacing, orientation, positions, the
declared size against the pixel data); a single enhanced multi-frame file is read as one volume
whose frames are placed by their own positions.

The child and its parent talk in JSON lines on the child's stdout: ``{"size": [I, J, K],
"components": C}`` once the headers are read, answered by ``go`` on its stdin (the parent checks
the voxel limit first and kills the child instead); then ``{"spacing", "origin", "direction",
"dtype", "shape"}`` with the voxels in the ``.npy`` file named on its command line and the record of
the instances read (:class:`~medvolcore.dicomrecord.DicomRecord`) in the ``.json`` beside it, or
``{"error": class name, "message": text}``. The parent kills the child when ``cancel`` is set.
"""

from __future__ import annotations

import json
import logging
import os
import selectors
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from .dicomrecord import DicomRecord, _identity, frame_geometry, scan_instances
from .errors import CancelledError, LimitError, VolumeError

log = logging.getLogger(__name__)

HEADER_BUDGET = 256 << 20   # bytes the child may add to its start-up size while scanning headers, plus
FOLDER_FACTOR = 2           # this many times the folder's bytes (GDCM keeps every file it scans in memory)
PIXEL_MARGIN = 512 << 20    # decode buffers of one slice and the reader's own, on top of the image
_ERRORS = {c.__name__: c for c in (VolumeError, LimitError)}
# one line per message; the child never writes more than a few hundred bytes in one
_MAX_LINE = 1 << 20
_IN_CHILD = sys.platform.startswith("linux")  # RLIMIT_AS is enforced on Linux only


def header_budget(path: Path) -> int:
    """Bytes the child may add while scanning the headers of the files in folder ``path``: GDCM
    keeps each file it scans in memory, so :data:`FOLDER_FACTOR` times their bytes (regular files
    only) plus :data:`HEADER_BUDGET`."""
    total = 0
    with os.scandir(path) as it:
        for entry in it:
            if entry.is_file(follow_symlinks=True):
                st = entry.stat(follow_symlinks=True)
                total += min(st.st_size, st.st_blocks * 512)  # a sparse file does not raise the cap
    return HEADER_BUDGET + FOLDER_FACTOR * total


def pixel_budget(size, components: int = 1) -> int:
    """Bytes the child may add while decoding a series of ``size`` voxels: the image at up to
    8 bytes per component (GDCM returns float64 for some rescales) plus :data:`PIXEL_MARGIN`."""
    return int(np.prod([int(v) for v in size], dtype=np.int64)) * int(components) * 8 + PIXEL_MARGIN


@dataclass
class Series:
    """The voxels of a series in SimpleITK's ``(k, j, i)`` order, its LPS geometry, and the
    record of the instances read (:class:`~medvolcore.dicomrecord.DicomRecord`)."""

    array: np.ndarray
    spacing: tuple
    origin: tuple
    direction: tuple
    record: Optional[DicomRecord] = None


def read_series(path: Path, check_size: Callable, cancel=None) -> Series:
    """Read the one DICOM series in folder ``path``.

    ``check_size(size, components)`` is called with the size ``(I, J, K)`` the headers declare
    (``K`` = the number of files) before any voxel is decoded; it raises to refuse the series.
    Raises :class:`VolumeError` for a folder that is not one evenly spaced series of scalar
    slices, or one that GDCM cannot read within its memory cap.
    """
    if _IN_CHILD and sys.executable:
        return _read_in_child(Path(path), check_size, cancel)
    import SimpleITK as sitk  # noqa: N813

    def _go(size, components):
        if size is not None:
            check_size(size, components)
        _check_cancel(cancel, path)

    image, record = _read_here(sitk, Path(path), _go)
    return Series(sitk.GetArrayFromImage(image), *_geometry(image), record)


# ---- what runs where GDCM runs (the child, or the caller off Linux) ------------------------------------------

def _check_cancel(cancel, path) -> None:
    if cancel is not None and cancel.is_set():
        raise CancelledError(f"reading {Path(path).name} was cancelled")


def _read_here(sitk, path: Path, go: Callable):
    """Scan the headers, call ``go(size, components)``, read and check every slice's header
    (:func:`~medvolcore.dicomrecord.scan_instances`), read the voxels: ``(image, record)``."""
    try:
        reader = sitk.ImageSeriesReader()
        series = reader.GetGDCMSeriesIDs(str(path))
        if not series:
            raise VolumeError(f"{path} is a folder without a readable DICOM series (no file in it could be read as "
                              "DICOM: not DICOM, damaged or truncated)")
        if len(series) > 1:
            named = [uid.strip() or "one with no Series Instance UID" for uid in series[:4]]
            raise VolumeError(f"{path} holds {len(series)} DICOM series ({', '.join(named)}"
                              f"{' …' if len(series) > 4 else ''}); put each series in its own folder")
        files = reader.GetGDCMSeriesFileNames(str(path), series[0])
        info = sitk.ImageFileReader()
        info.SetFileName(files[0])
        info.ReadImageInformation()
        size = info.GetSize()
        components = info.GetNumberOfComponents()
        frames = int(size[2]) if len(size) > 2 and len(files) == 1 else 1  # an enhanced multi-frame instance
        go((size[0], size[1], len(files) * frames), components)
        if components != 1:
            raise VolumeError(f"{path}: not a 3-D scalar CT: its slices have {components} components per pixel "
                              "(a colour or vector image)")
        record, float_rescale = scan_instances(path, files)  # every slice checked, its digest kept
        go(None, None)
        if record.frames is not None:  # one multi-frame file: its frames as stored, placed by their own positions
            reader = sitk.ImageFileReader()
            reader.SetFileName(files[0])
        else:
            reader.SetFileNames(files)
        if float_rescale:  # a non-integer or per-slice rescale: applied exactly, never truncated
            reader.SetOutputPixelType(sitk.sitkFloat32)
            record.notes.append("the series' rescale slope/intercept are not integers or differ between slices; "
                                "its voxels were read as floating point HU")
        image = reader.Execute()
        if record.frames is not None:
            if image.GetDimension() != 3 or image.GetSize()[2] != len(record.frames):
                raise VolumeError(f"{path}: GDCM read {image.GetSize()} voxels from a multi-frame instance of "
                                  f"{len(record.frames)} frames")
            spacing, origin, direction = frame_geometry(record)
            image.SetSpacing(spacing)
            image.SetOrigin(origin)
            image.SetDirection(direction)
        for inst in record.instances:
            if _identity(os.stat(inst.file)) != tuple(inst.identity):
                raise VolumeError(f"{Path(inst.file).name} changed while the series was being read; run again on a "
                                  "folder that nothing else writes")
        return image, record
    except (VolumeError, LimitError, CancelledError):
        raise
    except Exception as exc:  # noqa: BLE001 - SimpleITK raises RuntimeError subclasses
        text = str(exc).strip().splitlines()[-1]
        if "alloc" in text.lower():  # over the child's memory cap
            text += " (more memory than a series of this size needs: a damaged or truncated file?)"
        raise VolumeError(f"cannot read {path}: {text}") from None


def _geometry(image) -> tuple:
    """Spacing, origin and direction (LPS) of a series read by SimpleITK."""
    if image.GetNumberOfComponentsPerPixel() != 1 or image.GetDimension() != 3:
        raise VolumeError("the DICOM series is not a 3-D scalar image")
    return tuple(image.GetSpacing()), tuple(image.GetOrigin()), tuple(image.GetDirection())


# ---- the parent's side ------------------------------------------------------------------------------------

def _child_env() -> dict:
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parent.parent)  # the folder holding this package, for `-m`
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    # one thread and at most two malloc arenas: each arena reserves 64 MB of address space, and
    # GDCM decodes one slice at a time anyway
    env.update(MALLOC_ARENA_MAX="2", ITK_GLOBAL_DEFAULT_NUMBER_OF_THREADS="1", OMP_NUM_THREADS="1",
               OPENBLAS_NUM_THREADS="1")
    return env


def _message(proc, sel, path: Path, cancel) -> dict:
    """The child's next JSON line, checking ``cancel`` every 0.1 s."""
    while True:
        _check_cancel(cancel, path)
        if sel.select(timeout=0.1):
            line = proc.stdout.readline(_MAX_LINE)
            if line:
                try:
                    return json.loads(line)
                except ValueError:
                    raise VolumeError(f"cannot read {path}: the DICOM reader answered {line[:80]!r}") from None
            rc = proc.wait()
            how = f"signal {-rc}" if rc < 0 else f"exit status {rc}"
            raise VolumeError(f"cannot read {path}: the DICOM reader stopped ({how}); a damaged or truncated file?")


def _read_in_child(path: Path, check_size: Callable, cancel) -> Series:
    with tempfile.TemporaryDirectory(prefix="medvol-dicom-") as tmp:
        out = Path(tmp) / "voxels.npy"
        proc = subprocess.Popen([sys.executable, "-m", "medvolcore.dicom", str(path), str(out)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, bufsize=0,
                                env=_child_env())
        try:
            with selectors.DefaultSelector() as sel:
                sel.register(proc.stdout, selectors.EVENT_READ)
                msg = _message(proc, sel, path, cancel)
                if "size" in msg:
                    check_size(tuple(msg["size"]), int(msg["components"]))
                    try:
                        proc.stdin.write(b"go\n")
                    except BrokenPipeError:  # it stopped: the next message says how
                        pass
                    msg = _message(proc, sel, path, cancel)
            if "error" in msg:
                raise _ERRORS.get(msg["error"], VolumeError)(str(msg.get("message")))
            if "shape" not in msg:
                raise VolumeError(f"cannot read {path}: the DICOM reader answered {str(msg)[:80]}")
            proc.wait()
            shape = tuple(int(v) for v in msg["shape"])
            array = np.load(out, mmap_mode="r")
            if array.shape != shape or array.dtype.kind not in "biuf":
                raise VolumeError(f"cannot read {path}: the DICOM reader returned {array.dtype} {array.shape}")
            with open(out.with_suffix(".json"), encoding="utf-8") as fh:
                record = DicomRecord.from_json(json.load(fh))
            return Series(np.array(array), tuple(msg["spacing"]), tuple(msg["origin"]), tuple(msg["direction"]),
                          record)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            for stream in (proc.stdin, proc.stdout):
                stream.close()


# ---- the child's side ---------------------------------------------------------------------------------------

def _address_space() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise OSError("no VmSize in /proc/self/status")


def _say(obj) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _child(path: Path, out: Path) -> int:
    import resource

    import SimpleITK as sitk  # noqa: N813

    def cap(extra: int) -> None:
        """At most ``extra`` bytes more address space than now (within any hard limit already set)."""
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        soft = _address_space() + extra
        resource.setrlimit(resource.RLIMIT_AS, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))

    cap(header_budget(path))

    def go(size, components):
        nonlocal declared, comps
        if size is None:  # headers checked: allow what the declared series needs, no more
            cap(pixel_budget(declared, comps))
            return
        declared, comps = size, components
        _say({"size": [int(v) for v in size], "components": int(components)})
        if sys.stdin.readline().strip() != "go":
            raise SystemExit(0)

    declared, comps = (0, 0, 0), 1
    try:
        image, record = _read_here(sitk, path, go)
        spacing, origin, direction = _geometry(image)
        voxels = sitk.GetArrayViewFromImage(image)  # valid while `image` lives
        np.save(out, voxels)
        with open(out.with_suffix(".json"), "w", encoding="utf-8") as fh:
            json.dump(record.to_json(), fh)
    except (VolumeError, LimitError) as exc:
        _say({"error": type(exc).__name__, "message": str(exc)})
        return 0
    except MemoryError:
        _say({"error": "VolumeError", "message": f"cannot read {path}: the DICOM reader needed more memory than "
                                                 "the series' size justifies (a damaged or truncated file?)"})
        return 0
    _say({"shape": list(voxels.shape), "dtype": str(voxels.dtype), "spacing": list(spacing), "origin": list(origin),
          "direction": list(direction)})
    return 0


if __name__ == "__main__":
    sys.exit(_child(Path(sys.argv[1]), Path(sys.argv[2])))
