"""MedVol-R1 engine: CT volumes, evidence anchors, MedSAM2 propagation.

Importing this package is cheap: torch, sam2 and SimpleITK are imported only by the
functions that use them.
"""

__version__ = "0.1.0"

#: Said by every front door that shows results to people: ``medvol --help``, the QC picture, the
#: batch report, the worker's ``hello``, the Slicer panel and ``medvol-train --help``.
RESEARCH_USE_NOTICE = "Research use only — not a medical device."
