"""Stand-ins for the CTK and qMRML widgets the module's ``.ui`` and code use, and PythonQt's
``qt.QUiLoader`` that builds the ``.ui`` with them.

Each is a real Qt widget written from its public header — CTK at 5056664a (the commit Slicer
v5.12.3 builds, SuperBuild/External_CTK.cmake:80): ``Libs/Widgets/ctkCollapsibleButton.h``,
``ctkPathLineEdit.h``; Slicer v5.12.3: ``Libs/MRML/Widgets/qMRMLWidget.h``, ``qMRMLNodeComboBox.h``,
``Modules/Loadable/Segmentations/Widgets/qMRMLSegmentEditorWidget.h`` — with the properties,
signals and slots of those headers that the ``.ui`` or the module uses, and nothing else.
A signal whose header signature names a VTK pointer is a ``pyqtSignal(object)`` here; its header
signature is listed in ``HEADER_SIGNALS`` so that PythonQt's string ``connect`` finds it.
The code is written as Slicer's Python is, against PythonQt's ``qt`` (properties are attributes);
private state is declared on the class (the strict ``qt`` refuses new attributes).

What they do not reproduce: painting and size hints, the node combo box's scene model (its tree,
filtering by attributes, the Add/Remove/Rename actions, picking the first node added when "None"
is not enabled), the path line edit's validator, completer, history and Browse dialog, and the
Segment Editor's effects and undo stack (``saveStateForUndo`` is only counted).
"""

from __future__ import annotations

import types

import vtk
from PyQt5 import QtCore, QtGui, QtWidgets, sip
from PyQt5.QtCore import pyqtProperty, pyqtSignal
from PyQt5.uic.Loader.loader import DynamicUILoader
from PyQt5.uic.Loader.qobjectcreator import LoaderCreatorPolicy
from PyQt5.uic.uiparser import UIParser


# ---- CTK ---------------------------------------------------------------------------------------

class ctkCollapsibleButton(QtWidgets.QAbstractButton):
    """ctkCollapsibleButton.h: a checkable button whose children hide when it is collapsed
    (``checked`` is ``not collapsed``, ctkCollapsibleButton.cpp:88-90, 272-278, 281-329), also a
    child shown or added while it is (its ``childEvent`` and ``eventFilter``)."""

    contentsCollapsed = pyqtSignal(bool)
    _collapsed = False
    _forcing = False

    def __init__(self, *args):
        parent = args[-1] if args and isinstance(args[-1], QtWidgets.QWidget) else None
        super().__init__(parent)
        if args and isinstance(args[0], str):
            self.text = args[0]
        self.checkable = True
        self.checked = True
        self.connect("toggled(bool)", self._onToggled)

    def _onToggled(self, checked):
        self._collapse(not checked)

    def _collapse(self, collapsed):
        if collapsed == self._collapsed:
            return
        self._collapsed = collapsed
        for child in self.children():
            if isinstance(child, QtWidgets.QWidget):
                self._setChildVisible(child, not collapsed)
        self.contentsCollapsed.emit(collapsed)

    def _setChildVisible(self, child, visible):
        self._forcing = True
        try:
            child.setVisible(visible)
        finally:
            self._forcing = False

    def childEvent(self, event):
        if event.type() == QtCore.QEvent.ChildAdded and event.child().isWidgetType():
            event.child().installEventFilter(self)
        super().childEvent(event)

    def eventFilter(self, child, event):
        if event.type() == QtCore.QEvent.ShowToParent and self._collapsed and not self._forcing:
            self._setChildVisible(child, False)  # hidden to its parent while collapsed
        return False

    def collapsed(self):
        return self._collapsed

    def setCollapsed(self, collapsed):
        self.checked = not collapsed  # ctkCollapsibleButton.cpp:225-232

    collapsed = pyqtProperty(bool, collapsed, setCollapsed, notify=contentsCollapsed)

    def paintEvent(self, event):  # a plain push button's look
        painter = QtWidgets.QStylePainter(self)
        option = QtWidgets.QStyleOptionButton()
        option.initFrom(self)
        option.text = self.text
        painter.drawControl(QtWidgets.QStyle.CE_PushButton, option)


class ctkPathLineEdit(QtWidgets.QWidget):
    """ctkPathLineEdit.h: an editable combo box (NoInsert) whose line edit holds the path
    (ctkPathLineEdit.cpp:258-300); ``currentPath`` is its text (:702-706), ``setCurrentPath`` sets
    it (:709-713), and an edit emits ``currentPathChanged`` (:730-745)."""

    # enum Filter (ctkPathLineEdit.h:128-148)
    Dirs, Files, Drives, NoSymLinks = 0x001, 0x002, 0x004, 0x008
    AllEntries = Dirs | Files | Drives

    currentPathChanged = pyqtSignal(str)
    validInputChanged = pyqtSignal(bool)
    _combo = None
    _filters = AllEntries
    _label = ""
    _nameFilters = ()

    def __init__(self, parent=None):
        super().__init__(parent)
        layout = QtWidgets.QHBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        self._combo = QtWidgets.QComboBox(self)
        self._combo.editable = True
        self._combo.insertPolicy = QtWidgets.QComboBox.NoInsert
        layout.addWidget(self._combo)
        self._combo.lineEdit().connect("textChanged(QString)", self._onTextChanged)

    def _onTextChanged(self, text):
        self.currentPathChanged.emit(self.currentPath)

    def comboBox(self):
        return self._combo

    def currentPath(self):
        return self._combo.lineEdit().text

    def setCurrentPath(self, path):
        self._combo.lineEdit().text = path

    def filters(self):
        return self._filters

    def setFilters(self, filters):
        self._filters = int(filters)

    def label(self):
        return self._label

    def setLabel(self, label):
        self._label = label

    def nameFilters(self):
        return list(self._nameFilters)

    def setNameFilters(self, filters):
        self._nameFilters = tuple(filters)

    currentPath = pyqtProperty(str, currentPath, setCurrentPath, user=True)
    filters = pyqtProperty(int, filters, setFilters)
    label = pyqtProperty(str, label, setLabel)
    nameFilters = pyqtProperty("QStringList", nameFilters, setNameFilters)


# ---- qMRML -------------------------------------------------------------------------------------

class qMRMLWidget(QtWidgets.QWidget):
    """qMRMLWidget.h: ``setMRMLScene(vtkMRMLScene*)`` emits ``mrmlSceneChanged(vtkMRMLScene*)``."""

    mrmlSceneChanged = pyqtSignal(object)
    HEADER_SIGNALS = {"mrmlSceneChanged(vtkMRMLScene*)": "mrmlSceneChanged(PyQt_PyObject)"}
    _scene = None

    def mrmlScene(self):
        return self._scene

    def setMRMLScene(self, scene):
        if scene is self._scene:
            return
        self._scene = scene
        self.mrmlSceneChanged.emit(scene)


class qMRMLNodeComboBox(QtWidgets.QWidget):
    """qMRMLNodeComboBox.h: the nodes of ``nodeTypes`` in the scene (their subclasses only with
    ``showChildNodeTypes``), "None" first when ``noneEnabled`` (shown as ``noneDisplay``);
    ``currentNodeChanged(vtkMRMLNode*)``, ``currentNodeChanged(bool)`` and
    ``currentNodeIDChanged(QString)`` when the selection changes (qMRMLNodeComboBox.cxx
    ``emitCurrentNodeChanged``), also when the current node leaves the scene.

    As in Slicer (v5.12.3), the selection changes without a pick: when the current node is
    removed, QComboBox makes the row that took its place current, and ``emitCurrentNodeChanged``
    (qMRMLNodeComboBox.cxx:719-741) turns a row that is no node (an extra item such as "Create
    new") into the last node, so the next node, else the last one, is selected (None when none
    is left); the first node added to an empty combo box without "None" becomes current
    (QComboBox selects the first row inserted into an empty model); "Create new" adds a node and
    selects it (``addNode``, :589-622, ``selectNodeUponCreation`` true by default) and "Delete
    current" removes the current node (``removeCurrentNode``, :784-787)."""

    currentNodeChanged = pyqtSignal([object], [bool])
    currentNodeIDChanged = pyqtSignal(str)
    HEADER_SIGNALS = {"currentNodeChanged(vtkMRMLNode*)": "currentNodeChanged(PyQt_PyObject)"}
    _combo = None
    _scene = None
    _sceneTags = ()
    _nodes = ()
    _current = None
    _nodeTypes = ()
    _showChildNodeTypes = True
    _noneEnabled = False
    _addEnabled = True
    _removeEnabled = True
    _renameEnabled = False
    _noneDisplay = "None"

    def __init__(self, parent=None):
        super().__init__(parent)
        layout = QtWidgets.QHBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        self._combo = QtWidgets.QComboBox(self)
        layout.addWidget(self._combo)
        self._combo.connect("activated(int)", self._onActivated)
        self.enabled = False  # no scene yet (qMRMLNodeComboBox.cxx setMRMLScene: setEnabled(scene != nullptr))

    # -- the scene --
    def mrmlScene(self):
        return self._scene

    def setMRMLScene(self, scene):
        if scene is self._scene:
            return
        for tag in self._sceneTags:
            self._scene.RemoveObserver(tag)
        self._scene = scene
        self._sceneTags = () if scene is None else tuple(
            scene.AddObserver(event, callback) for event, callback in (
                (scene.NodeAddedEvent, self._onSceneChanged), (scene.NodeAboutToBeRemovedEvent, self._onNodeLeaving),
                (scene.EndCloseEvent, self._onSceneChanged), (scene.EndImportEvent, self._onSceneChanged)))
        self._refresh()
        self.enabled = scene is not None

    def _alive(self):
        if sip.isdeleted(self):  # the panel was deleted: stop watching the scene
            for tag in self._sceneTags:
                self._scene.RemoveObserver(tag)
            return False
        return True

    def _onSceneChanged(self, caller=None, event=None):
        if self._alive():
            self._refresh()

    @vtk.calldata_type(vtk.VTK_OBJECT)
    def _onNodeLeaving(self, caller, event, node):
        """Slicer's scene model drops a node's row on ``NodeAboutToBeRemovedEvent``, so the
        selection changes before the node leaves the scene."""
        if self._alive():
            self._refresh(leaving=node)

    def _wanted(self, node):
        if node.GetHideFromEditors() or node.GetScene() is None:
            return False
        if self._showChildNodeTypes:
            return any(node.IsA(t) for t in self._nodeTypes)
        return node.GetClassName() in self._nodeTypes

    def _refresh(self, leaving=None):
        nodes = []
        if self._scene is not None:
            for i in range(self._scene.GetNumberOfNodes()):
                node = self._scene.GetNthNode(i)
                if node is not leaving and self._wanted(node):
                    nodes.append(node)
        old, self._nodes = self._nodes, tuple(nodes)
        if self._current is not None and self._current not in self._nodes:
            row = old.index(self._current) if self._current in old else len(old)
            kept = [n for n in old[row + 1:] if n in self._nodes]  # the row that took its place, else the last
            self._current = kept[0] if kept else (self._nodes[-1] if self._nodes else None)
            self._updateItems()
            self._emitCurrent()
        elif self._current is None and not self._noneEnabled and not old and self._nodes:
            self._current = self._nodes[0]  # QComboBox: the first row inserted into an empty model is current
            self._updateItems()
            self._emitCurrent()
        else:
            self._updateItems()

    def _updateItems(self):
        blocked = self._combo.blockSignals(True)
        self._combo.clear()
        if self._noneEnabled:
            self._combo.addItem(self._noneDisplay)
        for node in self._nodes:
            self._combo.addItem(node.GetName())
        offset = 1 if self._noneEnabled else 0
        self._combo.currentIndex = (self._nodes.index(self._current) + offset if self._current in self._nodes
                                    else (0 if self._noneEnabled else -1))
        self._combo.blockSignals(blocked)

    def _onActivated(self, index):  # the user picked an item
        offset = 1 if self._noneEnabled else 0
        self.setCurrentNode(self._nodes[index - offset] if index >= offset else None)

    def _emitCurrent(self):
        node = self._current
        self.currentNodeChanged[object].emit(node)
        self.currentNodeChanged[bool].emit(node is not None)
        self.currentNodeIDChanged.emit(node.GetID() if node is not None else "")

    # -- the selection --
    def currentNode(self):
        return self._current

    def currentNodeID(self):
        return self._current.GetID() if self._current is not None else ""

    def setCurrentNode(self, node):
        if node is not None and node not in self._nodes:
            node = None  # not one of the listed nodes: nothing is selected
        if node is self._current:
            return
        self._current = node
        self._updateItems()
        self._emitCurrent()

    def setCurrentNodeID(self, nodeID):
        self.setCurrentNode(self._scene.GetNodeByID(nodeID) if self._scene is not None and nodeID else None)

    def nodeCount(self):
        return len(self._nodes)

    # -- the menu's actions (qMRMLNodeComboBox.cxx:416-488) --
    def addNode(self, nodeType=None):
        """"Create new …": a new node of ``nodeType`` (the first of ``nodeTypes``), selected (:589-622)."""
        nodeType = nodeType or (self._nodeTypes[0] if self._nodeTypes else None)
        if nodeType is None or nodeType not in self._nodeTypes:
            return None
        node = self._scene.AddNewNodeByClass(nodeType)
        self.setCurrentNode(node)
        return node

    def removeCurrentNode(self):
        """"Delete current …" (:784-787): the selection then moves as on any removal."""
        self._scene.RemoveNode(self._current)

    def nodeFromIndex(self, index):
        return self._nodes[index] if 0 <= index < len(self._nodes) else None

    # -- properties (header order) --
    def nodeTypes(self):
        return list(self._nodeTypes)

    def setNodeTypes(self, nodeTypes):
        self._nodeTypes = tuple(nodeTypes)
        self._refresh()

    def showChildNodeTypes(self):
        return self._showChildNodeTypes

    def setShowChildNodeTypes(self, show):
        self._showChildNodeTypes = bool(show)
        self._refresh()

    def noneEnabled(self):
        return self._noneEnabled

    def setNoneEnabled(self, enable):
        self._noneEnabled = bool(enable)
        self._updateItems()

    def addEnabled(self):
        return self._addEnabled

    def setAddEnabled(self, enable):
        self._addEnabled = bool(enable)

    def removeEnabled(self):
        return self._removeEnabled

    def setRemoveEnabled(self, enable):
        self._removeEnabled = bool(enable)

    def renameEnabled(self):
        return self._renameEnabled

    def setRenameEnabled(self, enable):
        self._renameEnabled = bool(enable)

    def noneDisplay(self):
        return self._noneDisplay

    def setNoneDisplay(self, text):
        self._noneDisplay = text
        self._updateItems()

    currentNodeID = pyqtProperty(str, currentNodeID, setCurrentNodeID, notify=currentNodeIDChanged)
    nodeTypes = pyqtProperty("QStringList", nodeTypes, setNodeTypes)
    showChildNodeTypes = pyqtProperty(bool, showChildNodeTypes, setShowChildNodeTypes)
    noneEnabled = pyqtProperty(bool, noneEnabled, setNoneEnabled)
    addEnabled = pyqtProperty(bool, addEnabled, setAddEnabled)
    removeEnabled = pyqtProperty(bool, removeEnabled, setRemoveEnabled)
    renameEnabled = pyqtProperty(bool, renameEnabled, setRenameEnabled)
    noneDisplay = pyqtProperty(str, noneDisplay, setNoneDisplay)


class qMRMLSegmentEditorWidget(qMRMLWidget):
    """qMRMLSegmentEditorWidget.h: what it edits is its ``vtkMRMLSegmentEditorNode`` (the
    segmentation, the source volume, the selected segment); ``saveStateForUndo`` is counted.

    As in Slicer (qMRMLSegmentEditorWidget.cxx at v5.12.3): ``segmentationNode()`` answers from
    its segmentation combo box (:1332-1336), a ``qMRMLNodeComboBox`` without "None" (its .ui:
    76-85), which shows the editor node's segmentation (:855-866) and, when it moves by itself (its
    node removed, a first one added), sets it (:337, :1393-1401); ``setSegmentationNode`` of
    another segmentation deactivates the active effect (:1319-1329, :1007-1021)."""

    _editorNode = None
    _editorTag = None
    _combo = None
    undoStatesSaved = 0  # test instrumentation: how often saveStateForUndo() was called

    def _segmentationCombo(self):
        if self._combo is None:
            self._combo = qMRMLNodeComboBox(self)
            self._combo.setNodeTypes(["vtkMRMLSegmentationNode"])
            self._combo.setNoneEnabled(False)
            self._combo.setRenameEnabled(True)
            self._combo.currentNodeChanged[object].connect(self._onSegmentationNodeChanged)
        return self._combo

    def setMRMLScene(self, scene):
        super().setMRMLScene(scene)
        self._segmentationCombo().setMRMLScene(scene)

    def _gone(self):
        """The widget was deleted (its panel closed): stop watching its editor node."""
        if not sip.isdeleted(self):
            return False
        if self._editorNode is not None and self._editorTag is not None:
            self._editorNode.RemoveObserver(self._editorTag)
            self._editorTag = None
        return True

    def _onSegmentationNodeChanged(self, node):  # :1393-1401
        if self._gone() or self._scene is None or self._scene.IsBatchProcessing():
            return
        self.setSegmentationNode(node)

    def _updateWidgetFromMRML(self, caller=None, event=None):  # :855-866
        if self._gone():
            return
        combo = self._segmentationCombo()
        node = self._editorNode.GetSegmentationNode() if self._editorNode is not None else None
        if node is not combo.currentNode():
            blocked = combo.blockSignals(True)
            combo.setCurrentNode(node)
            combo.blockSignals(blocked)

    def mrmlSegmentEditorNode(self):
        return self._editorNode

    def setMRMLSegmentEditorNode(self, node):
        if self._editorNode is not None and self._editorTag is not None:
            self._editorNode.RemoveObserver(self._editorTag)
        self._editorNode, self._editorTag = node, None
        if node is not None:
            self._editorTag = node.AddObserver(vtk.vtkCommand.ModifiedEvent, self._updateWidgetFromMRML)
        self._updateWidgetFromMRML()

    def segmentationNode(self):
        return self._segmentationCombo().currentNode()

    def setSegmentationNode(self, node):
        if self._editorNode is None or self._editorNode.GetSegmentationNode() is node:
            return
        self._editorNode.SetAndObserveSegmentationNode(node)
        self.setActiveEffect(None)  # "deactivate current effect when we switch to a different segmentation"

    def activeEffect(self):
        return self._editorNode.GetActiveEffectName() or None if self._editorNode is not None else None

    def setActiveEffectByName(self, name):
        if self._editorNode is not None:
            self._editorNode.SetActiveEffectName(name)

    def setActiveEffect(self, effect):
        if self._editorNode is not None:
            self._editorNode.SetActiveEffectName(effect or "")

    def sourceVolumeNode(self):
        return self._editorNode.GetSourceVolumeNode() if self._editorNode is not None else None

    def setSourceVolumeNode(self, node):
        self._editorNode.SetAndObserveSourceVolumeNode(node)

    def currentSegmentID(self):
        return self._editorNode.GetSelectedSegmentID() if self._editorNode is not None else ""

    def setCurrentSegmentID(self, segmentID):
        self._editorNode.SetSelectedSegmentID(segmentID)

    def saveStateForUndo(self):
        self.undoStatesSaved += 1


CUSTOM_WIDGETS = {cls.__name__: cls for cls in (ctkCollapsibleButton, ctkPathLineEdit, qMRMLWidget, qMRMLNodeComboBox,
                                                qMRMLSegmentEditorWidget)}


# ---- QUiLoader ---------------------------------------------------------------------------------

class _CustomWidgets:
    """uic's custom-widget lookup, answered from :data:`CUSTOM_WIDGETS` (a ``.ui``'s header names
    the C++ header, not a Python module)."""

    def __init__(self):
        self.declared = {}

    def addCustomWidget(self, widgetClass, baseClass, module):
        self.declared[widgetClass] = module

    def search(self, cls):
        if cls not in self.declared:
            return None
        if cls not in CUSTOM_WIDGETS:
            raise LookupError(f"the .ui uses {cls} ({self.declared[cls]}.h), for which the tests have no stand-in")
        return CUSTOM_WIDGETS[cls]


class _Policy(LoaderCreatorPolicy):
    def createCustomWidgetLoader(self):
        return _CustomWidgets()


class _Loader(DynamicUILoader):
    def __init__(self):
        UIParser.__init__(self, QtCore, QtGui, QtWidgets, _Policy(""))  # DynamicUILoader's, with our policy

    def createConnections(self, elem):
        """The ``.ui``'s ``<connections>`` through PythonQt's string ``connect`` (QUiLoader connects
        by signature, like ``QObject::connect``): an unknown signal or slot raises."""
        def find(name):
            return self.toplevelWidget if name == self.uiname else self.toplevelWidget.findChild(QtCore.QObject, name)

        for conn in elem:
            sender, receiver = find(conn.findtext("sender")), find(conn.findtext("receiver"))
            slot = getattr(receiver, conn.findtext("slot").split("(")[0])
            sender.connect(conn.findtext("signal"), slot)


class QUiLoader(QtCore.QObject):
    """PythonQt's ``qt.QUiLoader`` (QtUiTools), as ``slicer.util.loadUI`` uses it: ``load(file)``
    builds the ``.ui`` with the Qt widgets and the stand-ins above. Like Qt's loader, the widget it
    returns has no Python attribute per child (uic sets them; they are removed)."""

    def load(self, device, parentWidget=None):
        path = device.fileName()
        widget = _Loader().loadUi(path, None, "_rc")
        for name in list(vars(widget)):
            delattr(widget, name)
        if parentWidget is not None:
            widget.setParent(parentWidget)
        return widget


def ctk_namespace():
    """The ``ctk`` module: the CTK stand-ins."""
    ctk = types.ModuleType("ctk", "CTK widgets (stand-ins, Testing/slicer_qt/widgets.py)")
    ctk.ctkCollapsibleButton = ctkCollapsibleButton
    ctk.ctkPathLineEdit = ctkPathLineEdit
    return ctk

