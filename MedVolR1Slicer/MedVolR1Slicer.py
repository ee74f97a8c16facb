"""MedVol-R1 in 3D Slicer: type a clinical query, click Segment, see the evidence, edit the
boxes, correct the result anywhere (boxes on any slice, positive and negative points, a slice
range), re-propagate.

A thin shell: the widget wires the panel to a parameter node and calls the logic; the logic
takes nodes and plain values, talks to the MedVol worker (``medvol serve``, a child process
with Slicer's Python, or a remote one) through ``MedVolR1SlicerLib`` and updates MRML; it never
touches the GUI. torch, transformers, sam2 and medvolcore are never imported here: the worker
runs them in its own process, and Slicer loads this file at start-up.

Needs 3D Slicer 5.10 or newer for a local worker (see ``MedVolR1SlicerLib.install``). The logic
reaches Slicer only through ``slicer.mrmlScene``, ``slicer.modules.<name>.logic()``, MRML node
and storage-node classes and ``slicer.util``'s array helpers, which 3D Slicer and the
``slicer-core`` wheel both provide, so ``Testing/slicer_mrml`` runs it against real MRML.
"""

import atexit
import contextlib
import json
import logging
import os
import shutil
import tempfile
import uuid
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import qt
import slicer
import vtk
from slicer import vtkMRMLMarkupsFiducialNode, vtkMRMLMarkupsROINode, vtkMRMLScalarVolumeNode, vtkMRMLSegmentationNode
from slicer.parameterNodeWrapper import parameterNodeWrapper
from slicer.ScriptedLoadableModule import (
    ScriptedLoadableModule,
    ScriptedLoadableModuleLogic,
    ScriptedLoadableModuleTest,
    ScriptedLoadableModuleWidget,
)
from slicer.util import VTKObservationMixin

from MedVolR1SlicerLib import install, params
from MedVolR1SlicerLib.client import WorkerError, python_for_worker
from MedVolR1SlicerLib.consensus import agreement_level, agreement_segment_name, confidence_note, confidence_text
from MedVolR1SlicerLib.corrections import (MAX_OBJECTS, CorrectionBox, CorrectionPoint, build_anchor,
                                           parse_point_label, point_label, prompts_from_anchor, range_text)
from MedVolR1SlicerLib.guibinding import GuiBinding
from MedVolR1SlicerLib.geometry import GeometryError, RoiBox, VolumeGeometry, anchor_from_rois, check_untransformed, rois_from_anchor
from MedVolR1SlicerLib.presets import model_presets, model_text, result_model_text, sample_ct
from MedVolR1SlicerLib.session import CANCELLING, IDLE, Options, Session

SETTINGS_HISTORY = "MedVolR1Slicer/QueryHistory"
POLL_MS = 100
# Node attributes of the module's ROIs (saved with the scene): the object a box is for and the
# slice it lies on (index along the volume's slice axis). A point's object and sign are its
# control-point label, "+N" or "-N" (saved in the markups file).
OBJECT_ATTR = "MedVolR1.object"
SLICE_ATTR = "MedVolR1.slice"
NEGATIVE_KEY = "N"  # toggles the sign of new points while the module is shown


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


@parameterNodeWrapper
class MedVolR1SlicerParameterNode:
    inputVolume: vtkMRMLScalarVolumeNode
    query: str = ""
    preset: str = params.DEFAULTS["preset"]
    adapter: str = ""
    device: str = params.DEFAULTS["device"]
    window: str = params.DEFAULTS["window"]
    worker: str = params.DEFAULTS["worker"]
    remoteUrl: str = params.DEFAULTS["remote_url"]
    outputSegmentation: vtkMRMLSegmentationNode
    segmentId: str = ""
    resultVolume: vtkMRMLScalarVolumeNode  # the volume the last result, its boxes and Undo belong to
    boxes: list[vtkMRMLMarkupsROINode]  # the key-slice boxes: the anchor's objects 1..N
    keySlice: int = -1  # stack z of the anchor (shown to the user)
    keySliceIJK: int = -1  # the same slice along the volume's slice axis (for re-propagation)
    reasoning: str = ""
    anchorJson: str = ""
    boxesEdited: bool = False  # boxes, corrections, points or the range changed since the result
    corrections: list[vtkMRMLMarkupsROINode]  # boxes on other slices or of new objects (prompts)
    points: vtkMRMLMarkupsFiducialNode  # "MedVol points": control points labelled +N / -N
    rangeStart: int = -1  # the slice range's ends along the volume's slice axis (-1: not set)
    rangeEnd: int = -1
    correctionObject: int = 0  # the object Add box here and new points are for (0: a new object)
    negativePoints: bool = False  # new points mark the outside of the object
    consensus: int = 1  # Advanced: answers per Segment (1: off)
    confidence: str = ""  # how sure the model was about the last result (MedVolR1SlicerLib.consensus)
    agreementSegmentId: str = ""  # the last result's "… agreement ≥ k/G" segment, if any


# ---- widget ----------------------------------------------------------------------------------

class MedVolR1SlicerWidget(ScriptedLoadableModuleWidget, VTKObservationMixin):
    """The panel. :meth:`setup` builds the Qt side (widgets, signals, the poll timer) and then
    calls :meth:`setupScene`, the part without Qt (scene observers, the parameter node, the
    button rules), which a test runs on real MRML with stand-in widgets."""

    def __init__(self, parent=None):
        ScriptedLoadableModuleWidget.__init__(self, parent)
        VTKObservationMixin.__init__(self)
        self.logic = None
        self._parameterNode = None
        self._guiBinding = GuiBinding()  # one GUI connection, also on Slicer 5.8 (no tag)
        self._timer = None
        self._history = params.QueryHistory()
        self._observedBoxes = []
        self._observedPoints = None
        self._objectChoices = None
        self._negativeShortcut = None
        self._tips = {}
        self._queryText = ""

    def setup(self):
        ScriptedLoadableModuleWidget.setup(self)
        uiWidget = slicer.util.loadUI(self.resourcePath("UI/MedVolR1Slicer.ui"))
        self.layout.addWidget(uiWidget)
        self.ui = slicer.util.childWidgetVariables(uiWidget)
        uiWidget.setMRMLScene(slicer.mrmlScene)

        descriptions = model_presets().descriptions  # Resources/models.json, as the worker reads it
        for i, name in enumerate(params.PRESETS):
            self.ui.presetComboBox.addItem(name)
            self.ui.presetComboBox.setItemData(i, descriptions.get(name, ""), qt.Qt.ToolTipRole)
        for name in params.DEVICES:
            self.ui.deviceComboBox.addItem(name)
        for name in params.WINDOWS:
            self.ui.windowComboBox.addItem(name)
        self._history = params.QueryHistory.from_json(qt.QSettings().value(SETTINGS_HISTORY, "[]"))
        self._refreshHistory()

        self.ui.segmentButton.connect("clicked(bool)", self.onSegmentButton)
        self.ui.repropagateButton.connect("clicked(bool)", self.onRepropagateButton)
        self.ui.addBoxButton.connect("clicked(bool)", self.onAddBoxButton)
        self.ui.objectComboBox.connect("activated(int)", self.onObjectChosen)
        self.ui.placePointsButton.connect("clicked(bool)", self.onPlacePointsButton)
        self.ui.negativePointsButton.connect("toggled(bool)", self.onNegativePoints)
        self.ui.setRangeStartButton.connect("clicked(bool)", lambda: self.onSetRangeEnd("start"))
        self.ui.setRangeEndButton.connect("clicked(bool)", lambda: self.onSetRangeEnd("end"))
        self.ui.clearRangeButton.connect("clicked(bool)", self.onClearRange)
        self.ui.clearCorrectionsButton.connect("clicked(bool)", self.onClearCorrections)
        self.ui.undoButton.connect("clicked(bool)", self.onUndoButton)
        self.ui.jumpButton.connect("clicked(bool)", self.onJumpButton)
        self.ui.show3DCheckBox.connect("toggled(bool)", self.onShow3D)
        self.ui.editButton.connect("clicked(bool)", self.onEditButton)
        self.ui.restartWorkerButton.connect("clicked(bool)", self.onRestartWorker)
        self.ui.historyComboBox.connect("activated(int)", self.onHistoryChosen)
        self.ui.queryEdit.connect("textChanged()", self._onQueryEdited)
        self.ui.presetComboBox.connect("currentTextChanged(QString)", lambda t: self._setParam("preset", t))
        self.ui.deviceComboBox.connect("currentTextChanged(QString)", lambda t: self._setParam("device", t))
        self.ui.windowComboBox.connect("currentTextChanged(QString)", lambda t: self._setParam("window", t))
        self.ui.adapterPathLineEdit.connect("currentPathChanged(QString)", lambda t: self._setParam("adapter", t))
        self.ui.remoteUrlLineEdit.connect("textChanged(QString)", lambda t: self._setParam("remoteUrl", t))
        self.ui.workerLocalRadioButton.connect("toggled(bool)", lambda on: self._setParam("worker", "local" if on else "remote"))
        # Esc cancels a running request while the panel has the focus (Alt+<letter> come from the
        # buttons' mnemonics; Enter in the query box runs Segment, see _onQueryEdited)
        self._cancelShortcut = qt.QShortcut(qt.QKeySequence("Esc"), self.parent)
        self._cancelShortcut.setContext(qt.Qt.WidgetWithChildrenShortcut)
        self._cancelShortcut.connect("activated()", self.onCancelShortcut)

        self._timer = qt.QTimer()
        self._timer.setInterval(POLL_MS)
        self._timer.connect("timeout()", self.onPollTimer)
        self.setupScene(MedVolR1SlicerLogic())

    def setupScene(self, logic):
        """The panel's non-Qt half: the logic, the scene observers and the parameter node."""
        self.logic = logic
        self.logic.beforeChange = self._saveEditorUndoState
        self.logic.session.state_changed.connect(self._onStateChanged)
        self.logic.session.progress.connect(self._onProgress)
        self.addObserver(slicer.mrmlScene, slicer.mrmlScene.StartCloseEvent, self.onSceneStartClose)
        self.addObserver(slicer.mrmlScene, slicer.mrmlScene.EndCloseEvent, self.onSceneEndClose)
        self.addObserver(slicer.mrmlScene, slicer.mrmlScene.NodeRemovedEvent, self.onNodeRemoved)
        interaction = self.logic._interactionNode()
        if interaction is not None:  # place mode started or ended (here, in the toolbar, by a right-click)
            self.addObserver(interaction, interaction.InteractionModeChangedEvent, self._onInteractionModeChanged)
        self.initializeParameterNode()
        self._onStateChanged(self.logic.session.state)

    def cleanup(self):
        """The module is unloaded (or reloaded) or Slicer exits: stop the worker, drop every
        observer and the GUI connection."""
        self.removeObservers()
        self._observedBoxes = []
        self._observedPoints = None
        self._removeNegativeShortcut()
        self._guiBinding.unbind()
        self._guiBinding.forget()
        self._parameterNode = None
        if self._timer is not None:
            self._timer.stop()
        if self.logic is not None:
            self.logic.beforeChange = None
            self.logic.session.state_changed.disconnect(self._onStateChanged)
            self.logic.session.progress.disconnect(self._onProgress)
            self.logic.cleanup()

    def onReload(self):
        """Developer "Reload": Slicer reloads this file only; the Lib is reloaded here first, so
        that an edited MedVolR1SlicerLib takes effect too (children before their importers)."""
        import importlib
        import sys

        for name in ("signals", "client", "presets", "session", "geometry", "corrections", "guibinding", "install",
                     "params", "batchjobs"):
            module = sys.modules.get(f"MedVolR1SlicerLib.{name}")
            if module is not None:
                importlib.reload(module)
        ScriptedLoadableModuleWidget.onReload(self)

    def enter(self):
        self.initializeParameterNode()
        self._installNegativeShortcut()

    def exit(self):
        # The GUI connection is kept while the panel is hidden: binding again on every visit
        # leaked one observer per visit on Slicer 5.10 (fixed in 5.12); setParameterNode with
        # the same node adds nothing.
        self._removeNegativeShortcut()

    def _installNegativeShortcut(self):
        """N toggles the sign of new points while the module is shown, wherever the focus is
        (a slice view, while placing points), as the Segment Editor installs its keys on the
        main window; a text box keeps its N (Qt gives typed letters to it first)."""
        if self._negativeShortcut is not None or getattr(slicer, "app", None) is None:
            return
        mainWindow = slicer.util.mainWindow()
        if mainWindow is None:  # no main window (e.g. --no-main-window)
            return
        self._negativeShortcut = qt.QShortcut(qt.QKeySequence(NEGATIVE_KEY), mainWindow)
        self._negativeShortcut.connect("activated()", self.onToggleNegative)

    def _removeNegativeShortcut(self):
        if self._negativeShortcut is not None:  # as the Segment Editor deletes its shortcuts on exit
            self._negativeShortcut.setEnabled(False)
            self._negativeShortcut.deleteLater()
            self._negativeShortcut = None

    def onSceneStartClose(self, caller, event):
        # the logic cancels the running request and forgets the scene's result (its own observer)
        self.setParameterNode(None)

    def onSceneEndClose(self, caller, event):
        if self.parent is not None and self.parent.isEntered:
            self.initializeParameterNode()

    def initializeParameterNode(self):
        self.setParameterNode(self.logic.getParameterNode())
        if not self._parameterNode.inputVolume:
            first = self.logic.firstUsableVolume()  # not a label map or a colour volume
            if first:
                self._parameterNode.inputVolume = first

    def setParameterNode(self, inputParameterNode):
        same = (inputParameterNode is not None and self._parameterNode is not None
                and inputParameterNode.parameterNode is self._parameterNode.parameterNode)
        if same:  # module re-entered: keep the connection and the observer
            self._updateGuiFromParameterNode()
            return
        if self._parameterNode:
            self._guiBinding.unbind()
            self.removeObserver(self._parameterNode, vtk.vtkCommand.ModifiedEvent, self._onParameterNodeModified)
        self._parameterNode = inputParameterNode
        if self._parameterNode:
            self._guiBinding.bind(self._parameterNode, self.ui)
            self.addObserver(self._parameterNode, vtk.vtkCommand.ModifiedEvent, self._onParameterNodeModified)
            self._updateGuiFromParameterNode()
        else:
            self._guiBinding.forget()
            self._observeBoxes([])

    def _onParameterNodeModified(self, caller=None, event=None):
        self._updateGuiFromParameterNode()

    def _setParam(self, name, value):
        if self._parameterNode is not None:
            setattr(self._parameterNode, name, value)

    @staticmethod
    def _setText(widget, attr: str, value: str) -> None:
        """Write a line edit only when its text differs: writing it on every keystroke would
        put the cursor at the end (Slicer's own GUI connectors compare first, too)."""
        if getattr(widget, attr) != value:
            setattr(widget, attr, value)

    def _updateGuiFromParameterNode(self):
        p = self._parameterNode
        if p is None:  # the scene is closing
            return
        blockers = [self.ui.queryEdit, self.ui.presetComboBox, self.ui.deviceComboBox, self.ui.windowComboBox,
                    self.ui.remoteUrlLineEdit, self.ui.adapterPathLineEdit]
        old = [w.blockSignals(True) for w in blockers]
        if self.ui.queryEdit.toPlainText() != p.query:
            self.ui.queryEdit.setPlainText(p.query)
            self._queryText = p.query
        self.ui.presetComboBox.setCurrentText(p.preset)
        self.ui.deviceComboBox.setCurrentText(p.device)
        self.ui.windowComboBox.setCurrentText(p.window)
        self._setText(self.ui.remoteUrlLineEdit, "text", p.remoteUrl)
        self._setText(self.ui.adapterPathLineEdit, "currentPath", p.adapter)
        for w, b in zip(blockers, old):
            w.blockSignals(b)
        self.ui.modelLabel.text = model_text(p.preset, p.adapter)  # zero-shot, MedVol-R1 needs an adapter, …
        # Check the radio button that should be on: in an exclusive pair, setChecked(False)
        # on the other one does nothing, so Remote could never be switched back to Local.
        radio = self.ui.workerRemoteRadioButton if p.worker == "remote" else self.ui.workerLocalRadioButton
        if not radio.checked:
            radio.setChecked(True)
        self.ui.keySliceLabel.text = self.logic.keySliceText(p)
        self.ui.reasoningEdit.setPlainText(p.reasoning)
        self.ui.confidenceLabel.text = p.confidence or "–"
        self.ui.rangeLabel.text = self.logic.rangeText(p)
        if self.ui.negativePointsButton.checked != bool(p.negativePoints):
            blocked = self.ui.negativePointsButton.blockSignals(True)
            self.ui.negativePointsButton.checked = bool(p.negativePoints)
            self.ui.negativePointsButton.blockSignals(blocked)
        self._observeBoxes(list(p.boxes) + list(p.corrections))
        self._observePoints(p.points)
        self._updateObjectChoices()
        self._updateButtons()

    def _updateObjectChoices(self):
        """The Object selector: the objects in use, the one being started, and "New object";
        rebuilt only when the list changed."""
        p = self._parameterNode
        choices = self.logic.objectChoices(p) if p is not None and p.anchorJson else [("New object", 0)]
        combo = self.ui.objectComboBox
        blocked = combo.blockSignals(True)
        if choices != self._objectChoices:
            combo.clear()
            for text, number in choices:
                combo.addItem(text, number)
            self._objectChoices = choices
        current = p.correctionObject if p is not None else 0
        numbers = [n for _, n in choices]
        combo.setCurrentIndex(numbers.index(current) if current in numbers else len(numbers) - 1)
        combo.blockSignals(blocked)

    def _updateButtons(self):
        p = self._parameterNode
        state = self.logic.session.state
        idle = state == IDLE
        self.ui.segmentButton.enabled = state != CANCELLING and (
            not idle or bool(p and p.inputVolume and p.query.strip()))
        # what a running request was started with stays as it was until it ends
        for w in (self.ui.inputVolumeSelector, self.ui.queryEdit, self.ui.historyComboBox,
                  self.ui.outputSegmentationSelector, self.ui.presetComboBox, self.ui.deviceComboBox,
                  self.ui.windowComboBox, self.ui.adapterPathLineEdit, self.ui.workerLocalRadioButton,
                  self.ui.workerRemoteRadioButton):
            w.enabled = idle
        editable = bool(p) and not self.logic.resultProblem(p)
        has_result = bool(p and p.anchorJson and p.resultVolume is not None)
        # the corrections belong to the result's volume, as the boxes do
        for w in (self.ui.addBoxButton, self.ui.objectComboBox, self.ui.placePointsButton,
                  self.ui.negativePointsButton, self.ui.setRangeStartButton, self.ui.setRangeEndButton):
            w.enabled = idle and editable
        self.ui.clearRangeButton.enabled = idle and editable and (p.rangeStart >= 0 or p.rangeEnd >= 0)
        self.ui.clearCorrectionsButton.enabled = idle and editable and self.logic.hasCorrections(p)
        placing = bool(p) and self.logic.placingPoints(p)
        if self.ui.placePointsButton.checked != placing:
            self.ui.placePointsButton.checked = placing
        self.ui.repropagateButton.enabled = (idle and editable and bool(p.boxesEdited)
                                             and any(b is not None for b in p.boxes))
        tip = self.logic.resultProblem(p) if p and p.anchorJson and not editable else ""
        self.ui.repropagateButton.toolTip = tip or ("Propagate the edited boxes and the corrections (boxes on other "
                                                    "slices, points, slice range) again and replace the segment.")
        for name in ("addBoxButton", "placePointsButton", "setRangeStartButton", "setRangeEndButton"):
            w = getattr(self.ui, name)
            usual = self._tips.setdefault(name, w.toolTip)  # the .ui's tooltip, read once
            w.toolTip = tip or usual
        self.ui.undoButton.enabled = idle and self.logic.canUndo
        self.ui.jumpButton.enabled = has_result
        has_segment = bool(p and p.outputSegmentation is not None and p.segmentId)
        self.ui.editButton.enabled = idle and has_segment
        self.ui.show3DCheckBox.enabled = p is not None and p.outputSegmentation is not None
        remote = bool(p and p.worker == "remote")
        self.ui.remoteUrlLineEdit.enabled = self.ui.remoteTokenLineEdit.enabled = remote and idle

    def _onQueryEdited(self):
        text = self.ui.queryEdit.toPlainText()
        query, submit = params.query_submitted(self._queryText, text)
        if submit:  # Enter at the end of the query: run Segment instead of starting a new line
            blocked = self.ui.queryEdit.blockSignals(True)
            self.ui.queryEdit.setPlainText(query)
            self.ui.queryEdit.blockSignals(blocked)
        self._queryText = query
        self._setParam("query", query)
        self._updateButtons()
        if submit and self.ui.segmentButton.enabled and self.logic.session.state == IDLE:
            self.onSegmentButton()

    def _refreshHistory(self):
        self.ui.historyComboBox.clear()
        self.ui.historyComboBox.addItem("")
        for q in self._history.items:
            self.ui.historyComboBox.addItem(q)

    def onHistoryChosen(self, index):
        if index > 0:
            self.ui.queryEdit.setPlainText(self._history.items[index - 1])

    # -- box observation: moving, resizing or deleting a box enables Re-propagate --
    def _observeBoxes(self, boxes):
        boxes = [b for b in boxes if b is not None]
        if boxes == self._observedBoxes:
            return
        for node in self._observedBoxes:
            for event in (vtkMRMLMarkupsROINode.PointModifiedEvent, vtk.vtkCommand.ModifiedEvent):
                self.removeObserver(node, event, self._onBoxEdited)
        self._observedBoxes = boxes
        for node in boxes:  # a drag moves the centre (point) or the size (node modified)
            for event in (vtkMRMLMarkupsROINode.PointModifiedEvent, vtk.vtkCommand.ModifiedEvent):
                self.addObserver(node, event, self._onBoxEdited)

    def _onBoxEdited(self, caller=None, event=None):
        if self._parameterNode is not None and not self._parameterNode.boxesEdited:
            self._parameterNode.boxesEdited = True
        self._updateButtons()

    def _observePoints(self, node):
        """A point placed, moved or deleted in "MedVol points" enables Re-propagate."""
        if node is self._observedPoints:
            return
        events = (vtkMRMLMarkupsFiducialNode.PointAddedEvent, vtkMRMLMarkupsFiducialNode.PointRemovedEvent,
                  vtkMRMLMarkupsFiducialNode.PointModifiedEvent)
        if self._observedPoints is not None:
            for event in events:
                self.removeObserver(self._observedPoints, event, self._onPointsEdited)
        self._observedPoints = node
        if node is not None:
            for event in events:
                self.addObserver(node, event, self._onPointsEdited)

    def _onPointsEdited(self, caller=None, event=None):
        self._onBoxEdited()
        self._updateObjectChoices()  # a point of a new object makes it an object in use

    def _onInteractionModeChanged(self, caller=None, event=None):
        self._updateButtons()

    @vtk.calldata_type(vtk.VTK_OBJECT)
    def onNodeRemoved(self, caller, event, node):
        """A box, correction box or the points node deleted by the user: drop it from its field
        (during this event Slicer's parameter node wrapper may still list it, and afterwards lists
        ``None`` in its place)."""
        p = self._parameterNode
        if p is None:
            return
        if isinstance(node, vtkMRMLMarkupsFiducialNode):
            if node is self._observedPoints:
                self._observePoints(None)
            if p.points is node:
                p.points = None
                p.boxesEdited = True
            self._updateGuiFromParameterNode()
            return
        if not isinstance(node, vtkMRMLMarkupsROINode):
            return
        for name in ("boxes", "corrections"):
            nodes = getattr(p, name)
            kept = [b for b in nodes if b is not None and b is not node]
            if len(kept) != len(nodes):
                if node in self._observedBoxes:
                    self._observedBoxes.remove(node)
                    for ev in (vtkMRMLMarkupsROINode.PointModifiedEvent, vtk.vtkCommand.ModifiedEvent):
                        self.removeObserver(node, ev, self._onBoxEdited)
                setattr(p, name, kept)
                p.boxesEdited = True
                self._updateObjectChoices()
                self._updateButtons()

    # -- running --
    def _options(self) -> Optional[Options]:
        p = self._parameterNode
        try:
            return params.options_from_panel(p.preset, p.adapter, p.device, p.window, p.worker, p.remoteUrl,
                                             self.ui.remoteTokenLineEdit.text, consensus=p.consensus)
        except ValueError as e:
            slicer.util.errorDisplay(str(e))
            return None

    def _ensureInstalled(self, options: Options) -> bool:
        if options.worker == "remote":
            return True  # the remote machine has its own environment
        plan = install.current_plan()
        if not plan.needed:
            return True
        if plan.remote_only:  # Slicer older than 5.10: pip could only fail here
            if slicer.util.confirmYesNoDisplay(plan.message(), windowTitle="MedVol-R1: this Slicer is too old"):
                self._setParam("worker", "remote")
                self.ui.advancedCollapsibleButton.collapsed = False
                self.ui.remoteUrlLineEdit.setFocus()
                self.ui.statusLabel.text = "Give the remote worker's address (and token), then click Segment."
            return False
        if not plan.steps:
            slicer.util.errorDisplay(plan.message(), windowTitle="MedVol-R1")
            return False
        if not slicer.util.confirmOkCancelDisplay(plan.message(), windowTitle="MedVol-R1: install packages"):
            return False
        slicer.app.setOverrideCursor(qt.Qt.WaitCursor)
        try:  # one dialog on failure: the helpers are asked not to show their own
            self.logic.runInstallPlan(plan, progress=self._installProgress)
        except install.InstallError as e:
            slicer.util.errorDisplay(f"Installing the MedVol-R1 packages failed: {e}", windowTitle="MedVol-R1",
                                     detailedText=e.detail)
            return False
        finally:
            slicer.app.restoreOverrideCursor()
        return not install.current_plan().needed

    def _installProgress(self, index, count, text):
        self.ui.statusLabel.text = f"Installing ({index}/{count}): {text}"
        slicer.app.processEvents()

    def onSegmentButton(self):
        session = self.logic.session
        if session.state != IDLE:
            self.logic.cancel()
            return
        p = self._parameterNode
        problem = self.logic.volumeProblem(p.inputVolume)
        if problem:
            slicer.util.errorDisplay(problem, windowTitle="MedVol-R1")
            return
        options = self._options()
        if options is None or not self._ensureInstalled(options):
            return
        self._history.add(p.query)
        qt.QSettings().setValue(SETTINGS_HISTORY, self._history.to_json())
        self._refreshHistory()
        replace = False
        existing = self.logic.existingSegmentId(p)
        if existing:
            box = qt.QMessageBox(qt.QMessageBox.Question, "MedVol-R1",
                                 f"The segmentation already has a segment named “{params.segment_name(p.query)}”.",
                                 qt.QMessageBox.NoButton, slicer.util.mainWindow())
            replaceButton = box.addButton("Replace it", qt.QMessageBox.AcceptRole)
            keepButton = box.addButton("Keep both", qt.QMessageBox.AcceptRole)
            box.addButton(qt.QMessageBox.Cancel)
            box.exec_()
            if box.clickedButton() not in (replaceButton, keepButton):
                return
            replace = box.clickedButton() == replaceButton
        try:  # the segment to replace is fixed now, whatever is edited while the worker runs
            self.logic.startSegment(p, options, self._onJobFinished, replaceExisting=replace)
        except (WorkerError, GeometryError, ValueError) as e:
            slicer.util.errorDisplay(str(e), windowTitle="MedVol-R1")
            return
        self._timer.start()

    def onRepropagateButton(self):
        options = self._options()
        if options is None:
            return
        try:
            _, notes = self.logic.startRepropagate(self._parameterNode, options, self._onJobFinished)
        except (WorkerError, GeometryError, ValueError) as e:
            slicer.util.errorDisplay(str(e), windowTitle="MedVol-R1")
            return
        if notes:
            self.ui.statusLabel.text = "; ".join(notes)
        self._timer.start()

    def onAddBoxButton(self):
        """Add box here: a box on the slice the Red view shows, for the chosen object."""
        try:
            self.logic.addBoxHere(self._parameterNode)
        except GeometryError as e:
            slicer.util.errorDisplay(str(e), windowTitle="MedVol-R1")
        self._updateGuiFromParameterNode()

    def onObjectChosen(self, index):
        if self._parameterNode is None or self._objectChoices is None or not 0 <= index < len(self._objectChoices):
            return
        try:
            self.logic.chooseObject(self._parameterNode, self._objectChoices[index][1])
        except GeometryError as e:
            slicer.util.errorDisplay(str(e), windowTitle="MedVol-R1")
        self._updateGuiFromParameterNode()

    def onPlacePointsButton(self, on=True):
        """Place points (toggles place mode; a right-click or the toolbar ends it too)."""
        p = self._parameterNode
        if self.logic.placingPoints(p):
            self.logic.stopPlacingPoints()
        else:
            try:
                self.logic.startPlacingPoints(p)
            except GeometryError as e:
                slicer.util.errorDisplay(str(e), windowTitle="MedVol-R1")
        self._updateGuiFromParameterNode()

    def onNegativePoints(self, negative):
        if self._parameterNode is not None:
            self.logic.setNegativePoints(self._parameterNode, negative)

    def onToggleNegative(self):
        """The N key: new points switch between inside (+) and outside (-)."""
        p = self._parameterNode
        if p is not None and self.ui.negativePointsButton.enabled:
            self.logic.setNegativePoints(p, not p.negativePoints)
            self.ui.statusLabel.text = "New points: " + ("outside (-)" if p.negativePoints else "inside (+)")

    def onSetRangeEnd(self, which):
        try:
            self.logic.setRangeEnd(self._parameterNode, which)
        except (GeometryError, ValueError) as e:
            slicer.util.errorDisplay(str(e), windowTitle="MedVol-R1")
        self._updateGuiFromParameterNode()

    def onClearRange(self):
        self.logic.clearRange(self._parameterNode)
        self._updateGuiFromParameterNode()

    def onClearCorrections(self):
        self.logic.clearCorrections(self._parameterNode)
        self._updateGuiFromParameterNode()

    def onUndoButton(self):
        try:
            undone = self.logic.undoLastResult()
        except EditedSinceResult as e:
            if not slicer.util.confirmYesNoDisplay(f"{e}.\n\nUndo anyway?", windowTitle="MedVol-R1: Undo"):
                return
            undone = self.logic.undoLastResult(discardEdits=True)
        if undone:
            self.ui.statusLabel.text = "The last result was taken back."
        self._updateButtons()

    def onJumpButton(self):
        self.logic.jumpToKeySlice(self._parameterNode)

    def onShow3D(self, show):
        if self._parameterNode is not None:
            self.logic.setShow3D(self._parameterNode, show)

    def onEditButton(self):
        """Open the result in the Segment Editor: its segmentation, the CT as source volume and
        the segment selected (the editor's own Undo covers what is painted there)."""
        try:
            editorNode = self.logic.segmentEditorNode(self._parameterNode)
        except ValueError as e:
            slicer.util.errorDisplay(str(e), windowTitle="MedVol-R1")
            return
        slicer.util.selectModule("SegmentEditor")
        editor = slicer.modules.segmenteditor.widgetRepresentation().self().editor
        editor.setMRMLSegmentEditorNode(editorNode)
        editor.setSegmentationNode(editorNode.GetSegmentationNode())
        editor.setSourceVolumeNode(self._parameterNode.resultVolume or self._parameterNode.inputVolume)
        editor.setCurrentSegmentID(self._parameterNode.segmentId)

    @staticmethod
    def _saveEditorUndoState(segmentationNode):
        """Before a result or Undo changes ``segmentationNode``: when the Segment Editor is
        editing it, save its undo state, so Ctrl+Z there takes the change back as well."""
        modules = getattr(slicer, "modules", None)
        if modules is None or not hasattr(modules, "segmenteditor"):
            return
        try:
            editor = modules.segmenteditor.widgetRepresentation().self().editor
            edited = editor.segmentationNode()
            if edited is not None and edited.GetID() == segmentationNode.GetID():
                editor.saveStateForUndo()
        except Exception:  # noqa: BLE001 - the editor's undo is a convenience; never block a result
            logging.exception("MedVol-R1: saving the Segment Editor's undo state failed")

    def onCancelShortcut(self):
        if self.logic.session.state != IDLE:
            self.logic.cancel()

    def onPollTimer(self):
        self.logic.poll()

    def onRestartWorker(self):
        self.logic.shutdown()
        self.ui.statusLabel.text = "Worker stopped; the next request starts a new one."

    def _onStateChanged(self, state):
        self.ui.segmentButton.text = {"idle": "&Segment", "running": "Cancel", "cancelling": "Cancelling…"}[state]
        if state == IDLE and self._timer is not None:
            self._timer.stop()
        self._updateButtons()

    def _onProgress(self, job):
        value, label = params.progress_text(job.stage, job.fraction, job.message, getattr(job, "eta_s", None))
        self.ui.progressBar.value = value
        self.ui.statusLabel.text = label

    def _onJobFinished(self, job, notes):
        if job.state == "done":
            self.ui.progressBar.value = 100
            self.ui.statusLabel.text = "Done." + ("  " + "; ".join(notes) if notes else "")
        elif job.state == "cancelled":
            self.ui.progressBar.value = 0
            reason = job.error.message if job.error is not None and job.error.message != "cancelled" else ""
            self.ui.statusLabel.text = "Cancelled." + (f" {reason[:1].upper()}{reason[1:]}." if reason else "")
        else:
            self.ui.progressBar.value = 0
            self.ui.statusLabel.text = f"Failed: {job.error.message}"
            if job.error.code == "model_not_found":
                self._offerDownload(job.request.get("preset") or self._parameterNode.preset, job.error.message)
            elif job.error.code != "worker_crashed":
                slicer.util.errorDisplay(job.error.message, windowTitle="MedVol-R1")
            else:
                slicer.util.errorDisplay(job.error.message + "\n\nSee the troubleshooting section of docs/slicer.md "
                                         "(out of memory: choose a smaller preset or device cpu).",
                                         windowTitle="MedVol-R1: the worker stopped")
        self._updateGuiFromParameterNode()

    def _offerDownload(self, preset, message):
        text = (f"{message}\n\nDownload the weights of preset '{preset}' now (several GB)?\n\n"
                + install.import_hint(preset))
        if not slicer.util.confirmOkCancelDisplay(text, windowTitle="MedVol-R1: model weights"):
            return
        cmd = install.download_command(python_for_worker(), preset)
        dialog = slicer.util.createProgressDialog(labelText=f"Downloading {preset}…", maximum=100)
        proc = qt.QProcess()
        proc.setProcessChannelMode(qt.QProcess.MergedChannels)

        def onOutput():
            text = install.qbytes_text(proc.readAll())  # a PythonQt QByteArray: .data(), not bytes()
            for line in text.replace("\r", "\n").splitlines():
                f = install.download_progress(line)
                if f is not None:
                    dialog.value = int(f * 100)
                if line.strip():
                    dialog.labelText = line.strip()[:120]
            slicer.app.processEvents()

        proc.connect("readyRead()", onOutput)
        proc.start(cmd[0], cmd[1:])
        ended = install.wait_for_process(proc, qt.QProcess.NotRunning, slicer.app.processEvents,
                                         lambda: dialog.wasCanceled)
        onOutput()  # what arrived after the last readyRead
        dialog.close()
        if not ended:
            return
        ok, why = install.download_outcome(proc, qt.QProcess, cmd)  # a process that never started is no success
        if ok:
            slicer.util.infoDisplay(f"Weights of '{preset}' are ready. Click Segment again.")
        else:
            slicer.util.errorDisplay(f"The download failed: {why}\n\n" + install.import_hint(preset))


# ---- logic -----------------------------------------------------------------------------------

@dataclass
class _Target:
    """Where a request's result goes, fixed when the request starts."""

    volume: object  # the volume that was exported (the result lies on its grid)
    segmentation: object  # None: a new segmentation
    replaceSegmentId: str  # '' : add a segment
    query: str
    generation: int  # the logic's scene count: a closed scene's result is dropped
    notes: List[str] = field(default_factory=list)


@dataclass
class _Undo:
    """What Undo takes back: the segment, the mask it held before (None: it was added) and the
    mask the result wrote (bits packed), to tell whether someone edited it since."""

    segmentation: object
    segmentId: str
    previous: object
    volume: object
    written: object
    agreementId: str = ""  # the agreement segment the result added (Undo removes it too)


class EditedSinceResult(ValueError):
    """Undo would throw away edits made to the segment after the result."""

    def __init__(self, voxels: int, segmentName: str):
        self.voxels = voxels
        super().__init__(f"“{segmentName}” was edited after the result ({voxels} voxels changed); "
                         "Undo would throw those edits away")


class MedVolR1SlicerLogic(ScriptedLoadableModuleLogic):
    """Nodes and plain values in, MRML out; no GUI. Usable from Slicer's Python console::

        logic = slicer.util.getModuleLogic("MedVolR1Slicer")
        seg, segment_id, rois, anchor = logic.segmentBlocking(volumeNode, "the organ that secretes bile")

    Files cross to the worker through MRML storage nodes (the volume out as an uncompressed
    NIfTI with the node's own IJK grid, the mask back the same way), never through Slicer's
    Qt I/O manager, so the same code runs in Slicer and on ``slicer-core``.

    ``session``: the :class:`Session` that talks to the worker. Slicer builds the logic with no
    argument, which gives :meth:`defaultSession`; a test or a script may pass its own (another
    worker command, a recording client).
    """

    def __init__(self, session: Optional[Session] = None):
        ScriptedLoadableModuleLogic.__init__(self)
        self.session = session if session is not None else self.defaultSession()
        self._tmp = None  # the module's temporary folder, made on first use (see tempDir)
        self._exported = {}  # volume node ID → (node, MTime, path)
        self._undo: Optional[_Undo] = None
        self._generation = 0  # scenes closed so far: a result started in an earlier one is dropped
        # called with a segmentation node just before a result or Undo changes it (the panel saves
        # the Segment Editor's undo state there, so Ctrl+Z in the editor takes a result back too)
        self.beforeChange = None
        scene = slicer.mrmlScene
        self._sceneObservers = [(scene, scene.AddObserver(scene.StartCloseEvent, self._onSceneStartClose))]

    @staticmethod
    def defaultSession() -> Session:
        """A local worker run by Slicer's Python (``PythonSlicer``) in Slicer's start-up environment."""
        env = None
        try:
            env = slicer.util.startupEnvironment()  # the child Python gets Slicer's clean environment
        except AttributeError:
            pass
        return Session(python=python_for_worker(), env=env)

    def getParameterNode(self):
        return MedVolR1SlicerParameterNode(super().getParameterNode())

    # -- plumbing --
    def tempDir(self) -> str:
        """The module's temporary folder: exported volumes, the pip constraints file. Removed by
        :meth:`cleanup` (module cleanup) and, failing that, when Python exits."""
        if self._tmp is None or not os.path.isdir(self._tmp):
            self._tmp = tempfile.mkdtemp(prefix="medvol-slicer-")
            atexit.register(shutil.rmtree, self._tmp, True)
            self._exported = {}
        return self._tmp

    def poll(self):
        self.session.poll(0.0)

    def cancel(self):
        self.session.cancel()

    def shutdown(self):
        """Stop the worker (the next request starts a new one); the temporary files stay."""
        self.session.shutdown()

    def _onSceneStartClose(self, caller=None, event=None):
        """The scene is closing (the next patient is coming): cancel the request that runs, and
        make sure nothing of this scene (a result, an exported volume, an Undo) reaches the next."""
        self._generation += 1
        if self.session.job is not None:
            try:
                self.session.cancel()
            except Exception:  # noqa: BLE001 - a dead worker: its job fails on its own
                logging.exception("MedVol-R1: cancelling on scene close failed")
        self._undo = None
        for _, _, path in self._exported.values():
            if os.path.exists(path):
                os.remove(path)
        self._exported = {}

    def cleanup(self):
        """Stop the worker, stop watching the scene and remove the temporary folder (the module
        is unloaded or Slicer exits)."""
        for scene, tag in self._sceneObservers:
            scene.RemoveObserver(tag)
        self._sceneObservers = []
        self.shutdown()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
        self._tmp = None
        self._exported = {}

    def runInstallPlan(self, plan, progress=None):
        """Run an :class:`install.InstallPlan` with this Slicer's pip helper (``slicer.packaging``
        on 5.12, ``slicer.util.pip_install`` on 5.10) and the PyTorch extension; raises
        :class:`install.InstallError` (one line) on the first failure."""
        install.run_plan(plan, os.path.join(self.tempDir(), "constraints.txt"), slicer.util,
                         packaging=install.slicer_packaging(), progress=progress)

    @staticmethod
    def geometry(volumeNode) -> VolumeGeometry:
        check_untransformed(volumeNode.GetParentTransformNode() is not None)
        m = vtk.vtkMatrix4x4()
        volumeNode.GetIJKToRASMatrix(m)
        return VolumeGeometry(slicer.util.arrayFromVTKMatrix(m), volumeNode.GetImageData().GetDimensions())

    # -- files, through MRML storage nodes --
    @staticmethod
    def _storageError(storage, what: str) -> OSError:
        messages = storage.GetUserMessages()
        detail = messages.GetAllMessagesAsString().strip() if messages is not None else ""
        return OSError(what + (f": {detail}" if detail else ""))

    @staticmethod
    def writeVolumeFile(volumeNode, path: str, compress: Optional[bool] = None) -> None:
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
            raise MedVolR1SlicerLogic._storageError(storage, f"could not write {volumeNode.GetName()} to {path}")

    @staticmethod
    def writeSegmentationFile(segmentationNode, path: str) -> None:
        """Write a segmentation node as a ``.seg.nrrd`` (compressed). Raises OSError."""
        storage = slicer.vtkMRMLSegmentationStorageNode()
        storage.SetFileName(str(path))
        storage.SetUseCompression(1)
        if not storage.WriteData(segmentationNode):
            raise MedVolR1SlicerLogic._storageError(storage, f"could not write {segmentationNode.GetName()} to {path}")

    @staticmethod
    def readLabelmapFile(path: str):
        """A ``vtkMRMLLabelMapVolumeNode`` read from ``path``, not added to the scene (nothing to
        remove afterwards, nothing for the user to see). Raises OSError."""
        node = slicer.vtkMRMLLabelMapVolumeNode()
        storage = slicer.vtkMRMLVolumeArchetypeStorageNode()
        storage.SetFileName(str(path))
        storage.SetSingleFile(1)
        if not os.path.isfile(str(path)) or not storage.ReadData(node) or node.GetImageData() is None:
            raise MedVolR1SlicerLogic._storageError(storage, f"could not read the mask {path}")
        return node

    def readMask(self, path: str, volumeNode, atLeast: int = 1):
        """The worker's mask as a ``(k, j, i)`` uint8 0/1 array on ``volumeNode``'s grid: the voxels
        whose value is at least ``atLeast`` (an agreement map holds counts 0..G). A mask on any
        other grid (another shape, spacing, origin or orientation) raises GeometryError: it would
        be painted onto the wrong voxels."""
        import numpy as np

        label = self.readLabelmapFile(path)
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
        return (slicer.util.arrayFromVolume(label) >= max(1, int(atLeast))).astype(np.uint8)

    def exportVolume(self, volumeNode) -> str:
        """The volume as an uncompressed NIfTI the worker reads (same IJK grid and IJK→RAS;
        written again only when the node or its voxels changed). Uncompressed because it is
        read once, next door: gzip would cost seconds on a large CT for nothing."""
        mtime = max(volumeNode.GetMTime(), volumeNode.GetImageData().GetMTime())
        cached = self._exported.get(volumeNode.GetID())
        # the same node object, not only the same ID: a closed scene's IDs are given out again
        if cached and cached[0] is volumeNode and cached[1] == mtime and os.path.exists(cached[2]):
            return cached[2]
        folder = self.tempDir()
        path = os.path.join(folder, f"{volumeNode.GetID()}.nii")
        part = os.path.join(folder, f"{volumeNode.GetID()}.part.nii")
        self.writeVolumeFile(volumeNode, part, compress=False)
        os.replace(part, path)  # the worker never sees a half-written file
        self._exported[volumeNode.GetID()] = (volumeNode, mtime, path)
        return path

    # -- which volume, which segmentation --
    @staticmethod
    def volumeProblem(volumeNode) -> str:
        """Why ``volumeNode`` cannot be segmented ('' when it can): a label map, a vector or
        tensor volume, or a volume without voxels. The worker reads one scalar per voxel."""
        if volumeNode is None:
            return "choose a CT volume first"
        name = volumeNode.GetName()
        if volumeNode.IsA("vtkMRMLLabelMapVolumeNode"):
            return f"{name} is a label map, not a CT; choose the CT volume"
        if volumeNode.IsA("vtkMRMLVectorVolumeNode") or volumeNode.IsA("vtkMRMLTensorVolumeNode"):
            return f"{name} has several values per voxel (a colour, vector or tensor volume), not a CT"
        image = volumeNode.GetImageData()
        if image is None or min(image.GetDimensions()) < 1:
            return f"{name} has no voxels"
        if image.GetNumberOfScalarComponents() != 1:
            return f"{name} has {image.GetNumberOfScalarComponents()} values per voxel, not one; choose a CT"
        return ""

    @classmethod
    def firstUsableVolume(cls):
        """The first volume in the scene that can be segmented (not a label map or a vector
        volume), or None: what the panel selects when nothing is selected yet."""
        for node in slicer.util.getNodesByClass("vtkMRMLScalarVolumeNode"):
            if not cls.volumeProblem(node):
                return node
        return None

    @staticmethod
    def _inScene(node) -> bool:
        return node is not None and node.GetScene() is slicer.mrmlScene and slicer.mrmlScene.IsNodePresent(node)

    @staticmethod
    def referenceVolume(segmentationNode):
        """The volume whose grid ``segmentationNode`` was made on (None if not known)."""
        return segmentationNode.GetNodeReference(segmentationNode.GetReferenceImageGeometryReferenceRole())

    def resultProblem(self, p) -> str:
        """Why the boxes in ``p`` cannot be edited or re-propagated ('' when they can): no
        result yet, or the input volume is not the one they were drawn on."""
        if not p.anchorJson or p.keySliceIJK < 0:
            return "segment first: there is no key slice to put the boxes on"
        if p.resultVolume is None:
            return "the volume of the last result is no longer in the scene; click Segment"
        if p.inputVolume is not p.resultVolume:
            other = p.inputVolume.GetName() if p.inputVolume is not None else "no volume"
            return (f"the boxes were drawn on {p.resultVolume.GetName()}, but the input volume is now {other}; "
                    f"select {p.resultVolume.GetName()} again to edit or re-propagate them, or click Segment")
        return ""

    @staticmethod
    def existingSegmentId(p) -> str:
        """ID of the segment a new result for ``p.query`` would collide with ('' if none)."""
        if p.outputSegmentation is None:
            return ""
        return p.outputSegmentation.GetSegmentation().GetSegmentIdBySegmentName(params.segment_name(p.query)) or ""

    def _target(self, p, volume, replaceSegmentId: str = "") -> _Target:
        """Where the result of a request started now goes, fixed now: edits of the panel while
        the worker runs (query, output, Replace/Keep both) do not move it."""
        notes = []
        segmentation = p.outputSegmentation
        if segmentation is not None:
            ref = self.referenceVolume(segmentation)
            if ref is not None and ref is not volume and self._inScene(ref):
                notes.append(f"{segmentation.GetName()} belongs to {ref.GetName()}; the result went into a new "
                             "segmentation")
                segmentation, replaceSegmentId = None, ""
        return _Target(volume, segmentation, replaceSegmentId, p.query, self._generation, notes)

    # -- requests --
    def startSegment(self, p, options: Options, onFinished=None, replaceExisting: bool = False):
        volume = p.inputVolume
        problem = self.volumeProblem(volume)
        if problem:
            raise ValueError(problem)
        self.geometry(volume)  # refuse transformed volumes before the long run
        target = self._target(p, volume, self.existingSegmentId(p) if replaceExisting else "")
        # a local worker writes the consensus's agreement map where we say; a remote one only into
        # its own output folder, so over HTTP the panel shows the confidence alone
        agreement = ""
        if options.consensus > 1 and options.worker == "local":
            agreement = os.path.join(self.tempDir(), f"agreement-{uuid.uuid4().hex[:12]}.nii.gz")
        job = self.session.segment(self.exportVolume(volume), p.query, options, agreement=agreement)
        job.finished.connect(lambda j: self._finish(p, target, j, [], onFinished))
        return job

    def startRepropagate(self, p, options: Options, onFinished=None) -> Tuple[object, List[str]]:
        """Re-run MedSAM2 on the edited boxes and the corrections (:meth:`anchorFromBoxes`:
        ``medvol.anchor/2`` only when there are prompts or a slice range). Returns ``(job,
        notes)``: notes say which boxes had to be put back on their slice or cut to the image."""
        anchor, notes = self.anchorFromBoxes(p)
        volume = p.resultVolume
        target = self._target(p, volume, p.segmentId)
        job = self.session.propagate(self.exportVolume(volume), anchor, options)
        job.finished.connect(lambda j: self._finish(p, target, j, notes, onFinished))
        return job, notes

    @staticmethod
    def _failJob(job, error: Exception) -> None:
        """A result that came back but could not be put in the scene fails its job, so that the
        panel shows it and ``segmentBlocking`` raises it (instead of returning stale values)."""
        logging.exception("MedVol-R1: applying the result failed")
        kind = "" if isinstance(error, (GeometryError, ValueError, OSError)) else f"{type(error).__name__}: "
        job.state = "failed"
        job.error = WorkerError("apply_failed", f"the result could not be put in the scene: {kind}{error}")

    def _targetGone(self, target: _Target) -> str:
        if target.generation != self._generation:
            return "the scene was closed while the worker ran; nothing was added to the new scene"
        if not self._inScene(target.volume):
            return "the volume was removed while the worker ran; nothing was added"
        if target.segmentation is not None and not self._inScene(target.segmentation):
            return "the output segmentation was removed while the worker ran; nothing was added"
        return ""

    def _finish(self, p, target: _Target, job, notes, onFinished):
        notes = list(notes)
        if job.state == "done":
            gone = self._targetGone(target)
            if gone:  # never put a result into a scene or onto a volume it was not made for
                job.state = "cancelled"
                job.error = WorkerError("cancelled", gone)
            else:
                try:
                    notes = notes + target.notes + self.applyResult(p, target.volume, job.result, target=target)
                except Exception as e:  # noqa: BLE001 - every failure must reach the panel and the caller
                    self._failJob(job, e)
        if onFinished:
            onFinished(job, notes)

    # -- results → MRML --
    def applyResult(self, p, volumeNode, result: dict, replaceSegment: bool = False,
                    target: Optional[_Target] = None) -> List[str]:
        """Put the mask in a segment named after the query, the boxes on the key slice, the
        corrections that ran (the anchor's prompts and slice range, if any; the old correction
        nodes are removed), the reasoning in the parameter node, and show the key slice. Returns
        notes for the user.

        ``target`` (from the request's start) names the segmentation and the segment to replace;
        without one they are read from ``p`` now (``replaceSegment``: replace ``p.segmentId``).
        Everything that can fail on a bad result (the anchor's boxes, the mask file and its grid)
        is checked before the scene is touched, so a failure leaves no empty segment behind."""
        if target is None:
            target = _Target(volumeNode, p.outputSegmentation, p.segmentId if replaceSegment else "", p.query,
                             self._generation, [])
        anchor = result["anchor"]
        notes = list(result.get("notes") or [])
        model = result_model_text(result)  # what made it, as the worker says: zero-shot, MedVol-R1, smoke
        if model:
            notes.insert(0, model)
        if result.get("absent") or anchor.get("absent"):
            # "not present": nothing is added to the scene and the last result (boxes, segment,
            # reasoning, Undo) stays as it was; the notes carry the answer and its reasoning
            notes = [n for n in notes if not n.startswith("not found in this CT:")]
            why = anchor.get("reasoning") or ""
            sure = confidence_note(result)
            if result.get("agreement_path"):
                with contextlib.suppress(OSError):
                    os.remove(result["agreement_path"])  # ours, in the module's temporary folder
            return [params.absent_message(anchor.get("query") or target.query)] + \
                ([f"the model's reasoning: {why}"] if why else []) + ([sure] if sure else []) + notes
        geo = self.geometry(volumeNode)
        rois, k = rois_from_anchor(geo, anchor)
        prompts, zRange = prompts_from_anchor(geo, anchor)  # the corrections that ran (medvol.anchor/2)
        mask = self.readMask(result["mask_path"], volumeNode)
        agreement, samples = None, int(result.get("consensus") or 1)
        if result.get("agreement_path"):
            agreement = self.readMask(result["agreement_path"], volumeNode, atLeast=agreement_level(samples))
            with contextlib.suppress(OSError):
                os.remove(result["agreement_path"])  # ours, in the module's temporary folder
        elif samples > 1:
            notes.append("no agreement map came back (a remote worker writes it only into its output folder)")

        segNode = target.segmentation
        if segNode is None:
            segNode = slicer.mrmlScene.AddNewNodeByClass("vtkMRMLSegmentationNode", f"{volumeNode.GetName()} MedVol")
            segNode.CreateDefaultDisplayNodes()
            segNode.SetReferenceImageGeometryParameterFromVolumeNode(volumeNode)
            self.placeInStudy(segNode, volumeNode)
        elif self.beforeChange is not None:
            self.beforeChange(segNode)
        segmentation = segNode.GetSegmentation()
        replaceId = target.replaceSegmentId
        if replaceId and segmentation.GetSegment(replaceId):
            segmentId = replaceId
            previous = slicer.util.arrayFromSegmentBinaryLabelmap(segNode, segmentId, volumeNode).copy()
        else:
            existing = [segmentation.GetNthSegment(i).GetName() for i in range(segmentation.GetNumberOfSegments())]
            name = params.unique_name(params.segment_name(anchor.get("query") or target.query), existing)
            segmentId = segmentation.AddEmptySegment("", name)
            previous = None
            style = params.segment_style(result.get("terminology"))  # the worker's coded name and colour
            if style is not None:
                segment = segmentation.GetSegment(segmentId)
                segment.SetColor(*style[0])
                segment.SetTerminology(style[1])
        slicer.util.updateSegmentBinaryLabelmapFromArray(mask, segNode, segmentId, volumeNode)
        agreementId = self._replaceAgreement(p, segNode, volumeNode, agreement, anchor.get("query") or target.query,
                                             samples, keep=segmentId)
        self._undo = _Undo(segNode, segmentId, previous, volumeNode, self._packed(segNode, segmentId, volumeNode),
                           agreementId)
        p.confidence = confidence_text(result)
        p.outputSegmentation = segNode
        p.segmentId = segmentId
        p.resultVolume = volumeNode
        p.reasoning = anchor.get("reasoning") or ""
        p.keySlice = int(anchor["slice"])
        p.anchorJson = json.dumps(anchor)
        self._placeRois(p, rois, k, volumeNode)
        self._placeCorrections(p, geo, prompts, zRange, volumeNode)
        p.boxesEdited = False
        self.showKeySlice(volumeNode, anchor)
        return notes

    @staticmethod
    def _replaceAgreement(p, segNode, volumeNode, agreement, query: str, samples: int, keep: str) -> str:
        """Drop the last result's agreement segment (it described that result's answers) and add
        this one's, ``"<query> agreement ≥ k/G"``, from ``agreement`` (a 0/1 array of the voxels at
        least k samples include; None: no consensus). Returns the new segment's id or ''."""
        segmentation = segNode.GetSegmentation()
        old = p.agreementSegmentId
        if old and old != keep and segmentation.GetSegment(old) is not None:
            segmentation.RemoveSegment(old)
        p.agreementSegmentId = ""
        if agreement is None:
            return ""
        existing = [segmentation.GetNthSegment(i).GetName() for i in range(segmentation.GetNumberOfSegments())]
        name = params.unique_name(agreement_segment_name(query, agreement_level(samples), samples), existing)
        segmentId = segmentation.AddEmptySegment("", name)
        segmentation.GetSegment(segmentId).SetColor(1.0, 0.75, 0.2)
        slicer.util.updateSegmentBinaryLabelmapFromArray(agreement, segNode, segmentId, volumeNode)
        p.agreementSegmentId = segmentId
        return segmentId

    @staticmethod
    def _packed(segNode, segmentId, volumeNode):
        import numpy as np

        return np.packbits(slicer.util.arrayFromSegmentBinaryLabelmap(segNode, segmentId, volumeNode) > 0)

    @property
    def canUndo(self) -> bool:
        return self._undo is not None and self._inScene(self._undo.segmentation) and \
            self._undo.segmentation.GetSegmentation().GetSegment(self._undo.segmentId) is not None

    def editedSinceResult(self) -> int:
        """How many voxels of the last result's segment were changed since (Segment Editor,
        another module, a script): what Undo would throw away. 0 when none or nothing to undo."""
        import numpy as np

        if not self.canUndo:
            return 0
        u = self._undo
        now = self._packed(u.segmentation, u.segmentId, u.volume)
        if now.shape != u.written.shape:
            return int(u.written.size * 8)
        return int(np.unpackbits(np.bitwise_xor(now, u.written)).sum())

    def undoLastResult(self, discardEdits: bool = False) -> bool:
        """Take back the last result: remove the segment it added, or restore the mask it replaced.
        Raises :class:`EditedSinceResult` when the segment was edited after the result, unless
        ``discardEdits``: Undo would silently throw those edits away."""
        if not self.canUndo:
            return False
        edited = self.editedSinceResult()
        if edited and not discardEdits:
            raise EditedSinceResult(edited, self._undo.segmentation.GetSegmentation().GetSegment(
                self._undo.segmentId).GetName())
        u, self._undo = self._undo, None
        if self.beforeChange is not None:
            self.beforeChange(u.segmentation)
        if u.previous is None:
            u.segmentation.GetSegmentation().RemoveSegment(u.segmentId)
        else:
            slicer.util.updateSegmentBinaryLabelmapFromArray(u.previous, u.segmentation, u.segmentId, u.volume)
        if u.agreementId and u.segmentation.GetSegmentation().GetSegment(u.agreementId) is not None:
            u.segmentation.GetSegmentation().RemoveSegment(u.agreementId)
        return True

    # -- the scene around the result --
    @staticmethod
    def placeInStudy(node, volumeNode) -> None:
        """Put ``node`` in the subject hierarchy beside ``volumeNode`` (under its study), so the
        result is listed with the patient and study it was made from."""
        sh = slicer.vtkMRMLSubjectHierarchyNode.GetSubjectHierarchyNode(slicer.mrmlScene)
        if sh is None:
            return
        volumeItem = sh.GetItemByDataNode(volumeNode)
        if not volumeItem:
            return
        parent = sh.GetItemParent(volumeItem)
        if not parent or parent == sh.GetSceneItemID():
            return
        item = sh.GetItemByDataNode(node)  # Slicer's application makes one for each new node
        if item:
            sh.SetItemParent(item, parent)
        else:
            sh.CreateItem(parent, node)

    def setShow3D(self, p, show: bool) -> bool:
        """Show the result's segmentation as a surface in the 3D view (or stop). Returns whether
        a surface is shown."""
        seg = p.outputSegmentation
        if seg is None:
            return False
        if show:
            seg.CreateClosedSurfaceRepresentation()
        else:
            seg.RemoveClosedSurfaceRepresentation()
        return bool(show)

    def segmentEditorNode(self, p):
        """A Segment Editor parameter node set to the result: its segmentation, the CT as the
        source volume and the new segment selected (what "Edit in Segment Editor" opens)."""
        if p.outputSegmentation is None or not p.segmentId:
            raise ValueError("segment first: there is no result to edit")
        node = slicer.mrmlScene.GetSingletonNode("SegmentEditor", "vtkMRMLSegmentEditorNode")
        if node is None:
            node = slicer.vtkMRMLSegmentEditorNode()
            node.SetSingletonTag("SegmentEditor")
            node = slicer.mrmlScene.AddNode(node)
        node.SetAndObserveSegmentationNode(p.outputSegmentation)
        volume = p.resultVolume or p.inputVolume
        if hasattr(node, "SetAndObserveSourceVolumeNode"):
            node.SetAndObserveSourceVolumeNode(volume)
        else:  # Slicer before 5.2 named it the master volume
            node.SetAndObserveMasterVolumeNode(volume)
        node.SetSelectedSegmentID(p.segmentId)
        return node

    def keySliceText(self, p) -> str:
        """The key slice as Slicer's axial slice view shows its position (S in mm), and as the
        model saw it, counted from the bottom: "S 112.5 mm (slice 17 of 30)"."""
        if not p.anchorJson or p.keySlice < 0:
            return "–"
        s = float(json.loads(p.anchorJson)["world"]["slice_center_ras"][2])
        of = ""
        if p.resultVolume is not None:
            try:
                geo = self.geometry(p.resultVolume)
                of = f" of {geo.shape[geo.slice_axis]}"
            except GeometryError:  # put under a transform since: the count is left out, not the panel
                pass
        return f"S {s:.1f} mm (slice {p.keySlice + 1}{of})"

    def jumpToKeySlice(self, p) -> bool:
        """Show the key slice of the last result in the slice views."""
        if not p.anchorJson or p.resultVolume is None:
            return False
        self.showKeySlice(p.resultVolume, json.loads(p.anchorJson))
        return True

    def placeBoxes(self, p, volumeNode, anchor: dict):
        """One ``vtkMRMLMarkupsROINode`` per anchor box, flat on the key slice, from ``world``;
        and the anchor's corrections (``medvol.anchor/2``: prompts, slice range), if any."""
        geo = self.geometry(volumeNode)
        rois, k = rois_from_anchor(geo, anchor)
        prompts, zRange = prompts_from_anchor(geo, anchor)
        p.resultVolume = volumeNode
        nodes = self._placeRois(p, rois, k, volumeNode)
        self._placeCorrections(p, geo, prompts, zRange, volumeNode)
        return nodes

    def _placeRois(self, p, rois: List[RoiBox], k: int, volumeNode=None):
        for old in p.boxes:
            if old is not None and old.GetScene() is not None:
                slicer.mrmlScene.RemoveNode(old)
        nodes = []
        for i, roi in enumerate(rois):
            node = slicer.mrmlScene.AddNewNodeByClass("vtkMRMLMarkupsROINode", f"MedVol box {i + 1}")
            self._setRoi(node, roi)
            node.SetAttribute(OBJECT_ATTR, str(i + 1))
            node.SetAttribute(SLICE_ATTR, str(k))
            if volumeNode is not None:
                self.placeInStudy(node, volumeNode)
            nodes.append(node)
        p.boxes = nodes
        p.keySliceIJK = k
        return nodes

    @staticmethod
    def _setRoi(node, roi: RoiBox, correction: bool = False):
        node.SetAndObserveObjectToNodeMatrix(slicer.util.vtkMatrixFromArray(roi.object_to_node()))
        node.SetCenter(*[float(v) for v in roi.center])
        node.SetSize(*[float(v) for v in roi.size])
        display = node.GetDisplayNode()
        if display is not None:
            # key-slice boxes yellow, correction boxes cyan
            display.SetSelectedColor(*((0.2, 0.8, 1.0) if correction else (1.0, 0.8, 0.0)))
            display.SetFillOpacity(0.1)

    @staticmethod
    def _getRoi(node) -> RoiBox:
        matrix = slicer.util.arrayFromVTKMatrix(node.GetObjectToNodeMatrix())
        center = [0.0, 0.0, 0.0]
        node.GetCenter(center)
        box = RoiBox.from_object_to_node(matrix, node.GetSize())
        return RoiBox(center, box.size, box.axes)

    def anchorFromBoxes(self, p):
        """The anchor rebuilt from the ROI nodes, the correction boxes, the points and the slice
        range (``source: "user"``, world coordinates), and the notes on what was clamped.

        Without corrections and range it is exactly the ``medvol.anchor/1`` anchor of the boxes;
        with them, ``medvol.anchor/2`` with ``prompts`` and ``world.z_range_ras``
        (:func:`MedVolR1SlicerLib.corrections.build_anchor`). Everything the worker would refuse
        (too many objects or prompts, two boxes of an object on one slice, a correction outside
        the range, ...) raises ValueError with a message before anything is sent. Clamped boxes
        and snapped points are put back where they will be used, so what the user sees is what runs."""
        problem = self.resultProblem(p)
        if problem:
            raise ValueError(problem)
        geo = self.geometry(p.resultVolume)
        keyNodes = self._live(p.boxes)
        if not keyNodes:
            raise ValueError("there is no box left; add one on the key slice (Add box here) or click Segment")
        corrNodes = self._live(p.corrections)
        pointIndices, points = self._pointEntries(p)
        built = build_anchor(
            geo, [self._getRoi(n) for n in keyNodes], [self.nodeObject(n, i + 1) for i, n in enumerate(keyNodes)],
            p.keySliceIJK,
            [CorrectionBox(self.nodeObject(n), self.nodeSlice(n), self._getRoi(n)) for n in corrNodes],
            points, self.sliceRange(p), query=p.query, reasoning=p.reasoning)
        for node, corners in zip(keyNodes, built.anchor["world"]["boxes_ras"]):
            roi, _ = geo.roi_from_world_box(corners)
            self._setRoi(node, roi)
        for node, corners in zip(corrNodes, built.boxes_ras):
            roi, _ = geo.roi_from_world_box(corners)
            self._setRoi(node, roi, correction=True)
        pointsNode = self._live([p.points])
        for i, centre in zip(pointIndices, built.points_ras):
            pointsNode[0].SetNthControlPointPositionWorld(i, *centre)
        return built.anchor, built.notes

    def addBox(self, p):
        """A new box (a new object) in the middle of the key slice, a quarter of the image wide."""
        problem = self.resultProblem(p)
        if problem:
            raise GeometryError(problem)
        return self.addBoxHere(p, objectNumber=self.nextObjectNumber(p), sliceIndex=p.keySliceIJK)

    # -- corrections: boxes on any slice, points, the slice range (medvol.anchor/2) --
    def _live(self, nodes) -> list:
        return [n for n in nodes if self._inScene(n)]

    @staticmethod
    def _intAttribute(node, name: str, default: int) -> int:
        try:
            return int(node.GetAttribute(name))
        except (TypeError, ValueError):
            return default

    @classmethod
    def nodeObject(cls, node, default: int = 0) -> int:
        """The object number a box is for (its ``MedVolR1.object`` attribute)."""
        return cls._intAttribute(node, OBJECT_ATTR, default)

    @classmethod
    def nodeSlice(cls, node, default: int = -1) -> int:
        """The slice a correction box was made on, along the volume's slice axis (``MedVolR1.slice``)."""
        return cls._intAttribute(node, SLICE_ATTR, default)

    def _pointEntries(self, p):
        """``(indices, points)``: the placed control points of "MedVol points" (those whose
        position is defined) as :class:`CorrectionPoint`, in RAS. A label that is not +N/-N
        raises GeometryError."""
        node = p.points if self._inScene(p.points) else None
        indices, points = [], []
        if node is None:
            return indices, points
        for i in range(node.GetNumberOfControlPoints()):
            if node.GetNthControlPointPositionStatus(i) != node.PositionDefined:
                continue  # the point being placed (preview), or one whose position was cleared
            obj, positive = parse_point_label(node.GetNthControlPointLabel(i))
            ras = [0.0, 0.0, 0.0]
            node.GetNthControlPointPositionWorld(i, ras)
            indices.append(i)
            points.append(CorrectionPoint(obj, positive, ras))
        return indices, points

    def objectNumbers(self, p) -> List[int]:
        """The object numbers in use: the key-slice boxes', the correction boxes' and the points'."""
        keyNodes = self._live(p.boxes)
        numbers = {self.nodeObject(n, i + 1) for i, n in enumerate(keyNodes)}
        numbers |= {self.nodeObject(n) for n in self._live(p.corrections)}
        try:
            numbers |= {pt.object for pt in self._pointEntries(p)[1]}
        except GeometryError:  # a renamed point: Re-propagate says so
            pass
        return sorted(n for n in numbers if n > 0)

    def nextObjectNumber(self, p) -> int:
        return max(self.objectNumbers(p), default=0) + 1

    def objectChoices(self, p) -> List[Tuple[str, int]]:
        """What the Object selector offers: ``(text, number)`` for each object, the one being
        started (chosen, nothing placed yet) marked "(new)", and "New object" (0)."""
        numbers = self.objectNumbers(p)
        choices = [(str(n), n) for n in numbers]
        if p.correctionObject > 0 and p.correctionObject not in numbers:
            choices.append((f"{p.correctionObject} (new)", p.correctionObject))
        return choices + [("New object", 0)]

    def chooseObject(self, p, number: int) -> int:
        """Choose the object Add box here and new points are for; 0 starts a new object (numbered
        now, so that every box and point added next belongs to that same object)."""
        number = int(number)
        if number <= 0:
            number = self.nextObjectNumber(p)
            if len(self.objectNumbers(p)) >= MAX_OBJECTS:
                raise GeometryError(f"there are {MAX_OBJECTS} objects already, the most that can be propagated at "
                                    "once; delete the boxes and points of one first")
        p.correctionObject = number
        self.updatePointLabelFormat(p)
        return number

    def _objectFor(self, p, objectNumber: Optional[int]) -> int:
        number = p.correctionObject if objectNumber is None else int(objectNumber)
        if number <= 0 or (number not in self.objectNumbers(p) and len(self.objectNumbers(p)) >= MAX_OBJECTS):
            number = self.chooseObject(p, 0)
        return number

    @staticmethod
    def redSliceNode():
        """The Red (axial) slice view's node, or None."""
        for node in slicer.util.getNodesByClass("vtkMRMLSliceNode"):
            if node.GetLayoutName() == "Red":
                return node
        return None

    def redSliceCentre(self) -> List[float]:
        """RAS of the centre of what the Red slice view shows."""
        import numpy as np

        node = self.redSliceNode()
        if node is None:
            raise GeometryError("there is no Red (axial) slice view to take the slice from")
        dims = node.GetDimensions()
        xy = np.array([dims[0] / 2.0, dims[1] / 2.0, 0.0, 1.0])
        return [float(v) for v in (slicer.util.arrayFromVTKMatrix(node.GetXYToRAS()) @ xy)[:3]]

    def _sliceHere(self, p, geo: VolumeGeometry, ras=None) -> Tuple[int, List[float]]:
        """The slice (index along the slice axis) through ``ras``, or through the centre of the Red
        slice view when not given, and that point."""
        ras = self.redSliceCentre() if ras is None else [float(v) for v in ras]
        k = geo.slice_of(ras)
        if not 0 <= k < geo.depth:
            raise GeometryError(f"the Red slice view shows no slice of {p.resultVolume.GetName()}; scroll it onto the "
                                "volume first")
        return k, ras

    def addBoxHere(self, p, objectNumber: Optional[int] = None, ras=None, sliceIndex: Optional[int] = None):
        """A new box flat on the slice the Red view shows (or through ``ras``, or slice
        ``sliceIndex``), a quarter of the image wide, centred where the view is (kept on the
        image), for object ``objectNumber`` (default: the chosen one, ``p.correctionObject``; a
        new one when none is chosen).

        On the key slice it is a key-slice box (the anchor's ``boxes``), allowed only for an
        object that has none there; on any other slice it is a correction box (a prompt), at most
        one per object and slice. Raises GeometryError with a message."""
        problem = self.resultProblem(p)
        if problem:
            raise GeometryError(problem)
        geo = self.geometry(p.resultVolume)
        if sliceIndex is None:
            k, centre = self._sliceHere(p, geo, ras)
        else:
            k, centre = int(sliceIndex), ras
        obj = self._objectFor(p, objectNumber)
        keyNodes, corrNodes = self._live(p.boxes), self._live(p.corrections)
        lo, hi = geo.box_around(k, centre)
        if k == p.keySliceIJK:
            if obj in [self.nodeObject(n, i + 1) for i, n in enumerate(keyNodes)]:
                raise GeometryError(f"object {obj} already has its box on the key slice; move or resize that box, "
                                    "or place points")
            node = slicer.mrmlScene.AddNewNodeByClass("vtkMRMLMarkupsROINode", f"MedVol box {obj}")
            self._setRoi(node, geo.roi_from_voxels(lo, hi))
        else:
            if any(self.nodeObject(n) == obj and self.nodeSlice(n) == k for n in corrNodes):
                raise GeometryError(f"object {obj} already has a box on {geo.slice_text(k)}; move or resize it")
            node = slicer.mrmlScene.AddNewNodeByClass(
                "vtkMRMLMarkupsROINode", f"MedVol box {obj}, slice {geo.stack_z(k) + 1}")
            self._setRoi(node, geo.roi_from_voxels(lo, hi), correction=True)
        node.SetAttribute(OBJECT_ATTR, str(obj))
        node.SetAttribute(SLICE_ATTR, str(k))
        self.placeInStudy(node, p.resultVolume)
        if k == p.keySliceIJK:
            p.boxes = keyNodes + [node]
        else:
            p.corrections = corrNodes + [node]
        p.correctionObject = obj
        p.boxesEdited = True
        self.updatePointLabelFormat(p)
        return node

    def pointsNode(self, p, create: bool = True):
        """The "MedVol points" markups node of the result (made on first use, filed under the
        volume's study), or None."""
        node = p.points if self._inScene(p.points) else None
        if node is None and create:
            problem = self.resultProblem(p)
            if problem:
                raise GeometryError(problem)
            node = slicer.mrmlScene.AddNewNodeByClass("vtkMRMLMarkupsFiducialNode", "MedVol points")
            if node.GetDisplayNode() is None:
                node.CreateDefaultDisplayNodes()
            display = node.GetDisplayNode()
            if display is not None:
                display.SetSelectedColor(0.2, 1.0, 0.4)
            self.placeInStudy(node, p.resultVolume)
            p.points = node
            self.updatePointLabelFormat(p)
        return node

    def updatePointLabelFormat(self, p) -> str:
        """Points placed from now on are labelled for the chosen object and sign (``+1``,
        ``-2``…): the points node's control-point label format (saved with it)."""
        obj = p.correctionObject if p.correctionObject > 0 else self.nextObjectNumber(p)
        label = point_label(obj, not p.negativePoints)
        node = p.points if self._inScene(p.points) else None
        if node is not None and node.GetControlPointLabelFormat() != label:
            node.SetControlPointLabelFormat(label)
        return label

    def setNegativePoints(self, p, negative: bool) -> None:
        """New points mark the outside (negative) or the inside (positive) of the object."""
        if bool(p.negativePoints) != bool(negative):
            p.negativePoints = bool(negative)
        self.updatePointLabelFormat(p)

    def addPoint(self, p, ras, positive: Optional[bool] = None, objectNumber: Optional[int] = None) -> int:
        """Add a point at ``ras`` (the console's and the tests' way; in the views, Place points):
        inside (``positive``, default: the panel's sign) or outside object ``objectNumber``
        (default: the chosen one). Returns its control-point index."""
        node = self.pointsNode(p)
        obj = self._objectFor(p, objectNumber)
        sign = (not p.negativePoints) if positive is None else bool(positive)
        index = node.AddControlPoint(float(ras[0]), float(ras[1]), float(ras[2]), point_label(obj, sign))
        p.correctionObject = obj
        p.boxesEdited = True
        self.updatePointLabelFormat(p)
        return index

    @staticmethod
    def _interactionNode():
        return slicer.mrmlScene.GetSingletonNode("Singleton", "vtkMRMLInteractionNode")

    def startPlacingPoints(self, p) -> bool:
        """Click to place points in the slice views (place mode stays on until stopped), labelled
        for the chosen object and sign; a new object is numbered now."""
        node = self.pointsNode(p)
        if p.correctionObject <= 0:
            self.chooseObject(p, 0)
        self.updatePointLabelFormat(p)
        logic = slicer.modules.markups.logic()
        logic.SetActiveList(node)
        return bool(logic.StartPlaceMode(True))

    def stopPlacingPoints(self) -> None:
        interaction = self._interactionNode()
        if interaction is not None and interaction.GetCurrentInteractionMode() == interaction.Place:
            interaction.SwitchToViewTransformMode()

    def placingPoints(self, p) -> bool:
        """Whether the views are placing points into "MedVol points"."""
        interaction = self._interactionNode()
        selection = slicer.mrmlScene.GetSingletonNode("Singleton", "vtkMRMLSelectionNode")
        node = p.points if self._inScene(p.points) else None
        return bool(interaction is not None and selection is not None and node is not None
                    and interaction.GetCurrentInteractionMode() == interaction.Place
                    and selection.GetActivePlaceNodeID() == node.GetID())

    def setRangeEnd(self, p, which: str, ras=None) -> int:
        """Set the ``"start"`` or ``"end"`` slice of the range to the slice the Red view shows (or
        the slice through ``ras``); the order does not matter. Returns the slice index."""
        if which not in ("start", "end"):
            raise ValueError(f"which must be 'start' or 'end', got {which!r}")
        problem = self.resultProblem(p)
        if problem:
            raise GeometryError(problem)
        k, _ = self._sliceHere(p, self.geometry(p.resultVolume), ras)
        if which == "start":
            p.rangeStart = k
        else:
            p.rangeEnd = k
        p.boxesEdited = True
        return k

    def clearRange(self, p) -> None:
        if p.rangeStart >= 0 or p.rangeEnd >= 0:
            p.rangeStart = p.rangeEnd = -1
            p.boxesEdited = True

    def sliceRange(self, p) -> Optional[Tuple[int, int]]:
        """``(k0, k1)`` (sorted, along the slice axis), None when no range is set; one end only
        raises ValueError."""
        if p.rangeStart < 0 and p.rangeEnd < 0:
            return None
        if p.rangeStart < 0 or p.rangeEnd < 0:
            missing = "start" if p.rangeStart < 0 else "end"
            raise ValueError(f"the slice range has no {missing} slice: set it (Set {missing}) or clear the range")
        return tuple(sorted((p.rangeStart, p.rangeEnd)))

    def rangeText(self, p) -> str:
        """The slice range as the panel shows it: "slices 40–90 (S -20.0 to 105.0 mm)", "–"."""
        if (p.rangeStart < 0 and p.rangeEnd < 0) or p.resultVolume is None:
            return "whole volume"
        try:
            geo = self.geometry(p.resultVolume)
        except GeometryError:
            return "–"
        if p.rangeStart < 0 or p.rangeEnd < 0:
            k = max(p.rangeStart, p.rangeEnd)
            return f"{'end' if p.rangeStart < 0 else 'start'}: {geo.slice_text(k)}; set the other end"
        return range_text(geo, p.rangeStart, p.rangeEnd)

    def hasCorrections(self, p) -> bool:
        return bool(self._live(p.corrections) or self._pointEntriesCount(p) or p.rangeStart >= 0 or p.rangeEnd >= 0)

    def _pointEntriesCount(self, p) -> int:
        node = p.points if self._inScene(p.points) else None
        return node.GetNumberOfControlPoints() if node is not None else 0

    def clearCorrections(self, p) -> bool:
        """Remove the correction boxes, the points and the slice range. Returns whether there was
        anything to remove."""
        had = self.hasCorrections(p) or self._inScene(p.points)
        self._removeCorrections(p)
        if had:
            p.boxesEdited = True
        return had

    def _removeCorrections(self, p) -> None:
        if self.placingPoints(p):
            self.stopPlacingPoints()
        for old in list(p.corrections) + [p.points]:
            if old is not None and old.GetScene() is not None:
                slicer.mrmlScene.RemoveNode(old)
        p.corrections = []
        p.points = None
        p.rangeStart = p.rangeEnd = -1

    def _placeCorrections(self, p, geo: VolumeGeometry, prompts, zRange, volumeNode) -> None:
        """Replace the correction nodes by the prompts the worker ran (its anchor's ``prompts``,
        read by ``prompts_from_anchor``) and the range by its ``z_range``."""
        self._removeCorrections(p)
        nodes = []
        pointsNode = None
        for prompt in prompts:
            if prompt.box_ras is not None:
                roi, k = geo.roi_from_world_box(prompt.box_ras)
                name = (f"MedVol box {prompt.object}" if k == p.keySliceIJK
                        else f"MedVol box {prompt.object}, slice {geo.stack_z(k) + 1}")
                node = slicer.mrmlScene.AddNewNodeByClass("vtkMRMLMarkupsROINode", name)
                self._setRoi(node, roi, correction=True)
                node.SetAttribute(OBJECT_ATTR, str(prompt.object))
                node.SetAttribute(SLICE_ATTR, str(k))
                self.placeInStudy(node, volumeNode)
                nodes.append(node)
            for ras, positive in prompt.points:
                if pointsNode is None:
                    pointsNode = self.pointsNode(p)
                pointsNode.AddControlPoint(ras[0], ras[1], ras[2], point_label(prompt.object, positive))
        p.corrections = nodes
        if zRange is not None:
            p.rangeStart, p.rangeEnd = zRange
        p.correctionObject = 1 if self._live(p.boxes) else 0
        self.updatePointLabelFormat(p)

    @staticmethod
    def showKeySlice(volumeNode, anchor: dict):
        slicer.util.setSliceViewerLayers(background=volumeNode)
        r, a, s = anchor["world"]["slice_center_ras"]
        slicer.modules.markups.logic().JumpSlicesToLocation(r, a, s, True)

    # -- blocking use (Python console, headless batch) --
    def segmentBlocking(self, volumeNode, query, options: Optional[Options] = None, segmentationNode=None,
                        timeout: Optional[float] = None):
        """Segment and wait. Returns ``(segmentationNode, segmentId, roiNodes, anchor)``, the anchor
        being this request's own; when the model answered that the target is not in this CT
        (``anchor["absent"]``) nothing was added: ``(None, "", [], anchor)``. Raises
        :class:`WorkerError` on failure."""
        p = self.getParameterNode()
        p.inputVolume = volumeNode
        p.query = query
        p.outputSegmentation = segmentationNode
        p.segmentId = ""
        job = self.startSegment(p, options or Options(preset=p.preset, device=p.device))
        self.session.wait(job, timeout)
        if job.error is not None:
            raise job.error
        return self._blockingResult(p, job)

    def repropagateBlocking(self, options: Optional[Options] = None, timeout: Optional[float] = None):
        """Re-propagate the (edited) boxes of the last result and wait; the same segment is
        replaced. Returns what :meth:`segmentBlocking` returns; raises :class:`WorkerError`."""
        p = self.getParameterNode()
        job, _ = self.startRepropagate(p, options or Options(preset=p.preset, device=p.device))
        self.session.wait(job, timeout)
        if job.error is not None:
            raise job.error
        return self._blockingResult(p, job)

    @staticmethod
    def _blockingResult(p, job):
        """What the blocking calls return, from ``job``'s own result (never an earlier one's)."""
        anchor = (job.result or {}).get("anchor") or {}
        if anchor.get("absent"):
            return None, "", [], anchor
        return p.outputSegmentation, p.segmentId, list(p.boxes), anchor


# ---- self-test -------------------------------------------------------------------------------

class SelfTestWorker:
    """A worker client for the self-test only (injected as SlicerNNUnet injects its process):
    it answers ``segment`` with a box around the brightest voxels' bounding box and ``propagate``
    with the boxes it is sent, as masks on the volume's grid written through MRML. It lets the
    self-test check the module's MRML side on any Slicer, including the extension build
    machines, which have none of torch, transformers or sam2. It is never used outside the test."""

    running = True
    starts = 1

    def __init__(self, logic, volumeNode):
        from MedVolR1SlicerLib.client import Job

        self._Job, self.logic, self.volume = Job, logic, volumeNode
        self.queue, self.requests, self.stopped, self.n = [], [], False, 0

    def submit(self, op, **fields):
        self.n += 1
        job = self._Job(str(self.n), op, fields)
        self.requests.append((op, fields))
        self.queue.append(job)
        return job

    def _answer(self, job):
        import numpy as np

        if job.op == "load":
            return {"preset": job.request["preset"]}
        geo = self.logic.geometry(self.volume)
        label = slicer.vtkMRMLLabelMapVolumeNode()
        m = vtk.vtkMatrix4x4()
        self.volume.GetIJKToRASMatrix(m)
        label.SetIJKToRASMatrix(m)
        image = vtk.vtkImageData()
        image.SetDimensions(self.volume.GetImageData().GetDimensions())
        image.AllocateScalars(vtk.VTK_UNSIGNED_CHAR, 1)
        label.SetAndObserveImageData(image)
        mask = slicer.util.arrayFromVolume(label)  # (k, j, i)
        mask[:] = 0
        if job.op == "segment":
            ijk = np.argwhere(slicer.util.arrayFromVolume(self.volume) > 100)[:, ::-1]  # (i, j, k)
            lo, hi = ijk.min(axis=0), ijk.max(axis=0)
            k = int((lo[geo.slice_axis] + hi[geo.slice_axis]) // 2)
            lo[geo.slice_axis] = hi[geo.slice_axis] = k
            rois = [geo.roi_from_voxels(list(lo), list(hi))]
        else:
            rois = [geo.roi_from_world_box(c)[0] for c in job.request["anchor"]["world"]["boxes_ras"]]
            k = geo.slice_of(rois[0].center)
        anchor, _ = anchor_from_rois(geo, rois, k, query=job.request.get("query", ""), reasoning="self-test")
        anchor.update(slice=k, source="grounder" if job.op == "segment" else "user")
        sent = job.request.get("anchor") or {}
        if sent.get("schema") == "medvol.anchor/2":  # the corrections that ran come back (world form)
            anchor["schema"] = sent["schema"]
            if sent.get("prompts"):
                anchor["prompts"] = sent["prompts"]
            if "z_range_ras" in sent["world"]:
                anchor["world"]["z_range_ras"] = sent["world"]["z_range_ras"]
        for roi in rois:  # the box on every slice: a cuboid through the volume
            c = geo.to_ijk(roi.corners())
            lo, hi = np.ceil(c.min(axis=0)).astype(int), np.floor(c.max(axis=0)).astype(int)  # voxel edges → centres
            lo, hi = np.maximum(lo, 0), np.minimum(hi, np.array(geo.shape) - 1)
            mask[:, lo[1]:hi[1] + 1, lo[0]:hi[0] + 1] = 1
        path = os.path.join(self.logic.tempDir(), f"selftest-mask-{job.id}.nii")
        self.logic.writeVolumeFile(label, path)
        return {"anchor": anchor, "mask_path": path, "notes": [], "smoke": False}

    def poll(self, timeout=0.0):
        done = 0
        while self.queue:
            job = self.queue.pop(0)
            job._finish(self._answer(job))
            done += 1
        return done

    def wait(self, job, timeout=None):
        while not job.done:
            self.poll()
        return job

    def cancel(self, job):
        if job in self.queue:
            self.queue.remove(job)
            job._finish(error=WorkerError("cancelled", "cancelled"))

    def stop(self):
        self.stopped = True


class MedVolR1SlicerTest(ScriptedLoadableModuleTest):
    """The module's self-test, as Slicer's extension build machines run it (ctest).

    ``test_module_with_selftest_worker`` runs everywhere: the module's MRML side (segment, the
    boxes on the key slice, an edit in the segment then Undo, corrections sent as a
    ``medvol.anchor/2`` anchor and placed back, a scene closed while a request runs, a switched
    volume) with :class:`SelfTestWorker` injected, no heavy package and no worker
    process. ``test_segment_edit_repropagate`` runs the real worker with the ``tiny`` preset
    (random weights, no download) and is skipped, with a message, where the MedVol-R1 packages
    are not installed. (The same steps run in CI against slicer-core: Testing/slicer_mrml.)"""

    def setUp(self):
        slicer.mrmlScene.Clear()

    def runTest(self):
        self.setUp()
        self.test_module_with_selftest_worker()
        self.setUp()
        if install.current_plan().needed:
            self.delayDisplay("Skipping the worker test: the MedVol-R1 packages are not installed here")
        else:
            self.test_segment_edit_repropagate()

    @staticmethod
    def _syntheticCT(name):
        import numpy as np

        node = slicer.mrmlScene.AddNewNodeByClass("vtkMRMLScalarVolumeNode", name)
        image = vtk.vtkImageData()
        image.SetDimensions(48, 40, 12)
        image.AllocateScalars(vtk.VTK_SHORT, 1)
        node.SetAndObserveImageData(image)
        node.SetSpacing(1.5, 1.5, 3.0)
        a = slicer.util.arrayFromVolume(node)
        a[:] = -1000
        a[3:9, 10:30, 12:36] = 300  # an "organ"
        slicer.util.arrayFromVolumeModified(node)
        return node

    def test_module_with_selftest_worker(self):
        from MedVolR1SlicerLib.session import Session

        volume = self._syntheticCT("PatientA_CT")
        clients = []
        logic = MedVolR1SlicerLogic(session=Session(
            client_factory=lambda options: clients.append(SelfTestWorker(logic, volume)) or clients[-1]))
        options = Options(preset="tiny", device="cpu")
        try:
            self.delayDisplay("Segmenting with the self-test worker")
            seg, segmentId, boxes, anchor = logic.segmentBlocking(volume, "the organ", options)
            self.assertEqual(seg.GetSegmentation().GetSegment(segmentId).GetName(), "the organ")
            got = slicer.util.arrayFromSegmentBinaryLabelmap(seg, segmentId, volume)
            self.assertEqual(int(got.sum()), 12 * 20 * 24)
            p = logic.getParameterNode()
            self.assertIs(p.resultVolume, volume)
            geo = logic.geometry(volume)
            for node in boxes:
                c = [0.0, 0.0, 0.0]
                node.GetCenter(c)
                self.assertEqual(geo.slice_of(c), p.keySliceIJK)

            self.delayDisplay("An edit after the result, then Undo")
            got = got.copy()
            got[0, 0, 0] = 1
            slicer.util.updateSegmentBinaryLabelmapFromArray(got, seg, segmentId, volume)
            self.assertEqual(logic.editedSinceResult(), 1)
            with self.assertRaises(EditedSinceResult):
                logic.undoLastResult()
            self.assertIsNotNone(seg.GetSegmentation().GetSegment(segmentId))  # nothing was undone
            self.assertTrue(logic.undoLastResult(discardEdits=True))
            self.assertIsNone(seg.GetSegmentation().GetSegment(segmentId))

            self.delayDisplay("Corrections: a box on another slice, a negative point, a slice range")
            seg, segmentId, boxes, anchor = logic.segmentBlocking(volume, "the organ", options)
            k = p.keySliceIJK
            logic.chooseObject(p, 1)
            logic.addBoxHere(p, ras=geo.slice_center_ras(k + 2))
            logic.addPoint(p, geo.slice_center_ras(k - 1), positive=False, objectNumber=1)
            logic.setRangeEnd(p, "start", ras=geo.slice_center_ras(k - 2))
            logic.setRangeEnd(p, "end", ras=geo.slice_center_ras(k + 3))
            logic.repropagateBlocking(options)
            sent = clients[-1].requests[-1][1]["anchor"]
            self.assertEqual(sent["schema"], "medvol.anchor/2")
            self.assertEqual([(q["object"], q["world"]["box_ras"] is None) for q in sent["prompts"]],
                             [(1, False), (1, True)])
            self.assertEqual(len(p.corrections), 1)  # what ran is shown again
            self.assertEqual(p.points.GetNthControlPointLabel(0), "-1")
            self.assertEqual(logic.sliceRange(p), (k - 2, k + 3))

            self.delayDisplay("The input volume switched: the boxes stay with their volume")
            seg, segmentId, boxes, anchor = logic.segmentBlocking(volume, "the organ", options)
            other = self._syntheticCT("PatientA_CT_2")
            p.inputVolume = other
            with self.assertRaises(ValueError):
                logic.startRepropagate(p, options)

            self.delayDisplay("The scene closed while a request runs")
            p.inputVolume = volume
            job = logic.startSegment(p, options)
            slicer.mrmlScene.Clear(0)
            newcomer = self._syntheticCT("PatientB_CT")
            logic.session.wait(job)
            self.assertEqual(job.state, "cancelled")
            self.assertEqual(slicer.mrmlScene.GetNodesByClass("vtkMRMLSegmentationNode").GetNumberOfItems(), 0)
            self.assertEqual(slicer.mrmlScene.GetNodesByClass("vtkMRMLMarkupsROINode").GetNumberOfItems(), 0)
            self.assertEqual(slicer.mrmlScene.GetNodesByClass("vtkMRMLMarkupsFiducialNode").GetNumberOfItems(), 0)
            p = logic.getParameterNode()
            self.assertEqual((p.anchorJson, p.segmentId, p.resultVolume), ("", "", None))  # nothing of A
            self.assertFalse(logic.canUndo)
            self.assertEqual(logic.firstUsableVolume(), newcomer)
        finally:
            logic.cleanup()
        self.delayDisplay("MedVol-R1 self-test (MRML side) passed")

    def test_segment_edit_repropagate(self):
        import numpy as np

        plan = install.current_plan()
        self.assertFalse(plan.needed, "install the MedVol-R1 packages first (click Segment once):\n" + plan.message())
        from medvolcore.resources import resource_path  # the sample CT travels with medvolcore

        self.delayDisplay("Loading the sample CT")
        volume = slicer.util.loadVolume(str(resource_path("samples/abdomen_ct_30slices.nii.gz")))
        logic = MedVolR1SlicerLogic()
        options = Options(preset="tiny", device="cpu")
        try:
            self.delayDisplay("Segmenting with the tiny preset")
            seg, segmentId, boxes, anchor = logic.segmentBlocking(volume, "the organ that secretes bile", options,
                                                                 timeout=600)
            self.assertIsNotNone(seg.GetSegmentation().GetSegment(segmentId))
            self.assertEqual(seg.GetSegmentation().GetSegment(segmentId).GetName(), "the organ that secretes bile")
            self.assertEqual(len(boxes), len(anchor["boxes"]))
            p = logic.getParameterNode()
            geo = logic.geometry(volume)
            for node in boxes:
                c = [0.0, 0.0, 0.0]
                node.GetCenter(c)
                self.assertEqual(geo.slice_of(c), p.keySliceIJK)
            before = slicer.util.arrayFromSegmentBinaryLabelmap(seg, segmentId, volume).copy()

            self.delayDisplay("Moving a box and re-propagating")
            c = [0.0, 0.0, 0.0]
            boxes[0].GetCenter(c)
            step = geo.to_ras([4, 4, 0]) - geo.to_ras([0, 0, 0])
            boxes[0].SetCenter(*(np.array(c) + step))
            seg2, segmentId2, boxes2, anchor2 = logic.repropagateBlocking(options, timeout=600)
            self.assertEqual(segmentId2, segmentId)  # replaced, not added
            self.assertEqual(anchor2["source"], "user")
            self.assertEqual(anchor2["slice"], anchor["slice"])
            self.assertNotEqual(anchor2["boxes"][0], anchor["boxes"][0])
            after = slicer.util.arrayFromSegmentBinaryLabelmap(seg2, segmentId2, volume)
            self.assertEqual(after.shape, before.shape)
            self.assertEqual(seg2.GetSegmentation().GetNumberOfSegments(), 1)

            self.delayDisplay("Undo")
            self.assertTrue(logic.undoLastResult())
            restored = slicer.util.arrayFromSegmentBinaryLabelmap(seg2, segmentId2, volume)
            self.assertTrue(np.array_equal(restored, before))
        finally:
            logic.cleanup()
        self.delayDisplay("MedVol-R1 self-test passed")
