"""The module's panel in real Qt: PyQt5 (Qt 5.15, the series Slicer 5.10 and 5.12 build on),
offscreen, on real MRML (slicer-core).

What Slicer's application gives a scripted module is built here: its scene and module logics
(``Testing/slicer_standins``, shared with ``Testing/slicer_mrml``), ``qt`` as PythonQt shows it
(:mod:`pythonqt`, strict), ``ctk`` and the qMRML widgets (:mod:`widgets`), ``slicer.app``, the
main window and the module panel (:mod:`slicer_app`), ``slicer.ScriptedLoadableModule`` and
``slicer.parameterNodeWrapper`` (shared). Slicer's own ``slicer.util`` (slicer-core's, the same
``loadUI``, ``childWidgetVariables``, ``VTKObservationMixin`` and message boxes as v5.10.0 and
v5.12.3) runs on top. The panel is built as Slicer builds it — ``MedVolR1SlicerWidget(parent)``,
``setup()``, ``enter()`` — and its worker is the module's own :class:`SelfTestWorker`, given
through the logic's injection point (``MedVolR1SlicerLogic.defaultSession``).

Any exception in a connected slot, a VTK observer or a GUI connector fails the test (PythonQt
and VTK would print it and go on). Nothing is installed or downloaded: ``slicer.util.pip_install``
refuses.

This tier runs in its own pytest process, as ``Testing/slicer_mrml`` does: it installs ``qt``,
``ctk`` and a real ``slicer`` into ``sys.modules`` and replaces attribute access on every QObject.
"""

from __future__ import annotations

import logging
import os
import sys
import types
from pathlib import Path

import pytest

os.environ["QT_QPA_PLATFORM"] = "offscreen"  # no X server; set before Qt starts
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # Testing/: the shared slicer_standins
sys.path.insert(0, str(HERE))  # pythonqt, widgets, slicer_app
from slicer_standins import application, parameter_node, scripted_module  # noqa: E402

try:
    from PyQt5 import QtCore, QtTest, QtWidgets  # noqa: F401

    HAVE_PYQT5 = QtCore.QT_VERSION_STR.startswith("5.15.")
except ImportError:  # set up with `bootstrap.py --no-pyqt`
    HAVE_PYQT5 = False
if not HAVE_PYQT5 and application.on_ci():
    raise RuntimeError("PyQt5 5.15 is not installed; `python3 MedVolCore/bootstrap.py` installs it")
HAVE_SLICER_CORE = application.have_slicer_core()  # raises on CI when slicer-core is missing

MODULE = "MedVolR1Slicer"
slot_errors = []  # (where, exception): from connected slots (pythonqt) and from sys.excepthook
dialogs_ = None  # slicer_app.ModalDialogs: answers the dialogs a test plans


def pytest_configure(config):
    config.addinivalue_line("markers", "developer_mode: build the panel with Slicer's Developer/DeveloperMode on")


def _record_uncaught(kind, value, tb):
    """VTK observers and PyQt5 report an exception raised in a Python callback here."""
    import traceback

    traceback.print_exception(kind, value, tb)
    slot_errors.append(("a Python callback", value))


@pytest.fixture(scope="session")
def slicer_qt(tmp_path_factory):
    """The application: yields ``(slicer, MedVolR1Slicer, window)``."""
    if not (HAVE_PYQT5 and HAVE_SLICER_CORE):
        pytest.skip("needs PyQt5 5.15 and slicer-core (bootstrap.py installs both)")
    import pythonqt
    import slicer
    import slicer_app
    import widgets

    application.check_no_strays()
    application.install_application()
    app = slicer_app.qSlicerApplication(["Slicer"])
    app.setOrganizationName("MedVolR1Tests")
    app.setApplicationName("Slicer")
    QtCore.QSettings.setDefaultFormat(QtCore.QSettings.IniFormat)  # settings in pytest's tmp, not ~/.config
    QtCore.QSettings.setPath(QtCore.QSettings.IniFormat, QtCore.QSettings.UserScope,
                             str(tmp_path_factory.mktemp("settings")))
    pythonqt.install()
    pythonqt.slot_errors = slot_errors
    sys.modules["qt"] = pythonqt.namespace(extra=[widgets.QUiLoader])
    sys.modules["ctk"] = widgets.ctk_namespace()
    for cls in (widgets.qMRMLWidget, widgets.qMRMLNodeComboBox, widgets.qMRMLSegmentEditorWidget):
        setattr(slicer, cls.__name__, cls)
    slicer.app = app
    for name, mod in (("ScriptedLoadableModule", scripted_module.make_module(slicer_app.ScriptedLoadableModuleWidget)),
                      ("parameterNodeWrapper", parameter_node.make_module())):
        sys.modules[f"slicer.{name}"] = mod
        setattr(slicer, name, mod)

    def refuse(*args, **kwargs):
        raise AssertionError("the tests never install packages")

    slicer.util.pip_install = refuse
    sys.excepthook = _record_uncaught
    global dialogs_
    dialogs_ = slicer_app.ModalDialogs(slot_errors)
    dialogs_.install()
    window = slicer_app.qSlicerMainWindow()
    window.resize(1200, 900)
    window.show()
    app.setActiveWindow(window)
    QtTest.QTest.qWaitForWindowActive(window, 2000)
    application.put_module_on_path()
    import MedVolR1Slicer

    yield slicer, MedVolR1Slicer, window
    window.close()


@pytest.fixture(autouse=True)
def no_errors_in_callbacks(caplog):
    """A test fails on any exception raised in a slot, a VTK observer or a GUI connector, and on
    any error message the panel showed (``slicer.util.errorDisplay`` logs it in testing mode)."""
    del slot_errors[:]
    if dialogs_ is not None:
        dialogs_.answers[:], dialogs_.shown[:] = [], []
    yield
    if dialogs_ is not None:
        assert dialogs_.answers == [], f"planned dialog answers never used: {dialogs_.answers}"
    errors, slot_errors[:] = list(slot_errors), []
    assert errors == [], f"exceptions in callbacks (PythonQt and VTK print them and go on): {errors}"
    shown = [r.getMessage() for r in caplog.get_records("call") if r.levelno >= logging.ERROR]
    assert shown == [], f"the panel showed error messages: {shown}"


@pytest.fixture
def dialogs(slicer_qt):
    """Plan the answers to the modal dialogs the test will meet: ``dialogs.plan("Keep both")``."""
    return dialogs_


class Workers:
    """The logic's workers: the module's own :class:`SelfTestWorker` (it answers ``segment`` with a
    box around the bright voxels, ``propagate`` with the boxes it is sent, masks written through
    MRML), made when the session needs a client."""

    def __init__(self):
        self.made = []
        self.options = []  # the options each client was made for (worker, address, token)
        self.logic = None

    def factory(self, options):
        import MedVolR1Slicer

        self.options.append(options)

        # the self-test's worker, wherever the module keeps it: beside its self-test class
        SelfTestWorker = sys.modules[MedVolR1Slicer.MedVolR1SlicerTest.__module__].SelfTestWorker
        worker = SelfTestWorker(self.logic, self.logic.getParameterNode().inputVolume)
        self.made.append(worker)
        return worker


@pytest.fixture
def panel(slicer_qt, monkeypatch, request):
    """The module's panel as Slicer shows it: built in the module panel of the main window
    (``MedVolR1SlicerWidget(parent)``, ``setup()``), entered, and on exit unloaded (Slicer's
    ``moduleAboutToBeUnloaded`` → ``cleanup()``). Its logic's worker is a :class:`Workers` factory."""
    import slicer_app
    from MedVolR1SlicerLib.session import Session

    slicer, module, window = slicer_qt
    slicer.mrmlScene.Clear(0)
    if not any(n.GetLayoutName() == "Red" for n in slicer.util.getNodesByClass("vtkMRMLSliceNode")):
        if slicer.mrmlScene.GetDefaultNodeByClass("vtkMRMLSliceNode") is None:  # as the layout logic does
            slicer.mrmlScene.AddDefaultNode(slicer.vtkMRMLSliceNode())
            slicer.vtkMRMLSliceNode.AddDefaultSliceOrientationPresets(slicer.mrmlScene)
        red = slicer.mrmlScene.CreateNodeByClass("vtkMRMLSliceNode")  # the Red view's node, a singleton
        red.UnRegister(None)
        red.SetLayoutName("Red")
        red.SetSingletonTag("Red")
        slicer.mrmlScene.AddNode(red)
        red.SetOrientationToAxial()
    workers = Workers()
    monkeypatch.setattr(module.MedVolR1SlicerLogic, "defaultSession",
                        staticmethod(lambda: Session(client_factory=workers.factory)))
    editorPanel = slicer_app.qSlicerScriptedLoadableModuleWidget()
    editorPanel.createPython(slicer_app.SegmentEditorWidget)
    window.addModulePanel("SegmentEditor", editorPanel)
    developer = request.node.get_closest_marker("developer_mode") is not None
    QtCore.QSettings().setValue("Developer/DeveloperMode", "true" if developer else "false")
    for key in ("MedVolR1Slicer/Worker", "MedVolR1Slicer/RemoteUrl"):  # each test starts as a new install
        QtCore.QSettings().remove(key)
    parent = slicer_app.qSlicerScriptedLoadableModuleWidget()
    window.addModulePanel(MODULE, parent)
    slicer.modules.medvolr1slicer = slicer_app.module_entry(MODULE, module.__file__, parent)
    slicer.modules.segmenteditor = slicer_app.module_entry("SegmentEditor", "SegmentEditor.py", editorPanel)
    widget = parent.createPython(module.MedVolR1SlicerWidget)  # __init__(parent), setup()
    workers.logic = widget.logic
    window.showModule(MODULE)  # enter()
    QtTest.QTest.qWaitForWindowExposed(window)
    yield types.SimpleNamespace(widget=widget, ui=widget.ui, logic=widget.logic, parent=parent, window=window,
                                workers=workers, slicer=slicer, module=module, dialogs=dialogs_)
    for _ in range(5):  # a menu a key opened
        popup = QtWidgets.QApplication.activePopupWidget()
        if popup is None:
            break
        popup.close()
    window.removeModulePanels()  # exit()
    slicer.app.moduleManager().moduleAboutToBeUnloaded.emit(MODULE)  # → cleanup()
    del slicer.modules.medvolr1slicer, slicer.modules.segmenteditor
    QtTest.QTest.qWait(1)
    slicer.mrmlScene.Clear(0)
