"""The module on a clinician's second day, on real MRML (slicer-core): a scene saved by an older
version with its worker settings, the headless batch beside such a scene, the self-test as
Slicer's test runner loads it on a machine without the MedVol-R1 packages, observers across
scene closes and ``cleanup()`` with the 5.10 and 5.12 parameter-node wrappers, and the developer
Reload. The panel's own side of these (settings, the question before an upload, Show 3D) is in
``Testing/slicer_qt/test_qt_worker_settings.py``."""

from __future__ import annotations

import ast
import gc
import importlib
import io
import sys
import types
import unittest

import pytest

pytest.importorskip("slicer_core", reason="slicer-core is not installed (bootstrap.py --no-slicer-core)")
import slicer  # noqa: E402 - the real package, imported by conftest.py
from slicer_standins import application, parameter_node  # noqa: E402
from test_mrml_clinician_day import ManualClient  # noqa: E402
from test_mrml_widget import UI_NAMES, FakeWidget  # noqa: E402

OLD_SCENE_SETTINGS = {"worker": "remote", "remoteUrl": "http://scene-host:8765"}


@pytest.fixture(scope="module")
def panel_module(slicer_env):
    """``MedVolR1SlicerPanel.panel`` (and the module file), imported over empty ``qt``/``ctk``
    modules that stay for this file only, as ``test_mrml_widget.py`` does."""
    with pytest.MonkeyPatch.context() as mp:
        for name in ("qt", "ctk"):
            mp.setitem(sys.modules, name, types.ModuleType(name))
        import MedVolR1Slicer  # noqa: F401 - what Slicer's test runner loads by name
        from MedVolR1SlicerPanel import panel

        yield panel


def make_panel(panel_module, logic):
    widget = panel_module.MedVolR1SlicerWidget(parent=types.SimpleNamespace(isEntered=True))
    widget.ui = types.SimpleNamespace(**{n: FakeWidget(n) for n in UI_NAMES})
    widget.setupScene(logic)
    return widget


def module_node():
    return slicer.mrmlScene.GetSingletonNode("MedVolR1Slicer", "vtkMRMLScriptedModuleNode")


def old_scene_file(tmp_path, logic):
    """A scene file as a version before this one saved it: the worker settings were parameters of
    the module's node (written here straight onto the node)."""
    node = logic.getParameterNode().parameterNode
    for name, value in OLD_SCENE_SETTINGS.items():
        node.SetParameter(name, value)
    path = tmp_path / "PatientA.mrml"
    slicer.mrmlScene.SetURL(str(path))
    assert slicer.mrmlScene.Commit()
    assert "scene-host" in path.read_text(encoding="utf-8")
    return path


def open_scene(path):
    """File → Load scene: the scene is closed, then the file imported (``vtkMRMLScene::Connect``)."""
    slicer.mrmlScene.Clear(0)
    slicer.mrmlScene.SetURL(str(path))
    assert slicer.mrmlScene.Import()


# ---- worker settings are the application's, never a scene's --------------------------------------

def test_a_scene_with_an_older_versions_worker_settings_is_read_without_them(slicer_env, logic, tmp_path):
    assert not {"worker", "remoteUrl"} & set(slicer_env.MedVolR1SlicerParameterNode.allParameters)
    path = old_scene_file(tmp_path, logic)
    assert logic.takeIgnoredWorkerSettings() == OLD_SCENE_SETTINGS  # the live scene's, taken out here
    open_scene(path)
    assert module_node().GetParameter("remoteUrl") == "http://scene-host:8765"  # as read from the file
    p = logic.getParameterNode()
    assert not module_node().HasParameter("worker") and not module_node().HasParameter("remoteUrl")
    assert p.query == ""
    assert logic.takeIgnoredWorkerSettings() == OLD_SCENE_SETTINGS
    assert logic.takeIgnoredWorkerSettings() == {}  # said once
    resaved = tmp_path / "resaved.mrml"
    slicer.mrmlScene.SetURL(str(resaved))
    assert slicer.mrmlScene.Commit()
    assert "scene-host" not in resaved.read_text(encoding="utf-8")


def test_the_panel_says_once_that_a_scenes_worker_settings_were_ignored(slicer_env, scene, panel_module, tmp_path):
    from MedVolR1SlicerLib.session import Session

    client = ManualClient()
    widget = make_panel(panel_module, slicer_env.MedVolR1SlicerLogic(session=Session(client_factory=lambda o: client)))
    try:
        path = old_scene_file(tmp_path, widget.logic)
        widget.ui.statusLabel.text = ""
        open_scene(path)  # the panel hears the scene's EndImportEvent
        status = widget.ui.statusLabel.text
        assert "older MedVol-R1" in status and "scene-host" in status and "ignored" in status
        assert not module_node().HasParameter("worker") and not module_node().HasParameter("remoteUrl")
        widget.ui.statusLabel.text = ""
        widget.exit()
        widget.enter()
        slicer.mrmlScene.Clear(0)
        assert widget.ui.statusLabel.text == ""  # once
        assert widget._options().worker == "local"  # the panel's (application) setting, not the scene's
    finally:
        widget.cleanup()


def test_the_batch_takes_its_worker_from_its_own_arguments(slicer_env, scene, tmp_path, logic):
    """``batch.py`` is the operator's script: ``--worker-url`` and ``--token-file`` or the local
    worker, whatever the scene's module node says (it never reads the parameter node for it)."""
    import nibabel as nib
    import numpy as np

    import batch

    for name, value in OLD_SCENE_SETTINGS.items():
        logic.getParameterNode().parameterNode.SetParameter(name, value)
    ct = tmp_path / "ct.nii.gz"
    nib.save(nib.Nifti1Image(np.zeros((6, 5, 4), np.int16), np.eye(4)), str(ct))
    token = tmp_path / "token"
    token.write_text("operator-token\n")
    seen = []

    class Recording:
        def segmentBlocking(self, volume, query, options=None):
            seen.append(options)
            return None, "", [], {"absent": True}

    assert batch.main(["--input", str(ct), "--query", "the liver", "--output", str(tmp_path / "a.seg.nrrd")],
                      logic=Recording()) == 0
    assert batch.main(["--input", str(ct), "--query", "the liver", "--output", str(tmp_path / "b.seg.nrrd"),
                       "--worker-url", "http://operator-gpu:8765/", "--token-file", str(token)], logic=Recording()) == 0
    assert [(o.worker, o.remote_url, o.remote_token) for o in seen] == [
        ("local", "", ""), ("remote", "http://operator-gpu:8765", "operator-token")]
    text = (application.SCRIPTS_DIR / "batch.py").read_text(encoding="utf-8")
    names = {n.attr for n in ast.walk(ast.parse(text)) if isinstance(n, ast.Attribute)}
    assert not names & {"getParameterNode", "parameterNode", "takeIgnoredWorkerSettings"}
    assert "MedVolR1Slicer/Worker" not in text and "RemoteUrl" not in text  # nor the panel's settings


# ---- the self-test as Slicer's test runner runs it --------------------------------------------------

class MissingPackages:
    """``install.current_plan()`` on an extension build machine: the packages are not there."""

    needed, remote_only, steps, problems = True, False, (), []
    missing = ["torch (>=2.3,<2.13; not installed)", "medvolcore (not installed)"]

    def message(self):
        return "MedVol-R1 needs these Python packages in Slicer:\n" + "\n".join(self.missing)


def test_slicers_test_runner_skips_the_worker_test_where_the_packages_are_missing(
        slicer_env, scene, panel_module, monkeypatch):
    """What the extension's ctest runs (``slicer_add_python_unittest(SCRIPT MedVolR1Slicer.py)``):
    ``slicer.testing.runUnitTest(paths, "MedVolR1Slicer")`` loads the module's tests with
    ``unittest.TestLoader().loadTestsFromName`` and runs them with a ``TextTestRunner``, failing
    unless ``wasSuccessful()`` (Base/Python/slicer/testing.py:14-28 at v5.12.3); each ``test_*``
    method runs on its own, and ``runTest()`` is never called."""
    from MedVolR1SlicerLib import install

    monkeypatch.setattr(install, "current_plan", lambda *a, **k: MissingPackages())
    suite = unittest.TestLoader().loadTestsFromName("MedVolR1Slicer")
    out = io.StringIO()
    result = unittest.TextTestRunner(stream=out, verbosity=2).run(suite)
    assert result.wasSuccessful(), out.getvalue()
    assert result.testsRun == 2
    (case, why), = result.skipped
    assert case._testMethodName == "test_segment_edit_repropagate"
    assert why.startswith("the MedVol-R1 packages are not installed here (missing: torch (>=2.3,<2.13; not installed)")


# ---- no observer outlives a scene close or cleanup() -------------------------------------------------

def observers(node) -> int:
    """How many observers ``node`` has: VTK numbers them in order, a removed one has no command."""
    probe = node.AddObserver("ModifiedEvent", lambda caller, event: None)
    node.RemoveObserver(probe)
    return sum(node.GetCommand(tag) is not None for tag in range(probe))


def parameter_node_class(version):
    """``MedVolR1SlicerParameterNode`` as ``MedVolR1SlicerScene/parameters.py`` makes it under the
    parameter-node wrapper of Slicer ``version`` (``Testing/slicer_standins/parameter_node.py``)."""
    import importlib.util

    import MedVolR1SlicerScene.parameters as parameters

    wrapper = parameter_node.make_module(version)
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "slicer.parameterNodeWrapper", wrapper)
        mp.setattr(slicer, "parameterNodeWrapper", wrapper)
        spec = importlib.util.spec_from_file_location(f"parameters_{'_'.join(map(str, version))}", parameters.__file__)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return module.MedVolR1SlicerParameterNode


@pytest.mark.parametrize("version", [(5, 10, 0), (5, 12, 3)], ids=["5.10.0", "5.12.3"])
def test_no_observer_of_the_parameter_node_outlives_scene_closes_or_cleanup(
        slicer_env, scene, panel_module, monkeypatch, version):
    """At 5.10.0 ``disconnectGui`` leaves the connection's observer on the node, and it holds the
    wrapper with its fields' cache observers; the module's node lives across scene closes."""
    import MedVolR1SlicerScene.logic as logic_module
    from MedVolR1SlicerLib.session import Session

    monkeypatch.setattr(logic_module, "MedVolR1SlicerParameterNode", parameter_node_class(version))
    logic = slicer_env.MedVolR1SlicerLogic(session=Session(client_factory=ManualClient))
    node = logic.getParameterNode().parameterNode
    gc.collect()
    before = observers(node)
    widget = make_panel(panel_module, logic)
    gc.collect()
    bound = observers(node)
    assert bound > before
    for _ in range(4):
        slicer.mrmlScene.Clear(0)
        gc.collect()
        assert widget._parameterNode.parameterNode is node  # the module's node is kept across closes
        assert observers(node) == bound
        widget.exit()
        widget.enter()
        assert observers(node) == bound
    widget.cleanup()
    gc.collect()
    assert observers(node) == before - 1  # the logic's own (it follows the selection) goes with its cleanup


# ---- the developer Reload ----------------------------------------------------------------------------

def _module_files():
    root = application.MODULE_DIR
    found = {}
    for package in ("MedVolR1SlicerLib", "MedVolR1SlicerScene", "MedVolR1SlicerPanel"):
        for path in sorted((root / package).glob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(name, path, known):
    """The modules of ``known`` that module ``name`` imports (anywhere in it): ``import M``,
    ``from M import x``, and ``from P import M`` for a module ``P.M``."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names} & set(known)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[:len(package) - node.level + 1] + [node.module or ""]).strip(".") \
                if node.level else node.module
            for alias in node.names:
                found |= {f"{base}.{alias.name}"} & set(known) or {base} & set(known)
    return found - {name}


def test_reload_reloads_every_module_of_the_three_packages_after_what_it_imports(slicer_env, panel_module, monkeypatch):
    files = _module_files()
    for name in files:  # as in Slicer after a while: every part has been imported
        if not name.startswith("MedVolR1SlicerPanel"):
            importlib.import_module(name)
    assert set(files) <= set(sys.modules)
    reloaded = []
    monkeypatch.setattr(importlib, "reload", lambda module: reloaded.append(module.__name__) or module)
    monkeypatch.setattr(panel_module.ScriptedLoadableModuleWidget, "onReload",
                        lambda self: reloaded.append("(the module file, by Slicer)"), raising=False)
    widget = panel_module.MedVolR1SlicerWidget(parent=types.SimpleNamespace(isEntered=False))
    widget.onReload()
    assert reloaded.pop() == "(the module file, by Slicer)"
    assert sorted(reloaded) == sorted(files)
    at = {name: i for i, name in enumerate(reloaded)}
    late = [(name, imported) for name, path in files.items() for imported in _imports(name, path, files)
            if at[imported] > at[name]]
    assert late == [], f"reloaded before what they import: {late}"
    assert {"MedVolR1SlicerLib", "MedVolR1SlicerScene.logic"} <= set(reloaded)
