"""The weights download's process as the widget runs it (``install.wait_for_process``,
``install.qbytes_text``): the wait ends when the process has ended, also between two waits or
before the first; cancel kills it; its output is read from a PythonQt ``QByteArray``;
``install.download_outcome`` tells a download that never started (or failed, or crashed) from
one that worked."""

from __future__ import annotations

import pytest
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


# ---- did the download work? ------------------------------------------------------------------

class QProcessEnums:
    """``qt.QProcess``'s enum values (Qt 5.15 and 6): ProcessError and ExitStatus."""

    FailedToStart, Crashed, Timedout, ReadError, WriteError, UnknownError = 0, 1, 2, 3, 4, 5
    NormalExit, CrashExit = 0, 1
    NotRunning, Starting, Running = 0, 1, 2


class EndedProcess:
    """A ``QProcess`` after it ended, as Qt leaves it: ``error()`` is ``UnknownError`` until an
    error happened; a program that could not be started has ``error() == FailedToStart`` and
    ``exitStatus() == NormalExit`` (the default) with ``exitCode()`` 0 where the start failed at
    once (255 measured on Linux, Qt 5.15.14 and 6.11); every ``waitForFinished(ms)`` that timed
    out left ``Timedout`` behind, also when the program later exited normally with 0 (measured
    with PyQt5 5.15.14 and PyQt6 6.11: ``error()`` 2, ``exitStatus()`` 0, ``exitCode()`` 0)."""

    def __init__(self, error=QProcessEnums.UnknownError, status=QProcessEnums.NormalExit, code=0, message=""):
        self._error, self._status, self._code, self._message = error, status, code, message

    def state(self):
        return QProcessEnums.NotRunning

    def error(self):
        return self._error

    def exitStatus(self):
        return self._status

    def exitCode(self):
        return self._code

    def errorString(self):
        return self._message


CMD = ["/opt/Slicer/bin/PythonSlicer", "-m", "medvolcore.cli", "models", "download", "qwen3-vl-4b"]


@pytest.mark.parametrize("code", [0, 255])
def test_a_download_that_never_started_is_not_ready(code):
    proc = EndedProcess(QProcessEnums.FailedToStart, QProcessEnums.NormalExit, code, "No such file or directory")
    # what the widget checked before: this passed for exit code 0
    assert proc.exitStatus() == QProcessEnums.NormalExit and (code != 0 or proc.exitCode() == 0)
    ok, message = install.download_outcome(proc, QProcessEnums, CMD)
    assert not ok
    assert message == ("Could not start `/opt/Slicer/bin/PythonSlicer -m medvolcore.cli models download "
                       "qwen3-vl-4b`: No such file or directory.")
    # the wait loop ends at once for it (it is not running)
    assert install.wait_for_process(proc, QProcessEnums.NotRunning, lambda: None, lambda: False)


def test_a_download_that_ran_and_exited_with_0_is_ready_though_the_waits_timed_out():
    ok, message = install.download_outcome(EndedProcess(QProcessEnums.Timedout), QProcessEnums, CMD)
    assert ok and "models download qwen3-vl-4b" in message
    assert install.download_outcome(EndedProcess(), QProcessEnums, CMD)[0]


def test_a_download_that_failed_or_crashed_says_so_and_names_the_command():
    ok, message = install.download_outcome(EndedProcess(code=3), QProcessEnums, CMD)
    assert not ok and message.endswith("models download qwen3-vl-4b` failed (exit code 3).")
    ok, message = install.download_outcome(EndedProcess(QProcessEnums.Crashed, QProcessEnums.CrashExit, 6),
                                           QProcessEnums, CMD)
    assert not ok and message.endswith("qwen3-vl-4b` crashed.") and "exit code" not in message


def test_a_fake_without_error_string_still_gets_a_message():
    class Bare:
        def error(self):
            return QProcessEnums.FailedToStart

        def exitStatus(self):
            return QProcessEnums.NormalExit

        def exitCode(self):
            return 0

    assert install.download_outcome(Bare(), QProcessEnums, ["medvol"]) == (False, "Could not start `medvol`.")
