"""The Slicer module's files: packaging list, lazy imports, UI names, extension metadata.

Slicer cannot be installed here, so the module file is imported once with minimal stand-ins
for ``slicer``, ``qt`` and ``vtk`` (test-only; the product never uses them) to show that loading
it imports no heavy package."""

from __future__ import annotations

import ast
import json
import os
import py_compile
import re
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MODULE = REPO / "MedVolR1Slicer"
HEAVY = ("torch", "transformers", "sam2", "medvolcore", "nibabel", "peft", "xgrammar")


def _cmake_list(text: str, var: str) -> list:
    body = re.search(rf"set\({var}\s+(.*?)\)", text, re.S).group(1)
    return [line.strip().replace("${MODULE_NAME}", "MedVolR1Slicer") for line in body.splitlines() if line.strip()]


def test_cmake_lists_every_module_file_and_only_existing_ones():
    text = (MODULE / "CMakeLists.txt").read_text(encoding="utf-8")
    scripts = set(_cmake_list(text, "MODULE_PYTHON_SCRIPTS"))
    resources = set(_cmake_list(text, "MODULE_PYTHON_RESOURCES"))
    on_disk_py = {p.relative_to(MODULE).as_posix() for p in MODULE.rglob("*.py") if "__pycache__" not in p.parts}
    on_disk_res = {p.relative_to(MODULE).as_posix() for p in (MODULE / "Resources").rglob("*") if p.is_file()}
    assert scripts == on_disk_py
    assert resources == on_disk_res
    assert "WITH_GENERIC_TESTS" in text


def _imports_in(tree):
    """Every absolute import anywhere in ``tree``: the module and ``module.name`` for each name."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append(node.module)
            out += [f"{node.module}.{a.name}" for a in node.names]
    return out


def _imports(path: Path, top_level_only: bool):
    tree = ast.parse(path.read_text(encoding="utf-8"))
    if top_level_only:
        return [m for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom)) for m in _imports_in(node)]
    return _imports_in(tree)


PARTS = ("MedVolR1SlicerLib", "MedVolR1SlicerScene", "MedVolR1SlicerPanel")


def _module_name(path: Path) -> str:
    """The import name of a file of the module folder (``MedVolR1SlicerScene.logic``, ``batch``: a
    script of ``Scripts/`` is imported from there)."""
    rel = path.relative_to(MODULE if path.parent.name != "Scripts" else path.parent).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    return ".".join(parts)


def _part_imports(path: Path) -> set:
    """The module's own files that ``path`` imports anywhere in it (function-local imports count),
    relative imports resolved against its package."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    own = set()
    package = _module_name(path).rsplit(".", 1)[0] if path.parent != MODULE else ""
    if path.name == "__init__.py":
        package = _module_name(path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(x for x in (package, base) if x)
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            if name.split(".")[0] in PARTS + ("MedVolR1Slicer", "batch"):
                own.add(name)
    files = {_module_name(f) for f in MODULE.rglob("*.py") if "__pycache__" not in f.parts}
    return {n for n in own if n in files}


def _module_files():
    return sorted(f for f in MODULE.rglob("*.py") if "__pycache__" not in f.parts)


def test_every_imported_module_file_is_packaged():
    text = (MODULE / "CMakeLists.txt").read_text(encoding="utf-8")
    scripts = {s.replace("/__init__.py", "").replace("/", ".").removesuffix(".py")
               for s in _cmake_list(text, "MODULE_PYTHON_SCRIPTS")}
    used = set().union(*(_part_imports(f) for f in _module_files()))
    missing = used - scripts
    assert not missing, f"imported but not in CMakeLists.txt: {missing}"
    assert {f"MedVolR1SlicerLib.{n}" for n in ("geometry", "client", "session", "install", "params", "batchjobs",
                                               "segments")} <= used
    assert {"MedVolR1SlicerScene.logic", "MedVolR1SlicerPanel.panel", "MedVolR1SlicerPanel.selftest"} <= used


# Which of the module's parts may import which (function-local imports count). The Lib is plain
# Python; the Scene is MRML without Qt, so the logic runs headless and on slicer-core; the Panel is
# the only Qt part; the module file hosts; the batch script needs the logic, not the panel.
MAY_IMPORT = {
    "MedVolR1SlicerLib": {"MedVolR1SlicerLib"},
    "MedVolR1SlicerScene": {"MedVolR1SlicerLib", "MedVolR1SlicerScene"},
    "MedVolR1SlicerPanel": {"MedVolR1SlicerLib", "MedVolR1SlicerScene", "MedVolR1SlicerPanel"},
    "MedVolR1Slicer": {"MedVolR1SlicerLib", "MedVolR1SlicerScene", "MedVolR1SlicerPanel"},
    "batch": {"MedVolR1SlicerLib", "MedVolR1SlicerScene"},
}
QT_NAMES = ("qt", "ctk", "PythonQt", "PyQt5", "slicer.qMRMLWidget")


def test_the_parts_import_only_their_layers_and_no_circle():
    graph = {}
    for f in _module_files():
        name = _module_name(f)
        layer = name.split(".")[0]
        targets = {t for t in _part_imports(f) if t != name}
        wrong = sorted(t for t in targets if t.split(".")[0] not in MAY_IMPORT[layer])
        assert wrong == [], f"{name} ({layer}) imports {wrong}"
        graph[name] = {t for t in targets if t in {_module_name(g) for g in _module_files()}}
    # no circle: a depth-first search finds no back edge
    state = {}

    def visit(node, path):
        state[node] = "open"
        for nxt in graph.get(node, ()):
            if state.get(nxt) == "open":
                raise AssertionError("import circle: " + " -> ".join(path + [node, nxt]))
            if nxt not in state:
                visit(nxt, path + [node])
        state[node] = "done"

    for node in graph:
        if node not in state:
            visit(node, [])
    assert "MedVolR1SlicerScene.logic" in graph and graph["MedVolR1SlicerScene.logic"]


def test_the_scene_and_lib_never_import_qt():
    """The logic is MRML only: what it does runs headless (batch, console) and is tested on
    slicer-core without any Qt module."""
    for f in _module_files():
        name = _module_name(f)
        if name.split(".")[0] not in ("MedVolR1SlicerScene", "MedVolR1SlicerLib"):
            continue
        qt_like = [m for m in _imports(f, top_level_only=False) if m.split(".")[0] in QT_NAMES]
        assert qt_like == [], f"{name} imports {qt_like}"


def test_no_file_of_the_slicer_wing_is_over_600_lines():
    sizes = {f.relative_to(MODULE).as_posix(): len(f.read_text(encoding="utf-8").splitlines()) for f in _module_files()}
    assert sizes["MedVolR1Slicer.py"] <= 150, "the module file only hosts"
    big = {k: v for k, v in sizes.items() if v > 600}
    assert big == {}


@pytest.mark.parametrize("path", [f.relative_to(MODULE).as_posix() for f in _module_files()])
def test_module_files_compile_and_import_nothing_heavy_at_load(path):
    py_compile.compile(str(MODULE / path), doraise=True)
    heavy = [m for m in _imports(MODULE / path, top_level_only=True) if m.split(".")[0] in HEAVY]
    assert heavy == []


def test_lib_never_imports_the_engine_or_its_models():
    for f in (MODULE / "MedVolR1SlicerLib").glob("*.py"):
        heavy = [m for m in _imports(f, top_level_only=False) if m.split(".")[0] in HEAVY + ("slicer", "qt", "vtk", "ctk")]
        assert heavy == [], f"{f.name} imports {heavy}"


STANDINS = textwrap.dedent('''
    import sys, types

    def module(name, **attrs):
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        sys.modules[name] = m
        return m

    class _Base:
        def __init__(self, *a, **k):
            pass

    class _Node:
        pass

    slicer = module("slicer", vtkMRMLMarkupsROINode=type("vtkMRMLMarkupsROINode", (_Node,), {}),
                    vtkMRMLMarkupsFiducialNode=type("vtkMRMLMarkupsFiducialNode", (_Node,), {}),
                    vtkMRMLScalarVolumeNode=type("vtkMRMLScalarVolumeNode", (_Node,), {}),
                    vtkMRMLSegmentationNode=type("vtkMRMLSegmentationNode", (_Node,), {}))
    module("slicer.parameterNodeWrapper", parameterNodeWrapper=lambda cls: cls,
           WithinRange=type("WithinRange", (), {"__init__": lambda self, minimum, maximum: None}))
    module("slicer.ScriptedLoadableModule", **{n: type(n, (_Base,), {}) for n in (
        "ScriptedLoadableModule", "ScriptedLoadableModuleLogic", "ScriptedLoadableModuleTest",
        "ScriptedLoadableModuleWidget")})
    module("slicer.util", VTKObservationMixin=type("VTKObservationMixin", (), {}))
    module("qt")
    module("vtk", calldata_type=lambda t: (lambda f: f), VTK_OBJECT=0)
    sys.path.insert(0, sys.argv[1])
    import MedVolR1Slicer
    cls = MedVolR1Slicer.MedVolR1SlicerParameterNode
    from MedVolR1SlicerLib.params import DEFAULTS  # the worker is an application setting, not a parameter
    print("DEFAULTS", cls.preset, cls.device, cls.window, DEFAULTS["worker"])
    print("HEAVY", sorted(m for m in sys.modules if m.split(".")[0] in %r))
''' % (HEAVY,))


def test_loading_the_module_imports_no_heavy_package(tmp_path):
    script = tmp_path / "load.py"
    script.write_text(STANDINS)
    r = subprocess.run([sys.executable, str(script), str(MODULE)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "HEAVY []" in r.stdout
    assert "DEFAULTS qwen3-vl-4b auto soft_tissue local" in r.stdout


def test_the_parameter_nodes_default_preset_follows_models_json(tmp_path):
    """What a new panel selects: ``$MEDVOL_MODELS_JSON``'s default when it has one (see
    ``test_presets.py`` for the manifest itself)."""
    script = tmp_path / "load.py"
    script.write_text(STANDINS)
    override = tmp_path / "models.json"
    override.write_text(json.dumps({"default": "tiny", "presets": {}}), encoding="utf-8")
    env = dict(os.environ, MEDVOL_MODELS_JSON=str(override))
    r = subprocess.run([sys.executable, str(script), str(MODULE)], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    assert "DEFAULTS tiny auto soft_tissue local" in r.stdout


def test_the_model_manifest_is_installed_where_the_lib_looks_for_it():
    """``Resources/models.json`` is not in the module's folder, so not in MODULE_PYTHON_RESOURCES:
    its own rule copies it into the module's ``Resources/`` in the build tree and at install."""
    from MedVolR1SlicerLib import presets

    text = (MODULE / "CMakeLists.txt").read_text(encoding="utf-8")
    source = re.search(r"set\(MODELS_MANIFEST \$\{CMAKE_SOURCE_DIR\}/(\S+)\)", text).group(1)
    assert REPO / source == presets.manifest_candidates(MODULE, environ={})[0]  # the checkout's
    installed = presets.manifest_candidates(MODULE, environ={})[-1].relative_to(MODULE).as_posix()
    assert installed == "Resources/models.json"
    assert re.search(r"configure_file\(\$\{MODELS_MANIFEST\} \$\{CMAKE_BINARY_DIR\}/\$\{Slicer_QTSCRIPTEDMODULES_LIB_DIR\}/"
                     + re.escape(installed) + r" COPYONLY\)", text)
    rule = re.search(r"install\(\s*FILES \$\{MODELS_MANIFEST\}\s+DESTINATION (\S+)\s+COMPONENT RuntimeLibraries\s*\)", text)
    assert rule and rule.group(1) == "${Slicer_INSTALL_QTSCRIPTEDMODULES_LIB_DIR}/Resources"


def test_the_module_imports_of_medvolcore_only_its_resources_in_the_self_test():
    """Slicer loads the module before medvolcore is installed; the self-test, run by hand once the
    packages are there, reads the sample CT through ``medvolcore.resources``."""
    def core(tree):
        return [m for m in _imports_in(tree) if m.split(".")[0] == "medvolcore"]

    users = {f.relative_to(MODULE).as_posix(): core(ast.parse(f.read_text(encoding="utf-8")))
             for f in _module_files()}
    assert {k: v for k, v in users.items() if v} == {
        "MedVolR1SlicerPanel/selftest.py": ["medvolcore.resources", "medvolcore.resources.resource_path"]}
    tree = ast.parse((MODULE / "MedVolR1SlicerPanel" / "selftest.py").read_text(encoding="utf-8"))
    self_test = next(n for n in ast.walk(_class(tree, "MedVolR1SlicerTest"))
                     if isinstance(n, ast.FunctionDef) and n.name == "test_segment_edit_repropagate")
    assert core(tree) == core(self_test)


def test_ui_has_every_widget_the_module_uses_and_parameter_names_exist():
    ui = ET.parse(MODULE / "Resources" / "UI" / "MedVolR1Slicer.ui").getroot()
    names = {w.get("name") for w in ui.iter("widget")}
    source = "\n".join(f.read_text(encoding="utf-8") for f in _module_files())
    used = set(re.findall(r"\bui\.(\w+)", source))
    assert used and used <= names, f"missing in the .ui: {used - names}"
    tree = ast.parse((MODULE / "MedVolR1SlicerScene" / "parameters.py").read_text(encoding="utf-8"))
    pnode = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "MedVolR1SlicerParameterNode")
    fields = {s.target.id for s in pnode.body if isinstance(s, ast.AnnAssign)}
    assert {"inputVolume", "query", "preset", "device", "outputSegmentation", "boxes", "keySlice", "reasoning"} <= fields
    bound = {p.findtext("string") for p in ui.iter("property") if p.get("name") == "SlicerParameterName"}
    assert bound and bound <= fields


def test_extension_metadata():
    text = (REPO / "CMakeLists.txt").read_text(encoding="utf-8")
    meta = dict(re.findall(r'set\((EXTENSION_\w+)\s+"([^"]*)"\)', text))
    assert meta["EXTENSION_CATEGORY"] == "Segmentation"
    assert "PyTorch" in meta["EXTENSION_DEPENDS"].split()
    for key in ("EXTENSION_HOMEPAGE", "EXTENSION_CONTRIBUTORS", "EXTENSION_DESCRIPTION"):
        assert meta[key].strip()
    for key in ("EXTENSION_ICONURL", "EXTENSION_SCREENSHOTURLS"):
        rel = meta[key].split("/main/", 1)[1]
        assert (REPO / rel).is_file(), f"{key} points at {rel}, which is not in the repository"
    assert "add_subdirectory(MedVolR1Slicer)" in text


# ---- checks of the source for what no wheel can run here (Slicer 5.8, Qt, PythonQt) ---------

def _calls(tree, owner=None):
    """``(dotted callee, call node)`` for every call in ``tree`` (``a.b.c(...)`` → ``"a.b.c"``)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            parts, f = [], node.func
            while isinstance(f, ast.Attribute):
                parts.append(f.attr)
                f = f.value
            if isinstance(f, ast.Name):
                parts.append(f.id)
            out.append((".".join(reversed(parts)), node))
    return out


def _class(tree, name):
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)


def test_logic_and_batch_do_io_through_storage_nodes_not_the_qt_io_manager():
    """``slicer.util.exportNode(node, path)`` keeps the first call's file format in its shared
    default dict (see Testing/slicer_mrml), and the load/save helpers need Slicer's Qt I/O
    manager: the logic and the batch script use MRML storage nodes and module logics instead."""
    qt_io = {"exportNode", "saveNode", "loadVolume", "loadLabelVolume", "loadNodeFromFile", "loadSegmentation"}
    scene = [ast.parse(f.read_text(encoding="utf-8")) for f in sorted((MODULE / "MedVolR1SlicerScene").glob("*.py"))]
    batch = ast.parse((MODULE / "Scripts" / "batch.py").read_text(encoding="utf-8"))
    for tree in scene + [batch]:
        used = {name.split(".")[-1] for name, _ in _calls(tree)}
        assert not used & qt_io, used & qt_io
    names = {name for name, _ in _calls(batch)}
    assert "AddArchetypeVolume" in names and "slicer.modules.volumes.logic" in names
    assert "DICOMUtils.loadSeriesByUID" in names and "DICOMUtils.TemporaryDICOMDatabase" in names


def test_widget_connects_its_gui_only_through_the_binding_and_checks_the_right_radio_button():
    panel = MODULE / "MedVolR1SlicerPanel"
    calls = [c for f in sorted(panel.glob("*.py")) for c in _calls(ast.parse(f.read_text(encoding="utf-8")))]
    assert not [n for n, _ in calls if n.endswith((".connectGui", ".disconnectGui"))]
    assert any(n == "self._guiBinding.bind" for n, _ in calls) and any(n == "self._guiBinding.unbind" for n, _ in calls)
    for name, call in calls:
        if name.endswith(".setChecked"):
            # in an exclusive radio pair only checking a button does anything
            assert isinstance(call.args[0], ast.Constant) and call.args[0].value is True, ast.unparse(call)


def test_weights_download_waits_on_the_process_state_and_reads_qbytearray_data():
    source = (MODULE / "MedVolR1SlicerPanel" / "install_dialogs.py").read_text(encoding="utf-8")
    widget = ast.parse(source)
    names = {n for n, _ in _calls(widget)}
    assert "install.wait_for_process" in names and "install.qbytes_text" in names
    assert "bytes(proc.readAll())" not in source
    for node in ast.walk(widget):
        if isinstance(node, ast.While):
            assert "waitForFinished" not in ast.unparse(node.test)


def test_widget_offers_the_remote_worker_on_an_old_slicer():
    dialogs = ast.parse((MODULE / "MedVolR1SlicerPanel" / "install_dialogs.py").read_text(encoding="utf-8"))
    method = next(n for n in dialogs.body if isinstance(n, ast.FunctionDef) and n.name == "ensure_installed")
    text = ast.unparse(method)
    assert "plan.remote_only" in text and "useRemote()" in text
    panel = ast.unparse(ast.parse((MODULE / "MedVolR1SlicerPanel" / "panel.py").read_text(encoding="utf-8")))
    assert "ensure_installed(self.logic, options, self.ui, self._useRemoteWorker)" in panel
    settings = ast.unparse(ast.parse((MODULE / "MedVolR1SlicerPanel" / "worker_settings.py").read_text(encoding="utf-8")))
    assert "self.ui.workerRemoteRadioButton.setChecked(True)" in settings
    # the remote check comes before anything that would run pip
    assert text.index("plan.remote_only") < text.index("runInstallPlan")


def test_module_files_load_on_the_python_of_an_old_slicer():
    """Slicer loads every module at start-up, 5.8 (Python 3.9) included: the files must parse
    there and evaluate no ``X | Y`` annotation, so that the panel can say the Slicer is too old
    (instead of a start-up traceback)."""
    for f in _module_files():
        source = f.read_text(encoding="utf-8")
        tree = ast.parse(source, filename=str(f), feature_version=(3, 9))
        if "from __future__ import annotations" in source:
            continue
        for node in ast.walk(tree):
            ann = getattr(node, "annotation", None) or getattr(node, "returns", None)
            if ann is not None:
                assert not any(isinstance(n, ast.BinOp) for n in ast.walk(ann)), f"{f.name}: {ast.unparse(ann)}"
