"""``GuiBinding``: one GUI connection per parameter node, however often the module is entered,
on Slicer 5.8 (``connectGui`` returns no tag) and 5.10 (a tag)."""

from __future__ import annotations

import pytest
from MedVolR1SlicerLib.guibinding import GuiBinding


class ParameterNodeStandIn:
    """``connectGui``/``disconnectGui`` as ``parameterNodeWrapper`` has them: Slicer 5.8 returns
    no tag (``None``) and ``disconnectGui(None)`` does nothing; 5.10 returns a tag that works.
    ``live`` counts the connections in force (each writes every widget edit to the node once)."""

    def __init__(self, returns_tag: bool, node=None):
        self.returns_tag = returns_tag
        self.parameterNode = node if node is not None else object()
        self.live = {}
        self._next = 0

    def connectGui(self, ui):
        self._next += 1
        self.live[self._next] = ui
        return self._next if self.returns_tag else None

    def disconnectGui(self, tag):
        self.live.pop(tag, None)


@pytest.mark.parametrize("returns_tag", [False, True], ids=["slicer-5.8", "slicer-5.10"])
def test_entering_the_module_again_never_stacks_gui_connections(returns_tag):
    node = ParameterNodeStandIn(returns_tag)
    binding = GuiBinding()
    for _ in range(5):  # enter / exit, as the widget does
        binding.bind(node, "ui")
        assert len(node.live) == 1
        binding.unbind()
    assert len(node.live) == (0 if returns_tag else 1)
    # a new wrapper object around the same MRML node (getParameterNode makes one per call)
    again = ParameterNodeStandIn(returns_tag, node.parameterNode)
    again.live = node.live
    binding.bind(again, "ui")
    assert len(node.live) == 1


def test_a_different_parameter_node_gets_its_own_connection():
    a, b = ParameterNodeStandIn(True), ParameterNodeStandIn(True)
    binding = GuiBinding()
    assert binding.bind(a, "ui") is True
    assert binding.bind(b, "ui") is True
    assert len(a.live) == 0 and len(b.live) == 1
    binding.bind(None, "ui")
    assert len(b.live) == 0


class ObservedNode:
    """A VTK object's observers as far as the binding uses them: ``AddObserver`` numbers them in
    order, ``GetCommand(tag)`` is None once removed."""

    def __init__(self):
        self.commands = {}
        self._tags = 0

    def AddObserver(self, event, callback, priority=0.0):  # noqa: N802 - VTK's names
        self._tags += 1
        self.commands[self._tags] = (event, callback)
        return self._tags

    def RemoveObserver(self, tag):  # noqa: N802
        self.commands.pop(tag, None)

    def GetCommand(self, tag):  # noqa: N802
        return self.commands.get(tag)


class WrapperStandIn(ParameterNodeStandIn):
    """``connectGui`` adds a widget-writing ``ModifiedEvent`` observer to the node, last (after
    writing the widgets, which may add others); ``disconnectGui`` removes it at 5.12 only."""

    def __init__(self, removes_observer: bool, node: ObservedNode):
        super().__init__(True, node)
        self.removes_observer = removes_observer
        self.observers = {}

    def connectGui(self, ui):
        tag = super().connectGui(ui)
        self.parameterNode.AddObserver("ModifiedEvent", lambda *a: None)  # e.g. another wrapper made meanwhile
        self.observers[tag] = self.parameterNode.AddObserver("ModifiedEvent", lambda *a: None)
        return tag

    def disconnectGui(self, tag):
        super().disconnectGui(tag)
        observer = self.observers.pop(tag)
        if self.removes_observer:
            self.parameterNode.RemoveObserver(observer)


@pytest.mark.parametrize("removes_observer", [False, True], ids=["slicer-5.10", "slicer-5.12"])
def test_unbinding_removes_the_observer_that_disconnect_gui_leaves_on_5_10(removes_observer):
    node = ObservedNode()
    binding = GuiBinding()
    for _ in range(3):  # three scene closes: a new wrapper each time, the same MRML node
        wrapper = WrapperStandIn(removes_observer, node)
        binding.bind(wrapper, "ui")
        binding.unbind()
    assert len(node.commands) == 3  # only the other observers made during the connections are left
    assert all(event == "ModifiedEvent" for event, _ in node.commands.values())
