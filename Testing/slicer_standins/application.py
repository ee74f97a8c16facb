"""``slicer.mrmlScene`` and ``slicer.modules.<name>.logic()`` as the Slicer application sets them
up, on slicer-core's real MRML and module logics (both test tiers)."""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MODULE_DIR = REPO / "MedVolR1Slicer"
SCRIPTS_DIR = MODULE_DIR / "Scripts"  # scripts run with --python-script, apart from the module's files

MODULE_LOGICS = {  # Slicer module name → logic class in slicer-core
    "Colors": "vtkSlicerColorLogic",
    "Volumes": "vtkSlicerVolumesLogic",
    "Segmentations": "vtkSlicerSegmentationsModuleLogic",
    "Markups": "vtkSlicerMarkupsLogic",
    "SubjectHierarchy": "vtkSlicerSubjectHierarchyModuleLogic",
}

_APPLICATION = {}  # keeps the application logic and the module logics alive (MRML holds raw pointers)


def on_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def have_slicer_core() -> bool:
    """Whether slicer-core is installed. On CI a missing one is a broken set-up, not a reason to
    skip: it raises (the test modules skip themselves elsewhere: ``bootstrap.py --no-slicer-core``)."""
    try:
        import slicer

        found = hasattr(slicer, "vtkMRMLScene")
    except ImportError:
        found = False
    if not found and on_ci():
        raise RuntimeError("slicer-core is not installed; `python3 MedVolCore/bootstrap.py` installs it")
    return found


def check_no_strays() -> None:
    """slicer-core's ``slicer`` extends itself with every ``slicer/`` folder on ``sys.path`` (a
    namespace portion) and imports what is in it: nothing of this repository may be named so
    (slicer-core's own files count only as installed packages, which may sit inside the checkout,
    e.g. in .venv)."""

    def ours(module) -> bool:
        path = Path(getattr(module, "__file__", None) or "/").resolve()
        return REPO in path.parents and "site-packages" not in path.parts

    strays = sorted(name for name, m in sys.modules.items() if name.startswith("slicer.") and ours(m))
    assert strays == [], f"files of this repository were imported as part of Slicer's slicer package: {strays}"


def install_application():
    """``slicer.mrmlScene`` and ``slicer.modules.<name>.logic()`` as the application sets them up:
    one scene, an application logic, and the module logics registered with it."""
    import slicer

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


def put_module_on_path() -> None:
    """As Slicer does: the module's folder is on ``sys.path``."""
    if str(MODULE_DIR) not in sys.path:
        sys.path.insert(0, str(MODULE_DIR))
    if str(SCRIPTS_DIR) not in sys.path:  # the headless batch script (``import batch``)
        sys.path.insert(0, str(SCRIPTS_DIR))
