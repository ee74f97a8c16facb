"""MedVol-R1 in 3D Slicer: type a clinical query, click Segment, see the evidence, edit the
boxes, correct the result anywhere (boxes on any slice, positive and negative points, a slice
range), re-propagate.

This file only hosts: it holds what Slicer looks up by name — the module class, the Sample Data
registration and the names ``MedVolR1SlicerWidget``, ``MedVolR1SlicerLogic`` and
``MedVolR1SlicerTest`` — and takes them from the module's parts:

- ``MedVolR1SlicerPanel/`` (Qt): the panel, its correction controls, the install and download
  dialogs, the self-test;
- ``MedVolR1SlicerScene/`` (MRML, no Qt): the logic facade and the parts it composes (results,
  markups, views, storage, nodes, the parameter node);
- ``MedVolR1SlicerLib/`` (plain Python): the worker protocol, geometry, corrections, settings.

torch, transformers, sam2 and medvolcore are never imported here: the worker runs them in its own
process (``medvol serve``, a child process with Slicer's Python, or a remote one), and Slicer
loads this file at start-up. Needs 3D Slicer 5.10 or newer for a local worker (see
``MedVolR1SlicerLib.install``).
"""

import logging
import os

import slicer
from slicer.ScriptedLoadableModule import ScriptedLoadableModule

from MedVolR1SlicerLib.client import WorkerError
from MedVolR1SlicerLib.geometry import GeometryError
from MedVolR1SlicerLib.presets import sample_ct
from MedVolR1SlicerLib.session import Options
from MedVolR1SlicerPanel.panel import MedVolR1SlicerWidget
from MedVolR1SlicerPanel.selftest import MedVolR1SlicerTest, SelfTestWorker
from MedVolR1SlicerScene.logic import MedVolR1SlicerLogic
from MedVolR1SlicerScene.parameters import MedVolR1SlicerParameterNode
from MedVolR1SlicerScene.history import EditedSinceResult

__all__ = ["MedVolR1Slicer", "MedVolR1SlicerWidget", "MedVolR1SlicerLogic", "MedVolR1SlicerTest",
           "MedVolR1SlicerParameterNode", "SelfTestWorker", "EditedSinceResult", "GeometryError", "WorkerError",
           "Options", "registerSampleData"]


class MedVolR1Slicer(ScriptedLoadableModule):
    def __init__(self, parent):
        ScriptedLoadableModule.__init__(self, parent)
        self.parent.title = "MedVol-R1"
        self.parent.categories = ["Segmentation"]
        self.parent.dependencies = []
        self.parent.contributors = ["MedVol-R1 for 3D Slicer contributors (MedVol-R1 project)"]
        self.parent.helpText = (
            "Segment a CT from a free-form clinical query. A vision-language model (Qwen3-VL) picks a key axial "
            "slice and draws boxes on it (the evidence anchor); MedSAM2 propagates them into a 3D mask. Move a box, "
            "add boxes on other slices, place positive/negative points or limit the slice range, then click "
            "Re-propagate to correct it. Research use only, not a medical device: no trained MedVol-R1 "
            "adapter is published, so the default model answers zero-shot and will often be wrong. "
            "See docs/slicer.md in the project for set-up, weights and a remote worker.")
        self.parent.acknowledgementText = (
            "Method: MedVol-R1 (arXiv 2605.26621). Models: Qwen3-VL (Alibaba Qwen team), MedSAM2 (Bo Wang lab), "
            "SAM 2 (Meta). Research use only; not a medical device.")
        app = getattr(slicer, "app", None)
        if app is not None:  # the sample CT in Sample Data, once the Sample Data module is there
            app.connect("startupCompleted()", registerSampleData)


def registerSampleData():
    """Offer the module's small abdominal CT in the Sample Data module (category "MedVol-R1").
    It is read from the extension's own folder (a file:// URI, checked against its SHA-256), so
    nothing is downloaded."""
    sample = sample_ct()
    if sample is None:
        logging.warning("MedVol-R1: the sample CT was not found; it is not offered in Sample Data")
        return
    import SampleData

    SampleData.SampleDataLogic.registerCustomSampleDataSource(
        category="MedVol-R1",
        sampleName="MedVolAbdomenCT",
        uris=sample.path.as_uri(),
        fileNames=sample.path.name,
        nodeNames="MedVolAbdomenCT",
        thumbnailFileName=os.path.join(os.path.dirname(__file__), "Resources", "Icons", "MedVolR1Slicer.png"),
        checksums=f"SHA256:{sample.sha256}",
    )
