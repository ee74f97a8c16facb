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
parameter-node wrapper that keeps each typed field on that MRML node the way Slicer's does
(plain values as node parameters, nodes as node references, lists of nodes as numbered
references with a length, a cache per wrapper dropped on the node's ``ModifiedEvent``), so a node
removed from the scene drops out of a field when and as it does in Slicer.

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
    """Slicer's ``parameterNodeWrapper`` as far as the module depends on it (checked against
    ``Base/Python/slicer/parameterNodeWrapper`` at v5.10.0 and v5.12.3):

    - a node field is a node reference named after the field (plus an empty parameter of the
      same name); a ``list[<node class>]`` field is the references ``name.0``, ``name.1``, … and
      the parameter ``name.len`` (``ListSerializer``);
    - each wrapper caches what it read, and drops its cache on the parameter node's
      ``ModifiedEvent`` (``_CachedParameterWrapper``). MRML removes a reference to a removed node
      *before* ``NodeRemovedEvent`` and modifies the parameter node *after* it, so a removed ROI
      is still in ``p.boxes`` (from the cache) while ``NodeRemovedEvent`` is handled, and is a
      ``None`` entry afterwards: the length parameter keeps counting it;
    - a node of the wrong class is refused (the ``IsInstance`` validator);
    - ``AddObserver``/``RemoveObserver`` are the parameter node's;
    - ``connectGui(ui)`` returns a tag that ``disconnectGui(tag)`` takes (5.10 and later).
    """
    mod = types.ModuleType("slicer.parameterNodeWrapper")

    def _base(t):  # Annotated[int, WithinRange(...)] is an int
        return typing.get_args(t)[0] if typing.get_origin(t) is typing.Annotated else t

    def is_node_class(t):
        return isinstance(t, type) and issubclass(t, slicer.vtkMRMLNode)

    def parameterNodeWrapper(cls):
        fields = {name: (ann, cls.__dict__.get(name)) for name, ann in cls.__annotations__.items()}
        connections = {}
        calls = {"connectGui": 0}

        def read(node, name):
            ann, default = fields[name]
            if is_node_class(ann):
                return node.GetNodeReference(name)
            if typing.get_origin(ann) is list:
                n = node.GetParameter(f"{name}.len")
                return [node.GetNodeReference(f"{name}.{i}") for i in range(int(n) if n else 0)]
            text = node.GetParameter(name)
            return _base(ann)(json.loads(text)) if text else default

        def write(node, name, value):
            ann, _ = fields[name]
            if is_node_class(ann):
                if value is not None and not isinstance(value, ann):
                    raise ValueError(f"{name} must be a {ann.__name__}, not a {type(value).__name__}")
                node.SetParameter(name, "")
                node.SetNodeReferenceID(name, value.GetID() if value is not None else None)
            elif typing.get_origin(ann) is list:
                (item,) = typing.get_args(ann)
                old = int(node.GetParameter(f"{name}.len") or 0)
                for i, v in enumerate(value):
                    if v is not None and not isinstance(v, item):
                        raise ValueError(f"{name}[{i}] must be a {item.__name__}, not a {type(v).__name__}")
                    node.SetNodeReferenceID(f"{name}.{i}", v.GetID() if v is not None else None)
                node.SetParameter(f"{name}.len", str(len(value)))
                for i in range(len(value), old):
                    node.RemoveNodeReferenceIDs(f"{name}.{i}")
            else:
                node.SetParameter(name, json.dumps(_base(ann)(value)))

        class Wrapper:
            def __init__(self, node):
                object.__setattr__(self, "parameterNode", node)
                object.__setattr__(self, "_cache", {})
                object.__setattr__(self, "_tag", node.AddObserver(vtk.vtkCommand.ModifiedEvent, self._drop))

            def _drop(self, caller=None, event=None):
                self._cache.clear()

            def __del__(self):
                self.parameterNode.RemoveObserver(self._tag)

            def __getattr__(self, name):
                if name not in fields:
                    raise AttributeError(name)
                if name not in self._cache:
                    self._cache[name] = read(self.parameterNode, name)
                value = self._cache[name]
                return list(value) if isinstance(value, list) else value

            def __setattr__(self, name, value):
                if name not in fields:
                    raise AttributeError(f"{cls.__name__} has no parameter {name!r}")
                was = self.parameterNode.StartModify()  # one ModifiedEvent per write (NodeModify)
                try:
                    write(self.parameterNode, name, value)
                finally:
                    self.parameterNode.EndModify(was)
                self._cache[name] = read(self.parameterNode, name)  # read back before observers run

            def AddObserver(self, event, callback, priority=0.0):  # as wrapper.py: the node's own
                return self.parameterNode.AddObserver(event, callback, priority)

            def RemoveObserver(self, tag):
                self.parameterNode.RemoveObserver(tag)

            def connectGui(self, ui):
                calls["connectGui"] += 1
                tag = object()
                connections[id(tag)] = (self.parameterNode, ui)
                return tag

            def disconnectGui(self, tag):
                connections.pop(id(tag), None)

        Wrapper.__name__ = cls.__name__
        Wrapper.connections = connections  # what the tests look at: the live GUI connections…
        Wrapper.calls = calls  # …and how often one was made (each costs an observer on 5.10)
        return Wrapper

    mod.parameterNodeWrapper = parameterNodeWrapper

    class WithinRange:  # the annotation the module's bounded numbers carry (validators.py)
        def __init__(self, minimum, maximum):
            self.minimum, self.maximum = minimum, maximum

    mod.WithinRange = WithinRange
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
