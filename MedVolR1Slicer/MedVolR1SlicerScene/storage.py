"""Files through MRML storage nodes, and the module's temporary folder.

Files cross to the worker through MRML storage nodes (the volume out as an uncompressed NIfTI
with the node's own IJK grid, the mask back the same way), never through Slicer's Qt I/O
manager, so the same code runs in Slicer and on ``slicer-core``. MRML only, no Qt."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from typing import Optional

import slicer
import vtk

from MedVolR1SlicerLib.geometry import GeometryError


def storage_error(storage, what: str) -> OSError:
    """``what`` and the storage node's own messages, as one OSError."""
    messages = storage.GetUserMessages()
    detail = messages.GetAllMessagesAsString().strip() if messages is not None else ""
    return OSError(what + (f": {detail}" if detail else ""))


def write_volume_file(volumeNode, path: str, compress: Optional[bool] = None) -> None:
    """Write a scalar or label-map volume node to ``path`` (format from the extension:
    ``.nii``, ``.nii.gz``, ``.nrrd``, ``.mha``…) with its own IJK grid and IJK→RAS.
    ``compress``: default on for every format but ``.nii``. Raises OSError."""
    path = str(path)
    if compress is None:
        compress = not path.lower().endswith(".nii")
    storage = slicer.vtkMRMLVolumeArchetypeStorageNode()
    storage.SetFileName(path)
    storage.SetUseCompression(1 if compress else 0)
    if not storage.WriteData(volumeNode):
        raise storage_error(storage, f"could not write {volumeNode.GetName()} to {path}")


def write_segmentation_file(segmentationNode, path: str) -> None:
    """Write a segmentation node as a ``.seg.nrrd`` (compressed). Raises OSError."""
    storage = slicer.vtkMRMLSegmentationStorageNode()
    storage.SetFileName(str(path))
    storage.SetUseCompression(1)
    if not storage.WriteData(segmentationNode):
        raise storage_error(storage, f"could not write {segmentationNode.GetName()} to {path}")


def read_labelmap_file(path: str):
    """A ``vtkMRMLLabelMapVolumeNode`` read from ``path``, not added to the scene (nothing to
    remove afterwards, nothing for the user to see). Raises OSError."""
    node = slicer.vtkMRMLLabelMapVolumeNode()
    storage = slicer.vtkMRMLVolumeArchetypeStorageNode()
    storage.SetFileName(str(path))
    storage.SetSingleFile(1)
    if not os.path.isfile(str(path)) or not storage.ReadData(node) or node.GetImageData() is None:
        raise storage_error(storage, f"could not read the mask {path}")
    return node


def read_mask(path: str, volumeNode, atLeast: int = 1):
    """The worker's mask as a ``(k, j, i)`` uint8 0/1 array on ``volumeNode``'s grid: the voxels
    whose value is at least ``atLeast`` (an agreement map holds counts 0..G). A mask on any
    other grid (another shape, spacing, origin or orientation) raises GeometryError: it would
    be painted onto the wrong voxels."""
    import numpy as np

    return (read_labels(path, volumeNode) >= max(1, int(atLeast))).astype(np.uint8)


def read_labels(path: str, volumeNode):
    """The worker's label map (label *k* for query *k* of several) as a ``(k, j, i)`` array on
    ``volumeNode``'s grid; another grid raises GeometryError, as in :func:`read_mask`."""
    import numpy as np

    label = read_labelmap_file(path)
    dims = tuple(label.GetImageData().GetDimensions())
    want = tuple(volumeNode.GetImageData().GetDimensions())
    if dims != want:
        raise GeometryError(f"the mask has {dims} voxels but the volume {volumeNode.GetName()} has {want}; "
                            "was the volume changed while it was being segmented?")
    a, b = vtk.vtkMatrix4x4(), vtk.vtkMatrix4x4()
    label.GetIJKToRASMatrix(a)
    volumeNode.GetIJKToRASMatrix(b)
    a, b = slicer.util.arrayFromVTKMatrix(a), slicer.util.arrayFromVTKMatrix(b)
    # NIfTI stores the matrix in float32: allow its rounding, nothing more
    if not np.allclose(a, b, rtol=0, atol=1e-3 * max(1.0, float(np.abs(b).max()))):
        raise GeometryError(f"the mask does not lie on the grid of {volumeNode.GetName()} "
                            "(its IJK→RAS matrix differs); was the volume changed while it was being segmented?")
    return np.array(slicer.util.arrayFromVolume(label))


class ExportFolder:
    """The module's temporary folder and the volumes exported into it for the worker.

    The folder is made on first use and removed by :meth:`remove` (module cleanup) and, failing
    that, when Python exits. A volume is written again only when its node or voxels changed."""

    def __init__(self):
        self._path = None
        self._exported = {}  # volume node ID → (node, MTime, path)

    def path(self) -> str:
        if self._path is None or not os.path.isdir(self._path):
            self._path = tempfile.mkdtemp(prefix="medvol-slicer-")
            atexit.register(shutil.rmtree, self._path, True)
            self._exported = {}
        return self._path

    def export(self, volumeNode) -> str:
        """The volume as an uncompressed NIfTI the worker reads (same IJK grid and IJK→RAS;
        written again only when the node or its voxels changed). Uncompressed because it is
        read once, next door: gzip would cost seconds on a large CT for nothing."""
        mtime = max(volumeNode.GetMTime(), volumeNode.GetImageData().GetMTime())
        cached = self._exported.get(volumeNode.GetID())
        # the same node object, not only the same ID: a closed scene's IDs are given out again
        if cached and cached[0] is volumeNode and cached[1] == mtime and os.path.exists(cached[2]):
            return cached[2]
        folder = self.path()
        path = os.path.join(folder, f"{volumeNode.GetID()}.nii")
        part = os.path.join(folder, f"{volumeNode.GetID()}.part.nii")
        write_volume_file(volumeNode, part, compress=False)
        os.replace(part, path)  # the worker never sees a half-written file
        self._exported[volumeNode.GetID()] = (volumeNode, mtime, path)
        return path

    def forget_exports(self) -> None:
        """Delete the exported volumes (the scene they came from is closing)."""
        for _, _, path in self._exported.values():
            if os.path.exists(path):
                os.remove(path)
        self._exported = {}

    def remove(self) -> None:
        if self._path is not None:
            shutil.rmtree(self._path, ignore_errors=True)
        self._path = None
        self._exported = {}
