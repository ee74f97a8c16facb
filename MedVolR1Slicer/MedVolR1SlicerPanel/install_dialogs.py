"""The panel's dialogs around the local worker's environment: installing the MedVol-R1 packages
on first use (one dialog listing everything missing, as SlicerTotalSegmentator asks first), and
downloading a preset's weights when the worker says they are missing. The plans, commands and
outcomes are plain Python in ``MedVolR1SlicerLib.install``; this file only shows them."""

from __future__ import annotations

from typing import Callable

import qt
import slicer

from MedVolR1SlicerLib import install
from MedVolR1SlicerLib.client import python_for_worker
from MedVolR1SlicerLib.session import Options


def ensure_installed(logic, options: Options, ui, useRemote: Callable[[], None]) -> bool:
    """Before a local request: whether the MedVol-R1 packages are there, after asking to install
    what is missing (one dialog listing it, then one progress line in ``ui.statusLabel``). On a
    Slicer too old for a local worker, offer the remote worker instead (``useRemote`` switches the
    panel to it). Returns True when the request may go on."""
    if options.worker == "remote":
        return True  # the remote machine has its own environment
    plan = install.current_plan()
    if not plan.needed:
        return True
    if plan.remote_only:  # Slicer older than 5.10: pip could only fail here
        if slicer.util.confirmYesNoDisplay(plan.message(), windowTitle="MedVol-R1: this Slicer is too old"):
            useRemote()
            ui.advancedCollapsibleButton.collapsed = False
            ui.remoteUrlLineEdit.setFocus()
            ui.statusLabel.text = "Give the remote worker's address (and token), then click Segment."
        return False
    if not plan.steps:
        slicer.util.errorDisplay(plan.message(), windowTitle="MedVol-R1")
        return False
    if not slicer.util.confirmOkCancelDisplay(plan.message(), windowTitle="MedVol-R1: install packages"):
        return False

    def progress(index, count, text):
        ui.statusLabel.text = f"Installing ({index}/{count}): {text}"
        slicer.app.processEvents()

    slicer.app.setOverrideCursor(qt.Qt.WaitCursor)
    try:  # one dialog on failure: the helpers are asked not to show their own
        logic.runInstallPlan(plan, progress=progress)
    except install.InstallError as e:
        slicer.util.errorDisplay(f"Installing the MedVol-R1 packages failed: {e}", windowTitle="MedVol-R1",
                                 detailedText=e.detail)
        return False
    finally:
        slicer.app.restoreOverrideCursor()
    return not install.current_plan().needed


def offer_download(preset: str, message: str) -> None:
    """The worker said the preset's weights are missing: offer to download them now (one
    dialog), run ``medvol models download`` with a progress dialog that can cancel it, and say
    how it ended; how to import them on an offline machine is in every message."""
    text = (f"{message}\n\nDownload the weights of preset '{preset}' now (several GB)?\n\n"
            + install.import_hint(preset))
    if not slicer.util.confirmOkCancelDisplay(text, windowTitle="MedVol-R1: model weights"):
        return
    cmd = install.download_command(python_for_worker(), preset)
    dialog = slicer.util.createProgressDialog(labelText=f"Downloading {preset}…", maximum=100)
    proc = qt.QProcess()
    proc.setProcessChannelMode(qt.QProcess.MergedChannels)

    def onOutput():
        text = install.qbytes_text(proc.readAll())  # a PythonQt QByteArray: .data(), not bytes()
        for line in text.replace("\r", "\n").splitlines():
            f = install.download_progress(line)
            if f is not None:
                dialog.value = int(f * 100)
            if line.strip():
                dialog.labelText = line.strip()[:120]
        slicer.app.processEvents()

    proc.connect("readyRead()", onOutput)
    proc.start(cmd[0], cmd[1:])
    ended = install.wait_for_process(proc, qt.QProcess.NotRunning, slicer.app.processEvents,
                                     lambda: dialog.wasCanceled)
    onOutput()  # what arrived after the last readyRead
    dialog.close()
    if not ended:
        return
    ok, why = install.download_outcome(proc, qt.QProcess, cmd)  # a process that never started is no success
    if ok:
        slicer.util.infoDisplay(f"Weights of '{preset}' are ready. Click Segment again.")
    else:
        slicer.util.errorDisplay(f"The download failed: {why}\n\n" + install.import_hint(preset))
