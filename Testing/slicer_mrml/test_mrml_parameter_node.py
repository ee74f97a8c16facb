"""The parameter-node wrapper stand-in (``Testing/slicer_standins/parameter_node.py``) behaves as
Slicer's ``Base/Python/slicer/parameterNodeWrapper`` at v5.12.3 (and v5.10.0 where they differ),
on a real ``vtkMRMLScriptedModuleNode``. ``file:line`` is at v5.12.3 unless said. The GUI
connectors are tested with real widgets in ``Testing/slicer_qt/test_qt_gui_connectors.py``."""

from __future__ import annotations

import types
from typing import Annotated

import pytest

pytest.importorskip("slicer_core", reason="slicer-core is not installed (bootstrap.py --no-slicer-core)")
import slicer  # noqa: E402 - the real package, imported by conftest.py
from slicer_standins import parameter_node  # noqa: E402

pnw = parameter_node.make_module()


@pnw.parameterNodeWrapper
class Params:
    query: str  # the first field: its cache observer is the node's first, which VTK calls last
    consensus: Annotated[int, pnw.WithinRange(1, 8)] = 1
    edited: bool = False
    volume: slicer.vtkMRMLScalarVolumeNode
    boxes: list[slicer.vtkMRMLMarkupsROINode]


@pytest.fixture
def node(scene):
    return scene.AddNewNodeByClass("vtkMRMLScriptedModuleNode", "params")


def modified_events(node):
    seen = []
    node.AddObserver("ModifiedEvent", lambda caller, event: seen.append(1))
    return seen


def live_observers(obj, tags=range(0, 2000)):
    """How many observers ``obj`` has (VTK numbers them from 0; ``GetCommand`` of a removed one is None)."""
    return sum(obj.GetCommand(t) is not None for t in tags)


def test_defaults_are_written_into_the_node_when_a_wrapper_is_made(node):
    """wrapper.py:136-139 (and the default of an unannotated str, serializers.py:292-293)."""
    assert not node.HasParameter("consensus")
    p = Params(node)
    assert [node.GetParameter(n) for n in ("query", "consensus", "edited", "volume", "boxes.len")] == \
        ["", "1", "False", "", "0"]
    assert p.query == "" and p.consensus == 1 and p.volume is None and p.boxes == []


def test_values_are_stored_as_slicers_serializers_store_them(node, scene):
    """serializers.py:260 (str(int)), :298 (str as is), :371 ("True"/"False"), :405-409 (a node
    reference plus an empty parameter), :654-660 (name.N references and name.len)."""
    p = Params(node)
    ct = scene.AddNewNodeByClass("vtkMRMLScalarVolumeNode", "CT")
    rois = [scene.AddNewNodeByClass("vtkMRMLMarkupsROINode") for _ in range(3)]
    p.query, p.consensus, p.edited, p.volume, p.boxes = "the liver", 4, True, ct, rois
    assert (node.GetParameter("query"), node.GetParameter("consensus"), node.GetParameter("edited")) == \
        ("the liver", "4", "True")
    assert node.GetParameter("volume") == "" and node.GetNodeReference("volume") is ct
    assert node.GetParameter("boxes.len") == "3" and [node.GetNodeReference(f"boxes.{i}") for i in range(3)] == rois
    p.boxes = rois[:1]  # shorter: the references past the end are removed (:659-660)
    assert node.GetParameter("boxes.len") == "1" and node.GetNodeReference("boxes.1") is None


def test_a_write_is_read_back_before_the_modified_event_reaches_any_observer(node):
    """wrapper.py:103-113: the value is read back inside ``NodeModify``, before ``EndModify``
    invokes ``ModifiedEvent``; one event per write. An observer that VTK calls before the
    field's own cache observer (added later; VTK calls the node's first observer last) still sees
    the new value."""
    p = Params(node)
    p.query = "before"
    seen = []
    node.AddObserver("ModifiedEvent", lambda caller, event: seen.append(p.query))
    p.query = "the liver"
    assert seen == ["the liver"]


def test_a_field_changed_behind_the_wrappers_back_is_read_again_on_modified(node):
    """wrapper.py:99-101: every field's cache re-reads on the node's ModifiedEvent (here another
    wrapper of the same node writes, as the logic's ``getParameterNode()`` makes one per call)."""
    p, other = Params(node), Params(node)
    assert p.consensus == 1
    other.consensus = 5
    assert p.consensus == 5
    node.SetParameter("query", "typed in the node")
    assert p.query == "typed in the node"


def test_a_missing_parameter_is_written_back_with_its_default_when_read(node):
    """wrapper.py:43-46: reading a parameter that is not in the node writes its default."""
    p = Params(node)
    p.consensus = 3
    node.UnsetParameter("consensus")  # fires ModifiedEvent: the cache re-reads
    assert p.consensus == 1 and node.GetParameter("consensus") == "1"


def test_validators_refuse_a_value_before_anything_is_written(node, scene):
    """serializers.py:162-164 (validate, then write); validators.py:93-95 (WithinRange), :78-80
    (IsInstance: serializers.py:246 for int, :396 for a node class)."""
    p = Params(node)
    events = modified_events(node)
    with pytest.raises(ValueError, match=r"within range \[1, 8\], is 9"):
        p.consensus = 9
    with pytest.raises(TypeError):
        p.consensus = "3"
    with pytest.raises(TypeError):
        p.volume = scene.AddNewNodeByClass("vtkMRMLSegmentationNode")
    events.clear()
    with pytest.raises(TypeError):
        p.boxes = [scene.AddNewNodeByClass("vtkMRMLScalarVolumeNode")]
    assert node.GetParameter("consensus") == "1" and p.consensus == 1 and p.volume is None and p.boxes == []
    p.consensus = 8
    assert node.GetParameter("consensus") == "8"


def test_a_list_field_reads_as_a_list_whose_edits_write_the_node(node, scene):
    """serializers.py:491-593 (ObservedList: mutators save, ``+`` is refused) and :675."""
    p = Params(node)
    roi = scene.AddNewNodeByClass("vtkMRMLMarkupsROINode")
    p.boxes.append(roi)
    assert node.GetParameter("boxes.len") == "1" and p.boxes == [roi]
    with pytest.raises(NotImplementedError):
        p.boxes + [roi]  # noqa: B018


def test_a_removed_node_is_listed_during_node_removed_and_none_afterwards(node, scene):
    """MRML removes the reference before ``NodeRemovedEvent`` and modifies the parameter node
    after it; the cache (wrapper.py:99-101) changes only then, and the length parameter keeps
    counting the entry (serializers.py:669-675 reads ``None`` for it)."""
    p = Params(node)
    a, b = scene.AddNewNodeByClass("vtkMRMLMarkupsROINode"), scene.AddNewNodeByClass("vtkMRMLMarkupsROINode")
    p.boxes = [a, b]
    during = []
    tag = scene.AddObserver(scene.NodeRemovedEvent, lambda caller, event: during.append(list(p.boxes)))
    scene.RemoveNode(a)
    scene.RemoveObserver(tag)
    assert during == [[a, b]] and p.boxes == [None, b]


def test_writing_a_name_that_is_no_field_is_refused(node):
    """Stricter than Slicer's (a plain class there, where a misspelt field is a new Python attribute)."""
    p = Params(node)
    with pytest.raises(AttributeError, match="no parameter 'consensu'"):
        p.consensu = 2


@pytest.mark.parametrize("version,leaked", [((5, 12, 3), 0), ((5, 10, 0), 1)])
def test_disconnect_gui_drops_its_observer_at_5_12_3_only(scene, version, leaked):
    """wrapper.py:213-214 and :263-265 at v5.12.3 keep and remove the connection's ModifiedEvent
    observer; at v5.10.0 (wrapper.py:212, 256-260) it is never removed: one leaks per pair."""
    module = parameter_node.make_module(version)

    @module.parameterNodeWrapper
    class P:
        query: str = ""

    node = scene.AddNewNodeByClass("vtkMRMLScriptedModuleNode")
    p = P(node)
    before = live_observers(node)
    gui = types.SimpleNamespace(label=types.SimpleNamespace(property=lambda name: None))  # binds nothing
    tag = p.connectGui(gui)
    assert live_observers(node) == before + 1
    p.disconnectGui(tag)
    assert live_observers(node) == before + leaked
