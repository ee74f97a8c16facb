"""The panel's non-Qt half on real MRML: ``MedVolR1SlicerWidget.setupScene`` with the Qt widgets
replaced by :class:`FakeWidget` objects (attributes and the few methods the panel calls; no Qt).
What is checked: one GUI connection across module visits, box observers, a box deleted in the
scene, the button rules (a switched volume, a running request locks the inputs), line edits left
alone when their text has not changed, a scene closed, and ``cleanup()``.

The panel module imports ``qt`` and ``ctk`` at the top (it is the module's Qt part); this tier
has neither, so :func:`widget_class` imports it over empty ones for this file only (nothing of
them is used by ``setupScene``). The ``.ui``, the signals' wiring in ``setup()``, the shortcuts
and the dialogs are tested in real Qt: ``Testing/slicer_qt``."""

from __future__ import annotations

import types

import pytest

pytest.importorskip("slicer_core", reason="slicer-core is not installed (bootstrap.py --no-slicer-core)")
import slicer  # noqa: E402 - the real package, imported by conftest.py
import vtk  # noqa: E402

from test_mrml_clinician_day import LIVER, ManualClient, answer_for, load_ct  # noqa: E402


@pytest.fixture(scope="module")
def widget_class(slicer_env):
    """``MedVolR1SlicerWidget``, imported over empty ``qt``/``ctk`` modules that are taken away
    again after this file (the logic's tests run without any)."""
    import sys

    with pytest.MonkeyPatch.context() as mp:
        for name in ("qt", "ctk"):
            mp.setitem(sys.modules, name, types.ModuleType(name))
        from MedVolR1SlicerPanel.panel import MedVolR1SlicerWidget

        yield MedVolR1SlicerWidget


class FakeWidget:
    """A Qt widget as far as the panel touches it; counts writes of ``text``/``currentPath``
    (a write moves a line edit's cursor to the end)."""

    def __init__(self, name):
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "writes", {})
        object.__setattr__(self, "_plain", "")
        self.enabled = True
        self.checked = False
        self.text = ""
        self.currentText = ""  # a QComboBox's
        self.currentPath = ""
        self.currentText = ""  # a combo box's text (the panel compares before writing it)
        self.toolTip = ""
        self.value = 0
        self._blocked = False
        self.writes.clear()

    def __setattr__(self, name, value):
        self.writes[name] = self.writes.get(name, 0) + 1
        object.__setattr__(self, name, value)

    def blockSignals(self, on):
        old, self._blocked = self._blocked, on
        return old

    def property(self, name):
        """No dynamic properties: Slicer's ``connectGui`` asks each widget of a namespace for
        ``SlicerParameterName`` (wrapper.py:249-251 at v5.12.3); these fakes bind to nothing."""
        return None

    def toPlainText(self):
        return self._plain

    def setPlainText(self, text):
        self._plain = text

    def setCurrentText(self, text):
        self.currentText = text

    def setChecked(self, on):
        self.checked = on

    # a QComboBox: items (text, data) and the current index
    def clear(self):
        object.__setattr__(self, "items", [])
        self.currentIndex = -1

    def addItem(self, text, data=None):
        if not hasattr(self, "items"):
            object.__setattr__(self, "items", [])
        self.items.append((text, data))

    def setCurrentIndex(self, index):
        self.currentIndex = index


UI_NAMES = ["queryEdit", "presetComboBox", "deviceComboBox", "windowComboBox", "remoteUrlLineEdit",
            "adapterPathLineEdit", "remoteTokenLineEdit", "workerLocalRadioButton", "workerRemoteRadioButton",
            "keySliceLabel", "reasoningEdit", "segmentButton", "addBoxButton", "repropagateButton", "undoButton",
            "jumpButton", "editButton", "show3DCheckBox", "inputVolumeSelector", "historyComboBox",
            "outputSegmentationSelector", "progressBar", "statusLabel", "objectComboBox", "placePointsButton",
            "negativePointsButton", "clearCorrectionsButton", "rangeLabel", "setRangeStartButton", "setRangeEndButton",
            "clearRangeButton", "modelLabel", "confidenceLabel", "redoButton", "segmentComboBox"]


@pytest.fixture
def panel(slicer_env, scene, widget_class):
    """The widget's non-Qt half with fake widgets and a :class:`ManualClient` worker."""
    from MedVolR1SlicerLib.session import Session

    client = ManualClient()
    widget = widget_class(parent=types.SimpleNamespace(isEntered=True))
    widget.ui = types.SimpleNamespace(**{n: FakeWidget(n) for n in UI_NAMES})
    widget.setupScene(slicer_env.MedVolR1SlicerLogic(session=Session(client_factory=lambda options: client)))
    widget.client = client
    yield widget
    widget.cleanup()


def connections(slicer_env):
    return slicer_env.MedVolR1SlicerParameterNode.connections


def run_segment(panel, volume, tmp_path, labels_ijk, tiny):
    p = panel._parameterNode
    p.inputVolume, p.query = volume, "the liver"
    job = panel.logic.startSegment(p, tiny, panel._onJobFinished)
    assert panel.ui.queryEdit.enabled is False and panel.ui.inputVolumeSelector.enabled is False  # locked
    result, _ = answer_for(panel.logic, volume, labels_ijk, [LIVER], tmp_path, "the liver")
    panel.client.answer(job, result)
    assert job.state == "done", job.error
    return job


@pytest.fixture
def labels_ijk(seg_sm_path):
    import nibabel as nib
    import numpy as np

    return np.asarray(nib.load(str(seg_sm_path)).dataobj).astype(np.uint8)


@pytest.fixture
def tiny(slicer_env):
    from MedVolR1SlicerLib.session import Options

    return Options(preset="tiny", device="cpu")


def test_one_gui_connection_across_module_visits_and_none_after_cleanup(slicer_env, scene, widget_class):
    from MedVolR1SlicerLib.session import Session

    widget = widget_class(parent=types.SimpleNamespace(isEntered=True))
    widget.ui = types.SimpleNamespace(**{n: FakeWidget(n) for n in UI_NAMES})
    client = ManualClient()
    widget.setupScene(slicer_env.MedVolR1SlicerLogic(session=Session(client_factory=lambda options: client)))
    before = len(connections(slicer_env))
    made = slicer_env.MedVolR1SlicerParameterNode.calls["connectGui"]
    observers = len(widget.Observations)
    for _ in range(5):  # leave the module and come back, five times
        widget.exit()
        widget.enter()
    assert len(connections(slicer_env)) == before == 1
    # not even connected again: on Slicer 5.10 every connectGui/disconnectGui pair leaks an observer
    assert slicer_env.MedVolR1SlicerParameterNode.calls["connectGui"] == made
    assert len(widget.Observations) == observers
    p = widget._parameterNode
    p.inputVolume, p.query = None, "the liver"
    widget.logic.session.segment("/nonexistent.nii", "the liver", widget._options())  # a worker client exists
    widget.cleanup()
    assert connections(slicer_env) == {} and widget.Observations == []
    assert client.stopped


def test_line_edits_are_not_rewritten_when_their_text_has_not_changed(panel):
    url, adapter = panel.ui.remoteUrlLineEdit, panel.ui.adapterPathLineEdit
    url.writes.clear()
    adapter.writes.clear()
    p = panel._parameterNode
    for q in ("the", "the liv", "the liver"):  # every keystroke in the query modifies the node
        p.query = q
    assert url.writes.get("text", 0) == 0 and adapter.writes.get("currentPath", 0) == 0
    p.adapter = "/runs/run1/adapter"  # (the remote URL was a parameter here before it became a setting)
    assert adapter.currentPath == "/runs/run1/adapter" and adapter.writes["currentPath"] == 1


def test_volume_auto_selection_skips_label_maps(slicer_env, scene, ct_sm_path, widget_class):
    from MedVolR1SlicerLib.session import Session

    label = slicer.mrmlScene.AddNewNodeByClass("vtkMRMLLabelMapVolumeNode", "labels")
    image = vtk.vtkImageData()
    image.SetDimensions(4, 4, 4)
    image.AllocateScalars(vtk.VTK_UNSIGNED_CHAR, 1)
    label.SetAndObserveImageData(image)
    ct = load_ct(ct_sm_path, "CT")
    widget = widget_class(parent=types.SimpleNamespace(isEntered=True))
    widget.ui = types.SimpleNamespace(**{n: FakeWidget(n) for n in UI_NAMES})
    widget.setupScene(slicer_env.MedVolR1SlicerLogic(session=Session(client_factory=ManualClient)))
    try:
        assert widget._parameterNode.inputVolume is ct
    finally:
        widget.cleanup()


def test_buttons_follow_the_result_its_volume_and_its_boxes(panel, ct_sm_path, tmp_path, labels_ijk, tiny):
    ui = panel.ui
    a, b = load_ct(ct_sm_path, "PatientA_CT"), load_ct(ct_sm_path, "PatientB_CT")
    assert not ui.repropagateButton.enabled and not ui.addBoxButton.enabled and not ui.undoButton.enabled
    run_segment(panel, a, tmp_path, labels_ijk, tiny)
    p = panel._parameterNode
    assert ui.queryEdit.enabled and ui.inputVolumeSelector.enabled  # unlocked when it ended
    assert ui.addBoxButton.enabled and ui.undoButton.enabled and ui.jumpButton.enabled and ui.editButton.enabled
    assert not ui.repropagateButton.enabled  # nothing edited yet
    assert ui.keySliceLabel.text.startswith("S ") and " mm (slice " in ui.keySliceLabel.text

    # a box dragged: the observer enables Re-propagate
    c = [0.0, 0.0, 0.0]
    p.boxes[0].GetCenter(c)
    p.boxes[0].SetCenter(c[0] + 5, c[1], c[2])
    assert p.boxesEdited and ui.repropagateButton.enabled

    # another volume selected: the boxes belong to A, Re-propagate and Add box say so
    p.inputVolume = b
    assert not ui.repropagateButton.enabled and not ui.addBoxButton.enabled
    assert "drawn on PatientA_CT" in ui.repropagateButton.toolTip
    p.inputVolume = a
    assert ui.repropagateButton.enabled


def test_a_box_deleted_in_the_scene_leaves_the_list_and_its_observers(panel, ct_sm_path, tmp_path, labels_ijk, tiny):
    volume = load_ct(ct_sm_path)
    run_segment(panel, volume, tmp_path, labels_ijk, tiny)
    p = panel._parameterNode
    panel.logic.addBox(p)
    first, second = p.boxes
    assert panel._observedBoxes == [first, second]
    p.boxesEdited = False
    seen = []
    original = panel.onNodeRemoved

    def spy(caller, event, node):  # what the panel's handler sees during NodeRemovedEvent
        seen.append(list(panel._parameterNode.boxes))
        original(caller, event, node)

    panel.removeObserver(slicer.mrmlScene, slicer.mrmlScene.NodeRemovedEvent, original)
    panel.addObserver(slicer.mrmlScene, slicer.mrmlScene.NodeRemovedEvent, vtk.calldata_type(vtk.VTK_OBJECT)(spy))
    slicer.mrmlScene.RemoveNode(first)
    assert seen == [[first, second]]  # Slicer's wrapper still lists it during the event (its cache)
    assert p.boxes == [second] and panel._observedBoxes == [second]
    assert p.boxesEdited and panel.ui.repropagateButton.enabled
    assert not any(o[0] is first for o in panel.Observations)


def test_closing_the_scene_clears_the_panel_and_keeps_one_connection(slicer_env, panel, ct_sm_path, tmp_path,
                                                                    labels_ijk, tiny):
    volume = load_ct(ct_sm_path)
    run_segment(panel, volume, tmp_path, labels_ijk, tiny)
    assert panel.ui.reasoningEdit.toPlainText() == "because"
    panel._parameterNode.confidence = "0.50: agreement of 4 answers"  # what a consensus result leaves there
    assert panel.ui.confidenceLabel.text == "0.50: agreement of 4 answers"
    slicer.mrmlScene.Clear(0)
    assert panel._parameterNode is not None  # the new scene's parameter node, bound again
    assert len(connections(slicer_env)) == 1
    assert panel.ui.reasoningEdit.toPlainText() == "" and panel.ui.keySliceLabel.text == "–"
    assert panel.ui.confidenceLabel.text == "–"
    assert not panel.ui.undoButton.enabled and not panel.ui.jumpButton.enabled and not panel.ui.editButton.enabled
    assert panel._observedBoxes == []


def test_enter_in_the_query_box_runs_segment(panel, ct_sm_path):
    volume = load_ct(ct_sm_path)
    panel._parameterNode.inputVolume = volume
    started = []
    panel.onSegmentButton = lambda: started.append(panel._parameterNode.query)
    for text in ("the liv", "the liver"):  # typed
        panel.ui.queryEdit.setPlainText(text)
        panel._onQueryEdited()
    assert started == []
    panel.ui.queryEdit.setPlainText("the liver\n")  # Enter
    panel._onQueryEdited()
    assert started == ["the liver"] and panel.ui.queryEdit.toPlainText() == "the liver"


def test_the_correction_controls_follow_the_result_and_the_scene(panel, ct_sm_path, tmp_path, labels_ijk, tiny):
    """Object selector, Add box here, points (place mode, the N key), the slice range and Clear
    corrections: what they enable, what they observe, a node deleted in the scene, and a
    switched volume that blocks them as it blocks Add box."""
    ui = panel.ui
    correction_buttons = (ui.addBoxButton, ui.objectComboBox, ui.placePointsButton, ui.negativePointsButton,
                          ui.setRangeStartButton, ui.setRangeEndButton)
    assert not any(w.enabled for w in correction_buttons)
    a = load_ct(ct_sm_path, "PatientA_CT")
    run_segment(panel, a, tmp_path, labels_ijk, tiny)
    p, logic = panel._parameterNode, panel.logic
    geo = logic.geometry(a)
    k = p.keySliceIJK
    assert all(w.enabled for w in correction_buttons)
    assert not ui.clearRangeButton.enabled and not ui.clearCorrectionsButton.enabled
    assert ui.objectComboBox.items == [("1", 1), ("New object", 0)] and ui.objectComboBox.currentIndex == 0
    assert ui.rangeLabel.text == "whole volume"

    # "New object" chosen in the selector: numbered at once, and shown as being started
    panel.onObjectChosen(1)
    assert p.correctionObject == 2
    assert ui.objectComboBox.items == [("1", 1), ("2 (new)", 2), ("New object", 0)]
    assert ui.objectComboBox.currentIndex == 1

    # Add box here on another slice (through the Red view): a correction, observed like a box
    red = logic.redSliceNode()  # a singleton: kept across scene closes, as in Slicer
    if red is None:
        red = slicer.mrmlScene.AddNewNodeByClass("vtkMRMLSliceNode")
        red.SetLayoutName("Red")
        red.SetOrientationToAxial()
    red.JumpSliceByCentering(*geo.slice_center_ras(k - 1))
    panel.onAddBoxButton()
    (box,) = p.corrections
    assert logic.nodeObject(box) == 2 and logic.nodeSlice(box) == k - 1
    assert box in panel._observedBoxes and ui.clearCorrectionsButton.enabled and ui.repropagateButton.enabled
    assert ui.objectComboBox.items == [("1", 1), ("2", 2), ("New object", 0)]

    # points: place mode on and off, the N key, a moved point marks the result edited
    panel.onPlacePointsButton()
    assert logic.placingPoints(p) and ui.placePointsButton.checked
    assert p.points.GetControlPointLabelFormat() == "+2"
    panel.onToggleNegative()  # N
    assert p.negativePoints and ui.negativePointsButton.checked
    assert p.points.GetControlPointLabelFormat() == "-2" and "outside" in ui.statusLabel.text
    index = p.points.AddControlPoint(*geo.slice_center_ras(k - 1))  # as a click in a view adds it
    assert p.points.GetNthControlPointLabel(index) == "-2"
    assert panel._observedPoints is p.points
    panel.onPlacePointsButton()
    assert not logic.placingPoints(p) and not ui.placePointsButton.checked
    p.boxesEdited = False
    p.points.SetNthControlPointPosition(index, *geo.slice_center_ras(k - 2))
    assert p.boxesEdited

    # the range, from the Red view
    red.JumpSliceByCentering(*geo.slice_center_ras(k + 2))
    panel.onSetRangeEnd("end")
    assert ui.rangeLabel.text.startswith("end: slice ") and ui.clearRangeButton.enabled
    red.JumpSliceByCentering(*geo.slice_center_ras(k - 3))
    panel.onSetRangeEnd("start")
    assert ui.rangeLabel.text.startswith("slices ")
    panel.onClearRange()
    assert ui.rangeLabel.text == "whole volume" and not ui.clearRangeButton.enabled

    # nodes deleted in the scene leave their fields and observers
    slicer.mrmlScene.RemoveNode(box)
    assert p.corrections == [] and box not in panel._observedBoxes
    points = p.points
    slicer.mrmlScene.RemoveNode(points)
    assert p.points is None and panel._observedPoints is None
    assert not any(o[0] is points for o in panel.Observations)
    assert not ui.clearCorrectionsButton.enabled

    # another volume selected: the corrections belong to A, their buttons say so
    p.inputVolume = load_ct(ct_sm_path, "PatientB_CT")
    assert not any(w.enabled for w in correction_buttons)
    assert "drawn on PatientA_CT" in ui.addBoxButton.toolTip and "drawn on PatientA_CT" in ui.setRangeEndButton.toolTip
    p.inputVolume = a
    assert all(w.enabled for w in correction_buttons) and "drawn on" not in ui.addBoxButton.toolTip


def test_the_panel_names_the_model_before_and_after_a_run(panel, ct_sm_path, tmp_path, labels_ijk, tiny):
    """No trained MedVol-R1 adapter is published: the model line says what the selected preset runs
    as (``MedVolR1SlicerLib.presets.model_text``), and the status after a run names the model that
    made the result, as the worker reports it."""
    from MedVolR1SlicerLib.presets import model_text

    p, ui = panel._parameterNode, panel.ui
    p.preset = "qwen3-vl-4b"
    assert ui.modelLabel.text == model_text("qwen3-vl-4b", "") and "zero-shot" in ui.modelLabel.text
    p.preset = "medvol-r1"
    assert "needs a trained adapter" in ui.modelLabel.text
    p.adapter = str(tmp_path / "run1" / "adapter")
    assert "LoRA adapter run1/adapter" in ui.modelLabel.text
    p.inputVolume, p.query = load_ct(ct_sm_path, "PatientA_CT"), "the liver"
    job = panel.logic.startSegment(p, tiny, panel._onJobFinished)
    result, _ = answer_for(panel.logic, p.inputVolume, labels_ijk, [LIVER], tmp_path, "the liver")
    result["model_label"] = "Qwen3-VL-4B-Instruct, zero-shot, not trained for this task"
    panel.client.answer(job, result)
    assert ui.statusLabel.text.startswith("Done.  Model: Qwen3-VL-4B-Instruct, zero-shot, not trained for this task")
