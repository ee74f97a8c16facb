"""The module's panel in real Qt, built as Slicer builds it (``MedVolR1SlicerWidget(parent)``,
``setup()``, ``enter()``) in the main window's module panel, and used with real key presses and
clicks (QTest). The worker is the module's own ``SelfTestWorker`` (conftest.py)."""

from __future__ import annotations

import ast

import pytest

pytest.importorskip("PyQt5.QtWidgets", reason="PyQt5 is not installed (bootstrap.py --no-pyqt)")
pytest.importorskip("slicer_core", reason="slicer-core is not installed (bootstrap.py --no-slicer-core)")
import pythonqt  # noqa: E402
from PyQt5 import QtWidgets  # noqa: E402
from PyQt5.QtCore import Qt  # noqa: E402
from steps import (MODULE_DIR, UI, UI_CLASSES, QTest, click, idle, key, load_ct, mnemonic,  # noqa: E402
                   press_mnemonic, segment, type_text, ui_property, use_remote_worker, wait_until)


def _module_sources():
    """Every Python file of the module (the host file and any package beside it)."""
    return sorted(MODULE_DIR.rglob("*.py"))


def _ui_uses():
    """``{widget name: {"get": {...}, "set": {...}, "call": {...}, "connect": {...}}}`` for every
    ``self.ui.<name>`` / ``ui.<name>`` in the module's code."""
    uses = {}
    for path in _module_sources():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute):
                continue
            base = node.value
            if not ((isinstance(base, ast.Attribute) and base.attr == "ui") or (isinstance(base, ast.Name) and base.id == "ui")):
                continue
            use = uses.setdefault(node.attr, {"get": set(), "set": set(), "call": set(), "connect": set()})
            member = parents.get(node)
            if not (isinstance(member, ast.Attribute) and member.value is node):
                continue
            call = parents.get(member)
            if isinstance(member.ctx, ast.Store):
                use["set"].add(member.attr)
            elif isinstance(call, ast.Call) and call.func is member:
                use["call"].add(member.attr)
                if member.attr in ("connect", "disconnect") and call.args and isinstance(call.args[0], ast.Constant):
                    use["connect"].add(call.args[0].value)
            else:
                use["get"].add(member.attr)
    return uses


UI_USES = _ui_uses()


def test_the_module_code_uses_ui_widgets_and_they_are_scanned():
    assert len(UI_USES) >= 30 and {"segmentButton", "advancedCollapsibleButton", "inputVolumeSelector"} <= set(UI_USES)


def test_setup_builds_the_panel_in_the_module_panel(panel):
    ui = panel.ui
    assert panel.parent.isEntered and panel.window.selectedModule() == "MedVolR1Slicer"
    assert ui.MedVolR1Slicer.parent() is panel.parent  # the .ui's top widget, in the panel's layout
    assert ui.noticeLabel.text == "Research use only — not a medical device."
    assert ui.segmentButton.text == "&Segment" and not ui.segmentButton.enabled  # no CT, no query yet
    from MedVolR1SlicerLib import params

    assert [ui.presetComboBox.itemText(i) for i in range(ui.presetComboBox.count)] == list(params.PRESETS)
    assert ui.inputVolumeSelector.mrmlScene() is panel.slicer.mrmlScene  # the .ui's mrmlSceneChanged connection
    assert ui.advancedCollapsibleButton.collapsed and not ui.consensusSpinBox.visible


@pytest.mark.parametrize("name", sorted(UI_USES))
def test_every_widget_the_code_uses_is_in_the_ui_and_has_what_the_code_uses(panel, name):
    """Each ``ui.<name>`` the code touches exists, is of the class the .ui declares (a stand-in for
    a CTK/qMRML class), and has every attribute the code reads or calls; what it writes is a
    writable Q_PROPERTY; what it connects is one of its signals."""
    widget = getattr(panel.ui, name, None)
    assert isinstance(widget, QtWidgets.QWidget), f"the code uses ui.{name}, which the .ui does not have"
    assert type(widget).__name__ == UI_CLASSES[name]
    use = UI_USES[name]
    for member in use["get"] | use["call"]:
        assert hasattr(widget, member), f"ui.{name} ({UI_CLASSES[name]}) has no {member}"
    for member in use["call"]:
        assert callable(getattr(widget, member)), f"ui.{name}.{member} is a property, not a method"
    meta = widget.metaObject()
    for member in use["set"]:
        index = meta.indexOfProperty(member)
        assert index >= 0 and meta.property(index).isWritable(), f"ui.{name}.{member} is no writable Q_PROPERTY"
    for signature in use["connect"]:
        pythonqt.signal(widget, signature)  # raises for a signal it does not have


def test_enter_in_the_query_box_runs_segment(panel):
    volume = load_ct(panel)
    use_remote_worker(panel)
    ui = panel.ui
    type_text(ui.queryEdit, "the organ")
    assert panel.workers.made == [] and ui.queryEdit.toPlainText() == "the organ"
    key(ui.queryEdit, Qt.Key_Return)
    (worker,) = panel.workers.made
    assert [op for op, _ in worker.requests] == ["load", "segment"]
    assert worker.requests[1][1]["query"] == "the organ"
    assert ui.queryEdit.toPlainText() == "the organ"  # no line break left behind
    wait_until(lambda: idle(panel))
    p = panel.logic.getParameterNode()
    segmentation = p.outputSegmentation.GetSegmentation()
    assert segmentation.GetSegment(p.segmentId).GetName() == "the organ" and p.resultVolume is volume


def test_shift_enter_starts_the_next_query_and_several_queries_go_in_one_request(panel):
    """One query per line: Shift+Enter starts a line, Enter runs Segment; one ``segment`` request
    with ``queries``, a segment for the one found and "not found" for the other, on its own line."""
    load_ct(panel)
    use_remote_worker(panel)
    ui = panel.ui
    type_text(ui.queryEdit, "the organ")
    key(ui.queryEdit, Qt.Key_Return, Qt.ShiftModifier)
    type_text(ui.queryEdit, "the appendix")
    assert panel.workers.made == [] and ui.queryEdit.toPlainText() == "the organ\nthe appendix"
    key(ui.queryEdit, Qt.Key_Return)
    (worker,) = panel.workers.made
    assert [op for op, _ in worker.requests] == ["load", "segment"]
    assert worker.requests[1][1]["queries"] == ["the organ", "the appendix"] and "query" not in worker.requests[1][1]
    wait_until(lambda: idle(panel))
    p = panel.logic.getParameterNode()
    segmentation = p.outputSegmentation.GetSegmentation()
    assert segmentation.GetNumberOfSegments() == 1 and segmentation.GetSegment(p.segmentId).GetName() == "the organ"
    assert "Not found in this CT: the appendix" in ui.statusLabel.text
    assert [ui.segmentComboBox.itemText(i) for i in range(ui.segmentComboBox.count)] == ["the organ"]


def test_the_segment_selector_shows_each_segments_own_evidence(panel):
    """Two queries, two segments: choosing the first in the Segment selector (arrow key) shows its
    boxes and hides the second's; Add box here then goes to the first."""
    load_ct(panel)
    use_remote_worker(panel)
    ui, p = panel.ui, panel.logic.getParameterNode()
    segment(panel, "the organ")
    first_id, first_boxes = p.segmentId, list(p.boxes)
    segment(panel, "the other organ")
    second_id, second_boxes = p.segmentId, list(p.boxes)
    assert second_id != first_id and ui.segmentComboBox.currentText == "the other organ"
    assert not first_boxes[0].GetDisplayNode().GetVisibility()
    ui.segmentComboBox.setFocus()
    key(ui.segmentComboBox, Qt.Key_Up)
    assert p.segmentId == first_id and p.boxes == first_boxes and ui.segmentComboBox.currentText == "the organ"
    assert first_boxes[0].GetDisplayNode().GetVisibility() and not second_boxes[0].GetDisplayNode().GetVisibility()
    k = p.keySliceIJK
    panel.logic.redSliceNode().JumpSliceByCentering(*panel.logic.geometry(p.resultVolume).slice_center_ras(k + 1))
    click(ui.addBoxButton)
    assert len(p.corrections) == 1 and ui.repropagateButton.enabled
    key(ui.segmentComboBox, Qt.Key_Down)
    assert p.segmentId == second_id and p.corrections == [] and not ui.repropagateButton.enabled


def test_escape_cancels_a_running_request(panel):
    load_ct(panel)
    use_remote_worker(panel)
    ui = panel.ui
    type_text(ui.queryEdit, "the organ")
    click(ui.segmentButton)
    assert ui.segmentButton.text == "Cancel" and panel.logic.session.state == "running"
    focus = QtWidgets.QApplication.focusWidget()
    assert panel.parent.isAncestorOf(focus)  # the focus is in the panel (the query box is locked now)
    key(focus, Qt.Key_Escape)
    assert panel.logic.session.state == "idle"
    assert ui.statusLabel.text.startswith("Cancelled.") and ui.segmentButton.text == "&Segment"
    QTest.qWait(250)  # two poll-timer periods: nothing arrives afterwards
    assert panel.slicer.mrmlScene.GetNodesByClass("vtkMRMLSegmentationNode").GetNumberOfItems() == 0


def test_n_switches_the_sign_of_new_points_with_the_focus_in_a_view_not_in_a_text_box(panel):
    load_ct(panel)
    use_remote_worker(panel)
    segment(panel)
    ui, p = panel.ui, panel.logic.getParameterNode()
    views = panel.window.views()
    views.setFocus()
    assert QtWidgets.QApplication.focusWidget() is views
    key(views, Qt.Key_N)
    assert p.negativePoints and ui.negativePointsButton.checked and "outside" in ui.statusLabel.text
    key(views, Qt.Key_N)
    assert not p.negativePoints and not ui.negativePointsButton.checked
    type_text(ui.queryEdit, "N")  # a text box keeps its N
    assert ui.queryEdit.toPlainText().endswith("N") and not p.negativePoints


SLICER_MENU_MNEMONICS = {"Alt+F", "Alt+E", "Alt+V", "Alt+H"}  # qSlicerMainWindow.ui:206,224,237,299 at v5.12.3


def _mnemonic_widgets(root):
    widgets = [w for w in root.findChildren(QtWidgets.QAbstractButton) if mnemonic(w.text)]
    labels = [w for w in root.findChildren(QtWidgets.QLabel) if mnemonic(w.text)]
    return widgets + labels


def test_the_main_window_has_slicers_menus(panel):
    titles = [a.text for a in panel.window.menuBar().actions()]
    assert {mnemonic(t) for t in titles} == SLICER_MENU_MNEMONICS


def test_every_mnemonic_is_unique_and_free_of_slicers_menus(panel):
    found = {}
    for w in _mnemonic_widgets(panel.parent):
        found.setdefault(mnemonic(w.text), []).append(w.objectName)
    assert len(found) >= 10
    shared = {k: v for k, v in found.items() if len(v) > 1}
    assert shared == {}, f"mnemonics used twice in the panel: {shared}"
    clash = {k: v for k, v in found.items() if k in SLICER_MENU_MNEMONICS}
    assert clash == {}, f"mnemonics that Slicer's menu bar takes (File, Edit, View, Help): {clash}"


@pytest.mark.developer_mode
def test_developer_mode_adds_slicers_reload_section_and_no_mnemonic(panel):
    """ScriptedLoadableModule.py:142-230 at v5.12.3: the "Reload && Test" section, in developer
    mode only (its "&&" is a literal "&", no mnemonic)."""
    widget = panel.widget
    assert widget.developerMode and widget.reloadCollapsibleButton.text == "Reload && Test"
    assert widget.reloadButton.parent() is not None and widget.reloadCollapsibleButton.parent() is panel.parent
    assert mnemonic(widget.reloadCollapsibleButton.text) is None
    test_every_mnemonic_is_unique_and_free_of_slicers_menus(panel)


def test_no_reload_section_outside_developer_mode(panel):
    assert not panel.widget.developerMode and not hasattr(panel.widget, "reloadCollapsibleButton")


def test_the_panel_is_driven_by_its_alt_keys_in_the_main_window(panel):
    """With a result in the panel, Alt+<mnemonic> in Slicer's main window presses each button it
    names, from Jump to Segment; Edit in Segment Editor switches modules."""
    load_ct(panel)
    use_remote_worker(panel)
    segment(panel)
    ui, window, p = panel.ui, panel.window, panel.logic.getParameterNode()
    geo = panel.logic.geometry(p.resultVolume)
    panel.logic.redSliceNode().JumpSliceByCentering(*geo.slice_center_ras(p.keySliceIJK + 1))
    steps = ["addBoxButton", "jumpButton", "placePointsButton", "placePointsButton", "negativePointsButton",
             "negativePointsButton", "setRangeStartButton", "setRangeEndButton", "clearRangeButton",
             "clearCorrectionsButton", "repropagateButton", "show3DCheckBox", "undoButton", "editButton", "segmentButton"]
    for name in steps:
        if name == "segmentButton":
            window.showModule("MedVolR1Slicer")  # back from the Segment Editor
            panel.dialogs.plan("Keep both")  # "the organ" is in the segmentation already
        button = getattr(ui, name)
        assert button.enabled and button.visible, f"{name} is not enabled and shown"
        clicks = []

        def count():
            clicks.append(1)

        button.connect("clicked()", count)
        press_mnemonic(window, button.text)
        button.disconnect("clicked()", count)
        assert clicks == [1], f"{mnemonic(button.text)} in the main window did not press {name} ({button.text!r})"
        wait_until(lambda: idle(panel))
        if name == "editButton":
            assert window.selectedModule() == "SegmentEditor"
    assert ui.statusLabel.text.startswith("Done.") and p.resultVolume.GetName() == "PatientA_CT"
    assert [text for text, _ in panel.dialogs.shown] == ["The segmentation already has a segment named “the organ”."]
    segmentation = p.outputSegmentation.GetSegmentation()
    assert sorted(segmentation.GetNthSegment(i).GetName() for i in range(segmentation.GetNumberOfSegments())) == \
        ["the organ", "the organ (2)"]


def test_editable_text_keeps_what_is_typed_in_its_middle_and_the_cursor(panel):
    """Every editable line edit, path edit, editable combo box and the query box: "40, 400", the
    cursor put after the "4", Delete and "5" give "45, 400" — not "4, 4005" (the text written back
    on each keystroke moves the cursor to the end)."""
    use_remote_worker(panel)  # the remote URL is editable only then
    ui = panel.ui
    editable = []
    for name, cls in UI_CLASSES.items():
        w = UI.find(f".//widget[@name='{name}']")
        if cls == "QLineEdit" or cls == "ctkPathLineEdit" or (cls == "QComboBox" and ui_property(w, "editable") == "true"):
            editable.append(name)
        if cls == "QPlainTextEdit" and ui_property(w, "readOnly") != "true":
            editable.append(name)
    assert {"windowComboBox", "presetComboBox", "remoteUrlLineEdit", "adapterPathLineEdit", "queryEdit"} <= set(editable)
    garbled = {}
    for name in sorted(editable):
        widget = getattr(ui, name)
        target = {"QComboBox": lambda w: w.lineEdit(), "ctkPathLineEdit": lambda w: w.comboBox().lineEdit()}.get(
            UI_CLASSES[name], lambda w: w)(widget)
        target.setFocus()
        key(target, Qt.Key_A, Qt.ControlModifier)
        QTest.keyClicks(target, "40, 400")
        key(target, Qt.Key_Home)
        key(target, Qt.Key_Right)
        key(target, Qt.Key_Delete)
        QTest.keyClicks(target, "5")
        text = target.toPlainText() if UI_CLASSES[name] == "QPlainTextEdit" else target.text
        if text != "45, 400":
            garbled[name] = text
    assert garbled == {}, f"typing in the middle garbled: {garbled}"


def test_each_spin_box_keeps_the_range_the_ui_and_the_parameter_give(panel):
    """The .ui's range, which the parameter's annotation must not widen: consensus is 1 (off) to
    MAX_CONSENSUS answers; a 9 typed in cannot reach the parameter."""
    from MedVolR1SlicerLib.consensus import MAX_CONSENSUS

    spin_boxes = [name for name, cls in UI_CLASSES.items() if cls == "QSpinBox"]
    assert spin_boxes == ["consensusSpinBox"]
    ranges = {}
    for name in spin_boxes:
        w = UI.find(f".//widget[@name='{name}']")
        ranges[name] = (getattr(panel.ui, name).minimum, getattr(panel.ui, name).maximum,
                        int(ui_property(w, "minimum")), int(ui_property(w, "maximum")))
    assert ranges == {"consensusSpinBox": (1, MAX_CONSENSUS, 1, MAX_CONSENSUS)}
    spin = panel.ui.consensusSpinBox
    click(panel.ui.advancedCollapsibleButton)
    spin.setFocus()
    key(spin, Qt.Key_A, Qt.ControlModifier)
    QTest.keyClicks(spin, "9")
    key(spin, Qt.Key_Return)
    assert spin.value <= MAX_CONSENSUS and panel.logic.getParameterNode().consensus <= MAX_CONSENSUS


def test_segment_add_box_repropagate_undo_through_the_panel(panel):
    """Segment → the result → a box dragged and "Add box here" on another slice → Re-propagate
    (sends both) → Undo (the first result's mask is back) → Edit in Segment Editor."""
    import numpy as np

    slicer = panel.slicer
    volume = load_ct(panel)
    use_remote_worker(panel)
    p = panel.logic.getParameterNode()
    assert p.inputVolume is volume  # the CT selector wrote the parameter (GUI connector)
    segment(panel)
    ui = panel.ui
    seg, segmentId = p.outputSegmentation, p.segmentId
    first = slicer.util.arrayFromSegmentBinaryLabelmap(seg, segmentId, volume).copy()
    assert first.sum() > 0 and ui.keySliceLabel.text.startswith("S ") and ui.reasoningEdit.toPlainText() == "self-test"
    assert ui.addBoxButton.enabled and ui.undoButton.enabled and ui.editButton.enabled and not ui.repropagateButton.enabled

    geo, k = panel.logic.geometry(volume), p.keySliceIJK
    panel.logic.redSliceNode().JumpSliceByCentering(*geo.slice_center_ras(k + 2))  # the user scrolls the Red view
    click(ui.addBoxButton)
    (box,) = p.corrections
    assert panel.logic.nodeSlice(box) == k + 2 and ui.repropagateButton.enabled
    center = [0.0, 0.0, 0.0]
    p.boxes[0].GetCenter(center)
    step = geo.to_ras([6, 3, 0]) - geo.to_ras([0, 0, 0])
    p.boxes[0].SetCenter(*(np.array(center) + step))  # what a drag in the slice view does
    click(ui.repropagateButton)
    wait_until(lambda: idle(panel))
    assert ui.statusLabel.text.startswith("Done."), ui.statusLabel.text
    sent = panel.workers.made[-1].requests[-1]
    assert sent[0] == "propagate" and sent[1]["anchor"]["schema"] == "medvol.anchor/2"
    assert [q["object"] for q in sent[1]["anchor"]["prompts"]] == [1]
    second = slicer.util.arrayFromSegmentBinaryLabelmap(seg, segmentId, volume)
    assert p.segmentId == segmentId and not np.array_equal(second, first)

    click(ui.undoButton)
    assert ui.statusLabel.text == "Taken back: the organ."
    assert np.array_equal(slicer.util.arrayFromSegmentBinaryLabelmap(seg, segmentId, volume), first)
    # the evidence as it was when Re-propagate was clicked: the moved box and the box on slice k + 2
    assert [panel.logic.nodeSlice(b) for b in p.corrections] == [k + 2] and ui.repropagateButton.enabled
    assert ui.undoButton.enabled and ui.redoButton.enabled  # the first result is next; Redo puts this back
    click(ui.redoButton)
    assert ui.statusLabel.text == "Put back: the organ." and not ui.redoButton.enabled
    assert np.array_equal(slicer.util.arrayFromSegmentBinaryLabelmap(seg, segmentId, volume), second)
    click(ui.undoButton)
    click(ui.undoButton)  # the first result too: no segment, and no evidence left on screen
    assert seg.GetSegmentation().GetSegment(segmentId) is None and not ui.undoButton.enabled
    assert ui.keySliceLabel.text == "–" and ui.reasoningEdit.toPlainText() == ""
    assert not ui.repropagateButton.enabled and not ui.addBoxButton.enabled
    click(ui.redoButton)
    assert np.array_equal(slicer.util.arrayFromSegmentBinaryLabelmap(seg, segmentId, volume), first)
    assert p.segmentId == segmentId and ui.keySliceLabel.text.startswith("S ")

    click(ui.editButton)
    editor = slicer.modules.segmenteditor.widgetRepresentation().self().editor
    assert panel.window.selectedModule() == "SegmentEditor" and not panel.parent.isEntered
    assert editor.segmentationNode() is seg and editor.sourceVolumeNode() is volume
    assert editor.currentSegmentID() == segmentId


def test_a_new_result_while_the_segment_editor_edits_it_is_saved_in_its_undo(panel):
    load_ct(panel)
    use_remote_worker(panel)
    segment(panel)
    ui, p = panel.ui, panel.logic.getParameterNode()
    click(ui.editButton)
    editor = panel.slicer.modules.segmenteditor.widgetRepresentation().self().editor
    before = editor.undoStatesSaved
    panel.window.showModule("MedVolR1Slicer")
    p.boxes[0].SetSize(*[s * 0.5 for s in p.boxes[0].GetSize()])
    click(ui.repropagateButton)
    wait_until(lambda: idle(panel))
    assert editor.undoStatesSaved == before + 1

