"""The MedVolR1Slicer module's logic against real 3D Slicer libraries (``slicer-core``).

``slicer-core`` is Slicer's non-Qt half as a wheel: the MRML scene, volume, label-map,
segmentation and markups nodes, their storage nodes, and the Volumes, Segmentations, Markups,
Colors and Subject Hierarchy module logics, with Slicer's own ``slicer.util``. What Slicer's
application adds on top is built the way the application does it: one scene
(``slicer.mrmlScene``), an application logic, and the module logics registered with it and
reachable as ``slicer.modules.<name>.logic()`` (``Testing/slicer_standins/application.py``).

Two Python parts of Slicer that are not in the wheel come from ``Testing/slicer_standins``,
shared with the Qt tier (``Testing/slicer_qt``) — no ``qt`` module is installed here, and the
logic runs without one: ``slicer.ScriptedLoadableModule`` (the logic's
singleton parameter node as Slicer's; a widget base without Qt) and ``slicer.parameterNodeWrapper``,
mirrored from Slicer's at v5.12.3 and v5.10.0 (fields stored on the MRML node as Slicer stores
them, nodes as node references and lists of nodes as numbered references with a length, one
cache per field refreshed inside the write and on the node's ``ModifiedEvent``), so a node removed
from the scene drops out of a field when and as it does in Slicer. No widget is run here.

This tier runs in its own pytest process (``Testing/conftest.py`` leaves it out of the main
run): it installs a real ``slicer`` package and these stand-ins into ``sys.modules``.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # Testing/: the shared slicer_standins
from slicer_standins import application, parameter_node, scripted_module  # noqa: E402

REPO, MODULE_DIR = application.REPO, application.MODULE_DIR
HAVE_SLICER_CORE = application.have_slicer_core()  # raises on CI when slicer-core is missing
if HAVE_SLICER_CORE:
    import slicer
    import vtk
else:  # set up with `bootstrap.py --no-slicer-core`
    slicer = vtk = None


@pytest.fixture(scope="session")
def slicer_env():
    """Real MRML with the module's logic importable, and no Qt: yields the names the tests use
    (the logic facade and its parameter node from ``MedVolR1SlicerScene``, the self-test from
    ``MedVolR1SlicerPanel.selftest``, which needs no Qt, and the errors). The module file itself
    imports the Qt panel: the Qt tier (``Testing/slicer_qt``) imports it."""
    application.check_no_strays()
    application.install_application()
    for name, mod in (("ScriptedLoadableModule", scripted_module.make_module()),
                      ("parameterNodeWrapper", parameter_node.make_module())):
        sys.modules[f"slicer.{name}"] = mod
        setattr(slicer, name, mod)
    application.put_module_on_path()
    assert "qt" not in sys.modules, "something imported qt before the logic"
    from MedVolR1SlicerLib.client import WorkerError
    from MedVolR1SlicerLib.geometry import GeometryError
    from MedVolR1SlicerPanel.selftest import MedVolR1SlicerTest, SelfTestWorker
    from MedVolR1SlicerScene.logic import MedVolR1SlicerLogic
    from MedVolR1SlicerScene.parameters import MedVolR1SlicerParameterNode
    from MedVolR1SlicerScene.history import EditedSinceResult

    # the logic, the self-test and everything they import run without any Qt module
    assert not {"qt", "ctk"} & set(sys.modules), sorted({"qt", "ctk"} & set(sys.modules))
    yield types.SimpleNamespace(
        MedVolR1SlicerLogic=MedVolR1SlicerLogic, MedVolR1SlicerParameterNode=MedVolR1SlicerParameterNode,
        MedVolR1SlicerTest=MedVolR1SlicerTest, SelfTestWorker=SelfTestWorker, EditedSinceResult=EditedSinceResult,
        GeometryError=GeometryError, WorkerError=WorkerError)


@pytest.fixture
def scene(slicer_env):
    """``slicer.mrmlScene``, closed before and after each test (singletons kept, as Slicer does)."""
    slicer.mrmlScene.Clear(0)
    yield slicer.mrmlScene
    slicer.mrmlScene.Clear(0)


@pytest.fixture
def logic(slicer_env, scene):
    """A fresh module logic (its worker is started only by a request)."""
    lg = slicer_env.MedVolR1SlicerLogic()
    yield lg
    lg.cleanup()
