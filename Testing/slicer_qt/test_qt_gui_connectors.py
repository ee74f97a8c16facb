"""``connectGui`` of the parameter-node wrapper stand-in with real widgets, as Slicer's
``Base/Python/slicer/parameterNodeWrapper`` at v5.12.3 binds them (wrapper.py, guiConnectors.py;
``file:line`` at v5.12.3, the same at v5.10.0 but for ``disconnectGui``)."""

from __future__ import annotations

import pathlib
import types
from typing import Annotated

import pytest

pytest.importorskip("PyQt5.QtWidgets", reason="PyQt5 is not installed (bootstrap.py --no-pyqt)")
pytest.importorskip("slicer_core", reason="slicer-core is not installed (bootstrap.py --no-slicer-core)")
import slicer  # noqa: E402 - slicer-core's
from PyQt5.QtCore import Qt  # noqa: E402
from slicer_standins import parameter_node  # noqa: E402
from steps import QTest  # noqa: E402

pnw = parameter_node.make_module()


@pytest.fixture
def env(slicer_qt):
    import ctk
    import qt
    import slicer

    slicer.mrmlScene.Clear(0)
    yield types.SimpleNamespace(qt=qt, ctk=ctk, slicer=slicer, scene=slicer.mrmlScene,
                                node=slicer.mrmlScene.AddNewNodeByClass("vtkMRMLScriptedModuleNode"))
    slicer.mrmlScene.Clear(0)


def bound(widget, name):
    widget.setProperty(pnw.SlicerParameterNamePropertyName, name)
    return widget


def test_a_spin_box_takes_its_range_from_the_annotation_or_the_int_limits(env):
    """guiConnectors.py:300-321: ``WithinRange`` sets the range; ``Minimum``/``Maximum`` each end;
    without them the int limits, whatever the .ui said."""
    qt = env.qt

    @pnw.parameterNodeWrapper
    class P:
        answers: Annotated[int, pnw.WithinRange(1, 8)] = 1
        floor: Annotated[int, pnw.Minimum(0)] = 0
        plain: int = 1

    spins = {name: bound(qt.QSpinBox(), name) for name in ("answers", "floor", "plain")}
    for spin in spins.values():
        spin.setRange(1, 8)  # what the .ui says
    P(env.node).connectGui(types.SimpleNamespace(**spins))
    assert {n: (s.minimum, s.maximum) for n, s in spins.items()} == {
        "answers": (1, 8), "floor": (0, 2**31 - 1), "plain": (-(2**31), 2**31 - 1)}


def test_a_widget_edit_writes_the_parameter_and_a_parameter_write_shows_in_the_widget(env):
    """wrapper.py:173-179 (the widget's change signal writes the field, inside NodeModify) and
    :182-192, :213 (every ModifiedEvent writes all bound widgets)."""
    qt = env.qt

    @pnw.parameterNodeWrapper
    class P:
        answers: Annotated[int, pnw.WithinRange(1, 8)] = 1
        show: bool = False

    spin, check = bound(qt.QSpinBox(), "answers"), bound(qt.QCheckBox(), "show")
    p = P(env.node)
    p.connectGui(types.SimpleNamespace(spin=spin, check=check))
    spin.setFocus()
    QTest.keyClick(spin, Qt.Key_Up)
    assert p.answers == 2 and env.node.GetParameter("answers") == "2"
    QTest.keyClick(check, Qt.Key_Space)
    assert p.show is True
    p.answers = 7
    assert spin.value == 7
    spin.value = 8
    assert p.answers == 8


def test_a_line_edit_is_written_only_when_its_text_differs(env):
    """guiConnectors.py:539-548: writing the same text again would move the cursor to the end."""
    qt = env.qt

    @pnw.parameterNodeWrapper
    class P:
        url: str = ""
        other: int = 0

    line = bound(qt.QLineEdit(), "url")
    p = P(env.node)
    p.connectGui(types.SimpleNamespace(line=line))
    line.setFocus()
    QTest.keyClicks(line, "http://gpu:8765")
    line.cursorPosition = 4
    p.other = 1  # any write: every bound widget is written again
    assert line.cursorPosition == 4 and p.url == "http://gpu:8765"


def test_a_node_selector_binds_a_node_field_and_takes_its_node_type(env):
    """guiConnectors.py:744-774: ``nodeTypes`` becomes the field's class (:759, util.py:78-85);
    ``currentNodeChanged`` writes the field, a field write selects the node."""
    scene = env.scene

    @pnw.parameterNodeWrapper
    class P:
        volume: slicer.vtkMRMLScalarVolumeNode

    combo = bound(slicer.qMRMLNodeComboBox(), "volume")
    combo.nodeTypes = ["vtkMRMLSegmentationNode"]  # what a .ui might say
    combo.showChildNodeTypes = False
    combo.setMRMLScene(scene)
    a, b = scene.AddNewNodeByClass("vtkMRMLScalarVolumeNode", "A"), scene.AddNewNodeByClass("vtkMRMLScalarVolumeNode", "B")
    p = P(env.node)
    p.connectGui(types.SimpleNamespace(combo=combo))
    assert combo.nodeTypes == ["vtkMRMLScalarVolumeNode"] and combo.nodeCount() == 2
    combo.setCurrentNode(b)
    assert p.volume is b
    p.volume = a
    assert combo.currentNode() is a
    scene.RemoveNode(a)  # the selection moves to the neighbour (qMRMLNodeComboBox.cxx:719-741), and so does the field
    assert combo.currentNode() is b and p.volume is b
    scene.RemoveNode(b)  # none left
    assert combo.currentNode() is None and p.volume is None


def test_a_widget_tree_is_searched_for_bound_children(env):
    """wrapper.py:245-248: given a widget, its children carrying ``SlicerParameterName`` are bound."""
    qt = env.qt

    @pnw.parameterNodeWrapper
    class P:
        answers: Annotated[int, pnw.WithinRange(2, 5)] = 3

    panel = qt.QWidget()
    spin = bound(qt.QSpinBox(qt.QFrame(panel)), "answers")
    P(env.node).connectGui(panel)
    assert (spin.minimum, spin.maximum, spin.value) == (2, 5, 3)


def test_a_widget_that_no_connector_represents_is_refused(env):
    """guiConnectors.py:145 (no connector: RuntimeError; Slicer has none for QPlainTextEdit or
    QRadioButton) and :430-431 (a QComboBox needs a ``Choice``)."""
    qt, ctk = env.qt, env.ctk

    @pnw.parameterNodeWrapper
    class P:
        query: str = ""
        worker: str = "local"
        adapter: pathlib.Path

    p = P(env.node)
    with pytest.raises(RuntimeError, match="Unable to create GUI connector"):
        p.connectGui(types.SimpleNamespace(edit=bound(qt.QPlainTextEdit(), "query")))
    with pytest.raises(RuntimeError, match="Unable to create GUI connector"):
        p.connectGui(types.SimpleNamespace(radio=bound(qt.QRadioButton(), "worker")))
    with pytest.raises(RuntimeError, match="requires the Choice annotation"):
        p.connectGui(types.SimpleNamespace(combo=bound(qt.QComboBox(), "worker")))
    with pytest.raises(RuntimeError, match="Unable to create GUI connector"):  # a path edit takes a Path, not a str
        p.connectGui(types.SimpleNamespace(path=bound(ctk.ctkPathLineEdit(), "query")))
    path = bound(ctk.ctkPathLineEdit(), "adapter")
    p.connectGui(types.SimpleNamespace(path=path))
    assert path.currentPath == "."  # the default Path() (serializers.py:331-332)
    line = path.comboBox().lineEdit()
    QTest.keyClick(line, Qt.Key_A, Qt.ControlModifier)
    QTest.keyClicks(line, "/runs/adapter")
    assert p.adapter == pathlib.Path("/runs/adapter")
