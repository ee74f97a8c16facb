"""The MedVolR1Slicer module's logic against real 3D Slicer libraries (``slicer-core``).

``slicer-core`` is Slicer's non-Qt half as a wheel: the MRML scene, volume, label-map,
segmentation and markups nodes, their storage nodes, and the Volumes, Segmentations, Markups,
Colors and Subject Hierarchy module logics, with Slicer's own ``slicer.util``. What Slicer's
application adds on top is built here the way the application does it: one scene
(``slicer.mrmlScene``), an application logic, and the module logics registered with it and
reachable as ``slicer.modules.<name>.logic()``.

Three small Python parts of Slicer are not in the wheel, because they belong to the Qt
application: ``qt`` itself, ``slicer.ScriptedLoadableModule`` and
``slicer.parameterNodeWrapper``. The stand-ins below give only what the module's *logic* uses
(the widget is never run here): an empty ``qt``; ``ScriptedLoadableModuleLogic.getParameterNode``
returning the module's singleton ``vtkMRMLScriptedModuleNode`` as Slicer's does; and a
parameter-node wrapper that keeps each typed field on that MRML node (plain values as node
parameters, nodes as node references, so a node removed from the scene drops out of a field as it
does in Slicer).

This tier runs in its own pytest process (``Testing/conftest.py`` leaves it out of the main
run): it installs a real ``slicer`` package and these stand-ins into ``sys.modules``.
"""

from __future__ import annotations

import json
import os
import sys
import types
import typing
import unittest
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MODULE_DIR = REPO / "MedVolR1Slicer"


try:
    import slicer
    import vtk

    HAVE_SLICER_CORE = hasattr(slicer, "vtkMRMLScene")
except ImportError:  # set up with `bootstrap.py --no-slicer-core`
    slicer = vtk = None
    HAVE_SLICER_CORE = False

if not HAVE_SLICER_CORE and os.environ.get("CI", "").strip().lower() in ("1", "true", "yes"):
    # On CI a missing slicer-core is a broken set-up, not a reason to skip (the test modules
    # skip themselves elsewhere: `bootstrap.py --no-slicer-core`).
    raise RuntimeError("slicer-core is not installed; `python3 MedVolCore/bootstrap.py` installs it")


# ---- what the Slicer application provides ------------------------------------------------------

MODULE_LOGICS = {  # Slicer module name → logic class in slicer-core
    "Colors": "vtkSlicerColorLogic",
    "Volumes": "vtkSlicerVolumesLogic",
    "Segmentations": "vtkSlicerSegmentationsModuleLogic",
    "Markups": "vtkSlicerMarkupsLogic",
    "SubjectHierarchy": "vtkSlicerSubjectHierarchyModuleLogic",
}


_APPLICATION = {}  # keeps the application logic and the module logics alive (MRML holds raw pointers)


def _install_application():
    """``slicer.mrmlScene`` and ``slicer.modules.<name>.logic()`` as the application sets them up."""
    scene = slicer.vtkMRMLScene()
    app_logic = slicer.vtkSlicerApplicationLogic()
    app_logic.SetMRMLScene(scene)
    modules = types.SimpleNamespace()
    for name, cls in MODULE_LOGICS.items():
        logic = getattr(slicer, cls)()
        logic.SetMRMLApplicationLogic(app_logic)
        logic.SetMRMLScene(scene)  # registers the module's node classes with the scene
        app_logic.SetModuleLogic(name, logic)
        setattr(modules, name.lower(), types.SimpleNamespace(logic=(lambda logic=logic: logic)))
        _APPLICATION[name] = logic
    _APPLICATION["application"] = app_logic
    slicer.mrmlScene = scene
    slicer.modules = modules
    return scene, app_logic


# ---- test-only stand-ins for the Qt application's Python parts -------------------------------

def _scripted_loadable_module():
    mod = types.ModuleType("slicer.ScriptedLoadableModule")

    class ScriptedLoadableModule:
        def __init__(self, parent=None):
            self.parent = parent

    class ScriptedLoadableModuleWidget:
        def __init__(self, parent=None):
            self.parent = parent

    class ScriptedLoadableModuleLogic:
        def __init__(self, parent=None):
            name = type(self).__name__
            self.moduleName = name[: -len("Logic")] if name.endswith("Logic") else name

        def getParameterNode(self):
            """The module's singleton parameter node in ``slicer.mrmlScene``, as Slicer's."""
            node = slicer.mrmlScene.GetSingletonNode(self.moduleName, "vtkMRMLScriptedModuleNode")
            if node is None:
                node = slicer.vtkMRMLScriptedModuleNode()
                node.SetSingletonTag(self.moduleName)
                node.SetAttribute("ModuleName", self.moduleName)
                node = slicer.mrmlScene.AddNode(node)
            return node

    class ScriptedLoadableModuleTest(unittest.TestCase):
        pass

    for c in (ScriptedLoadableModule, ScriptedLoadableModuleWidget, ScriptedLoadableModuleLogic,
              ScriptedLoadableModuleTest):
        setattr(mod, c.__name__, c)
    return mod


def _parameter_node_wrapper():
    mod = types.ModuleType("slicer.parameterNodeWrapper")

    def is_node_class(t):
        return isinstance(t, type) and issubclass(t, slicer.vtkMRMLNode)

    def parameterNodeWrapper(cls):
        fields = {name: (ann, cls.__dict__.get(name)) for name, ann in cls.__annotations__.items()}

        class Wrapper:
            def __init__(self, node):
                object.__setattr__(self, "parameterNode", node)

            def __getattr__(self, name):
                if name not in fields:
                    raise AttributeError(name)
                ann, default = fields[name]
                node = self.parameterNode
                if is_node_class(ann):
                    return node.GetNodeReference(name)
                if typing.get_origin(ann) is list:
                    return [node.GetNthNodeReference(name, i) for i in range(node.GetNumberOfNodeReferences(name))]
                text = node.GetParameter(name)
                return ann(json.loads(text)) if text else default

            def __setattr__(self, name, value):
                if name not in fields:
                    raise AttributeError(f"{cls.__name__} has no parameter {name!r}")
                ann, _ = fields[name]
                node = self.parameterNode
                if is_node_class(ann):
                    node.SetNodeReferenceID(name, value.GetID() if value is not None else None)
                elif typing.get_origin(ann) is list:
                    node.RemoveNodeReferenceIDs(name)
                    for v in value:
                        node.AddNodeReferenceID(name, v.GetID())
                else:
                    node.SetParameter(name, json.dumps(ann(value)))

        Wrapper.__name__ = cls.__name__
        return Wrapper

    mod.parameterNodeWrapper = parameterNodeWrapper
    return mod


@pytest.fixture(scope="session")
def slicer_env():
    """Real MRML with the module's logic importable; yields the imported module file."""
    # slicer-core's `slicer` extends itself with every `slicer/` folder on sys.path (a namespace
    # portion) and imports what is in it: nothing of this repository may be named so (slicer-core's
    # own files count only as installed packages, which may sit inside the checkout, e.g. in .venv)
    def ours(module) -> bool:
        path = Path(getattr(module, "__file__", None) or "/").resolve()
        return REPO in path.parents and "site-packages" not in path.parts

    strays = sorted(name for name, m in sys.modules.items() if name.startswith("slicer.") and ours(m))
    assert strays == [], f"files of this repository were imported as part of Slicer's slicer package: {strays}"
    _install_application()
    sys.modules.setdefault("qt", types.ModuleType("qt"))
    for name, mod in (("ScriptedLoadableModule", _scripted_loadable_module()),
                      ("parameterNodeWrapper", _parameter_node_wrapper())):
        sys.modules[f"slicer.{name}"] = mod
        setattr(slicer, name, mod)
    if str(MODULE_DIR) not in sys.path:
        sys.path.insert(0, str(MODULE_DIR))  # as Slicer does: the module folder is on sys.path
    import MedVolR1Slicer

    yield MedVolR1Slicer


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
