"""The module's panel (``MedVolR1SlicerWidget``): it wires the ``.ui`` to the parameter node and
calls the logic; it never changes the scene itself. Its correction controls are
:mod:`.correction_controls`, its worker settings (application settings, not the scene's) and the
question before a CT is sent away :mod:`.worker_settings`, its install and download dialogs
:mod:`.install_dialogs`.

:meth:`MedVolR1SlicerWidget.setup` builds the Qt side (widgets, signals, shortcuts, the poll
timer) and then calls :meth:`~MedVolR1SlicerWidget.setupScene`, the part without Qt (scene
observers, the parameter node, the button rules). ``Testing/slicer_qt`` runs both on real Qt
widgets over real MRML."""

from __future__ import annotations

import logging
from typing import Optional

import qt
import slicer
import vtk
from slicer.ScriptedLoadableModule import ScriptedLoadableModuleWidget
from slicer.util import VTKObservationMixin

from MedVolR1SlicerLib import params
from MedVolR1SlicerLib.client import WorkerError
from MedVolR1SlicerLib.geometry import GeometryError
from MedVolR1SlicerLib.guibinding import GuiBinding
from MedVolR1SlicerLib.presets import model_presets, model_text
from MedVolR1SlicerLib.reloading import reload_order
from MedVolR1SlicerLib.segments import segment_name
from MedVolR1SlicerLib.session import CANCELLING, IDLE, Options
from MedVolR1SlicerScene.logic import MedVolR1SlicerLogic
from MedVolR1SlicerScene.history import EditedSinceResult

from .correction_controls import CorrectionControls
from .install_dialogs import ensure_installed, offer_download
from .segment_selection import SegmentSelection
from .worker_settings import WorkerSettings

SETTINGS_HISTORY = "MedVolR1Slicer/QueryHistory"
POLL_MS = 100


class MedVolR1SlicerWidget(ScriptedLoadableModuleWidget, VTKObservationMixin, CorrectionControls, WorkerSettings,
                           SegmentSelection):
    """The panel. :meth:`setup` builds the Qt side (widgets, signals, the poll timer) and then
    calls :meth:`setupScene`, the part without Qt (scene observers, the parameter node, the
    button rules)."""

    def __init__(self, parent=None):
        ScriptedLoadableModuleWidget.__init__(self, parent)
        VTKObservationMixin.__init__(self)
        self.logic = None
        self._parameterNode = None
        self._guiBinding = GuiBinding()  # one GUI connection, also on Slicer 5.8 (no tag)
        self._timer = None
        self._history = params.QueryHistory()
        self._initCorrectionControls()
        self._initWorkerSettings()
        self._initSegmentSelection()
        self._observedSegmentation = None
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
        self._loadWorkerSettings()  # the application's, never the scene's

        self.ui.segmentButton.connect("clicked(bool)", self.onSegmentButton)
        self.ui.repropagateButton.connect("clicked(bool)", self.onRepropagateButton)
        self._connectCorrectionControls()
        self.ui.undoButton.connect("clicked(bool)", self.onUndoButton)
        self.ui.redoButton.connect("clicked(bool)", self.onRedoButton)
        self._connectSegmentSelection()
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
        self._connectWorkerSettings()
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
        self.logic.selectionChanged = self._onSelectionChanged  # why the evidence shown changed or went
        self.logic.session.state_changed.connect(self._onStateChanged)
        self.logic.session.progress.connect(self._onProgress)
        self.addObserver(slicer.mrmlScene, slicer.mrmlScene.StartCloseEvent, self.onSceneStartClose)
        self.addObserver(slicer.mrmlScene, slicer.mrmlScene.EndCloseEvent, self.onSceneEndClose)
        self.addObserver(slicer.mrmlScene, slicer.mrmlScene.EndImportEvent, self.onSceneEndImport)
        self.addObserver(slicer.mrmlScene, slicer.mrmlScene.NodeRemovedEvent, self.onNodeRemoved)
        interaction = self.logic._interactionNode()
        if interaction is not None:  # place mode started or ended (here, in the toolbar, by a right-click)
            self.addObserver(interaction, interaction.InteractionModeChangedEvent, self._onInteractionModeChanged)
        self._setupSegmentSelection()
        self.initializeParameterNode()
        self._onStateChanged(self.logic.session.state)

    def cleanup(self):
        """The module is unloaded (or reloaded) or Slicer exits: stop the worker, drop every
        observer and the GUI connection."""
        self.removeObservers()
        self._forgetCorrectionObservers()
        self._forgetSegmentSelection()
        self._observedSegmentation = None
        self._removeNegativeShortcut()
        self._guiBinding.unbind()
        self._guiBinding.forget()
        self._parameterNode = None
        if self._timer is not None:
            self._timer.stop()
        if self.logic is not None:
            self.logic.beforeChange = None
            self.logic.selectionChanged = None
            self.logic.session.state_changed.disconnect(self._onStateChanged)
            self.logic.session.progress.disconnect(self._onProgress)
            self.logic.cleanup()

    def onReload(self):
        """Developer "Reload": Slicer reloads the module file only; the Lib, Scene and Panel parts
        are reloaded here first, each after what it imports (:mod:`MedVolR1SlicerLib.reloading`
        reads the order from the files), so that an edited part takes effect too."""
        import importlib
        import sys

        for name in reload_order():
            module = sys.modules.get(name)
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

    def onSceneStartClose(self, caller, event):
        # the logic cancels the running request and forgets the scene's result (its own observer)
        self.setParameterNode(None)

    def onSceneEndClose(self, caller, event):
        if self.parent is not None and self.parent.isEntered:
            self.initializeParameterNode()

    def onSceneEndImport(self, caller, event):
        """A scene was opened: worker settings an older version saved in it are dropped (once)."""
        self._sayIgnoredSceneWorkerSettings()

    def initializeParameterNode(self):
        self.setParameterNode(self.logic.getParameterNode())
        if not self._parameterNode.inputVolume:
            first = self.logic.firstUsableVolume()  # not a label map or a colour volume
            if first:
                self._parameterNode.inputVolume = first
        self._sayIgnoredSceneWorkerSettings()

    def setParameterNode(self, inputParameterNode):
        same = (inputParameterNode is not None and self._parameterNode is not None
                and inputParameterNode.parameterNode is self._parameterNode.parameterNode)
        if same:  # module re-entered: keep the connection and the observer
            self._updateGuiFromParameterNode()
            return
        # The MRML node is observed, not its wrapper: VTKObservationMixin keeps every object it
        # ever observed as a key (removeObserver leaves it), and a wrapper kept alive keeps its
        # fields' cache observers on the node, one set per scene close.
        if self._parameterNode:
            self._guiBinding.unbind()
            self.removeObserver(self._parameterNode.parameterNode, vtk.vtkCommand.ModifiedEvent,
                                self._onParameterNodeModified)
        self._parameterNode = inputParameterNode
        if self._parameterNode:
            self._guiBinding.bind(self._parameterNode, self.ui)
            self.addObserver(self._parameterNode.parameterNode, vtk.vtkCommand.ModifiedEvent,
                             self._onParameterNodeModified)
            self._updateGuiFromParameterNode()
        else:
            self._guiBinding.forget()
            self._observeBoxes([])
            self._observeSegmentation(None)
            self._updateSegmentChoices()
            self._updateButtons()  # Show 3D: no result, no surface

    def _onSelectionChanged(self, note: str) -> None:
        self.ui.statusLabel.text = note

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
                    self.ui.adapterPathLineEdit]
        old = [w.blockSignals(True) for w in blockers]
        if self.ui.queryEdit.toPlainText() != p.query:
            self.ui.queryEdit.setPlainText(p.query)
            self._queryText = p.query
        for combo, value in ((self.ui.presetComboBox, p.preset), (self.ui.deviceComboBox, p.device),
                             (self.ui.windowComboBox, p.window)):
            if combo.currentText != value:  # as a line edit: the edit being typed is not written back
                combo.setCurrentText(value)
        self._setText(self.ui.adapterPathLineEdit, "currentPath", p.adapter)
        for w, b in zip(blockers, old):
            w.blockSignals(b)
        self.ui.modelLabel.text = model_text(p.preset, p.adapter)  # zero-shot, MedVol-R1 needs an adapter, …
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
        self._observeSegmentation(p.outputSegmentation)
        self._updateObjectChoices()
        self._updateSegmentChoices()
        self._updateButtons()

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
        self.ui.repropagateButton.enabled = (idle and editable and (bool(p.boxesEdited) or self.logic.segmentPainted(p))
                                             and any(b is not None for b in p.boxes))
        tip = self.logic.resultProblem(p) if p and p.anchorJson and not editable else ""
        self.ui.repropagateButton.toolTip = tip or ("Propagate the edited boxes and the corrections (boxes on other "
                                                    "slices, points, slice range, slices repainted in the Segment "
                                                    "Editor) again and replace the segment.")
        for name in ("addBoxButton", "placePointsButton", "setRangeStartButton", "setRangeEndButton"):
            w = getattr(self.ui, name)
            usual = self._tips.setdefault(name, w.toolTip)  # the .ui's tooltip, read once
            w.toolTip = tip or usual
        depth, redo = (self.logic.undoDepth(p), self.logic.undoDepth(p, undo=False)) if p else (0, 0)
        self.ui.undoButton.enabled = idle and depth > 0
        self.ui.redoButton.enabled = idle and redo > 0
        self.ui.undoButton.toolTip = (f"Take back {self.logic.undoText(p)} ({depth} result{'s' if depth != 1 else ''} "
                                      "of this segmentation can be taken back), with its evidence (Alt+U)."
                                      if depth else "Nothing to take back in this segmentation.")
        self.ui.segmentComboBox.enabled = idle and bool(self._segmentChoices)
        self.ui.jumpButton.enabled = has_result
        has_segment = bool(p and p.outputSegmentation is not None and p.segmentId)
        self.ui.editButton.enabled = idle and has_segment
        self.ui.show3DCheckBox.enabled = p is not None and p.outputSegmentation is not None
        self._updateShow3D()
        self.ui.remoteUrlLineEdit.enabled = self.ui.remoteTokenLineEdit.enabled = self._remoteChosen() and idle

    def _updateShow3D(self):
        """Show 3D says whether the result's segmentation is shown as a surface: unchecked for a new
        segmentation and after a scene close, checked when it was made here or elsewhere."""
        shown = bool(self._parameterNode is not None and self.logic.showsSurface(self._parameterNode))
        box = self.ui.show3DCheckBox
        if bool(box.checked) != shown:
            blocked = box.blockSignals(True)  # showing what is, not asking for a change
            box.checked = shown
            box.blockSignals(blocked)

    def _observeSegmentation(self, node):
        """A surface made or removed elsewhere (Segment Editor, Segmentations) updates Show 3D."""
        if node is self._observedSegmentation:
            return
        event = slicer.vtkSegmentation.ContainedRepresentationNamesModified
        if self._observedSegmentation is not None:
            self.removeObserver(self._observedSegmentation, event, self._onRepresentationsChanged)
        self._observedSegmentation = node
        if node is not None:
            self.addObserver(node, event, self._onRepresentationsChanged)

    def _onRepresentationsChanged(self, caller=None, event=None):
        self._updateButtons()

    def _onQueryEdited(self):
        text = self.ui.queryEdit.toPlainText()
        app = getattr(qt, "QApplication", None)  # Shift+Enter starts a new line: one query per line
        shift = app is not None and bool(app.keyboardModifiers() & qt.Qt.ShiftModifier)
        query, submit = params.query_submitted(self._queryText, text, newLine=shift)
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

    def _options(self) -> Optional[Options]:
        p = self._parameterNode
        worker, url, token = self._workerOptions()  # application settings; the token typed for this address
        try:
            return params.options_from_panel(p.preset, p.adapter, p.device, p.window, worker, url, token,
                                             consensus=p.consensus)
        except ValueError as e:
            slicer.util.errorDisplay(str(e))
            return None

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
        if options is None or not ensure_installed(self.logic, options, self.ui, self._useRemoteWorker):
            return
        if not self._confirmUpload(options):  # the first CT to a remote address: asked, naming it
            return
        self._history.add(p.query)
        qt.QSettings().setValue(SETTINGS_HISTORY, self._history.to_json())
        self._refreshHistory()
        replace = False
        existing = self.logic.existingSegmentId(p)
        if existing:
            box = qt.QMessageBox(qt.QMessageBox.Question, "MedVol-R1",
                                 f"The segmentation already has a segment named “{segment_name(p.query)}”.",
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
        if options is None or not self._confirmUpload(options):
            return
        try:
            _, notes = self.logic.startRepropagate(self._parameterNode, options, self._onJobFinished)
        except (WorkerError, GeometryError, ValueError) as e:
            slicer.util.errorDisplay(str(e), windowTitle="MedVol-R1")
            return
        if notes:
            self.ui.statusLabel.text = "; ".join(notes)
        self._timer.start()

    def onUndoButton(self):
        self._undoOrRedo(undo=True)

    def onRedoButton(self):
        self._undoOrRedo(undo=False)

    def _undoOrRedo(self, undo: bool):
        """Undo or Redo in the segmentation shown; asks first when it would throw edits away."""
        p = self._parameterNode
        action = self.logic.undoLastResult if undo else self.logic.redoLastResult
        what = self.logic.undoText(p, undo)
        try:
            done = action(p=p)
        except EditedSinceResult as e:
            word = "Undo" if undo else "Redo"
            if not slicer.util.confirmYesNoDisplay(f"{e}.\n\n{word} anyway?", windowTitle=f"MedVol-R1: {word}"):
                return
            done = action(discardEdits=True, p=p)
        if done:
            self.ui.statusLabel.text = f"{'Taken back' if undo else 'Put back'}: {what}."
        self._updateGuiFromParameterNode()

    def onJumpButton(self):
        self.logic.jumpToKeySlice(self._parameterNode)

    def onShow3D(self, show):
        if self._parameterNode is not None:
            self.logic.setShow3D(self._parameterNode, show)
        self._updateButtons()  # the box shows what is shown

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
                offer_download(job.request.get("preset") or self._parameterNode.preset, job.error.message)
            elif job.error.code != "worker_crashed":
                slicer.util.errorDisplay(job.error.message, windowTitle="MedVol-R1")
            else:
                slicer.util.errorDisplay(job.error.message + "\n\nSee the troubleshooting section of docs/slicer.md "
                                         "(out of memory: choose a smaller preset or device cpu).",
                                         windowTitle="MedVol-R1: the worker stopped")
        self._updateGuiFromParameterNode()

