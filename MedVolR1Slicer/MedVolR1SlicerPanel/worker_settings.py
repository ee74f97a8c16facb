"""The panel's worker settings: Local or Remote, the remote worker's address and its token, and
what the panel asks before a CT leaves the computer. A mixin of
:class:`.panel.MedVolR1SlicerWidget`, as :mod:`.correction_controls` is.

- Local/Remote and the address are the application's settings (``qt.QSettings``, keys
  ``MedVolR1Slicer/Worker`` and ``MedVolR1Slicer/RemoteUrl``), read when the panel is built and
  written when changed; they are never in the parameter node, so no scene saves them and opening
  a scene never changes where a CT goes. A scene saved by an older version that carries them is
  read without them, and the status line says so once.
- The token is kept in memory for this session only (Slicer has no secret store, and settings are
  a plain file), bound to the address it was typed for (:class:`MedVolR1SlicerLib.remote.RemoteAccess`):
  when the address changes the token field empties and the status line says that the token stays
  with its address; going back to that address brings it back.
- The first upload to an address in a session asks the worker what it is (``hello``) and then
  the user, naming the address and that answer; "Do not send" sends nothing. A "Send" is
  remembered for the address until Slicer exits.
"""

from __future__ import annotations

import qt
import slicer

from MedVolR1SlicerLib import params, remote
from MedVolR1SlicerLib.client import WorkerError


class WorkerSettings:
    """Needs from the widget: ``ui``, ``logic`` and ``_updateButtons``."""

    def _initWorkerSettings(self):
        self._remote = remote.RemoteAccess()
        self._remoteAddress = ""  # the address the token field belongs to

    def _loadWorkerSettings(self):
        """The application's worker settings into the panel (when it is built)."""
        settings = qt.QSettings()
        worker = str(settings.value(remote.SETTINGS_WORKER, params.DEFAULTS["worker"]) or "")
        url = str(settings.value(remote.SETTINGS_REMOTE_URL, params.DEFAULTS["remote_url"]) or "")
        self.ui.remoteUrlLineEdit.text = url
        self._remoteAddress = remote.address(url)
        radio = self.ui.workerRemoteRadioButton if worker == "remote" else self.ui.workerLocalRadioButton
        radio.setChecked(True)  # in an exclusive pair only checking a button does anything

    def _connectWorkerSettings(self):
        self.ui.workerLocalRadioButton.connect("toggled(bool)", self._onWorkerToggled)
        self.ui.remoteUrlLineEdit.connect("textChanged(QString)", self._onRemoteUrlEdited)
        self.ui.remoteTokenLineEdit.connect("textChanged(QString)", self._onRemoteTokenEdited)

    def _remoteChosen(self) -> bool:
        return bool(self.ui.workerRemoteRadioButton.checked)

    def _workerOptions(self):
        """``(worker, address, token)`` as the panel shows them; the token is the one typed for
        this address, never another's, and none for the local worker."""
        if not self._remoteChosen():
            return "local", "", ""
        url = self.ui.remoteUrlLineEdit.text
        return "remote", url, self._remote.token_for(url)

    def _onWorkerToggled(self, local):
        qt.QSettings().setValue(remote.SETTINGS_WORKER, "local" if local else "remote")
        self._updateButtons()

    def _useRemoteWorker(self):
        """Switch to the remote worker (offered where this Slicer cannot run a local one)."""
        self.ui.workerRemoteRadioButton.setChecked(True)

    def _onRemoteUrlEdited(self, text):
        qt.QSettings().setValue(remote.SETTINGS_REMOTE_URL, str(text).strip())
        before, now = self._remoteAddress, remote.address(text)
        self._remoteAddress = now
        token = self._remote.token_for(now)
        field = self.ui.remoteTokenLineEdit
        if field.text != token:
            blocked = field.blockSignals(True)  # this is not the user typing a token for ``now``
            field.text = token
            field.blockSignals(blocked)
            if not token and self._remote.token_for(before):
                self.ui.statusLabel.text = (
                    f"The token was typed for {remote.printable(before)}: it stays with that address and is "
                    f"not sent to {remote.printable(now) or 'another one'}. Type this worker's token if it needs one.")

    def _onRemoteTokenEdited(self, text):
        self._remote.set_token(self.ui.remoteUrlLineEdit.text, text)

    def _sayIgnoredSceneWorkerSettings(self):
        """Once per scene that carried them: the worker settings an older version saved in it
        were removed unread (the logic takes them out of the parameter node)."""
        found = self.logic.takeIgnoredWorkerSettings()
        if found:
            said = ", ".join(f"{name} {remote.printable(value, 60)!r}" for name, value in sorted(found.items()))
            self.ui.statusLabel.text = (
                f"This scene was saved by an older MedVol-R1 with worker settings ({said}); they were ignored. "
                "The worker is chosen in Advanced › Worker, never by a scene.")

    def _confirmUpload(self, options) -> bool:
        """Before a CT goes to a remote worker: the first time for its address in this session, ask
        the worker what it is (``hello``) and the user whether to send it there. Returns whether
        the request may go on; nothing is sent otherwise."""
        if options.worker != "remote" or self._remote.confirmed(options.remote_url):
            return True
        url = options.remote_url
        slicer.app.setOverrideCursor(qt.Qt.WaitCursor)
        try:
            identity = remote.identity_text(self.logic.session.identify(options))
        except WorkerError as e:
            slicer.util.errorDisplay(f"The remote worker at {url} did not say what it is, so nothing was sent to it: "
                                     f"{e.message}", windowTitle="MedVol-R1")
            return False
        finally:
            slicer.app.restoreOverrideCursor()
        plain = " It travels unencrypted (http://): see docs/security.md." if url.startswith("http://") else ""
        text = (f"Send this CT to the remote worker at {url}?\n\nThe server there says it is: {identity}.\n\n"
                f"The CT leaves this computer.{plain} You are asked once per address in this session.")
        box = qt.QMessageBox(qt.QMessageBox.Question, "MedVol-R1: send the CT away?", text, qt.QMessageBox.NoButton,
                             slicer.util.mainWindow())
        sendButton = box.addButton("Send", qt.QMessageBox.YesRole)
        keepButton = box.addButton("Do not send", qt.QMessageBox.NoRole)
        box.setDefaultButton(keepButton)
        box.setEscapeButton(keepButton)
        box.exec_()
        if box.clickedButton() != sendButton:
            self.ui.statusLabel.text = f"Nothing was sent to {url}."
            return False
        self._remote.confirm(url, identity)
        return True
