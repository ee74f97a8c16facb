"""The engine's tests, a package so that a test file may share its name with one of another tier
(``core.test_geometry`` beside ``slicer_lib``'s ``test_geometry``); pytest puts ``Testing/`` on
``sys.path``, so helpers are imported as ``core.probes``, ``core.worker_clients``."""
