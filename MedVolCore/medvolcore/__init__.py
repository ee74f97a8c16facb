"""MedVol-R1 engine: CT volumes, evidence anchors, MedSAM2 propagation.

Importing this package is cheap: torch, sam2 and SimpleITK are imported only by the
functions that use them.
"""

__version__ = "0.1.0"
