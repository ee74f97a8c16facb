"""The weights download's process as the widget runs it (``install.wait_for_process``,
``install.qbytes_text``): the wait ends when the process has ended, also between two waits or
before the first; cancel kills it; its output is read from a PythonQt ``QByteArray``."""

from __future__ import annotations

from MedVolR1SlicerLib import install


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
