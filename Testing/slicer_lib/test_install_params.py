"""The install planner (what is missing, what to install, what never to touch), panel defaults
and rules, and the headless batch's arguments and manifests."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from MedVolR1SlicerLib import install, params
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
    assert torch.requirement == ">=2.3"
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
    cmd = install.download_command("/opt/Slicer/bin/PythonSlicer", "medvol-r1")
    assert cmd == ["/opt/Slicer/bin/PythonSlicer", "-m", "medvolcore.cli", "models", "download", "medvol-r1"]
    assert install.download_progress("model.safetensors:  42%|████▏     | 3.4G/8.1G [01:02<01:30]") == 0.42
    assert install.download_progress("a  10%|█ | b  75%|███ |") == 0.75
    assert install.download_progress("Fetching 12 files") is None
    assert "models import medvol-r1" in install.import_hint("medvol-r1")


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
    assert params.segment_name("  the organ that\nsecretes bile ") == "the organ that secretes bile"
    long = params.segment_name("x " * 100)
    assert len(long) == params.SEGMENT_NAME_MAX and long.endswith("…")
    assert params.unique_name("liver", ["liver", "liver (2)"]) == "liver (3)"
    assert params.unique_name("liver (2)", ["liver", "liver (2)"]) == "liver (3)"
    assert params.unique_name("spleen", ["liver"]) == "spleen"


def test_panel_options_are_validated():
    o = params.options_from_panel("", device="cuda:1", window="40, 400")
    assert (o.preset, o.device, o.window) == ("medvol-r1", "cuda:1", [40.0, 400.0])
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
    with pytest.raises(BatchError, match="same output"):
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
