"""The stand-ins themselves: ``qt`` behaves as PythonQt does where the module relies on it and
refuses what PythonQt would let pass; the CTK/qMRML stand-ins build the module's ``.ui``.
(PythonQt references: MeVisLab/pythonqt ``src/`` at 642c06b6; see pythonqt.py.)"""

from __future__ import annotations

import pytest

pytest.importorskip("PyQt5.QtWidgets", reason="PyQt5 is not installed (bootstrap.py --no-pyqt)")
pytest.importorskip("slicer_core", reason="slicer-core is not installed (bootstrap.py --no-slicer-core)")
from PyQt5.QtCore import Qt  # noqa: E402
from steps import UI_CLASSES, UI_FILE, QTest  # noqa: E402


@pytest.fixture
def qt(slicer_qt):
    import qt

    return qt


def test_a_q_property_is_an_attribute_and_a_misspelt_one_is_refused(qt):
    """PythonQtInstanceWrapper.cpp:616-660 writes a Q_PROPERTY; :725-738 would quietly add a
    Python attribute for a name that is none."""
    button = qt.QPushButton("&Go")
    button.toolTip = "x"
    assert button.toolTip == "x" and button.text == "&Go" and button.enabled
    with pytest.raises(AttributeError, match="tooltip"):
        button.tooltip = "y"
    assert "tooltip" not in vars(button)
    with pytest.raises(AttributeError, match="not writable"):
        button.width = 5  # QWidget's `width` has no WRITE
    with pytest.raises(AttributeError, match="refuses to overwrite"):
        button.setText = "z"
    with pytest.raises(TypeError, match="does not accept"):
        qt.QSpinBox().value = "nine"
    button.setProperty("SlicerParameterName", "query")  # a dynamic property is writable as an attribute
    button.SlicerParameterName = "preset"
    assert button.property("SlicerParameterName") == "preset"


def test_name_is_the_object_name_and_a_child_is_an_attribute(qt):
    """PythonQtClassInfo.cpp:148-151; PythonQtInstanceWrapper.cpp:595-603 (direct children only)."""
    box = qt.QWidget()
    box.name = "box"
    child = qt.QLabel(box)
    child.objectName = "caption"
    grandchild = qt.QLabel(child)
    grandchild.objectName = "deep"
    assert box.objectName == "box" and box.caption is child
    with pytest.raises(AttributeError):
        box.deep  # noqa: B018


def test_an_empty_combo_box_is_true_as_in_pythonqt(qt):
    """PythonQtInstanceWrapper.cpp:850-854: true while the C++ object lives (PyQt5's empty
    QComboBox is false, and slicer.util.findChildren would skip it)."""
    combo = qt.QComboBox()
    assert combo.count == 0 and bool(combo)


def test_connect_by_signature_passes_as_many_arguments_as_the_callable_takes(qt):
    """PythonQtStdDecorators.cpp:50-73; PythonQtSignalReceiver.cpp:71-102."""
    button = qt.QPushButton()
    button.checkable = True
    got = []
    assert button.connect("clicked(bool)", lambda: got.append("none"))
    assert button.connect("clicked( bool )", lambda checked: got.append(checked))
    assert button.connect("toggled(bool)", lambda *args: got.append(args))
    QTest.mouseClick(button, Qt.LeftButton)
    assert got == [(True,), "none", True]  # Qt emits toggled before clicked


def test_an_unknown_signal_is_refused_not_ignored(qt):
    """PythonQt prints "signal ... does not exist" and returns False (PythonQtStdDecorators.cpp:64-69)."""
    button = qt.QPushButton()
    with pytest.raises(ValueError, match="no signal 'clicked\\(int\\)'"):
        button.connect("clicked(int)", print)
    with pytest.raises(ValueError, match="no signal 'textChanged"):
        qt.QPlainTextEdit().connect("textChanged(QString)", print)  # QPlainTextEdit's takes no argument
    with pytest.raises(ValueError):
        button.disconnect("pressed(bool)", print)


def test_disconnect_removes_only_that_callable(qt):
    button = qt.QPushButton()
    got = []

    def first():
        got.append(1)

    def second():
        got.append(2)

    button.connect("clicked()", first)
    button.connect("clicked()", second)
    assert button.disconnect("clicked()", first)
    QTest.mouseClick(button, Qt.LeftButton)
    assert got == [2]


def test_an_exception_in_a_slot_is_reported_to_the_test(qt, slicer_qt):
    """PythonQt prints it and goes on; here the test fails (conftest's no_errors_in_callbacks)."""
    import pythonqt

    button = qt.QPushButton()
    button.connect("clicked()", lambda: 1 / 0)
    QTest.mouseClick(button, Qt.LeftButton)
    (where, error), = pythonqt.slot_errors
    assert isinstance(error, ZeroDivisionError) and "clicked()" in where
    pythonqt.slot_errors.clear()  # expected here


def test_the_stand_ins_build_the_module_ui_with_its_declared_classes(slicer_qt):
    import ctk
    import slicer

    widget = slicer.util.loadUI(str(UI_FILE))
    built = {w.objectName: type(w).__name__ for w in slicer.util.findChildren(widget) if w.objectName in UI_CLASSES}
    assert built == UI_CLASSES
    assert not vars(widget), "Qt's QUiLoader sets no Python attribute per child"
    ui = slicer.util.childWidgetVariables(widget)
    assert isinstance(ui.adapterPathLineEdit, ctk.ctkPathLineEdit) and ui.adapterPathLineEdit.filters == ctk.ctkPathLineEdit.Dirs
    assert ui.inputVolumeSelector.nodeTypes == ["vtkMRMLScalarVolumeNode"] and not ui.inputVolumeSelector.showChildNodeTypes
    assert ui.outputSegmentationSelector.noneEnabled and ui.outputSegmentationSelector.noneDisplay == "Create new segmentation"
    assert ui.consensusSpinBox.property("SlicerParameterName") == "consensus"
    widget.setMRMLScene(slicer.mrmlScene)  # the .ui's <connections>: the selectors get the scene
    assert ui.inputVolumeSelector.mrmlScene() is slicer.mrmlScene


def test_a_ui_with_a_widget_without_a_stand_in_is_refused(slicer_qt, tmp_path):
    import slicer

    ui = tmp_path / "other.ui"
    ui.write_text('<?xml version="1.0"?><ui version="4.0"><class>W</class><widget class="qMRMLWidget" name="W">'
                  '<layout class="QVBoxLayout"><item><widget class="qMRMLSliceWidget" name="view"/></item></layout>'
                  '</widget><customwidgets><customwidget><class>qMRMLSliceWidget</class><extends>QWidget</extends>'
                  '<header>qMRMLSliceWidget.h</header></customwidget><customwidget><class>qMRMLWidget</class>'
                  '<extends>QWidget</extends><header>qMRMLWidget.h</header><container>1</container></customwidget>'
                  '</customwidgets></ui>')
    with pytest.raises(LookupError, match="qMRMLSliceWidget"):
        slicer.util.loadUI(str(ui))


def test_the_node_combo_box_lists_the_scene_and_follows_removals(slicer_qt):
    """qMRMLNodeComboBox.h: exact classes without showChildNodeTypes; the selection leaves with
    its node (on NodeAboutToBeRemovedEvent, as Slicer's scene model does)."""
    import slicer

    slicer.mrmlScene.Clear(0)
    combo = slicer.qMRMLNodeComboBox()
    combo.nodeTypes = ["vtkMRMLScalarVolumeNode"]
    combo.showChildNodeTypes = False
    combo.noneEnabled = True
    combo.setMRMLScene(slicer.mrmlScene)
    ct = slicer.mrmlScene.AddNewNodeByClass("vtkMRMLScalarVolumeNode", "CT")
    slicer.mrmlScene.AddNewNodeByClass("vtkMRMLLabelMapVolumeNode", "labels")
    assert combo.nodeCount() == 1 and combo.currentNode() is None  # "None" stays selected
    seen = []
    combo.connect("currentNodeChanged(vtkMRMLNode*)", lambda node: seen.append(node))
    combo.setCurrentNode(ct)
    slicer.mrmlScene.RemoveNode(ct)
    assert seen == [ct, None] and combo.nodeCount() == 0
    slicer.mrmlScene.Clear(0)


def test_a_modal_dialog_is_answered_as_planned_or_fails_the_test(qt, dialogs):
    """``exec_()`` would wait for a user (and hang the test): slicer_app.ModalDialogs clicks the
    planned button, and records a dialog nobody planned for as an error."""
    import pythonqt

    box = qt.QMessageBox(qt.QMessageBox.Question, "MedVol-R1", "Replace?", qt.QMessageBox.NoButton)
    keep = box.addButton("Keep both", qt.QMessageBox.AcceptRole)
    box.addButton(qt.QMessageBox.Cancel)
    dialogs.plan("Keep both")
    box.exec_()
    assert box.clickedButton() is keep and dialogs.shown == [("Replace?", ["Cancel", "Keep both"])]
    assert qt.QDialog().exec_() == qt.QDialog.Rejected
    (where, error), = pythonqt.slot_errors
    assert "nobody answers" in str(error)
    pythonqt.slot_errors.clear()  # expected here


def test_the_node_combo_box_moves_to_a_neighbour_when_its_node_is_removed(slicer_qt):
    """qMRMLNodeComboBox.cxx:719-741 at v5.12.3 (``emitCurrentNodeChanged``: a current row that
    is no node becomes the last node) over QComboBox's removal (the row that took its place is
    current): deleting the current segmentation selects the next one, else the last one."""
    import slicer

    slicer.mrmlScene.Clear(0)
    combo = slicer.qMRMLNodeComboBox()
    combo.nodeTypes = ["vtkMRMLSegmentationNode"]
    combo.noneEnabled = True
    combo.setMRMLScene(slicer.mrmlScene)
    a, b, c = (slicer.mrmlScene.AddNewNodeByClass("vtkMRMLSegmentationNode", n) for n in "abc")
    seen = []
    combo.connect("currentNodeChanged(vtkMRMLNode*)", lambda node: seen.append(node))
    combo.setCurrentNode(b)
    combo.removeCurrentNode()  # "Delete current segmentation" (:784-787)
    assert combo.currentNode() is c
    slicer.mrmlScene.RemoveNode(c)  # the last one: the one before it
    assert combo.currentNode() is a
    slicer.mrmlScene.RemoveNode(a)
    assert seen == [b, c, a, None] and combo.currentNode() is None
    slicer.mrmlScene.Clear(0)


def test_the_node_combo_box_selects_what_create_new_makes_and_a_first_node_without_none(slicer_qt):
    """"Create new …" adds a node and selects it (qMRMLNodeComboBox.cxx:416-450, 589-622 at v5.12.3,
    ``selectNodeUponCreation`` on by default); without "None", the first node added to the empty
    combo box becomes current (QComboBox makes the first row of an empty model current, and
    :719-741 emits it)."""
    import slicer

    slicer.mrmlScene.Clear(0)
    combo = slicer.qMRMLNodeComboBox()
    combo.nodeTypes = ["vtkMRMLSegmentationNode"]
    combo.noneEnabled = True
    combo.setMRMLScene(slicer.mrmlScene)
    slicer.mrmlScene.AddNewNodeByClass("vtkMRMLSegmentationNode", "old")
    assert combo.currentNode() is None  # "None" stays selected
    made = combo.addNode()
    assert made is not None and combo.currentNode() is made and made.IsA("vtkMRMLSegmentationNode")

    strict = slicer.qMRMLNodeComboBox()
    strict.nodeTypes = ["vtkMRMLScalarVolumeNode"]
    strict.noneEnabled = False
    strict.setMRMLScene(slicer.mrmlScene)
    assert strict.currentNode() is None
    ct = slicer.mrmlScene.AddNewNodeByClass("vtkMRMLScalarVolumeNode", "CT")
    assert strict.currentNode() is ct
    slicer.mrmlScene.AddNewNodeByClass("vtkMRMLScalarVolumeNode", "CT2")
    assert strict.currentNode() is ct
    slicer.mrmlScene.Clear(0)


def test_every_top_level_python_file_of_the_module_folder_is_a_module_to_slicer(slicer_qt):
    """Slicer's factory loads every ``*.py`` at the top of a scripted module's folder as a module
    and needs a class of the file's name in it (qSlicerAbstractModuleFactoryManager.cxx:275-282,
    qSlicerScriptedLoadableModuleFactory.cxx:182-200, qSlicerScriptedLoadableModule.cxx:120-170 at
    v5.12.3): the headless batch script lives in ``Scripts/``, where the factory does not look."""
    from slicer_standins import application, scripted_module

    found = scripted_module.load_module_folder(application.MODULE_DIR)
    assert list(found) == ["MedVolR1Slicer"]
    assert (application.SCRIPTS_DIR / "batch.py").is_file()


def test_the_segment_editor_answers_from_its_combo_box_and_a_new_segmentation_ends_the_effect(slicer_qt):
    """qMRMLSegmentEditorWidget.cxx at v5.12.3: ``segmentationNode()`` is its combo box's node
    (:1332-1336); ``setSegmentationNode`` of another one deactivates the active effect
    (:1319-1329); the combo box (no "None", .ui:76-85) moves by itself when its node is removed and
    the editor follows it (:337, :1393-1401)."""
    import slicer

    slicer.mrmlScene.Clear(0)
    editor = slicer.qMRMLSegmentEditorWidget()
    editor.setMRMLScene(slicer.mrmlScene)
    node = slicer.mrmlScene.AddNode(slicer.vtkMRMLSegmentEditorNode())
    a, b = (slicer.mrmlScene.AddNewNodeByClass("vtkMRMLSegmentationNode", n) for n in "ab")
    editor.setMRMLSegmentEditorNode(node)
    editor.setSegmentationNode(b)
    assert editor.segmentationNode() is b and node.GetSegmentationNode() is b
    editor.setActiveEffectByName("Paint")
    editor.setSegmentationNode(b)  # the same one: the effect stays
    assert editor.activeEffect() == "Paint"
    editor.setSegmentationNode(a)
    assert editor.activeEffect() is None and editor.segmentationNode() is a
    slicer.mrmlScene.RemoveNode(a)  # the combo box moves to b, and the editor with it
    assert editor.segmentationNode() is b and node.GetSegmentationNode() is b
    slicer.mrmlScene.Clear(0)


def test_a_dialog_closed_with_esc_or_the_title_bar_gives_its_escape_button_or_none(qt, dialogs):
    """A user may leave a dialog with Esc or ×: Qt then gives the message box's escape button (what
    ``slicer.util.confirmYesNoDisplay`` reads as "no", util.py:3276-3287, 3366-3379 at v5.12.3) and
    no clicked button at all to a box without one."""
    import pythonqt
    import slicer_app

    for how in (slicer_app.ESC, slicer_app.CLOSE):
        box = qt.QMessageBox(qt.QMessageBox.Question, "MedVol-R1", "Replace?", qt.QMessageBox.NoButton)
        keep = box.addButton("Keep both", qt.QMessageBox.AcceptRole)
        cancel = box.addButton(qt.QMessageBox.Cancel)
        dialogs.plan(how)
        assert box.exec_() == qt.QMessageBox.Cancel and box.clickedButton() is cancel and box.clickedButton() is not keep
        yes_no = qt.QMessageBox(qt.QMessageBox.Question, "MedVol-R1", "Undo anyway?",
                                qt.QMessageBox.Yes | qt.QMessageBox.No)
        dialogs.plan(how)
        assert yes_no.exec_() == qt.QMessageBox.No
        dialogs.plan(how)
        assert qt.QDialog().exec_() == qt.QDialog.Rejected
    box = qt.QMessageBox(qt.QMessageBox.Question, "MedVol-R1", "Go on?", qt.QMessageBox.NoButton)
    box.addButton("Go on", qt.QMessageBox.AcceptRole)
    box.addButton("Stop here", qt.QMessageBox.AcceptRole)
    dialogs.plan(slicer_app.CLOSE)  # no escape button: × is ignored, the user is stuck
    box.exec_()
    assert box.clickedButton() is None
    (where, error), = pythonqt.slot_errors
    assert "cannot leave it" in str(error)
    pythonqt.slot_errors.clear()  # expected here
