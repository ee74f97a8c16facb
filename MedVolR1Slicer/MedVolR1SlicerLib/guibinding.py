"""The one connection between the panel's widgets and the parameter node, across Slicer versions.

``parameterNodeWrapper``'s ``connectGui(ui)`` returns a tag that ``disconnectGui(tag)`` takes to
undo the connection, but in Slicer 5.8 ``connectGui`` returns nothing (``None``; fixed in 5.10,
commit "Fix not returning GUI tag after connection"), and ``disconnectGui(None)`` does nothing.
A widget that connects on every module enter then stacks one more live connection each time:
every widget edit is written to the node once per connection. :class:`GuiBinding` keeps at most
one connection per parameter node: when there is no tag to disconnect with, the existing
connection is kept and reused instead of adding another.

In Slicer 5.10 ``disconnectGui(tag)`` drops the widgets' callbacks but not the ``ModifiedEvent``
observer ``connectGui`` added to the node (``wrapper.py`` at v5.10.0: the tag ``AddObserver``
returns is not kept; v5.12 keeps and removes it). That observer holds the wrapper, and with it
every field's cache observer, for as long as the node lives — and the module's parameter node
lives across scene closes. So :meth:`GuiBinding.bind` notes which observer the connection added
(VTK numbers a node's observers in order: the last one added during ``connectGui`` is the GUI
writer, which ``connectGui`` adds after writing the widgets) and :meth:`GuiBinding.unbind` removes
it when ``disconnectGui`` left it behind.
"""

from __future__ import annotations

from typing import Any, Optional


def _nothing(caller=None, event=None) -> None:
    pass


def _vtk_node(node) -> Any:
    """The MRML node under a parameter-node wrapper, when it can say which observers it has."""
    vtk_node = getattr(node, "parameterNode", None)
    return vtk_node if hasattr(vtk_node, "GetCommand") and hasattr(vtk_node, "AddObserver") else None


def _next_tag(vtk_node) -> Optional[int]:
    """The tag the node's next observer will get, as a tag that is already used (a probe added
    and removed at once)."""
    if vtk_node is None:
        return None
    tag = vtk_node.AddObserver("ModifiedEvent", _nothing)
    vtk_node.RemoveObserver(tag)
    return tag


class GuiBinding:
    """``bind(node, ui)`` connects ``ui`` to ``node`` unless it already is; ``unbind()`` undoes it
    where the Slicer version allows (a tag), and otherwise leaves it for the next ``bind`` of the
    same node to reuse. ``node`` is a parameter-node wrapper (``connectGui``/``disconnectGui``)."""

    def __init__(self):
        self.node: Any = None
        self.tag: Optional[Any] = None
        self.connected = False
        self.observer: Optional[int] = None  # the node's ModifiedEvent observer that writes the widgets

    def bind(self, node, ui) -> bool:
        """Connect ``ui`` to ``node``; returns True when a new connection was made."""
        if node is None:
            self.unbind()
            return False
        if self.connected and self._same(node):
            return False
        if self.connected:
            self.unbind()
        vtk_node = _vtk_node(node)
        before = _next_tag(vtk_node)
        tag = node.connectGui(ui)
        after = _next_tag(vtk_node)
        self.node, self.tag, self.connected = node, tag, True
        self.observer = None
        if before is not None and after is not None:
            added = [t for t in range(before + 1, after) if vtk_node.GetCommand(t) is not None]
            self.observer = added[-1] if added else None
        return True

    def unbind(self) -> None:
        """Disconnect when a tag allows it (Slicer ≥ 5.10), and remove the connection's observer
        if ``disconnectGui`` left it (5.10); without a tag the connection stays and is remembered,
        so that binding the same node again adds nothing."""
        if not self.connected:
            return
        if self.tag is not None:
            self.node.disconnectGui(self.tag)
            vtk_node = _vtk_node(self.node)
            if self.observer is not None and vtk_node is not None and vtk_node.GetCommand(self.observer) is not None:
                vtk_node.RemoveObserver(self.observer)  # Slicer 5.10 leaves it
            self.node, self.tag, self.connected, self.observer = None, None, False, None

    def forget(self) -> None:
        """The node is gone (scene closed): nothing to disconnect, nothing to reuse."""
        self.node, self.tag, self.connected, self.observer = None, None, False, None

    def _same(self, node) -> bool:
        a = getattr(self.node, "parameterNode", self.node)
        b = getattr(node, "parameterNode", node)
        return a is b


def show_choices(combo, choices: list, shown: Optional[list], current) -> list:
    """Fill a combo box with ``choices`` (``(text, value)`` pairs) unless it already shows them
    (``shown``, what the last call returned), and make ``current(values)`` its current index, its
    signals blocked meanwhile (a rebuilt list is not a user's choice). Returns ``choices``."""
    blocked = combo.blockSignals(True)
    try:
        if choices != shown:
            combo.clear()
            for text, value in choices:
                combo.addItem(text, value)
        combo.setCurrentIndex(current([value for _, value in choices]))
    finally:
        combo.blockSignals(blocked)
    return choices
