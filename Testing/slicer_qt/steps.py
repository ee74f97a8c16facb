"""What a user does in the panel, with real Qt events (QTest), for the tests of this tier."""

from __future__ import annotations

import time
import xml.etree.ElementTree as ET
from pathlib import Path

from PyQt5 import QtCore, QtGui, QtTest, QtWidgets
from PyQt5.QtCore import Qt

QTest = QtTest.QTest
MODULE_DIR = Path(__file__).resolve().parents[2] / "MedVolR1Slicer"
UI_FILE = MODULE_DIR / "Resources" / "UI" / "MedVolR1Slicer.ui"
UI = ET.parse(UI_FILE).getroot()
UI_CLASSES = {w.get("name"): w.get("class") for w in UI.iter("widget")}  # the .ui's widgets and their classes


def ui_property(widget, name):
    """The text of a property of a ``<widget>`` element of the .ui, or None."""
    prop = widget.find(f"property[@name='{name}']")
    return None if prop is None else prop[0].text


def wait_until(condition, timeout=10.0, what=""):
    """Run the event loop (the panel's poll timer, animated clicks) until ``condition()``."""
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout} s waiting for {what or condition}")
        QTest.qWait(20)


def click(widget):
    """A left click on ``widget`` (it must be visible and enabled to react): in its middle, or on
    the indicator of a check box or radio button (its middle may be past the label)."""
    assert widget.visible and widget.enabled, f"{widget.objectName} cannot be clicked (visible/enabled)"
    if isinstance(widget, (QtWidgets.QCheckBox, QtWidgets.QRadioButton)):
        h = widget.height // 2
        QTest.mouseClick(widget, Qt.LeftButton, Qt.NoModifier, QtCore.QPoint(h, h))
    else:
        QTest.mouseClick(widget, Qt.LeftButton)


def type_text(widget, text):
    widget.setFocus()
    QTest.keyClicks(widget, text)


def key(widget, k, modifier=Qt.NoModifier):
    QTest.keyClick(widget, k, modifier)


def mnemonic(text):
    """The Alt+key a button text's ``&`` gives, as Qt reads it, or None."""
    sequence = QtGui.QKeySequence.mnemonic(text)
    return sequence.toString() if not sequence.isEmpty() else None


def press_mnemonic(window, text):
    """Press the Alt+key of ``text`` in ``window`` and let an animated click finish (100 ms)."""
    sequence = QtGui.QKeySequence.mnemonic(text)
    combined = sequence[0]
    QTest.keyClick(window, Qt.Key(combined & ~int(Qt.KeyboardModifierMask)),
                   Qt.KeyboardModifiers(combined & int(Qt.KeyboardModifierMask)))
    QTest.qWait(150)


def load_ct(panel, name="PatientA_CT"):
    """The self-test's synthetic CT (48×40×12, an "organ" of 300 HU), chosen in the CT selector."""
    volume = panel.module.MedVolR1SlicerTest._syntheticCT(name)
    panel.ui.inputVolumeSelector.setCurrentNode(volume)
    return volume


def use_remote_worker(panel):
    """Advanced › Worker: Remote. The worker is the test's either way; a remote one needs nothing
    installed (no install plan runs). The choice is an application setting (never the parameter
    node's). Its address counts as confirmed for this panel's session, as after a first "Send": the
    question before the first upload is tested on its own (``test_qt_worker_settings.py``)."""
    ui = panel.ui
    if ui.advancedCollapsibleButton.collapsed:
        click(ui.advancedCollapsibleButton)
    click(ui.workerRemoteRadioButton)
    assert QtCore.QSettings().value("MedVolR1Slicer/Worker") == "remote" and ui.remoteUrlLineEdit.enabled
    panel.widget._remote.confirm(ui.remoteUrlLineEdit.text, "the tests' self-test worker")


def idle(panel):
    return panel.logic.session.state == "idle"


def segment(panel, query="the organ"):
    """Type the query and click Segment; wait for the result."""
    ui = panel.ui
    ui.queryEdit.setFocus()
    QTest.keyClick(ui.queryEdit, Qt.Key_A, Qt.ControlModifier)
    type_text(ui.queryEdit, query)
    click(ui.segmentButton)
    wait_until(lambda: idle(panel), what="the segment request to end")
    assert ui.statusLabel.text.startswith("Done."), ui.statusLabel.text

