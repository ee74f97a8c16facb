"""Everything of the MedVolR1Slicer module that is not Qt or MRML, in plain Python.

Importing this package imports neither torch, transformers, sam2 nor medvolcore: Slicer loads
every module at start-up, and these may not be installed yet.
"""

from .geometry import GeometryError, RoiBox, VolumeGeometry, anchor_from_rois, rois_from_anchor
from .session import CANCELLING, IDLE, RUNNING, Options, Session
from .client import Job, StdioWorker, WorkerError
from .remoteworker import RemoteWorker

__all__ = [
    "GeometryError", "RoiBox", "VolumeGeometry", "anchor_from_rois", "rois_from_anchor",
    "CANCELLING", "IDLE", "RUNNING", "Options", "Session",
    "Job", "RemoteWorker", "StdioWorker", "WorkerError",
]
