"""Fixtures for the Slicer module's plain-Python Lib (``MedVolR1Slicer/MedVolR1SlicerLib``)."""

from __future__ import annotations

import sys
from pathlib import Path

MODULE_DIR = Path(__file__).resolve().parents[2] / "MedVolR1Slicer"
if str(MODULE_DIR) not in sys.path:
    sys.path.insert(0, str(MODULE_DIR))  # as Slicer does: the module folder is on sys.path
