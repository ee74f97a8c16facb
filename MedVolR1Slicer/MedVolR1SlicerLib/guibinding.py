"""The one connection between the panel's widgets and the parameter node, across Slicer versions.

``parameterNodeWrapper``'s ``connectGui(ui)`` returns a tag that ``disconnectGui(tag)`` takes to
undo the connection, but in Slicer 5.8 ``connectGui`` returns nothing (``None``; fixed in 5.10,
commit "Fix not returning GUI tag after connection"), and ``disconnectGui(None)`` does nothing.
A widget that connects on every module enter then stacks one more live connection each time:
every widget edit is written to the node once per connection. :class:`GuiBinding` keeps at most
one connection per parameter node: when there is no tag to disconnect with, the existing
connection is kept and reused instead of adding another.
"""

from __future__ import annotations

from typing import Any, Optional


class GuiBinding:
    """``bind(node, ui)`` connects ``ui`` to ``node`` unless it already is; ``unbind()`` undoes it
    where the Slicer version allows (a tag), and otherwise leaves it for the next ``bind`` of the
    same node to reuse. ``node`` is a parameter-node wrapper (``connectGui``/``disconnectGui``)."""

    def __init__(self):
        self.node: Any = None
        self.tag: Optional[Any] = None
        self.connected = False

    def bind(self, node, ui) -> bool:
        """Connect ``ui`` to ``node``; returns True when a new connection was made."""
        if node is None:
            self.unbind()
            return False
        if self.connected and self._same(node):
            return False
        if self.connected:
            self.unbind()
        tag = node.connectGui(ui)
        self.node, self.tag, self.connected = node, tag, True
        return True

    def unbind(self) -> None:
        """Disconnect when a tag allows it (Slicer ≥ 5.10); without one the connection stays and
        is remembered, so that binding the same node again adds nothing."""
        if not self.connected:
            return
        if self.tag is not None:
            self.node.disconnectGui(self.tag)
            self.node, self.tag, self.connected = None, None, False

    def forget(self) -> None:
        """The node is gone (scene closed): nothing to disconnect, nothing to reuse."""
        self.node, self.tag, self.connected = None, None, False

    def _same(self, node) -> bool:
        a = getattr(self.node, "parameterNode", self.node)
        b = getattr(node, "parameterNode", node)
        return a is b
