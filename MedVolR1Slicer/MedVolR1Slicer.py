"""MedVol-R1 in 3D Slicer: type a clinical query, click Segment, see the evidence, edit the
boxes, re-propagate.

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
import json
import logging
import os
import shutil
import tempfile
from typing import List, Optional, Tuple

import qt
import slicer
import vtk
from slicer import vtkMRMLMarkupsROINode, vtkMRMLScalarVolumeNode, vtkMRMLSegmentationNode
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
from MedVolR1SlicerLib.guibinding import GuiBinding
from MedVolR1SlicerLib.geometry import GeometryError, RoiBox, VolumeGeometry, anchor_from_rois, check_untransformed, rois_from_anchor
from MedVolR1SlicerLib.presets import model_presets
from MedVolR1SlicerLib.session import CANCELLING, IDLE, Options, Session

SETTINGS_HISTORY = "MedVolR1Slicer/QueryHistory"
POLL_MS = 100


class MedVolR1Slicer(ScriptedLoadableModule):
    def __init__(self, parent):
        ScriptedLoadableModule.__init__(self, parent)
        self.parent.title = "MedVol-R1"
        self.parent.categories = ["Segmentation"]
        self.parent.dependencies = []
        self.parent.contributors = ["MedVol-R1 for 3D Slicer contributors"]
        self.parent.helpText = (
            "Segment a CT from a free-form clinical query. A vision-language model (Qwen3-VL) picks a key axial "
            "slice and draws boxes on it (the evidence anchor); MedSAM2 propagates them into a 3D mask. Move a box "
            "and click Re-propagate to correct it. Research use only, not a medical device: no trained MedVol-R1 "
            "adapter is published, so the default model answers zero-shot and will often be wrong. "
            "See docs/slicer.md in the project for set-up, weights and a remote worker.")
        self.parent.acknowledgementText = (
            "Method: MedVol-R1 (arXiv 2605.26621). Models: Qwen3-VL (Alibaba Qwen team), MedSAM2 (Bo Wang lab), "
            "SAM 2 (Meta). Research use only; not a medical device.")


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
    boxes: list[vtkMRMLMarkupsROINode]
    keySlice: int = -1  # stack z of the anchor (shown to the user)
    keySliceIJK: int = -1  # the same slice along the volume's slice axis (for re-propagation)
    reasoning: str = ""
    anchorJson: str = ""
    boxesEdited: bool = False


# ---- widget ----------------------------------------------------------------------------------

class MedVolR1SlicerWidget(ScriptedLoadableModuleWidget, VTKObservationMixin):
    def __init__(self, parent=None):
        ScriptedLoadableModuleWidget.__init__(self, parent)
        VTKObservationMixin.__init__(self)
        self.logic = None
        self._parameterNode = None
        self._guiBinding = GuiBinding()  # one GUI connection, also on Slicer 5.8 (no tag)
        self._timer = None
        self._history = params.QueryHistory()
        self._observedBoxes = []

    def setup(self):
        ScriptedLoadableModuleWidget.setup(self)
        uiWidget = slicer.util.loadUI(self.resourcePath("UI/MedVolR1Slicer.ui"))
        self.layout.addWidget(uiWidget)
        self.ui = slicer.util.childWidgetVariables(uiWidget)
        uiWidget.setMRMLScene(slicer.mrmlScene)

        self.logic = MedVolR1SlicerLogic()
        self.logic.session.state_changed.connect(self._onStateChanged)
        self.logic.session.progress.connect(self._onProgress)

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
        self.ui.undoButton.connect("clicked(bool)", self.onUndoButton)
        self.ui.restartWorkerButton.connect("clicked(bool)", self.onRestartWorker)
        self.ui.historyComboBox.connect("activated(int)", self.onHistoryChosen)
        self.ui.queryEdit.connect("textChanged()", self._onQueryEdited)
        self.ui.presetComboBox.connect("currentTextChanged(QString)", lambda t: self._setParam("preset", t))
        self.ui.deviceComboBox.connect("currentTextChanged(QString)", lambda t: self._setParam("device", t))
        self.ui.windowComboBox.connect("currentTextChanged(QString)", lambda t: self._setParam("window", t))
        self.ui.adapterPathLineEdit.connect("currentPathChanged(QString)", lambda t: self._setParam("adapter", t))
        self.ui.remoteUrlLineEdit.connect("textChanged(QString)", lambda t: self._setParam("remoteUrl", t))
        self.ui.workerLocalRadioButton.connect("toggled(bool)", lambda on: self._setParam("worker", "local" if on else "remote"))

        self._timer = qt.QTimer()
        self._timer.setInterval(POLL_MS)
        self._timer.connect("timeout()", self.logic.poll)

        self.addObserver(slicer.mrmlScene, slicer.mrmlScene.StartCloseEvent, self.onSceneStartClose)
        self.addObserver(slicer.mrmlScene, slicer.mrmlScene.EndCloseEvent, self.onSceneEndClose)
        self.addObserver(slicer.mrmlScene, slicer.mrmlScene.NodeRemovedEvent, self.onNodeRemoved)
        self.initializeParameterNode()
        self._onStateChanged(IDLE)

    def cleanup(self):
        self.removeObservers()
        if self._timer is not None:
            self._timer.stop()
        if self.logic is not None:
            self.logic.cleanup()

    def enter(self):
        self.initializeParameterNode()

    def exit(self):
        self._guiBinding.unbind()

    def onSceneStartClose(self, caller, event):
        self.setParameterNode(None)

    def onSceneEndClose(self, caller, event):
        if self.parent.isEntered:
            self.initializeParameterNode()

    def initializeParameterNode(self):
        self.setParameterNode(self.logic.getParameterNode())
        if not self._parameterNode.inputVolume:
            first = slicer.mrmlScene.GetFirstNodeByClass("vtkMRMLScalarVolumeNode")
            if first:
                self._parameterNode.inputVolume = first

    def setParameterNode(self, inputParameterNode):
        if self._parameterNode:
            self._guiBinding.unbind()
            self.removeObserver(self._parameterNode, vtk.vtkCommand.ModifiedEvent, self._onParameterNodeModified)
        self._parameterNode = inputParameterNode
        if self._parameterNode:
            self._guiBinding.bind(self._parameterNode, self.ui)
            self.addObserver(self._parameterNode, vtk.vtkCommand.ModifiedEvent, self._onParameterNodeModified)
            self._updateGuiFromParameterNode()

    def _onParameterNodeModified(self, caller=None, event=None):
        self._updateGuiFromParameterNode()

    def _setParam(self, name, value):
        if self._parameterNode is not None:
            setattr(self._parameterNode, name, value)

    def _updateGuiFromParameterNode(self):
        p = self._parameterNode
        if p is None:  # the scene is closing
            return
        blockers = [self.ui.queryEdit, self.ui.presetComboBox, self.ui.deviceComboBox, self.ui.windowComboBox,
                    self.ui.remoteUrlLineEdit, self.ui.adapterPathLineEdit]
        old = [w.blockSignals(True) for w in blockers]
        if self.ui.queryEdit.toPlainText() != p.query:
            self.ui.queryEdit.setPlainText(p.query)
        self.ui.presetComboBox.setCurrentText(p.preset)
        self.ui.deviceComboBox.setCurrentText(p.device)
        self.ui.windowComboBox.setCurrentText(p.window)
        self.ui.remoteUrlLineEdit.setText(p.remoteUrl)
        self.ui.adapterPathLineEdit.currentPath = p.adapter
        for w, b in zip(blockers, old):
            w.blockSignals(b)
        # Check the radio button that should be on: in an exclusive pair, setChecked(False)
        # on the other one does nothing, so Remote could never be switched back to Local.
        radio = self.ui.workerRemoteRadioButton if p.worker == "remote" else self.ui.workerLocalRadioButton
        if not radio.checked:
            radio.setChecked(True)
        self.ui.keySliceLabel.text = str(p.keySlice) if p.keySlice >= 0 else "–"
        self.ui.reasoningEdit.setPlainText(p.reasoning)
        self._observeBoxes(p.boxes)
        self._updateButtons()

    def _updateButtons(self):
        p = self._parameterNode
        idle = self.logic.session.state == IDLE
        self.ui.segmentButton.enabled = self.logic.session.state != CANCELLING and (
            not idle or bool(p and p.inputVolume and p.query.strip()))
        has_anchor = bool(p and p.anchorJson)
        self.ui.addBoxButton.enabled = idle and has_anchor
        self.ui.repropagateButton.enabled = idle and has_anchor and bool(p.boxesEdited) and len(p.boxes) > 0
        self.ui.undoButton.enabled = idle and self.logic.canUndo
        remote = bool(p and p.worker == "remote")
        self.ui.remoteUrlLineEdit.enabled = self.ui.remoteTokenLineEdit.enabled = remote

    def _onQueryEdited(self):
        self._setParam("query", self.ui.queryEdit.toPlainText())
        self._updateButtons()

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

    @vtk.calldata_type(vtk.VTK_OBJECT)
    def onNodeRemoved(self, caller, event, node):
        p = self._parameterNode
        if p is not None and isinstance(node, vtkMRMLMarkupsROINode) and node in p.boxes:
            p.boxes = [b for b in p.boxes if b is not node]
            p.boxesEdited = True
            self._updateButtons()

    # -- running --
    def _options(self) -> Optional[Options]:
        p = self._parameterNode
        try:
            return params.options_from_panel(p.preset, p.adapter, p.device, p.window, p.worker, p.remoteUrl,
                                             self.ui.remoteTokenLineEdit.text)
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
        try:
            self.logic.runInstallPlan(plan)
        except Exception as e:  # noqa: BLE001 - pip and PyTorchUtils raise many kinds
            slicer.util.errorDisplay(f"Installing the MedVol-R1 packages failed: {e}", windowTitle="MedVol-R1")
            return False
        finally:
            slicer.app.restoreOverrideCursor()
        return not install.current_plan().needed

    def onSegmentButton(self):
        session = self.logic.session
        if session.state != IDLE:
            self.logic.cancel()
            return
        p = self._parameterNode
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
        try:
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
        try:
            self.logic.addBox(self._parameterNode)
        except GeometryError as e:
            slicer.util.errorDisplay(str(e))
        self._updateGuiFromParameterNode()

    def onUndoButton(self):
        if self.logic.undoLastResult():
            self.ui.statusLabel.text = "The last result was taken back."
        self._updateButtons()

    def onRestartWorker(self):
        self.logic.shutdown()
        self.ui.statusLabel.text = "Worker stopped; the next request starts a new one."

    def _onStateChanged(self, state):
        self.ui.segmentButton.text = {"idle": "Segment", "running": "Cancel", "cancelling": "Cancelling…"}[state]
        if state == IDLE and self._timer is not None:
            self._timer.stop()
        self._updateButtons()

    def _onProgress(self, job):
        value, label = params.progress_text(job.stage, job.fraction, job.message)
        self.ui.progressBar.value = value
        self.ui.statusLabel.text = label

    def _onJobFinished(self, job, notes):
        if job.state == "done":
            self.ui.progressBar.value = 100
            self.ui.statusLabel.text = "Done." + ("  " + "; ".join(notes) if notes else "")
        elif job.state == "cancelled":
            self.ui.progressBar.value = 0
            self.ui.statusLabel.text = "Cancelled."
        else:
            self.ui.progressBar.value = 0
            self.ui.statusLabel.text = f"Failed: {job.error.message}"
            if job.error.code == "model_not_found":
                self._offerDownload(self._parameterNode.preset, job.error.message)
            elif job.error.code != "worker_crashed":
                slicer.util.errorDisplay(job.error.message, windowTitle="MedVol-R1")
            else:
                slicer.util.errorDisplay(job.error.message + "\n\nSee the troubleshooting section of docs/slicer.md "
                                         "(out of memory: try the qwen3-vl-2b preset or device cpu).",
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
        if proc.exitStatus() == qt.QProcess.NormalExit and proc.exitCode() == 0:
            slicer.util.infoDisplay(f"Weights of '{preset}' are ready. Click Segment again.")
        else:
            slicer.util.errorDisplay(f"The download failed (exit code {proc.exitCode()}).\n\n" + install.import_hint(preset))


# ---- logic -----------------------------------------------------------------------------------

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
        self._exported = {}  # volume node ID → (MTime, path)
        self._undo = None  # (segmentation, segment ID, previous mask or None when added, volume)

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

    def cleanup(self):
        """Stop the worker and remove the temporary folder (the module is unloaded or Slicer exits)."""
        self.shutdown()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
        self._tmp = None
        self._exported = {}

    def runInstallPlan(self, plan):
        """Run the steps of an :class:`install.InstallPlan` with Slicer's pip helpers."""
        constraints = os.path.join(self.tempDir(), "constraints.txt")
        with open(constraints, "w", encoding="utf-8") as f:
            f.write("\n".join(plan.constraints) + "\n")
        for step in plan.steps:
            if step.kind == "torch":
                import PyTorchUtils  # the PyTorch extension (EXTENSION_DEPENDS)

                if PyTorchUtils.PyTorchUtilsLogic().installTorch(askConfirmation=False,
                                                                 torchVersionRequirement=step.requirement) is None:
                    raise RuntimeError("PyTorch was not installed")
                continue
            old = {k: os.environ.get(k) for k in step.env}
            os.environ.update(step.env)
            try:
                slicer.util.pip_install([a if a != "{constraints}" else constraints for a in step.args])
            finally:
                for k, v in old.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v

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

    def readMask(self, path: str, volumeNode):
        """The worker's mask as a ``(k, j, i)`` uint8 array on ``volumeNode``'s grid. A mask on any
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
        return (slicer.util.arrayFromVolume(label) > 0).astype(np.uint8)

    def exportVolume(self, volumeNode) -> str:
        """The volume as an uncompressed NIfTI the worker reads (same IJK grid and IJK→RAS;
        written again only when the node or its voxels changed). Uncompressed because it is
        read once, next door: gzip would cost seconds on a large CT for nothing."""
        mtime = max(volumeNode.GetMTime(), volumeNode.GetImageData().GetMTime())
        cached = self._exported.get(volumeNode.GetID())
        if cached and cached[0] == mtime and os.path.exists(cached[1]):
            return cached[1]
        folder = self.tempDir()
        path = os.path.join(folder, f"{volumeNode.GetID()}.nii")
        part = os.path.join(folder, f"{volumeNode.GetID()}.part.nii")
        self.writeVolumeFile(volumeNode, part, compress=False)
        os.replace(part, path)  # the worker never sees a half-written file
        self._exported[volumeNode.GetID()] = (mtime, path)
        return path

    # -- requests --
    @staticmethod
    def existingSegmentId(p) -> str:
        """ID of the segment a new result for ``p.query`` would collide with ('' if none)."""
        if p.outputSegmentation is None:
            return ""
        return p.outputSegmentation.GetSegmentation().GetSegmentIdBySegmentName(params.segment_name(p.query)) or ""

    def startSegment(self, p, options: Options, onFinished=None, replaceExisting: bool = False):
        if not p.inputVolume:
            raise ValueError("choose a CT volume first")
        self.geometry(p.inputVolume)  # refuse transformed volumes before the long run
        volume = p.inputVolume
        job = self.session.segment(self.exportVolume(volume), p.query, options)
        job.finished.connect(lambda j: self._finishSegment(p, volume, j, onFinished, replaceExisting))
        return job

    def startRepropagate(self, p, options: Options, onFinished=None) -> Tuple[object, List[str]]:
        """Re-run MedSAM2 on the edited boxes. Returns ``(job, notes)``: notes say which boxes
        had to be put back on the key slice or cut to the image."""
        anchor, notes = self.anchorFromBoxes(p)
        volume = p.inputVolume
        job = self.session.propagate(self.exportVolume(volume), anchor, options)
        job.finished.connect(lambda j: self._finishPropagate(p, volume, j, notes, onFinished))
        return job, notes

    @staticmethod
    def _failJob(job, error: Exception) -> None:
        """A result that came back but could not be put in the scene fails its job, so that the
        panel shows it and ``segmentBlocking`` raises it (instead of returning stale values)."""
        logging.exception("MedVol-R1: applying the result failed")
        kind = "" if isinstance(error, (GeometryError, ValueError, OSError)) else f"{type(error).__name__}: "
        job.state = "failed"
        job.error = WorkerError("apply_failed", f"the result could not be put in the scene: {kind}{error}")

    def _finishSegment(self, p, volume, job, onFinished, replaceExisting=False):
        notes = []
        if job.state == "done":
            try:
                if replaceExisting:
                    p.segmentId = self.existingSegmentId(p)
                notes = self.applyResult(p, volume, job.result, replaceSegment=replaceExisting)
            except Exception as e:  # noqa: BLE001 - every failure must reach the panel and the caller
                self._failJob(job, e)
        if onFinished:
            onFinished(job, notes)

    def _finishPropagate(self, p, volume, job, notes, onFinished):
        if job.state == "done":
            try:
                notes = notes + self.applyResult(p, volume, job.result, replaceSegment=True)
            except Exception as e:  # noqa: BLE001
                self._failJob(job, e)
        if onFinished:
            onFinished(job, notes)

    # -- results → MRML --
    def applyResult(self, p, volumeNode, result: dict, replaceSegment: bool) -> List[str]:
        """Put the mask in a segment named after the query, the boxes on the key slice, the
        reasoning in the parameter node, and show the key slice. Returns notes for the user.

        Everything that can fail on a bad result (the anchor's boxes, the mask file and its grid)
        is checked before the scene is touched, so a failure leaves no empty segment behind."""
        anchor = result["anchor"]
        notes = list(result.get("notes") or [])
        if result.get("smoke"):
            notes.insert(0, "made with the random-weight 'tiny' preset: a smoke test, not a segmentation")
        rois, k = rois_from_anchor(self.geometry(volumeNode), anchor)
        mask = self.readMask(result["mask_path"], volumeNode)

        segNode = p.outputSegmentation
        if segNode is None:
            segNode = slicer.mrmlScene.AddNewNodeByClass("vtkMRMLSegmentationNode", f"{volumeNode.GetName()} MedVol")
            segNode.CreateDefaultDisplayNodes()
            segNode.SetReferenceImageGeometryParameterFromVolumeNode(volumeNode)
            p.outputSegmentation = segNode
        segmentation = segNode.GetSegmentation()
        if replaceSegment and p.segmentId and segmentation.GetSegment(p.segmentId):
            segmentId = p.segmentId
            previous = slicer.util.arrayFromSegmentBinaryLabelmap(segNode, segmentId, volumeNode).copy()
            undo = (segNode, segmentId, previous, volumeNode)
        else:
            existing = [segmentation.GetNthSegment(i).GetName() for i in range(segmentation.GetNumberOfSegments())]
            name = params.unique_name(params.segment_name(anchor.get("query") or p.query), existing)
            segmentId = segmentation.AddEmptySegment("", name)
            undo = (segNode, segmentId, None, volumeNode)
        slicer.util.updateSegmentBinaryLabelmapFromArray(mask, segNode, segmentId, volumeNode)
        self._undo = undo
        p.segmentId = segmentId
        p.reasoning = anchor.get("reasoning") or ""
        p.keySlice = int(anchor["slice"])
        p.anchorJson = json.dumps(anchor)
        self._placeRois(p, rois, k)
        p.boxesEdited = False
        self.showKeySlice(volumeNode, anchor)
        return notes

    @property
    def canUndo(self) -> bool:
        return self._undo is not None and self._undo[0].GetScene() is not None

    def undoLastResult(self):
        """Take back the last result: remove the segment it added, or restore the mask it replaced."""
        if not self.canUndo:
            return False
        segNode, segmentId, previous, volumeNode = self._undo
        self._undo = None
        if segNode.GetSegmentation().GetSegment(segmentId) is None:
            return False
        if previous is None:
            segNode.GetSegmentation().RemoveSegment(segmentId)
        else:
            slicer.util.updateSegmentBinaryLabelmapFromArray(previous, segNode, segmentId, volumeNode)
        return True

    def placeBoxes(self, p, volumeNode, anchor: dict):
        """One ``vtkMRMLMarkupsROINode`` per anchor box, flat on the key slice, from ``world``."""
        rois, k = rois_from_anchor(self.geometry(volumeNode), anchor)
        return self._placeRois(p, rois, k)

    def _placeRois(self, p, rois: List[RoiBox], k: int):
        for old in p.boxes:
            if old is not None and old.GetScene() is not None:
                slicer.mrmlScene.RemoveNode(old)
        nodes = []
        for i, roi in enumerate(rois):
            node = slicer.mrmlScene.AddNewNodeByClass("vtkMRMLMarkupsROINode", f"MedVol box {i + 1}")
            self._setRoi(node, roi)
            nodes.append(node)
        p.boxes = nodes
        p.keySliceIJK = k
        return nodes

    @staticmethod
    def _setRoi(node, roi: RoiBox):
        node.SetAndObserveObjectToNodeMatrix(slicer.util.vtkMatrixFromArray(roi.object_to_node()))
        node.SetCenter(*[float(v) for v in roi.center])
        node.SetSize(*[float(v) for v in roi.size])
        display = node.GetDisplayNode()
        if display is not None:
            display.SetSelectedColor(1.0, 0.8, 0.0)
            display.SetFillOpacity(0.1)

    @staticmethod
    def _getRoi(node) -> RoiBox:
        matrix = slicer.util.arrayFromVTKMatrix(node.GetObjectToNodeMatrix())
        center = [0.0, 0.0, 0.0]
        node.GetCenter(center)
        box = RoiBox.from_object_to_node(matrix, node.GetSize())
        return RoiBox(center, box.size, box.axes)

    def anchorFromBoxes(self, p):
        """The anchor rebuilt from the ROI nodes (``source: "user"``, world coordinates) and the
        notes on what was clamped."""
        if not p.anchorJson or p.keySliceIJK < 0:
            raise ValueError("segment first: there is no key slice to put the boxes on")
        geo = self.geometry(p.inputVolume)
        rois = [self._getRoi(n) for n in p.boxes if n is not None]
        anchor, notes = anchor_from_rois(geo, rois, p.keySliceIJK, query=p.query, reasoning=p.reasoning)
        # put clamped boxes back where they will be used, so what the user sees is what runs
        for node, corners in zip([n for n in p.boxes if n is not None], anchor["world"]["boxes_ras"]):
            roi, _ = geo.roi_from_world_box(corners)
            self._setRoi(node, roi)
        return anchor, notes

    def addBox(self, p):
        """A new box in the middle of the key slice, a quarter of the image wide."""
        if p.keySliceIJK < 0:
            raise GeometryError("segment first: a new box goes on the key slice")
        geo = self.geometry(p.inputVolume)
        lo = [0, 0, 0]
        hi = [0, 0, 0]
        for a in range(3):
            n = geo.shape[a]
            lo[a], hi[a] = (p.keySliceIJK, p.keySliceIJK) if a == geo.slice_axis else (3 * n // 8, 5 * n // 8)
        node = slicer.mrmlScene.AddNewNodeByClass("vtkMRMLMarkupsROINode", f"MedVol box {len(p.boxes) + 1}")
        self._setRoi(node, geo.roi_from_voxels(lo, hi))
        p.boxes = list(p.boxes) + [node]
        p.boxesEdited = True
        return node

    @staticmethod
    def showKeySlice(volumeNode, anchor: dict):
        slicer.util.setSliceViewerLayers(background=volumeNode)
        r, a, s = anchor["world"]["slice_center_ras"]
        slicer.modules.markups.logic().JumpSlicesToLocation(r, a, s, True)

    # -- blocking use (Python console, headless batch) --
    def segmentBlocking(self, volumeNode, query, options: Optional[Options] = None, segmentationNode=None,
                        timeout: Optional[float] = None):
        """Segment and wait. Returns ``(segmentationNode, segmentId, roiNodes, anchor)``;
        raises :class:`WorkerError` on failure."""
        p = self.getParameterNode()
        p.inputVolume = volumeNode
        p.query = query
        p.outputSegmentation = segmentationNode
        p.segmentId = ""
        job = self.startSegment(p, options or Options(preset=p.preset, device=p.device))
        self.session.wait(job, timeout)
        if job.error is not None:
            raise job.error
        return p.outputSegmentation, p.segmentId, list(p.boxes), json.loads(p.anchorJson)

    def repropagateBlocking(self, options: Optional[Options] = None, timeout: Optional[float] = None):
        """Re-propagate the (edited) boxes of the last result and wait; the same segment is
        replaced. Returns what :meth:`segmentBlocking` returns; raises :class:`WorkerError`."""
        p = self.getParameterNode()
        job, _ = self.startRepropagate(p, options or Options(preset=p.preset, device=p.device))
        self.session.wait(job, timeout)
        if job.error is not None:
            raise job.error
        return p.outputSegmentation, p.segmentId, list(p.boxes), json.loads(p.anchorJson)


# ---- self-test -------------------------------------------------------------------------------

class MedVolR1SlicerTest(ScriptedLoadableModuleTest):
    """Runs with the ``tiny`` preset (random weights, no download): load the sample CT, segment,
    check the segment and the boxes on the key slice, move a box, re-propagate, undo. (The same
    steps run in CI against slicer-core: Testing/slicer_mrml/test_mrml_worker_batch.py.)"""

    def setUp(self):
        slicer.mrmlScene.Clear()

    def runTest(self):
        self.setUp()
        self.test_segment_edit_repropagate()

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
