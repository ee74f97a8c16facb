"""Stand-ins for the Python parts of the 3D Slicer application that PyPI's ``slicer-core`` does not
ship, shared by the two tiers that run the module against real Slicer libraries:

- ``Testing/slicer_mrml``: the module's logic on real MRML, no Qt;
- ``Testing/slicer_qt``: the module's panel in real Qt (PyQt5, Qt 5.15), on the same MRML.

What both tiers share lives here and is imported by both conftests:

- :mod:`.application`: ``slicer.mrmlScene`` and ``slicer.modules.<name>.logic()`` built as the
  application builds them;
- :mod:`.parameter_node`: ``slicer.parameterNodeWrapper``, mirrored from Slicer's at v5.10.0 and
  v5.12.3 (storage, cache, validators, GUI connectors);
- :mod:`.scripted_module`: ``slicer.ScriptedLoadableModule`` (its Qt-free parts).

The Qt tier's own stand-ins (``qt`` as PythonQt shows it, CTK and qMRML widgets, ``slicer.app``)
are in ``Testing/slicer_qt``. Nothing here is a ``slicer`` package of its own: slicer-core's
``slicer`` extends itself with every ``slicer/`` folder on ``sys.path``.
"""
