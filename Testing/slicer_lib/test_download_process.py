"""What the first run in a real Slicer would have hit, in the module's plain-Python parts:
errors raised by a slot reach the caller, the weights-download wait ends when the process has
ended, one GUI connection per parameter node on Slicer 5.8 (no tag) and 5.10 (a tag)."""

from __future__ import annotations

import pytest
from MedVolR1SlicerLib import install
from MedVolR1SlicerLib.guibinding import GuiBinding
from MedVolR1SlicerLib.signals import Signal


# ---- Signal: errors reach the caller ----------------------------------------------------------

def test_a_failing_slot_raises_to_the_emitter_after_every_slot_ran():
    s = Signal("finished")
    ran = []

    def bad(x):
        ran.append(("bad", x))
        raise ValueError("the mask does not fit")

    def worse(x):
        ran.append(("worse", x))
        raise KeyError("later")

    s.connect(lambda x: ran.append(("first", x)))
    s.connect(bad)
    s.connect(worse)
    s.connect(lambda x: ran.append(("last", x)))
    with pytest.raises(ValueError, match="the mask does not fit"):  # the first error, not swallowed
        s.emit(7)
    assert ran == [("first", 7), ("bad", 7), ("worse", 7), ("last", 7)]
    s.disconnect(bad)
    s.disconnect(worse)
    s.emit(8)  # no error: nothing raised
    assert ran[-2:] == [("first", 8), ("last", 8)]


# ---- the weights download waits on the process state ------------------------------------------

NOT_RUNNING, RUNNING = 0, 2  # QProcess::NotRunning, QProcess::Running


class QtLikeProcess:
    """``QProcess``'s documented waiting semantics, for a loop test without Qt:
    ``waitForFinished`` returns true only when the process finishes *during* the call, and false
    on a time-out **or when it is not running any more** (Qt's documentation says so)."""

    def __init__(self, runs_for_calls: int):
        self.left = runs_for_calls
        self.running = runs_for_calls > 0
        self.calls = 0
        self.killed = False

    def state(self):
        return RUNNING if self.running else NOT_RUNNING

    def waitForFinished(self, ms):
        self.calls += 1
        if self.calls > 1000:
            raise AssertionError("the wait loop spins")
        if not self.running:
            return False
        self.left -= 1
        if self.left <= 0:
            self.running = False
            return True
        return False

    def kill(self):
        self.killed = True
        self.running = False


def test_the_wait_ends_when_the_process_ended_between_two_waits():
    # it ended while the GUI was processing events: Qt then answers false for ever
    proc = QtLikeProcess(runs_for_calls=3)
    proc.waitForFinished = (lambda orig: (lambda ms: orig(ms) and False))(proc.waitForFinished)
    events = []
    assert install.wait_for_process(proc, NOT_RUNNING, lambda: events.append(1), lambda: False) is True
    assert proc.calls == 3 and len(events) == 3


def test_the_wait_ends_at_once_for_a_process_that_never_started_or_already_ended():
    proc = QtLikeProcess(runs_for_calls=0)  # e.g. the program was not found
    assert install.wait_for_process(proc, NOT_RUNNING, lambda: None, lambda: False) is True
    assert proc.calls == 0


def test_cancel_kills_the_process_and_says_so():
    proc = QtLikeProcess(runs_for_calls=100)
    ticks = []
    assert install.wait_for_process(proc, NOT_RUNNING, lambda: ticks.append(1), lambda: len(ticks) >= 2) is False
    assert proc.killed and proc.state() == NOT_RUNNING


def test_process_output_is_read_from_a_pythonqt_qbytearray():
    class PythonQtQByteArray:  # PythonQt's QByteArray: data() gives bytes, bytes(qba) raises
        def __init__(self, raw):
            self.raw = raw

        def data(self):
            return self.raw

        def __bytes__(self):
            raise TypeError("cannot convert 'QByteArray' object to bytes")

    assert install.qbytes_text(PythonQtQByteArray("model:  42%|██".encode("utf-8"))) == "model:  42%|██"
    assert install.qbytes_text(b"\xff ok") == "\ufffd ok"


# ---- one GUI connection per parameter node ----------------------------------------------------

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
