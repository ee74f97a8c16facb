"""``qt`` as Slicer's Python sees it through PythonQt, built over PyQt5 (Qt 5.15) — strict.

PythonQt shows Qt to Python differently from PyQt5, and the module is written for PythonQt.
References below are to MeVisLab/pythonqt ``src/`` at 642c06b6 (v4.1.0 + 3 commits); Slicer
v5.12.3's CTK (5056664a, CMakeExternals/PythonQt.cmake:94) builds commontk/PythonQt 74dcd675,
"patched-v4.1.0", which was not at hand to compare line by line.

- one namespace, ``qt``, for QtCore, QtGui and QtWidgets (and ``QUiLoader``);
- a ``Q_PROPERTY`` is an attribute: ``label.text = "x"``, ``button.enabled`` — a property is looked
  up before a method of the same name (PythonQtClassInfo.cpp:326) and written by ``setattr``
  (PythonQtInstanceWrapper.cpp:616-660); ``name`` is ``objectName`` (PythonQtClassInfo.cpp:148-151);
  a direct child is an attribute by its object name (PythonQtInstanceWrapper.cpp:595-603);
- a wrapped object is true while its C++ object lives (PythonQtInstanceWrapper.cpp:850-854), even
  an empty combo box (PyQt5's ``QComboBox`` has ``__len__``, so an empty one is false, and
  ``slicer.util.findChildren`` would skip it);
- signals connect by signature string: ``obj.connect("clicked(bool)", callable)``
  (PythonQtStdDecorators.cpp:50-73), and the callable gets as many of the signal's arguments as it
  takes (PythonQtSignalReceiver.cpp:71-102).

Where PythonQt goes on quietly, this facade raises, so that a test fails:

- ``connect``/``disconnect`` with a signal the object does not have (PythonQt prints "signal ...
  does not exist" and returns False: PythonQtStdDecorators.cpp:64-69);
- writing an attribute that is neither a ``Q_PROPERTY``, a dynamic property nor an existing
  attribute (PythonQt creates a Python attribute on any object whose class derives from a wrapped
  QObject class, PythonQtInstanceWrapper.cpp:725-738: ``button.tooltip = "x"`` changes nothing on
  screen), and overwriting a method or signal;
- an exception raised by a connected Python callable (PythonQt prints it and carries on):
  collected in :data:`slot_errors`, which the tests' fixtures check.

How: :func:`install` replaces ``QObject.__getattribute__`` and ``__setattr__`` in this process.
Attribute access from PyQt5's own Python code (``PyQt5.uic``, which builds ``.ui`` files) keeps
PyQt5's meaning; everything else — Slicer's ``slicer.util``, the module, the stand-ins, the tests —
sees PythonQt's. Python subclasses (the CTK and qMRML stand-ins) keep their own Python attributes.
Not modelled: PythonQt's conversion of arguments (a VTK object passed for ``vtkMRMLNode*``, a
Python list for ``QStringList``), decorators beyond ``connect``/``disconnect``, and its
``QVariant`` conversions of property values (PyQt5's are used).
"""

from __future__ import annotations

import inspect
import sys
import traceback
import types

from PyQt5 import QtCore, QtGui, QtWidgets, sip

_QObject = QtCore.QObject
_get = _QObject.__getattribute__  # sip's, i.e. object's: instance dict, then the class
_set = _QObject.__setattr__

slot_errors: list = []  # (where, exception) raised by connected callables since the last check
_connections: dict = {}  # (id(sender), signature, callable) → the wrapper connected to the PyQt5 signal


def _from_pyqt(depth: int = 2) -> bool:
    """Whether the attribute access comes from PyQt5's own Python code (uic)."""
    return sys._getframe(depth).f_globals.get("__name__", "").startswith("PyQt5.")


def _python_attribute(obj, name: str) -> bool:
    """A Python-level attribute: in the instance's dict, or defined by a Python subclass of a Qt
    class (the stand-ins' methods, ``pyqtProperty`` and ``pyqtSignal``)."""
    try:
        if name in _get(obj, "__dict__"):
            return True
    except AttributeError:
        pass
    for klass in type(obj).__mro__:
        if klass.__module__.startswith(("PyQt5", "sip")) or klass is object:
            break
        if name in vars(klass):
            return True
    return False


def _meta_property(obj, name: str):
    meta = _QObject.metaObject(obj)
    index = meta.indexOfProperty(name)
    if index < 0 and name == "name":  # PythonQtClassInfo.cpp:148-151
        index = meta.indexOfProperty("objectName")
    if index < 0 or (name == "singleShot" and isinstance(obj, QtCore.QTimer)):  # PythonQtClassInfo.cpp:156-159
        return None
    return meta.property(index)


def _getattribute(self, name):
    if name.startswith("__") or _from_pyqt() or _python_attribute(self, name):
        return _get(self, name)
    prop = _meta_property(self, name)
    if prop is not None:
        return prop.read(self)
    try:
        return _get(self, name)
    except AttributeError:
        for child in _QObject.children(self):  # PythonQtInstanceWrapper.cpp:595-603
            if _QObject.objectName(child) == name:
                return child
        raise


def _setattr(self, name, value):
    if _from_pyqt() or _python_attribute(self, name):
        return _set(self, name, value)
    cls = type(self).__name__
    prop = _meta_property(self, name)
    if prop is not None:
        if not prop.isWritable():
            raise AttributeError(f"Property '{name}' of {cls} object is not writable")
        if not prop.write(self, value):
            raise TypeError(f"Property '{name}' of type '{prop.typeName()}' does not accept {value!r}")
        return None
    if bytes(name, "utf-8") in _QObject.dynamicPropertyNames(self):
        _QObject.setProperty(self, name, value)
        return None
    if hasattr(type(self), name):
        raise AttributeError(f"'{name}' is a method or signal of {cls}: PythonQt refuses to overwrite it")
    raise AttributeError(
        f"{cls} has no Q_PROPERTY, dynamic property or attribute '{name}': PythonQt would quietly create a Python "
        "attribute (PythonQtInstanceWrapper.cpp:725), and nothing on screen would change")


# ---- signals by signature ----------------------------------------------------------------------

def signal(obj, signature: str):
    """The PyQt5 bound signal for a C++ ``signature`` and its number of arguments. A stand-in
    written in Python declares the signatures of its header that PyQt5 spells otherwise (a
    ``vtkMRMLNode*`` travels as ``PyQt_PyObject``) in ``HEADER_SIGNALS``."""
    wanted = bytes(QtCore.QMetaObject.normalizedSignature(signature)).decode()
    meta = _QObject.metaObject(obj)
    found = wanted
    if meta.indexOfSignal(found) < 0:
        found = {k: v for klass in reversed(type(obj).__mro__)
                 for k, v in vars(klass).get("HEADER_SIGNALS", {}).items()}.get(wanted, "")
    if not found or meta.indexOfSignal(found) < 0:
        raise ValueError(f"{meta.className()} has no signal {signature!r}: PythonQt would print that it does not "
                         "exist and connect nothing (PythonQtStdDecorators.cpp:64-69)")
    name, args = found[:-1].split("(", 1)
    types_ = [object if t == "PyQt_PyObject" else t for t in args.split(",") if t]
    bound = _get(obj, name)
    if types_:
        bound = bound[types_[0] if len(types_) == 1 else tuple(types_)]
    return bound, len(types_), wanted


def _python_arg_count(callable_):
    """How many arguments PythonQt passes: a function's or method's fixed count, all of them for
    anything else or ``*args`` (PythonQtSignalReceiver.cpp:71-102)."""
    function = getattr(callable_, "__func__", callable_)
    if not isinstance(function, types.FunctionType) or function.__code__.co_flags & inspect.CO_VARARGS:
        return None
    return function.__code__.co_argcount - (1 if hasattr(callable_, "__self__") else 0)


def _slot(callable_, signal_args: int, where: str):
    takes = _python_arg_count(callable_)

    def slot(*args):
        args = args[:signal_args] if takes is None else args[:min(signal_args, takes)]
        try:
            callable_(*args)
        except Exception as e:  # noqa: BLE001 - PythonQt prints it and goes on; the tests fail on it
            traceback.print_exc()
            slot_errors.append((where, e))

    return slot


def connect(self, signature, callable_):
    """``obj.connect("signal(args)", callable)`` (PythonQtStdDecorators.cpp:50-73)."""
    bound, count, wanted = signal(self, signature)
    key = (id(self), wanted, callable_)
    if key in _connections:  # PythonQt keeps one handler per callable and signal
        return True
    wrapper = _slot(callable_, count, f"{_QObject.metaObject(self).className()}.{wanted}")
    bound.connect(wrapper)
    _connections[key] = wrapper
    return True


def disconnect(self, signature, callable_=None):
    """``obj.disconnect("signal(args)"[, callable])`` (PythonQtStdDecorators.cpp:104-130)."""
    bound, _, wanted = signal(self, signature)
    keys = [k for k in _connections if k[0] == id(self) and k[1] == wanted and callable_ in (None, k[2])]
    for key in keys:
        bound.disconnect(_connections.pop(key))
    return bool(keys)


# ---- the namespace -----------------------------------------------------------------------------

def namespace(extra=()) -> types.ModuleType:
    """The ``qt`` module: QtCore, QtGui and QtWidgets in one namespace, plus ``extra`` classes."""
    qt = types.ModuleType("qt", __doc__)
    for module in (QtCore, QtGui, QtWidgets):
        for name in dir(module):
            if name.startswith("Q") and not hasattr(qt, name):
                setattr(qt, name, getattr(module, name))
    qt.Qt = QtCore.Qt
    for cls in extra:
        setattr(qt, cls.__name__, cls)
    return qt


def _alive(self) -> bool:
    return not sip.isdeleted(self)


def install() -> None:
    """PythonQt's attribute semantics, truth value and string ``connect`` on every QObject of this
    process."""
    _QObject.__getattribute__ = _getattribute
    _QObject.__setattr__ = _setattr
    _QObject.__bool__ = _alive
    _QObject.connect = connect
    _QObject.disconnect = disconnect
