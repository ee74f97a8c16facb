"""The install planner (what is missing, what to install, what never to touch), panel defaults
and rules, and the headless batch's arguments and manifests."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from MedVolR1SlicerLib import install, params, segments
from MedVolR1SlicerLib.batchjobs import BatchError, anchor_path, check_outputs, jobs_from_args, parse_args, read_manifest, summary

REPO = Path(__file__).resolve().parents[2]

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    tomllib = None

EVERYTHING = {
    "torch": "2.5.1", "transformers": "5.1.0", "tokenizers": "0.22.1", "safetensors": "0.5.0", "peft": "0.17.0",
    "xgrammar": "0.1.25", "huggingface_hub": "0.35.0", "nibabel": "5.2.0", "Pillow": "10.0.0",
    "hydra-core": "1.3.2", "iopath": "0.1.10", "tqdm": "4.67.0", "numpy": "1.26.4", "scipy": "1.13.0",
    "sam2": "1.1.0", "medvolcore": "0.1.0", "SimpleITK": "2.4.0", "requests": "2.32.0",
}


def _without(*names, **changed):
    d = {k: v for k, v in EVERYTHING.items() if k not in names}
    d.update({k.replace("_", "-") if k == "hydra_core" else k: v for k, v in changed.items()})
    return d


def test_nothing_to_do_when_everything_is_installed():
    plan = install.plan_install(EVERYTHING, core_source=Path("/x/MedVolCore"))
    assert not plan.needed and plan.steps == [] and plan.missing == []


def test_a_fresh_slicer_gets_torch_first_then_pip_then_sam2():
    slicer_only = {k: EVERYTHING[k] for k in ("numpy", "scipy", "SimpleITK", "requests")}
    plan = install.plan_install(slicer_only, core_source=Path("/x/MedVolCore"), constraints_path="C.txt")
    assert [s.kind for s in plan.steps] == ["torch", "pip", "pip"]
    torch, pip, sam2 = plan.steps
    assert torch.requirement == ">=2.3,<2.13"  # see test_torch_is_asked_for_below_the_release_that_does_not_install_in_slicer
    # floors, never pins, for the ordinary packages; medvolcore from the bundled copy
    assert "transformers>=5.0" in pip.args and "xgrammar>=0.1.25" in pip.args and "/x/MedVolCore" in pip.args
    assert not any(a.startswith(("numpy", "scipy", "torch")) for a in pip.args)
    assert pip.args[-2:] == ["-c", "C.txt"]
    assert all(">=" in a for a in pip.args if a not in ("/x/MedVolCore", "-c", "C.txt"))
    # sam2: pinned, no deps (its metadata wants torchvision), no isolation, CUDA extension off
    assert sam2.args[:3] == ["--no-deps", "--no-build-isolation", "sam2==1.1.0"]
    assert sam2.env["SAM2_BUILD_CUDA"] == "0"
    # Slicer's own packages are pinned for every pip call
    assert "numpy==1.26.4" in plan.constraints and "scipy==1.13.0" in plan.constraints
    assert "simpleitk==2.4.0" in plan.constraints  # canonical names; pip matches them case-insensitively
    names = " ".join(plan.missing)
    for n in ("torch", "transformers", "sam2", "medvolcore"):
        assert n in names
    assert "numpy" not in names
    text = plan.message()
    assert "torch" in text and "Install them now?" in text


def test_installed_torch_is_never_replaced_by_pip():
    plan = install.plan_install(_without("transformers", "peft"), core_source=Path("/x/MedVolCore"))
    assert [s.kind for s in plan.steps] == ["pip"]
    assert "torch==2.5.1" in plan.constraints
    assert set(plan.steps[0].args[:2]) == {"transformers>=5.0", "peft>=0.17"}


def test_outdated_packages_are_upgraded_to_their_floor_but_shipped_ones_are_reported():
    plan = install.plan_install(_without(transformers="4.57.0", numpy="1.23.5"), core_source=Path("/x/MedVolCore"))
    assert "transformers>=5.0" in plan.steps[0].args
    assert not any("numpy" in a for s in plan.steps for a in s.args)
    assert "numpy==1.23.5" in plan.constraints  # pinned: pip may not "fix" it either
    assert any("numpy 1.23.5 comes with Slicer" in p for p in plan.problems)
    assert any(m.startswith("transformers (transformers>=5.0; found 4.57.0)") for m in plan.missing)


def test_old_torch_goes_through_pytorchutils_and_is_not_pinned():
    plan = install.plan_install(_without(torch="2.1.0"), core_source=Path("/x/MedVolCore"))
    assert [s.kind for s in plan.steps] == ["torch"]
    assert not any(c.startswith("torch==") for c in plan.constraints)


def test_missing_bundle_is_a_problem_not_a_guess():
    plan = install.plan_install(_without("medvolcore"), core_source=None)
    assert plan.steps == []
    assert any("medvolcore is not bundled" in p for p in plan.problems)


def test_sam2_with_another_version_is_replaced_with_the_pinned_one():
    plan = install.plan_install(_without(sam2="1.0"), core_source=Path("/x"))
    assert [s.args[2] for s in plan.steps] == ["sam2==1.1.0"]


def test_versions_compare_by_release_numbers():
    assert install.at_least("2.13.0+cpu", "2.3")
    assert install.at_least("0.1.25", "0.1.25")
    assert not install.at_least("0.1.9", "0.1.25")
    assert install.at_least("5.0.0rc1", "5.0") and not install.at_least("4.99", "5.0")
    assert install.version_tuple("1.10.post2") == (1, 10)


def test_bundled_core_is_found_in_a_source_checkout_and_in_a_built_extension(tmp_path):
    assert install.find_bundled_core() == REPO / "MedVolCore"
    mod = tmp_path / "MedVolR1Slicer"
    (mod / "MedVolR1SlicerLib" / "wheels").mkdir(parents=True)
    assert install.find_bundled_core(mod) is None
    wheel = mod / "MedVolR1SlicerLib" / "wheels" / "medvolcore-0.1.0-py3-none-any.whl"
    wheel.write_bytes(b"")
    assert install.find_bundled_core(mod) == wheel


def test_dependency_floors_equal_medvolcores_own():
    """The Slicer installer asks for what medvolcore declares (and nothing it does not)."""
    text = (REPO / "MedVolCore" / "pyproject.toml").read_text(encoding="utf-8")
    block = re.search(r"dependencies = \[(.*?)\]", text, re.S).group(1)
    core = dict(re.findall(r'"([A-Za-z0-9_.-]+)>=([0-9.]+)"', block))
    deps = install.load_dependencies()
    ours = {r.name: r.floor for r in deps.requirements if r.via in ("pip", "torch")}
    assert {install.canonical(k): v for k, v in core.items()} == {install.canonical(k): v for k, v in ours.items()}
    version = re.search(r'^version = "([^"]+)"', text, re.M).group(1)
    assert next(r.floor for r in deps.requirements if r.name == "medvolcore") == version


def test_current_plan_reads_this_python():
    plan = install.current_plan()
    # this test environment has the whole engine installed
    assert plan.steps == [] and plan.problems == [], plan.message()


def test_weights_download_command_and_progress():
    cmd = install.download_command("/opt/Slicer/bin/PythonSlicer", "qwen3-vl-4b")
    assert cmd == ["/opt/Slicer/bin/PythonSlicer", "-m", "medvolcore.cli", "models", "download", "qwen3-vl-4b"]
    assert install.download_progress("model.safetensors:  42%|████▏     | 3.4G/8.1G [01:02<01:30]") == 0.42
    assert install.download_progress("a  10%|█ | b  75%|███ |") == 0.75
    assert install.download_progress("Fetching 12 files") is None
    assert "models import qwen3-vl-4b" in install.import_hint("qwen3-vl-4b")


def test_the_download_command_is_a_real_medvol_command(tmp_path):
    import subprocess

    cmd = install.download_command(sys.executable, "tiny")[:-2] + ["--help"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "download" in r.stdout


# ---- parameters --------------------------------------------------------------------------

def test_defaults_agree_with_medvolcore():
    from medvolcore import models
    from medvolcore.resources import load_json

    assert params.DEFAULTS["preset"] == models.default_preset()
    assert set(params.PRESETS) == {p.name for p in models.list_presets()}
    windows = load_json("windows.json")
    assert params.DEFAULTS["window"] == windows["default"]
    assert set(params.WINDOWS) == set(windows["presets"])


def test_query_history_keeps_recent_unique_queries():
    h = params.QueryHistory(size=3)
    for q in ["the liver", "The  Liver ", "left kidney", "", "spleen", "bladder"]:
        h.add(q)
    assert h.items == ["bladder", "spleen", "left kidney"]
    again = params.QueryHistory.from_json(h.to_json(), size=3)
    assert again.items == h.items
    assert params.QueryHistory.from_json("{not json").items == []
    assert params.QueryHistory.from_json('{"a": 1}').items == []


def test_segment_names_and_uniqueness():
    assert segments.segment_name("  the organ that\nsecretes bile ") == "the organ that secretes bile"
    long = segments.segment_name("x " * 100)
    assert len(long) == segments.SEGMENT_NAME_MAX and long.endswith("…")
    assert segments.unique_name("liver", ["liver", "liver (2)"]) == "liver (3)"
    assert segments.unique_name("liver (2)", ["liver", "liver (2)"]) == "liver (3)"
    assert segments.unique_name("spleen", ["liver"]) == "spleen"


def test_panel_options_are_validated():
    o = params.options_from_panel("", device="cuda:1", window="40, 400")
    assert (o.preset, o.device, o.window) == ("qwen3-vl-4b", "cuda:1", [40.0, 400.0])
    assert params.options_from_panel("tiny", window="lung").window == "lung"
    with pytest.raises(ValueError, match="positive width"):
        params.parse_window("40,-5")
    with pytest.raises(ValueError, match="window must be one of"):
        params.parse_window("bright")
    with pytest.raises(ValueError, match="device"):
        params.options_from_panel("tiny", device="gpu")
    with pytest.raises(ValueError, match="http://host"):
        params.options_from_panel("tiny", worker="remote", remote_url="myserver")
    assert params.options_from_panel("tiny", worker="remote", remote_url="http://gpu:8765/").remote_url == "http://gpu:8765"


def test_progress_moves_forward_across_stages():
    values = [params.progress_text(s, f)[0] for s in ("load", "read", "ground", "propagate", "write") for f in (0, 0.5, 1)]
    assert values == sorted(values) and values[0] == 0 and values[-1] == 100
    assert params.progress_text("propagate", 0.5, "slice 3/30")[1] == "Propagating: slice 3/30"
    # the grounding moves the bar (most of a request on a CPU) and shows the worker's time left
    assert params.progress_text("ground", 0.1)[0] < params.progress_text("ground", 0.9)[0]
    assert params.progress_text("ground", 0.6, "decoding 31/256 tokens", eta_s=125.4)[1] == \
        "Finding the key slice: decoding 31/256 tokens (about 2:05 left)"


# ---- headless batch ----------------------------------------------------------------------

def test_batch_arguments():
    a = parse_args(["--input", "ct.nii.gz", "--query", "the liver", "--output", "liver.seg.nrrd", "--preset", "tiny"])
    (job,) = jobs_from_args(a)
    assert (job.query, job.output.name, job.as_labelmap) == ("the liver", "liver.seg.nrrd", False)
    with pytest.raises(SystemExit):
        parse_args(["--input", "ct.nii.gz"])
    with pytest.raises(SystemExit):
        parse_args(["--manifest", "m.csv", "--query", "x"])
    with pytest.raises(BatchError, match="must end in"):
        jobs_from_args(parse_args(["--input", "ct.nii.gz", "--query", "q", "--output", "out.png"]))


def test_manifests_csv_and_jsonl(tmp_path):
    csv_path = tmp_path / "jobs.csv"
    csv_path.write_text("input,query,output\ncts/a.nii.gz,the liver,out/a.nii.gz\n/abs/b.nrrd, the  spleen ,\n")
    jobs = read_manifest(csv_path, tmp_path / "o")
    assert jobs[0].input == tmp_path / "cts" / "a.nii.gz" and jobs[0].output == tmp_path / "out" / "a.nii.gz"
    assert jobs[0].as_labelmap
    assert jobs[1].query == "the spleen" and jobs[1].output == tmp_path / "o" / "b.row3.seg.nrrd"
    with pytest.raises(BatchError, match=r"jobs.csv:3: no 'output'"):
        read_manifest(csv_path)
    jl = tmp_path / "jobs.jsonl"
    jl.write_text(json.dumps({"input": "a.nii.gz", "query": "q", "output": "x.seg.nrrd"}) + "\n\n"
                  + json.dumps({"input": "b.nii.gz", "query": "q", "output": "x.seg.nrrd"}) + "\n")
    with pytest.raises(BatchError, match=r"row 1's output and row 3's output are the same file \(.*x\.seg\.nrrd\)"):
        read_manifest(jl)
    jl.write_text('{"input": "a.nii.gz"}\n')
    with pytest.raises(BatchError, match=r"jobs.jsonl:1: needs both"):
        read_manifest(jl)
    jl.write_text("[1, 2]\n")
    with pytest.raises(BatchError, match="JSON object"):
        read_manifest(jl)
    bad = tmp_path / "bad.csv"
    bad.write_text("volume,text\nx,y\n")
    with pytest.raises(BatchError, match="header"):
        read_manifest(bad)


def test_existing_outputs_are_refused_unless_overwrite(tmp_path):
    (tmp_path / "a.seg.nrrd").write_text("x")
    jobs = jobs_from_args(parse_args(["--input", "ct.nii.gz", "--query", "q", "--output", str(tmp_path / "a.seg.nrrd")]))
    with pytest.raises(BatchError, match="exists; pass --overwrite"):
        check_outputs(jobs, overwrite=False)
    check_outputs(jobs, overwrite=True)
    assert anchor_path(tmp_path, jobs[0]).name == "a.anchor.json"
    text, code = summary([(jobs[0], None), (jobs[0], "boom")])
    assert code == 1 and "1 of 2 done" in text and "boom" in text
    assert summary([(jobs[0], None)])[1] == 0


# ---- the minimum Slicer ----------------------------------------------------------------------

def test_an_old_slicer_gets_no_pip_steps_and_is_offered_the_remote_worker():
    """Slicer 5.8 ships Python 3.9, on which transformers 5 and sam2 1.1.0 do not install: the
    plan must not try (pip would fail half-way) and must offer the remote worker instead."""
    slicer_only = {k: EVERYTHING[k] for k in ("numpy", "scipy", "SimpleITK", "requests")}
    plan = install.plan_install(slicer_only, core_source=Path("/x/MedVolCore"), python_version=(3, 9, 10))
    assert plan.remote_only and plan.needed
    assert plan.steps == [] and plan.constraints == []
    text = plan.message()
    assert "Python 3.9" in text and "3D Slicer 5.10 or newer" in text
    assert "remote worker" in text and "medvol serve --http" in text
    assert "Install them now?" not in text
    # the first supported Python is planned as usual
    ok = install.plan_install(slicer_only, core_source=Path("/x/MedVolCore"), python_version=(3, 10, 0))
    assert not ok.remote_only and [s.kind for s in ok.steps] == ["torch", "pip", "pip"]
    assert install.plan_install(EVERYTHING, core_source=Path("/x"), python_version=(3, 12, 10)).needed is False


def test_the_floors_are_those_of_the_packages_and_said_everywhere():
    deps = install.load_dependencies()
    assert (deps.slicer_floor, deps.python_floor) == ("5.10", "3.10")
    core = (REPO / "MedVolCore" / "pyproject.toml").read_text(encoding="utf-8")
    assert re.search(r'^requires-python = ">=3\.10"', core, re.M)
    cmake = (REPO / "CMakeLists.txt").read_text(encoding="utf-8")
    description = re.search(r'set\(EXTENSION_DESCRIPTION "([^"]*)"\)', cmake).group(1)
    assert "Slicer 5.10" in description
    guide = (REPO / "docs" / "slicer.md").read_text(encoding="utf-8")
    section = guide.split("## Install", 1)[1].split("\n## ", 1)[0]
    assert "Slicer 5.10 or newer" in section and "5.8" in section  # says what happens on 5.8
    for page in (REPO / "README.md", REPO / "docs" / "slicer.md"):
        assert "Slicer 5.8 or newer" not in page.read_text(encoding="utf-8"), page
    for f in (REPO / "MedVolR1Slicer").rglob("*.py"):
        assert "5.8 or newer" not in f.read_text(encoding="utf-8"), f


# ---- batch inputs ----------------------------------------------------------------------------

def _dicom_bytes() -> bytes:
    return b"\0" * 128 + b"DICM" + b"\x02\x00\x00\x00UL\x04\x00" + b"\0" * 16


def test_batch_input_kinds(tmp_path):
    from MedVolR1SlicerLib.batchjobs import check_inputs, input_kind

    nii = tmp_path / "ct.nii.gz"
    nii.write_bytes(b"\x1f\x8b" + b"\0" * 200)
    assert input_kind(nii) == "file"
    series = tmp_path / "series"
    series.mkdir()
    (series / "DICOMDIR.txt").write_text("notes")
    for i in range(3):
        (series / f"IM{i}").write_bytes(_dicom_bytes())
    assert input_kind(series) == "dicom_folder"
    with pytest.raises(BatchError, match="single DICOM file; give the folder"):
        input_kind(series / "IM1")  # one slice is not the series
    empty = tmp_path / "pngs"
    empty.mkdir()
    (empty / "a.png").write_bytes(b"\x89PNG" + b"\0" * 200)
    with pytest.raises(BatchError, match="folder without DICOM files"):
        input_kind(empty)
    with pytest.raises(BatchError, match="does not exist"):
        input_kind(tmp_path / "nope.nii.gz")
    csv_path = tmp_path / "jobs.csv"
    csv_path.write_text("input,query,output\nct.nii.gz,the liver,a.seg.nrrd\nmissing.nii.gz,the liver,b.seg.nrrd\n")
    with pytest.raises(BatchError, match=r"missing.nii.gz \(row 3\) does not exist"):
        check_inputs(read_manifest(csv_path))


# ---- running a plan in Slicer 5.10 and 5.12 ----------------------------------------------------

class SlicerStandIns:
    """Recording stand-ins for the Slicer APIs :func:`install.run_plan` calls. Each function has
    the parameters of the real one (names, order, defaults), so a wrong keyword is a TypeError
    here as it is in Slicer; ``test_stand_in_signatures_are_slicers`` compares them with the
    source when ``SLICER_SOURCE_GIT`` / ``SLICER_PYTORCH_GIT`` name git directories of Slicer
    and of fepegar/SlicerPyTorch.

    * Slicer 5.10 ``slicer.util.pip_install(requirements)`` — Base/Python/slicer/util.py:3991@v5.10.0.
      ``PythonSlicer -m pip install *requirements`` (util.py:4024-4034) through
      ``_executePythonModule`` → ``launchConsoleProcess(commandLine, useStartupEnvironment=False)``
      (util.py:3986-3987), whose environment is then ``None``: the child inherits ``os.environ``
      (util.py:3905-3910). A non-zero exit raises ``CalledProcessError`` (``logProcessOutput``,
      util.py:3953-3954); no PythonSlicer, ``RuntimeError`` (util.py:3975-3976). No dialog.
    * Slicer 5.12 ``slicer.packaging.pip_install(requirements, constraints=None,
      no_deps_requirements=None, skip_packages=None, blocking=True, show_progress=True,
      requester=None, parent=None, logCallback=None, completedCallback=None)`` —
      Base/Python/slicer/packaging.py:528-539@v5.12.3. ``show_progress and blocking``: modal
      progress dialog, and on failure ``errorDisplay("Package installation failed.")`` *then*
      ``CalledProcessError(returnCode, "pip install")`` (packaging.py:678-682, 738-790);
      ``not show_progress and blocking``: busy cursor only, ``CalledProcessError`` from
      ``logProcessOutput`` (packaging.py:689-691, 720-735, 701-717). Arguments:
      ``["install", *requirements, "-c", constraints]`` (``_build_pip_args``, packaging.py:940-965);
      the child's environment as on 5.10 (``executePythonModule`` → ``launchConsoleProcess(...,
      useStartupEnvironment=False)``, util.py:4313-4315 and 4125-4130@v5.12.3).
    * Slicer 5.12 ``slicer.util.pip_install(requirements, **kwargs)`` — util.py:4326-4335@v5.12.3:
      ``slicer.packaging.pip_install`` with its defaults (progress dialog, error dialog).
    * PyTorch extension ``PyTorchUtilsLogic.installTorch(self, askConfirmation=False,
      forceComputationBackend=None, torchVersionRequirement=None, torchvisionVersionRequirement=None)``
      — PyTorchUtils/PyTorchUtils.py:194@e1c85cc (fepegar/SlicerPyTorch): ``ltt install
      torch<requirement> torchvision`` (``_getPipInstallArguments``, :235-243) through
      ``slicer.util._executePythonModule`` (:224), then ``import torch`` (:225); returns the
      module, or None when a confirmation was declined (:207-214).
    """

    def __init__(self, fail_pip_at=None, returncode=1, torch_error=None):
        self.fail_pip_at = fail_pip_at  # index of the pip call that fails (0 = first), or None
        self.returncode = returncode
        self.torch_error = torch_error
        self.pip_calls = []  # (pip argv after "-m pip", {env var: value at call time})
        self.torch_calls = []
        self.dialogs = []  # what Slicer itself would have shown
        self.cursor = []

    def _run_pip(self, argv):
        import os

        self.pip_calls.append((list(argv), {k: os.environ.get(k) for k in install.SAM2_ENV}))
        if self.fail_pip_at is not None and len(self.pip_calls) - 1 == self.fail_pip_at:
            return self.returncode
        return 0

    # -- Slicer 5.10 --
    def util_510(self):
        from subprocess import CalledProcessError

        def pip_install(requirements):
            if type(requirements) == str:
                args = ["install", *requirements.split()]
            elif type(requirements) == list:
                args = ["install", *requirements]
            else:
                raise ValueError("pip_install requirement input must be string or list")
            rc = self._run_pip(args)
            if rc != 0:
                raise CalledProcessError(rc, ["PythonSlicer", "-m", "pip", *args])

        return _namespace(pip_install=pip_install)

    # -- Slicer 5.12 --
    def packaging_512(self):
        from subprocess import CalledProcessError

        def pip_install(requirements, constraints=None, no_deps_requirements=None, skip_packages=None,
                        blocking=True, show_progress=True, requester=None, parent=None,
                        logCallback=None, completedCallback=None):
            assert no_deps_requirements is None and skip_packages is None, "not used by MedVol"
            args = ["install", *(requirements.split() if isinstance(requirements, str) else requirements)]
            if constraints is not None:
                args += ["-c", str(constraints)]
            if show_progress and blocking:
                self.dialogs.append("progress dialog")
                rc = self._run_pip(args)
                if rc != 0:
                    self.dialogs.append("Package installation failed.")
                    raise CalledProcessError(rc, "pip install")
            elif blocking:
                self.cursor.append("busy")
                rc = self._run_pip(args)
                if rc != 0:
                    raise CalledProcessError(rc, ["PythonSlicer", "-m", "pip", *args])
            else:
                raise AssertionError("MedVol never installs without blocking")
            return None

        return _namespace(pip_install=pip_install)

    def util_512(self):
        packaging = self.packaging_512()

        def pip_install(requirements, **kwargs):
            return packaging.pip_install(requirements, **kwargs)

        return _namespace(pip_install=pip_install)

    # -- the PyTorch extension --
    def torch_logic(self):
        outer = self

        class PyTorchUtilsLogic:
            def installTorch(self, askConfirmation=False, forceComputationBackend=None,
                             torchVersionRequirement=None, torchvisionVersionRequirement=None):
                outer.torch_calls.append(["install", "torch" + (torchVersionRequirement or ""),
                                          "torchvision" + (torchvisionVersionRequirement or "")])
                if outer.torch_error is not None:
                    raise outer.torch_error
                return _namespace(__version__="2.12.1+cu130")

        return PyTorchUtilsLogic()


def _namespace(**kw):
    import types

    return types.SimpleNamespace(**kw)


def _fresh_plan():
    slicer_only = {k: EVERYTHING[k] for k in ("numpy", "scipy", "SimpleITK", "requests")}
    return install.plan_install(slicer_only, core_source=Path("/x/MedVolCore"))


@pytest.fixture
def clean_sam2_env(monkeypatch):
    for k in install.SAM2_ENV:
        monkeypatch.delenv(k, raising=False)


def test_torch_is_asked_for_below_the_release_that_does_not_install_in_slicer():
    """torch 2.13 installed by the PyTorch extension does not import on Slicer 5.12.2
    (Slicer/light-the-torch#176): PyTorchUtils gets ``>=2.3,<2.13``, and the constraints of the
    pip steps after it say the same, so peft's ``torch>=1.13`` cannot pull 2.13 in."""
    deps = install.load_dependencies()
    torch = next(r for r in deps.requirements if r.name == "torch")
    assert (torch.floor, torch.below) == ("2.3", "2.13")
    assert "light-the-torch#176" in json.loads(install.DEPENDENCIES_JSON.read_text(encoding="utf-8"))["_comment"]
    plan = _fresh_plan()
    assert plan.steps[0].kind == "torch" and plan.steps[0].requirement == ">=2.3,<2.13"
    assert "torch>=2.3,<2.13" in plan.constraints
    assert any(m.startswith("torch (torch>=2.3,<2.13; not installed)") for m in plan.missing)
    # an installed torch at or above the bound is kept (and pinned), not replaced
    kept = install.plan_install(_without(torch="2.13.0+cpu"), core_source=Path("/x"))
    assert kept.steps == [] and not kept.needed
    assert "torch==2.13.0+cpu" in install.plan_install(_without("peft", torch="2.13.0+cpu"), core_source=Path("/x")).constraints


def test_a_below_bound_must_be_above_the_floor(tmp_path):
    d = json.loads(install.DEPENDENCIES_JSON.read_text(encoding="utf-8"))
    d["requirements"][0]["below"] = "2.3"
    bad = tmp_path / "deps.json"
    bad.write_text(json.dumps(d), encoding="utf-8")
    with pytest.raises(ValueError, match="'below' 2.3 must be above the floor"):
        install.load_dependencies(bad)


def test_slicer_510_runs_every_step_through_util_pip_install(tmp_path, clean_sam2_env):
    import os

    s = SlicerStandIns()
    plan = _fresh_plan()
    seen = []
    install.run_plan(plan, tmp_path / "c.txt", s.util_510(), packaging=None, torch_logic=s.torch_logic(),
                     progress=lambda i, n, text: seen.append((i, n, text.split(" ")[0])))
    assert s.torch_calls == [["install", "torch>=2.3,<2.13", "torchvision"]]
    (pip_args, pip_env), (sam2_args, sam2_env) = s.pip_calls
    c = str(tmp_path / "c.txt")
    assert pip_args[-2:] == ["-c", c] and "transformers>=5.0" in pip_args and "/x/MedVolCore" in pip_args
    assert sam2_args == ["install", "--no-deps", "--no-build-isolation", "sam2==1.1.0", "-c", c]
    assert sam2_env["SAM2_BUILD_CUDA"] == "0" and pip_env["SAM2_BUILD_CUDA"] is None
    assert "SAM2_BUILD_CUDA" not in os.environ  # restored after the call
    text = (tmp_path / "c.txt").read_text(encoding="utf-8")
    assert "numpy==1.26.4" in text.splitlines() and "torch>=2.3,<2.13" in text.splitlines()
    assert seen == [(1, 3, "PyTorch"), (2, 3, "pip"), (3, 3, "pip")]
    assert s.dialogs == []


def test_slicer_512_uses_packaging_without_its_dialogs(tmp_path, clean_sam2_env):
    s = SlicerStandIns()
    install.run_plan(_fresh_plan(), tmp_path / "c.txt", s.util_512(), packaging=s.packaging_512(),
                     torch_logic=s.torch_logic())
    c = str(tmp_path / "c.txt")
    (pip_args, _), (sam2_args, sam2_env) = s.pip_calls
    assert pip_args.count("-c") == 1 and pip_args[-2:] == ["-c", c]  # constraints= once, not twice
    assert sam2_args == ["install", "--no-deps", "--no-build-isolation", "sam2==1.1.0", "-c", c]
    assert sam2_env == {"SAM2_BUILD_CUDA": "0", "SAM2_BUILD_ALLOW_ERRORS": "1"}
    assert s.dialogs == [] and s.cursor == ["busy", "busy"]


@pytest.mark.parametrize("slicer", ["5.10", "5.12"])
def test_a_failing_pip_step_is_one_install_error_and_no_slicer_dialog(tmp_path, clean_sam2_env, slicer):
    import os

    s = SlicerStandIns(fail_pip_at=1, returncode=2)  # sam2's build fails
    packaging = s.packaging_512() if slicer == "5.12" else None
    util = s.util_512() if slicer == "5.12" else s.util_510()
    with pytest.raises(install.InstallError) as e:
        install.run_plan(_fresh_plan(), tmp_path / "c.txt", util, packaging=packaging, torch_logic=s.torch_logic())
    message = str(e.value)
    assert "\n" not in message and message.startswith("Installing sam2 failed (pip exited with code 2)")
    assert "Python Console" in message
    assert "--no-build-isolation" in e.value.detail
    assert s.dialogs == []  # the module's dialog is the only one
    assert "SAM2_BUILD_CUDA" not in os.environ  # restored on failure too


def test_on_512_util_pip_install_alone_would_show_two_dialogs_before_the_modules(tmp_path, clean_sam2_env):
    """Why run_plan must be given ``packaging`` on 5.12: ``slicer.util.pip_install`` there is
    ``slicer.packaging.pip_install`` with ``show_progress=True``."""
    s = SlicerStandIns(fail_pip_at=0)
    with pytest.raises(install.InstallError):
        install.run_plan(_fresh_plan(), tmp_path / "c.txt", s.util_512(), packaging=None, torch_logic=s.torch_logic())
    assert s.dialogs == ["progress dialog", "Package installation failed."]


def test_torch_failures_are_install_errors(tmp_path):
    from subprocess import CalledProcessError

    s = SlicerStandIns(torch_error=CalledProcessError(1, ["PythonSlicer", "-m", "light_the_torch"]))
    with pytest.raises(install.InstallError, match=r"^Installing PyTorch \(torch>=2.3,<2.13\) with the PyTorch "
                                                   r"extension failed \(light-the-torch exited with code 1\)"):
        install.run_plan(_fresh_plan(), tmp_path / "c.txt", s.util_510(), torch_logic=s.torch_logic())
    assert s.pip_calls == []  # nothing after a failed torch step
    s = SlicerStandIns(torch_error=ImportError("cannot import name '_VF' from partially initialized module 'torch'"))
    with pytest.raises(install.InstallError, match=r"failed \(ImportError: cannot import name '_VF'"):
        install.run_plan(_fresh_plan(), tmp_path / "c.txt", s.util_510(), torch_logic=s.torch_logic())

    class Declined:
        def installTorch(self, askConfirmation=False, forceComputationBackend=None,
                         torchVersionRequirement=None, torchvisionVersionRequirement=None):
            return None

    with pytest.raises(install.InstallError, match=r"PyTorch \(torch>=2.3,<2.13\) was not installed"):
        install.run_plan(_fresh_plan(), tmp_path / "c.txt", s.util_510(), torch_logic=Declined())


def test_an_unwritable_constraints_file_is_an_install_error_before_any_step(tmp_path):
    s = SlicerStandIns()
    with pytest.raises(install.InstallError, match="Could not write the constraints file"):
        install.run_plan(_fresh_plan(), tmp_path / "missing" / "c.txt", s.util_510(), torch_logic=s.torch_logic())
    assert s.torch_calls == [] and s.pip_calls == []


def test_without_the_pytorch_extension_the_error_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "PyTorchUtils", None)  # import PyTorchUtils → ImportError
    s = SlicerStandIns()
    with pytest.raises(install.InstallError, match="PyTorch extension is not installed"):
        install.run_plan(_fresh_plan(), tmp_path / "c.txt", s.util_510())


def test_slicer_packaging_is_none_outside_slicer_512(monkeypatch):
    import types

    monkeypatch.setitem(sys.modules, "slicer", types.ModuleType("slicer"))
    monkeypatch.setitem(sys.modules, "slicer.packaging", None)  # Slicer 5.10: no such module
    assert install.slicer_packaging() is None
    fake = types.ModuleType("slicer.packaging")
    fake.pip_install = lambda requirements, **kw: None
    monkeypatch.setitem(sys.modules, "slicer.packaging", fake)
    assert install.slicer_packaging() is fake


def _real_signature(git_dir, ref, path, qualname):
    """Parameters (name, default source or None) of ``qualname`` in ``path`` at ``ref``."""
    import ast
    import subprocess

    source = subprocess.run(["git", "--git-dir", git_dir, "show", f"{ref}:{path}"], capture_output=True,
                            text=True, check=True).stdout
    node = ast.parse(source)
    for part in qualname.split("."):
        node = next(n for n in ast.iter_child_nodes(node)
                    if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == part)
    a = node.args
    names = [p.arg for p in a.posonlyargs + a.args]
    defaults = [None] * (len(names) - len(a.defaults)) + [ast.unparse(d) for d in a.defaults]
    params = list(zip(names, defaults))
    params += [(p.arg, ast.unparse(d) if d is not None else None) for p, d in zip(a.kwonlyargs, a.kw_defaults)]
    if a.kwarg:
        params.append(("**" + a.kwarg.arg, None))
    return [p for p in params if p[0] != "self"]


def _stand_in_signature(fn):
    import inspect

    out = []
    for p in inspect.signature(fn).parameters.values():
        if p.kind is p.VAR_KEYWORD:
            out.append(("**" + p.name, None))
        else:
            out.append((p.name, None if p.default is p.empty else repr(p.default)))
    return out


@pytest.mark.skipif(not __import__("os").environ.get("SLICER_SOURCE_GIT"),
                    reason="set SLICER_SOURCE_GIT to a git directory of Slicer (tags v5.10.0, v5.12.3)")
def test_stand_in_signatures_are_slicers():
    import os

    git = os.environ["SLICER_SOURCE_GIT"]
    s = SlicerStandIns()
    assert _stand_in_signature(s.util_510().pip_install) == _real_signature(
        git, "v5.10.0", "Base/Python/slicer/util.py", "pip_install")
    assert _stand_in_signature(s.packaging_512().pip_install) == _real_signature(
        git, "v5.12.3", "Base/Python/slicer/packaging.py", "pip_install")
    assert _stand_in_signature(s.util_512().pip_install) == _real_signature(
        git, "v5.12.3", "Base/Python/slicer/util.py", "pip_install")


@pytest.mark.skipif(not __import__("os").environ.get("SLICER_PYTORCH_GIT"),
                    reason="set SLICER_PYTORCH_GIT to a git directory of fepegar/SlicerPyTorch")
def test_stand_in_signature_is_pytorchutils():
    import os

    real = _real_signature(os.environ["SLICER_PYTORCH_GIT"], os.environ.get("SLICER_PYTORCH_REF", "HEAD"),
                           "PyTorchUtils/PyTorchUtils.py", "PyTorchUtilsLogic.installTorch")
    assert _stand_in_signature(SlicerStandIns().torch_logic().installTorch) == real
