"""``slicer.ScriptedLoadableModule`` for the tests (both tiers), written from Slicer's
``Base/Python/slicer/ScriptedLoadableModule.py`` at v5.12.3 (unchanged since v5.10.0).

Shared: the module class, the logic (its singleton parameter node, :310-364) and the test case.
The widget base differs per tier: the MRML tier has no Qt and uses :class:`ScriptedLoadableModuleWidget`
below (it keeps ``parent`` and nothing else); the Qt tier passes its own, which builds the panel
as Slicer's does (``Testing/slicer_qt/slicer_app.py``).
"""

from __future__ import annotations

import os
import types
import unittest


class ScriptedLoadableModule:
    """:17-56: the module's name, its self-test registered in ``slicer.selfTests``."""

    def __init__(self, parent):
        import slicer

        self.parent = parent
        self.moduleName = type(self).__name__
        if not hasattr(slicer, "selfTests"):
            slicer.selfTests = {}
        slicer.selfTests[self.moduleName] = self.runTest

    def resourcePath(self, filename):
        return os.path.join(os.path.dirname(self.parent.path), "Resources", filename)

    def runTest(self, msec=100, **kwargs):
        raise NotImplementedError("the tests run the self-test class directly")


class ScriptedLoadableModuleWidget:
    """The MRML tier's widget base: no Qt, only ``parent`` (the tests build ``ui`` themselves)."""

    def __init__(self, parent=None):
        self.parent = parent
        name = type(self).__name__
        self.moduleName = name[: -len("Widget")] if name.endswith("Widget") else name


class ScriptedLoadableModuleLogic:
    """:296-364: the module's singleton ``vtkMRMLScriptedModuleNode`` in ``slicer.mrmlScene``."""

    def __init__(self, parent=None):
        name = type(self).__name__
        self.moduleName = name[: -len("Logic")] if name.endswith("Logic") else name
        self.isSingletonParameterNode = True

    def getParameterNode(self):
        import slicer

        node = slicer.mrmlScene.GetSingletonNode(self.moduleName, "vtkMRMLScriptedModuleNode")
        if node is not None:
            if node.GetAttribute("ModuleName") != self.moduleName:  # :318-320, after a scene close
                node.SetAttribute("ModuleName", self.moduleName)
            return node
        return slicer.mrmlScene.AddNode(self.createParameterNode())

    def createParameterNode(self):
        import slicer

        node = slicer.vtkMRMLScriptedModuleNode()
        node.SetSingletonTag(self.moduleName)
        node.SetAttribute("ModuleName", self.moduleName)
        node.SetName(slicer.mrmlScene.GenerateUniqueName(self.moduleName))
        return node


class ScriptedLoadableModuleTest(unittest.TestCase):
    """:367-423: a ``unittest.TestCase`` whose ``delayDisplay`` calls ``slicer.util.delayDisplay``
    (the message logged, then shown for a moment); here it is logged only: there is no window."""

    def delayDisplay(self, message, requestedDelay=None, msec=None):
        import logging

        logging.info(message)


def load_module_folder(folder) -> dict:
    """What Slicer's scripted-module factory does with a module folder at start-up (v5.12.3):
    every file at its top (not below: ``qSlicerAbstractModuleFactoryManager.cxx:275-282``,
    ``entryInfoList(QDir::Files)``) whose suffix is ``py`` (``qSlicerScriptedLoadableModuleFactory.cxx:182-200``)
    is a module named after the file: loaded as a Python module of that name, unless
    ``sys.modules`` has it with the class, and its class of the same name instantiated; a file
    without that class fails with "class … was not found in file …"
    (``qSlicerScriptedLoadableModule.cxx:120-170``). Returns ``{name: class}``; raises
    ``RuntimeError`` with Slicer's message for the first file that is no module."""
    import importlib.util
    import sys
    from pathlib import Path

    found = {}
    for path in sorted(p for p in Path(folder).iterdir() if p.is_file() and p.suffix.lower() == ".py"):
        name = path.stem
        module = sys.modules.get(name)
        if module is None or not hasattr(module, name):
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
        if not hasattr(module, name):
            raise RuntimeError("qSlicerScriptedLoadableModule::setPythonSource - Failed to load scripted loadable "
                               f"module: class {name} was not found in file {path}")
        found[name] = getattr(module, name)
    return found


def make_module(widget_base=ScriptedLoadableModuleWidget) -> types.ModuleType:
    """A ``slicer.ScriptedLoadableModule`` module object with ``widget_base`` as its widget class."""
    mod = types.ModuleType("slicer.ScriptedLoadableModule")
    mod.__all__ = ["ScriptedLoadableModule", "ScriptedLoadableModuleWidget", "ScriptedLoadableModuleLogic",
                   "ScriptedLoadableModuleTest"]
    mod.ScriptedLoadableModule = ScriptedLoadableModule
    mod.ScriptedLoadableModuleWidget = widget_base
    mod.ScriptedLoadableModuleLogic = ScriptedLoadableModuleLogic
    mod.ScriptedLoadableModuleTest = ScriptedLoadableModuleTest
    return mod
