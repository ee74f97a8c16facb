"""The Slicer application around a module panel, in real Qt: ``slicer.app``, the main window, the
module panel that hosts a scripted module's widget, ``ScriptedLoadableModuleWidget``, and a
Segment Editor module. Written from Slicer v5.12.3:

- ``qSlicerApplication`` (Base/QTGUI/qSlicerApplication.h, Base/QTCore/qSlicerCoreApplication.h):
  ``startupCompleted()``, ``moduleManager()`` (``moduleAboutToBeUnloaded(QString)``,
  Base/QTCore/qSlicerModuleManager.h:60), ``userSettings()``/``settings()``, ``testingEnabled()``
  (on here, as when Slicer runs its self-tests: message boxes are logged, not shown), and
  ``layoutManager()``, which is None (there are no views);
- the main window (Base/QTApp/Resources/UI/qSlicerMainWindow.ui): object name
  ``qSlicerMainWindow``, the menus ``&File``, ``&Edit``, ``&View``, ``&Help`` (:206, :224, :237,
  :299), the module panel in the dock widget ``PanelDockWidget`` (:15-52), a central widget that
  stands for the slice views (it only takes the keyboard focus), and ``moduleSelector()`` whose
  ``selectModule(QString)`` shows another module's panel (qSlicerModuleSelectorToolBar.h:72);
- ``qSlicerScriptedLoadableModuleWidget`` (Base/QTGUI/qSlicerScriptedLoadableModuleWidget.cxx):
  a qMRMLWidget with a QVBoxLayout (:83) whose Python widget is built with it as ``parent``, then
  ``setup()`` (:208-213); ``enter()``/``exit()`` set ``isEntered`` and call the Python ones (:216-228);
- ``ScriptedLoadableModuleWidget`` (Base/Python/slicer/ScriptedLoadableModule.py:88-293).

Not here: views, the layout manager, rendering, the module manager's loading and reloading, the
application's start-up and shut-down. Modal dialogs do not open: ``testingEnabled`` keeps Slicer's
message boxes closed (they are logged), and a dialog the module runs itself (``exec_()``) is
answered by :class:`ModalDialogs`, from answers a test planned, or fails the test.
"""

from __future__ import annotations

import os
import types

from PyQt5 import QtCore, QtWidgets
from PyQt5.QtCore import pyqtProperty, pyqtSignal
from widgets import qMRMLSegmentEditorWidget, qMRMLWidget

MENUS = ("&File", "&Edit", "&View", "&Help")  # qSlicerMainWindow.ui:206, :224, :237, :299 at v5.12.3


class qSlicerModuleManager(QtCore.QObject):
    moduleAboutToBeUnloaded = pyqtSignal(str)


class qSlicerApplication(QtWidgets.QApplication):
    startupCompleted = pyqtSignal()
    _moduleManager = None

    def __init__(self, argv):
        super().__init__(argv)
        self._moduleManager = qSlicerModuleManager(self)

    def moduleManager(self):
        return self._moduleManager

    def userSettings(self):
        return QtCore.QSettings()

    settings = userSettings

    def testingEnabled(self):
        return True

    def layoutManager(self):
        return None


class qSlicerScriptedLoadableModuleWidget(qMRMLWidget):
    """The module panel's widget for a scripted module: ``python`` is the module's widget object."""

    _entered = False
    _python = None

    def __init__(self, parent=None):
        super().__init__(parent)
        QtWidgets.QVBoxLayout(self)

    def createPython(self, widgetClass):
        self._python = widgetClass(self)
        self._python.setup()
        return self._python

    def self(self):
        return self._python

    def isEntered(self):
        return self._entered

    isEntered = pyqtProperty(bool, isEntered)

    def enter(self):
        self._entered = True
        if hasattr(self._python, "enter"):
            self._python.enter()

    def exit(self):
        self._entered = False
        if hasattr(self._python, "exit"):
            self._python.exit()


class qSlicerModuleSelector(QtCore.QObject):
    """qSlicerModuleSelectorToolBar's ``selectModule(QString)``: the module panel shows that module."""

    moduleSelected = pyqtSignal(str)
    _window = None

    def selectModule(self, moduleName):
        self._window.showModule(moduleName)


class qSlicerMainWindow(QtWidgets.QMainWindow):
    _panels = None
    _current = ""
    _selector = None
    _stack = None
    _views = None

    def __init__(self):
        super().__init__()
        self.objectName = "qSlicerMainWindow"
        for title in MENUS:
            self.menuBar().addMenu(title)
        self._views = QtWidgets.QFrame(self)
        self._views.objectName = "CentralWidget"
        self._views.focusPolicy = QtCore.Qt.StrongFocus  # a slice view takes the focus when clicked
        self.setCentralWidget(self._views)
        dock = QtWidgets.QDockWidget("Modules", self)
        dock.objectName = "PanelDockWidget"
        self._stack = QtWidgets.QStackedWidget(dock)
        self._stack.objectName = "ModulePanel"
        dock.setWidget(self._stack)
        self.addDockWidget(QtCore.Qt.LeftDockWidgetArea, dock)
        self._panels = {}
        self._selector = qSlicerModuleSelector(self)
        self._selector._window = self

    def views(self):
        """The stand-in for the slice views (a widget that takes the keyboard focus)."""
        return self._views

    def moduleSelector(self):
        return self._selector

    def addModulePanel(self, name, panel):
        self._panels[name] = panel
        self._stack.addWidget(panel)

    def modulePanel(self, name):
        return self._panels[name]

    def showModule(self, name):
        """As the module panel does when a module is selected: exit the shown one, enter the new one."""
        if name not in self._panels:
            raise RuntimeError(f"no module named {name} in this application")
        if self._current == name:
            return
        if self._current:
            self._panels[self._current].exit()
        self._current = name
        self._stack.setCurrentWidget(self._panels[name])
        self._panels[name].enter()

    def selectedModule(self):
        return self._current

    def removeModulePanels(self):
        """Exit the shown module and delete every panel (the tests' teardown)."""
        if self._current:
            self._panels[self._current].exit()
        self._current = ""
        for panel in self._panels.values():
            panel.setParent(None)
            panel.deleteLater()
        self._panels = {}


class ScriptedLoadableModuleWidget:
    """ScriptedLoadableModule.py:88-293 at v5.12.3 (unchanged since v5.10.0)."""

    def __init__(self, parent=None):
        import slicer
        import qt

        self.moduleName = type(self).__name__
        if self.moduleName.endswith("Widget"):
            self.moduleName = self.moduleName[:-6]
        self.developerMode = slicer.util.settingsValue("Developer/DeveloperMode", False, converter=slicer.util.toBool)
        if not parent:
            self.parent = slicer.qMRMLWidget()
            self.parent.setLayout(qt.QVBoxLayout())
            self.parent.setMRMLScene(slicer.mrmlScene)
        else:
            self.parent = parent
        self.layout = self.parent.layout()
        if not parent:
            self.setup()
            self.parent.show()
        slicer.app.moduleManager().connect("moduleAboutToBeUnloaded(QString)", self._onModuleAboutToBeUnloaded)

    def resourcePath(self, filename):
        import slicer

        return os.path.join(os.path.dirname(slicer.util.modulePath(self.moduleName)), "Resources", filename)

    def cleanup(self):
        pass

    def _onModuleAboutToBeUnloaded(self, moduleName):  # :126-140
        import slicer

        if moduleName == self.moduleName:
            self.cleanup()
            slicer.app.moduleManager().disconnect("moduleAboutToBeUnloaded(QString)", self._onModuleAboutToBeUnloaded)

    def setupDeveloperSection(self):
        """:142-230: in developer mode, a "Reload && Test" section (Reload, Test, Edit, Restart)."""
        if not self.developerMode:
            return
        import ctk
        import qt

        self.reloadCollapsibleButton = ctk.ctkCollapsibleButton()
        self.reloadCollapsibleButton.text = "Reload && Test"
        self.layout.addWidget(self.reloadCollapsibleButton)
        row = qt.QHBoxLayout()
        qt.QFormLayout(self.reloadCollapsibleButton).addRow(row)
        self.reloadButton = qt.QPushButton("Reload")
        self.reloadButton.toolTip = "Reload this module."
        self.reloadButton.name = "ScriptedLoadableModuleTemplate Reload"
        self.reloadButton.connect("clicked()", self.onReload)
        self.reloadTestMenuButton = qt.QToolButton()
        self.reloadTestMenuButton.toolTip = "Test or Reload & Test"
        self.reloadTestMenuButton.name = "ScriptedLoadableModuleTemplate Testing"
        self.editSourceButton = qt.QPushButton("Edit")
        self.restartButton = qt.QPushButton("Restart Slicer")
        self.restartButton.name = "ScriptedLoadableModuleTemplate Restart"
        for w in (self.reloadButton, self.reloadTestMenuButton, self.editSourceButton, self.restartButton):
            row.addWidget(w)

    def setup(self):
        self.setupDeveloperSection()

    def onReload(self):
        raise NotImplementedError("reloading a scripted module needs Slicer's module manager (not in the tests)")


ESC, CLOSE = "Esc", "×"  # planned answers: close a dialog with the Esc key or the title bar's ×


class ModalDialogs:
    """``exec_()`` of a dialog would wait for a user: instead the dialog's button named by the next
    planned answer is clicked (``plan("Keep both")``), and a dialog nobody planned for fails the
    test with its text (it would block the panel, and the test, for ever).

    The planned answers :data:`ESC` and :data:`CLOSE` close the dialog as a user does without a
    button, through Qt itself (the dialog shown, then the Esc key or the title bar's ×): a message
    box then gives its escape button (Cancel, No, the one button that rejects) as the clicked one
    and ``exec_()`` its code, which is how ``slicer.util.confirmYesNoDisplay`` answers "no"
    (Base/Python/slicer/util.py:3276-3287, 3366-3379 at v5.12.3), and ``clickedButton()`` is None
    for one without (× is then ignored, and the test fails: the user could not close it); another
    dialog is rejected."""

    def __init__(self, errors):
        self.errors = errors
        self.answers = []
        self.shown = []

    def plan(self, *buttonTexts):
        self.answers.extend(buttonTexts)

    def exec_(self, dialog):
        text = getattr(dialog, "text", "") if isinstance(dialog, QtWidgets.QMessageBox) else dialog.windowTitle
        buttons = {b.text: b for b in dialog.findChildren(QtWidgets.QAbstractButton)}
        self.shown.append((text, sorted(buttons)))
        if not self.answers:
            self.errors.append(("a modal dialog", AssertionError(f"a modal dialog nobody answers: {text!r} {sorted(buttons)}")))
            return QtWidgets.QDialog.Rejected
        answer = self.answers.pop(0)
        if answer in (ESC, CLOSE):
            return self._closeWithout(dialog, answer, text)
        if answer not in buttons:
            self.errors.append(("a modal dialog", AssertionError(f"no button {answer!r} in {text!r} {sorted(buttons)}")))
            return QtWidgets.QDialog.Rejected
        buttons[answer].click()
        return dialog.result()

    def _closeWithout(self, dialog, how, text):
        from PyQt5 import QtTest

        dialog.show()  # a message box finds its escape button when shown
        QtWidgets.QApplication.setActiveWindow(dialog)  # exec_() gives a dialog the keyboard focus
        QtTest.QTest.qWaitForWindowActive(dialog, 1000)
        if how == ESC:
            QtTest.QTest.keyClick(dialog, QtCore.Qt.Key_Escape)
        else:
            dialog.close()
        for _ in range(100):  # Esc clicks the escape button with an animated click
            if not dialog.isVisible():
                break
            QtTest.QTest.qWait(10)
        if dialog.isVisible():
            dialog.hide()
            self.errors.append(("a modal dialog", AssertionError(f"{how} does not close {text!r}: the user cannot "
                                                                 "leave it without a button")))
            return QtWidgets.QDialog.Rejected
        return dialog.result()

    def install(self):
        for cls in (QtWidgets.QDialog, QtWidgets.QMessageBox, QtWidgets.QProgressDialog, QtWidgets.QFileDialog,
                    QtWidgets.QInputDialog):
            cls.exec_ = cls.exec = lambda dialog, _self=self: _self.exec_(dialog)


class SegmentEditorWidget:
    """Modules/Scripted/SegmentEditor/SegmentEditor.py: its panel holds ``editor``, a
    ``qMRMLSegmentEditorWidget`` (:60-65)."""

    def __init__(self, parent):
        import slicer

        self.parent = parent
        self.editor = qMRMLSegmentEditorWidget()
        self.editor.setMRMLScene(slicer.mrmlScene)
        parent.layout().addWidget(self.editor)

    def setup(self):
        pass


def module_entry(name, path, panel=None):
    """``slicer.modules.<name>``: its ``path`` and ``widgetRepresentation()``."""
    return types.SimpleNamespace(name=name, path=str(path), widgetRepresentation=lambda: panel)
