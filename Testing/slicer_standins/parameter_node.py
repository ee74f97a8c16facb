"""``slicer.parameterNodeWrapper`` for the tests, shared by ``Testing/slicer_mrml`` and
``Testing/slicer_qt``. Written from Slicer's ``Base/Python/slicer/parameterNodeWrapper`` at v5.12.3
and v5.10.0, for the field types the module declares and the widgets its ``.ui`` binds; the two
tags differ only in ``disconnectGui`` (:func:`make_module`'s ``version``). ``file:line`` below is
at v5.12.3.

Kept as Slicer's:

- storage (serializers.py): ``int``/``float`` as ``str(value)`` (:260), ``str`` as is (:298),
  ``bool`` as ``"True"``/``"False"`` (:371), a node as a reference named after the field plus an
  empty parameter of that name (:405-409), a ``list[...]`` as ``name.0``, ``name.1``, … and
  ``name.len`` (:644-667), read back as an :class:`ObservedList` whose edits write through (:491-593);
- validation before anything is written (:158-164): ``NotNone``/``IsInstance`` per type (:246,
  :288, :361, :396) and the validators of ``Annotated[...]`` (validators.py), e.g. ``WithinRange``;
- defaults written into the node when a wrapper is made (wrapper.py:136-139) and when a missing
  parameter is read (:43-46);
- one cache per field (``_CachedParameterWrapper``, wrapper.py:84-120). A write runs inside
  ``NodeModify`` and reads the value back *before* ``EndModify`` fires ``ModifiedEvent``
  (:103-113), so every observer of that event sees the written value; every other field re-reads
  in its own ``ModifiedEvent`` observer (:99-101), so a handler that VTK calls before a field's
  observer still sees that field's previous value (a node reference MRML removed, say);
- ``connectGui(gui)``: the widgets whose dynamic property ``SlicerParameterName`` names a field
  (a widget's children, or the values of a namespace such as ``slicer.util.childWidgetVariables``,
  wrapper.py:243-255) get a GUI connector (:195-215, guiConnectors.py): written now and on every
  ``ModifiedEvent``, and writing the field when edited (:173-179). A widget no connector represents
  raises (guiConnectors.py:145). ``disconnectGui`` drops the connection's ``ModifiedEvent`` observer
  at v5.12.3 (:263-265) but not at v5.10.0, where each connect/disconnect pair leaks one; that
  observer holds the wrapper (:213), so a leaked one keeps the wrapper's cache observers too.

Stricter than Slicer's: writing an attribute that is not a field raises (Slicer's wrapper is a
plain class: a misspelt field becomes a Python attribute and the node never changes).

Test instrumentation (not Slicer's): ``Wrapper.connections`` (the live GUI connections) and
``Wrapper.calls["connectGui"]``.
"""

from __future__ import annotations

import pathlib
import types
import typing
import weakref
from typing import Annotated

SlicerParameterNamePropertyName = "SlicerParameterName"  # wrapper.py:28


# ---- annotations (default.py, validators.py, util.py) ------------------------------------------

class Default:
    """default.py:4-30."""

    def __init__(self, value=None, *, generator=None):
        self._value, self._generator = value, generator

    @property
    def value(self):
        return self._generator() if self._generator else self._value


class Validator:
    def validate(self, value) -> None:
        raise NotImplementedError


class NotNone(Validator):  # validators.py:58-66
    def validate(self, value):
        if value is None:
            raise ValueError("Value must not be None")


class IsInstance(Validator):  # validators.py:69-80
    def __init__(self, classtype):
        self.classtype = classtype

    def validate(self, value):
        if value is not None and not isinstance(value, self.classtype):
            raise TypeError(f"Value must be of type '{self.classtype}', is type '{type(value)}' value '{value}'")


class WithinRange(Validator):  # validators.py:83-95
    def __init__(self, minimum, maximum):
        self.minimum, self.maximum = minimum, maximum

    def validate(self, value):
        if not self.minimum <= value <= self.maximum:
            raise ValueError(f"Value must be within range [{self.minimum}, {self.maximum}], is {value}")


class Minimum(Validator):  # validators.py:98-109
    def __init__(self, minimum):
        self.minimum = minimum

    def validate(self, value):
        if value < self.minimum:
            raise ValueError(f"Value must be greater than {self.minimum}, is {value}")


class Maximum(Validator):  # validators.py:112-123
    def __init__(self, maximum):
        self.maximum = maximum

    def validate(self, value):
        if value > self.maximum:
            raise ValueError(f"Value must be greater than {self.maximum}, is {value}")


class Choice(Validator):  # validators.py:126-137
    def __init__(self, choices):
        self.choices = choices

    def validate(self, value):
        if value not in self.choices:
            raise ValueError(f"Value is {value}, but must be in one of the following: {self.choices}")


def splitAnnotations(possiblyAnnotatedType):
    """util.py:15-28: ``(type, annotations)``; ``Annotated[int, a, b]`` → ``(int, (a, b))``."""
    args = typing.get_args(Annotated[possiblyAnnotatedType, "stub annotation"])
    return args[0], args[1:-1]


def unannotatedType(possiblyAnnotatedType):
    return splitAnnotations(possiblyAnnotatedType)[0]


def findFirstAnnotation(annotations, annotationType):
    found = [a for a in annotations if isinstance(a, annotationType)]
    return found[0] if found else None


def _is_node_class(t) -> bool:
    import slicer

    return isinstance(t, type) and issubclass(t, slicer.vtkMRMLNode)


# ---- serializers (serializers.py) ----------------------------------------------------------------

class _Scalar:
    """``NumberSerializer`` (:235-271), ``StringSerializer`` (:274-308), ``BoolSerializer`` (:350-381)."""

    def __init__(self, type_):
        self.type = type_
        self.validators = [NotNone(), IsInstance((int, float) if type_ is float else type_)]

    def default(self):
        return {int: 0, float: 0, str: "", bool: False}[self.type]

    def isIn(self, node, name):
        return node.HasParameter(name)

    def write(self, node, name, value):
        node.SetParameter(name, ("True" if value else "False") if self.type is bool else str(value))

    def read(self, node, name):
        text = node.GetParameter(name)
        if self.type is bool:
            return text == "True"
        return self.type(text) if self.type is not str else text

    def remove(self, node, name):
        node.UnsetParameter(name)


class _Path(_Scalar):
    """``PathSerializer`` (:311-347)."""

    def default(self):
        return self.type()

    def read(self, node, name):
        return self.type(node.GetParameter(name))


class _Node:
    """``NodeSerializer`` (:384-420)."""

    def __init__(self, type_):
        self.validators = [IsInstance(type_)]

    def default(self):
        return None

    def isIn(self, node, name):
        return node.HasParameter(name)

    def write(self, node, name, value):
        node.SetParameter(name, "")
        node.SetNodeReferenceID(name, value.GetID() if value is not None else None)

    def read(self, node, name):
        return node.GetNodeReference(name)

    def remove(self, node, name):
        node.UnsetParameter(name)
        node.RemoveNodeReferenceIDs(name)


class ObservedList(list):
    """serializers.py:491-593: the list a ``list[...]`` field reads as; its edits write the field.
    (Slicer's is a ``MutableSequence``; this one is a ``list`` whose mutators write through.)"""

    def __init__(self, node, serializer, name, items):
        super().__init__(items)
        self._node, self._serializer, self._name = node, serializer, name

    def _save(self):
        self._serializer.write(self._node, self._name, list(self))

    def append(self, item):
        super().append(item)
        self._save()

    def extend(self, items):
        super().extend(items)
        self._save()

    def insert(self, index, item):
        super().insert(index, item)
        self._save()

    def remove(self, item):
        super().remove(item)
        self._save()

    def pop(self, index=-1):
        item = super().pop(index)
        self._save()
        return item

    def clear(self):
        super().clear()
        self._save()

    def __setitem__(self, index, item):
        super().__setitem__(index, item)
        self._save()

    def __delitem__(self, index):
        super().__delitem__(index)
        self._save()

    def __iadd__(self, items):
        super().__iadd__(items)
        self._save()
        return self

    def __add__(self, other):  # serializers.py:545-549: a non-modifying + is refused
        raise NotImplementedError("Adding an ObservedList is not supported. However, += is supported.")

    __radd__ = __add__


class _List:
    """``ListSerializer`` (:596-698) of a serializer per item."""

    def __init__(self, item):
        self.item = item
        self.validators = []

    def default(self):
        return []

    def isIn(self, node, name):
        return node.HasParameter(f"{name}.len")

    def _len(self, node, name):
        return int(node.GetParameter(f"{name}.len")) if self.isIn(node, name) else 0

    def write(self, node, name, values):
        was = node.StartModify()  # with slicer.util.NodeModify(parameterNode): (:648)
        try:
            old = self._len(node, name)
            for i, v in enumerate(values):
                _validate(self.item, v)
                self.item.write(node, f"{name}.{i}", v)
            node.SetParameter(f"{name}.len", str(len(values)))
            for i in range(len(values), old):
                self.item.remove(node, f"{name}.{i}")
        finally:
            node.EndModify(was)

    def read(self, node, name):
        return ObservedList(node, self, name, [self.item.read(node, f"{name}.{i}") for i in range(self._len(node, name))])

    def remove(self, node, name):
        for i in range(self._len(node, name)):
            self.item.remove(node, f"{name}.{i}")
        node.UnsetParameter(f"{name}.len")


def _serializer(annotated):
    """``createSerializer`` (:219-224): the type's serializer, with the annotations' validators."""
    type_, annotations = splitAnnotations(annotated)
    if type_ in (int, float, str, bool):
        s = _Scalar(type_)
    elif type_ in (pathlib.Path, pathlib.PurePath, pathlib.PosixPath, pathlib.PurePosixPath):
        s = _Path(type_)
    elif _is_node_class(type_):
        s = _Node(type_)
    elif typing.get_origin(type_) is list:
        (item,) = typing.get_args(type_)
        s = _List(_serializer(item))
    else:
        raise TypeError(f"this stand-in has no serializer for {type_!r}; Slicer's has more (serializers.py)")
    validators = [a for a in annotations if isinstance(a, Validator)]
    s.validators = s.validators + validators
    return s


def _validate(serializer, value):
    for v in serializer.validators:  # ValidatedSerializer.validate (:158-160)
        v.validate(value)


# ---- GUI connectors (guiConnectors.py) ---------------------------------------------------------

class _Connector:
    """A widget adapted to a field: ``read``/``write`` the widget, ``onChanged(callback)`` on its
    change signal (connected with PythonQt's string ``connect``)."""

    def __init__(self, widget, signal, read, write):
        self._widget, self._signal, self.read, self.write = widget, signal, read, write
        self._callback = None

    def onChanged(self, callback):  # guiConnectors.py:75-82
        if self._callback is not None:
            self._widget.disconnect(self._signal, self._changed)
        self._callback = callback
        if callback is not None:
            self._widget.connect(self._signal, self._changed)

    def _changed(self):
        if self._callback:
            self._callback()


def createGuiConnector(widget, datatype) -> _Connector:
    """guiConnectors.py:126-147 for the connectors of the widget classes the module's ``.ui`` uses
    (classes compared exactly, ``type(widget) == …``, as Slicer's ``canRepresent`` do)."""
    import ctk
    import qt
    import slicer

    type_, annotations = splitAnnotations(datatype)
    kind = type(widget)
    if kind is qt.QCheckBox and type_ is bool:  # :161-191
        return _Connector(widget, "stateChanged(int)", lambda: widget.checked,
                          lambda v: setattr(widget, "checked", v))
    if kind in (qt.QSlider, qt.QSpinBox) and type_ is int:  # :275-336
        withinRange = findFirstAnnotation(annotations, WithinRange)
        minimum, maximum = findFirstAnnotation(annotations, Minimum), findFirstAnnotation(annotations, Maximum)
        if kind is qt.QSlider and withinRange is None and (minimum is None or maximum is None):
            raise RuntimeError("Cannot have a connection to QSlider where the int type is unbounded.")
        if withinRange is not None:
            widget.setRange(withinRange.minimum, withinRange.maximum)
        else:  # the int limits when the annotation gives none (:311-321)
            widget.setMinimum(minimum.minimum if minimum is not None else -(2**31))
            widget.setMaximum(maximum.maximum if maximum is not None else 2**31 - 1)
        return _Connector(widget, "valueChanged(int)", lambda: widget.value, lambda v: setattr(widget, "value", v))
    if kind is qt.QComboBox and type_ in (int, float, str, bool):  # :417-462
        choice = findFirstAnnotation(annotations, Choice)
        if choice is None:
            raise RuntimeError("ComboBoxToStringableConnector requires the Choice annotation to be used.")
        widget.clear()
        for c in choice.choices:
            widget.addItem(str(c))
        return _Connector(widget, "currentIndexChanged(int)", lambda: choice.choices[widget.currentIndex],
                          lambda v: setattr(widget, "currentIndex", list(choice.choices).index(v)))
    if kind is qt.QLineEdit and type_ is str:  # :514-548: written only when it differs (the cursor)
        return _Connector(widget, "textChanged(QString)", lambda: widget.text,
                          lambda v: setattr(widget, "text", v) if v != widget.text else None)
    if kind is ctk.ctkPathLineEdit and type_ in (pathlib.Path, pathlib.PurePath, pathlib.PosixPath):  # :672-705
        return _Connector(widget, "currentPathChanged(QString)", lambda: type_(widget.currentPath),
                          lambda v: setattr(widget, "currentPath", str(v)))
    if kind is slicer.qMRMLNodeComboBox and _is_node_class(type_):  # :744-774
        widget.nodeTypes = [type_().GetClassName()]  # getNodeTypes (util.py:78-85)
        return _Connector(widget, "currentNodeChanged(vtkMRMLNode*)", widget.currentNode, widget.setCurrentNode)
    raise RuntimeError(f"Unable to create GUI connector from datatype '{datatype}' to widget type '{kind}'.")


# ---- the wrapper (wrapper.py) ---------------------------------------------------------------------

class _Cached:
    """``_CachedParameterWrapper`` (wrapper.py:84-120) of one field."""

    def __init__(self, name, serializer, default, node):
        self.name, self.serializer, self.default, self.node = name, serializer, default, node
        self._writing = False
        self._value = self._read()
        me = weakref.ref(self)
        self._tag = node.AddObserver("ModifiedEvent", lambda caller, event: me() and me()._onModified())

    def __del__(self):
        self.node.RemoveObserver(self._tag)

    def _read(self):
        if not self.serializer.isIn(self.node, self.name):  # _Parameter.read (:43-46)
            self.serializer.write(self.node, self.name, self.default)
        return self.serializer.read(self.node, self.name)

    def _onModified(self):
        if not self._writing:
            self._value = self._read()

    def read(self):
        return self._value

    def write(self, value):
        _validate(self.serializer, value)
        self._writing = True
        try:
            was = self.node.StartModify()  # with slicer.util.NodeModify(self.parameterNode): (:109)
            try:
                self.serializer.write(self.node, self.name, value)
                self._value = self._read()  # read back before EndModify calls the observers (:106-111)
            finally:
                self.node.EndModify(was)
        finally:
            self._writing = False


def make_module(version=(5, 12, 3)) -> types.ModuleType:
    """A ``slicer.parameterNodeWrapper`` module as Slicer ``version`` has it (``(5, 10, 0)`` or
    ``(5, 12, 3)``)."""
    if tuple(version) not in ((5, 10, 0), (5, 12, 3)):
        raise ValueError(f"mirrored at v5.10.0 and v5.12.3 only, not {version}")
    leaks_gui_observer = tuple(version) < (5, 12, 0)

    def parameterNodeWrapper(cls):
        hints = typing.get_type_hints(cls, include_extras=True)  # wrapper.py:307
        fields = {}
        for name, annotated in hints.items():
            serializer = _serializer(annotated)
            default = cls.__dict__[name] if name in cls.__dict__ else (
                findFirstAnnotation(splitAnnotations(annotated)[1], Default) or Default(serializer.default())).value
            fields[name] = (annotated, serializer, default)
        connections, calls = {}, {"connectGui": 0}

        class Wrapper:
            __slots__ = ("parameterNode", "_fields", "_guis", "_guiTags", "_nextTag", "_updatingGUI", "__weakref__")

            def __init__(self, parameterNode):
                set_ = object.__setattr__
                set_(self, "parameterNode", parameterNode)
                set_(self, "_guis", {})
                set_(self, "_guiTags", {})
                set_(self, "_nextTag", 0)
                set_(self, "_updatingGUI", False)
                for name, (_, serializer, default) in fields.items():  # wrapper.py:136-144
                    if not serializer.isIn(parameterNode, name):
                        serializer.write(parameterNode, name, default)
                set_(self, "_fields", {name: _Cached(name, s, d, parameterNode) for name, (_, s, d) in fields.items()})

            def __getattr__(self, name):
                if name in fields:
                    return self._fields[name].read()
                raise AttributeError(f"{cls.__name__} has no parameter {name!r}")

            def __setattr__(self, name, value):
                if name not in fields:
                    raise AttributeError(f"{cls.__name__} has no parameter {name!r} (Slicer's wrapper would set a "
                                         "Python attribute and leave the parameter node as it was)")
                self._fields[name].write(value)

            # wrapper.py:355-359
            def StartModify(self):
                return self.parameterNode.StartModify()

            def EndModify(self, wasModifying):
                return self.parameterNode.EndModify(wasModifying)

            def AddObserver(self, event, callback, priority=0.0):
                return self.parameterNode.AddObserver(event, callback, priority)

            def RemoveObserver(self, tag):
                self.parameterNode.RemoveObserver(tag)

            def Modified(self):
                self.parameterNode.Modified()

            def getValue(self, name):
                return getattr(self, name)

            def setValue(self, name, value):
                setattr(self, name, value)

            @staticmethod
            def dataType(name):
                return fields[name][0]

            def _updateGUIFromParameterNode(self):  # wrapper.py:182-192
                if self._updatingGUI:
                    return
                object.__setattr__(self, "_updatingGUI", True)
                was = self.StartModify()
                try:
                    for mapping in list(self._guis.values()):
                        for name, connector in mapping.items():
                            connector.write(self.getValue(name))
                finally:
                    self.EndModify(was)
                    object.__setattr__(self, "_updatingGUI", False)

            def _guiToParameter(self, name, connector):  # wrapper.py:173-179
                def callback():
                    was = self.StartModify()
                    try:
                        if not self._updatingGUI:
                            self.setValue(name, connector.read())
                    finally:
                        self.EndModify(was)
                return callback

            def connectParametersToGui(self, mapping):  # wrapper.py:195-215
                for name in mapping:
                    if name not in fields:
                        raise ValueError(f"Cannot find a param with the given name: {name}")
                connectors = {name: createGuiConnector(w, self.dataType(name)) for name, w in mapping.items()}
                tag = self._nextTag
                object.__setattr__(self, "_nextTag", tag + 1)
                self._guis[tag] = connectors
                for name, connector in connectors.items():
                    connector.write(self.getValue(name))
                    connector.onChanged(self._guiToParameter(name, connector))
                # the observer holds the wrapper itself, as Slicer's does (wrapper.py:213, :212 at
                # v5.10.0): while it is on the node, the wrapper and its fields' cache observers live
                self._guiTags[tag] = self.AddObserver(
                    "ModifiedEvent", lambda caller, event: self._updateGUIFromParameterNode())
                return tag

            def connectGui(self, gui):  # wrapper.py:243-255
                calls["connectGui"] += 1
                if getattr(gui, "isWidgetType", lambda: False)():
                    import qt

                    widgets = gui.findChildren(qt.QWidget)
                else:
                    widgets = list(vars(gui).values())
                mapping = {w.property(SlicerParameterNamePropertyName): w for w in widgets
                           if w.property(SlicerParameterNamePropertyName)}
                tag = self.connectParametersToGui(mapping)
                connections[(id(self), tag)] = (self.parameterNode, gui)
                return tag

            def disconnectGui(self, tag):  # wrapper.py:258-265
                for connector in self._guis.pop(tag, {}).values():
                    connector.onChanged(None)
                observer = self._guiTags.pop(tag, None)
                if observer is not None and not leaks_gui_observer:
                    self.RemoveObserver(observer)
                connections.pop((id(self), tag), None)

        Wrapper.__name__ = Wrapper.__qualname__ = cls.__name__
        Wrapper.__module__ = cls.__module__
        Wrapper.allParameters = {name: annotated for name, (annotated, _, _) in fields.items()}
        Wrapper.connections = connections
        Wrapper.calls = calls
        return Wrapper

    mod = types.ModuleType("slicer.parameterNodeWrapper")
    mod.SLICER_VERSION = tuple(version)
    for obj in (parameterNodeWrapper, Default, Validator, NotNone, IsInstance, WithinRange, Minimum, Maximum, Choice,
                ObservedList, createGuiConnector, splitAnnotations, unannotatedType, findFirstAnnotation):
        setattr(mod, obj.__name__, obj)
    mod.SlicerParameterNamePropertyName = SlicerParameterNamePropertyName
    return mod
