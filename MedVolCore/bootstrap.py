#!/usr/bin/env python3
"""Create ``.venv`` at the repository root and install everything MedVol needs into it.

    python3 MedVolCore/bootstrap.py [--torch auto|cpu|cuda|keep] [--no-dev] [--no-training]
                                    [--no-slicer-core] [--no-pyqt] [--no-dicom-tools] [--no-nginx]
                                    [--no-browser]
                                    [--venv PATH]

Steps, each skipped when already satisfied, so running it again is cheap:

1. create the virtual environment;
2. install PyTorch. ``auto`` picks ``cuda`` when ``nvidia-smi`` finds a GPU, else ``cpu``.
   ``cpu`` never pulls CUDA wheels: it uses a CPU build offered to pip (for example the local
   ``torch==2.13.0+cpu`` wheel on our CI machines) and otherwise PyTorch's CPU index;
3. install ``medvolcore`` (editable, with the SimpleITK and test extras);
4. install ``sam2==1.1.0`` the way docs/architecture.md says: ``SAM2_BUILD_CUDA=0``, ``--no-deps``,
   ``--no-build-isolation`` (its metadata asks for torchvision, which we do not need);
5. install ``medvoltrain`` (editable, from ``Training/``: TRL, PEFT, accelerate, datasets,
   TensorBoard) unless ``--no-training`` is given; where an NVIDIA GPU is present, also try its
   ``deepspeed`` extra (multi-GPU ZeRO-2, and the GPU check's ``zero2`` step); a failure there is
   a warning, not an error, since single-GPU work does not need it;
6. install ``slicer-core`` (3D Slicer's non-Qt libraries as a wheel: MRML scene, volume,
   segmentation and markups nodes, storage nodes, module logics; it brings its own ``vtk``) so
   ``Testing/slicer_mrml`` runs the Slicer module's logic against real MRML, unless
   ``--no-slicer-core`` is given. It is for the tests only: inside Slicer these libraries are
   Slicer's own;
7. install ``PyQt5`` 5.15 (Qt 5.15, the series Slicer 5.10 and 5.12 are built on) so
   ``Testing/slicer_qt`` runs the module's panel in real Qt (offscreen, no display needed), unless
   ``--no-pyqt`` or ``--no-slicer-core`` is given (that tier needs both). Also for the tests only:
   inside Slicer, Qt comes through PythonQt;
8. install Debian's ``dicom3tools`` (``dciodvfy``) and ``dcmtk`` (``dcmdump``), which the DICOM
   conformance tests use to check the DICOM-SEGs written independently of highdicom, and ``orthanc``
   with ``orthanc-dicomweb`` (the DICOMweb server the PACS tests run on loopback), unless
   ``--no-dicom-tools`` is given: with ``apt-get`` as root only, and a failure is a warning (those
   checks then skip and say why);
9. install Debian's ``nginx`` (the reverse proxy of ``Resources/deploy/nginx/medvol.conf``, which
   ``Testing/core/test_deploy_nginx.py`` runs in front of two workers on loopback), unless
   ``--no-nginx`` is given; the same rule (root, a warning). On a machine running systemd, Debian
   starts its default site on port 80 once installed; the tests never use it (they run their own
   nginx with a private prefix on free loopback ports), and ``systemctl disable --now nginx``
   stops it;
10. install the web viewer's parts: the ``monailabel`` wheel without its dependencies (MONAI
   Label's Python client, which the contract tests speak, and the prebuilt OHIF viewer inside it,
   which ``medvol serve --monailabel`` serves; none of MONAI Label's server is used), and, unless
   ``--no-browser`` is given, ``playwright`` from PyPI (its driver only: no browser is downloaded)
   and Debian's ``chromium`` (the same rule as above: root, a warning), which the browser test
   drives.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TORCH_CPU_VERSION = "2.13.0"
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
SAM2_SPEC = "sam2==1.1.0"
# sam2's runtime needs (its own metadata also names torchvision, which we skip).
SAM2_RUNTIME = ["hydra-core>=1.3.2", "iopath>=0.1.10", "pillow>=9.0", "tqdm>=4.66"]
# Slicer's core libraries for the real-MRML test tier. PyPI has no wheel of Slicer 5.10 itself
# (the module's minimum); 5.11 onwards keep the MRML and module-logic APIs the module uses.
SLICER_CORE_SPEC = "slicer-core>=5.11,<6"
# Qt for the Qt test tier: the 5.15 series, as Slicer 5.10 and 5.12 build on Qt 5.15.
PYQT_SPEC = "PyQt5>=5.15,<5.16"
# MONAI Label's wheel, installed without its dependencies: its Python client and its prebuilt OHIF viewer
MONAILABEL_SPEC = "monailabel==0.8.5"
# the browser test's driver of Debian's Chromium (playwright's own browser download is never run)
PLAYWRIGHT_SPEC = "playwright>=1.45"


def log(msg: str) -> None:
    print(f"[bootstrap] {msg}", flush=True)


def run(cmd, env=None) -> None:
    log(" ".join(str(c) for c in cmd))
    subprocess.run([str(c) for c in cmd], check=True, env=env)


def venv_python(venv: Path) -> Path:
    return venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def has_module(py: Path, name: str) -> str | None:
    """Version of ``name`` installed in the venv, or None."""
    code = (
        "import importlib.metadata as m, sys\n"
        f"try: print(m.version({name!r}))\n"
        "except m.PackageNotFoundError: sys.exit(1)\n"
    )
    r = subprocess.run([str(py), "-c", code], capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 else None


def gpu_present() -> bool:
    if not shutil.which("nvidia-smi"):
        return False
    return subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0


def offered_torch_version(py: Path, spec: str) -> str | None:
    """The torch version pip would install for ``spec`` (dry run, no download of deps)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        r = subprocess.run(
            [str(py), "-m", "pip", "install", "--dry-run", "--no-deps", "--quiet",
             "--report", str(report), spec],
            capture_output=True, text=True,
        )
        if r.returncode != 0 or not report.exists():
            return None
        items = json.loads(report.read_text()).get("install", [])
        return items[0]["metadata"]["version"] if items else None


def install_torch(py: Path, mode: str) -> None:
    current = has_module(py, "torch")
    if mode == "auto":
        if current:
            log(f"torch {current} already installed")
            return
        mode = "cuda" if gpu_present() else "cpu"
    if mode == "keep":
        if not current:
            raise SystemExit("[bootstrap] --torch keep: no torch is installed in the virtual environment")
        log(f"torch {current} kept")
        return
    is_cpu_build = bool(current) and ("+cpu" in current or platform.system() != "Linux")
    if current and (mode == "cpu") == is_cpu_build:
        log(f"torch {current} already installed ({mode})")
        return
    pip = [py, "-m", "pip", "install"]
    if mode == "cuda":
        run(pip + ["torch>=2.5"])
        return
    # CPU: prefer a CPU build pip is offered directly (a local wheel or a mirror).
    spec = f"torch=={TORCH_CPU_VERSION}"
    offered = offered_torch_version(py, spec)
    if offered and "+cpu" in offered:
        run(pip + [spec])
    elif platform.system() != "Linux":
        run(pip + ["torch>=2.5"])  # macOS and Windows wheels on PyPI are CPU builds
    else:
        log("no local CPU build of torch offered; using PyTorch's CPU index")
        run(pip + ["torch>=2.5", "--index-url", TORCH_CPU_INDEX])


DICOM_TOOLS = {"dciodvfy": "dicom3tools", "dcmdump": "dcmtk", "Orthanc": "orthanc"}
# Orthanc's DICOMweb plugin, where Debian's orthanc-dicomweb puts it (the PACS tests' server)
ORTHANC_DICOMWEB = Path("/usr/share/orthanc/plugins/libOrthancDicomWeb.so")


def install_dicom_tools() -> None:
    """Debian's dicom3tools and dcmtk (the conformance tests' validators), and Orthanc with its
    DICOMweb plugin (the PACS tests' server), where apt-get can install them (root); never fatal."""
    missing = sorted({pkg for tool, pkg in DICOM_TOOLS.items() if shutil.which(tool) is None})
    if not ORTHANC_DICOMWEB.exists():
        missing.append("orthanc-dicomweb")
    if not missing:
        log("dciodvfy, dcmdump and Orthanc with its DICOMweb plugin already installed")
        return
    apt_install(missing, "the DICOM conformance tests' validator checks and the PACS tests against Orthanc skip "
                         "when theirs is missing")


def install_nginx() -> None:
    """Debian's nginx (the deployment test's reverse proxy), where apt-get can install it (root);
    never fatal. ``nginx`` itself: Debian's ``nginx-light`` is only ``nginx`` with an extra module."""
    if shutil.which("nginx") or os.access("/usr/sbin/nginx", os.X_OK):
        log("nginx already installed")
        return
    if apt_install(["nginx"], "the nginx deployment test skips"):
        log("nginx installed; where systemd runs, Debian started its default site on port 80 (the tests do not use "
            "it; `systemctl disable --now nginx` stops it)")


def install_web_viewer(py: Path, browser: bool) -> None:
    """The monailabel wheel without its dependencies (client and OHIF viewer); with ``browser``,
    Playwright and Debian's Chromium for the browser test (a failure there is a warning)."""
    if has_module(py, "monailabel") != MONAILABEL_SPEC.split("==")[1]:
        run([py, "-m", "pip", "install", "--quiet", "--no-deps", MONAILABEL_SPEC])
    else:
        log(f"{MONAILABEL_SPEC} already installed")
    if not browser:
        return
    if not has_module(py, "playwright"):
        run([py, "-m", "pip", "install", "--quiet", PLAYWRIGHT_SPEC])
    if Path("/usr/bin/chromium").exists():
        log("chromium already installed")
    else:
        apt_install(["chromium"], "the browser test of the web viewer skips")


def apt_install(packages: list, skipped: str) -> bool:
    """``apt-get install`` ``packages`` as root; a failure is a warning that ends with ``skipped``.
    True when all were installed."""
    if shutil.which("apt-get") is None or not hasattr(os, "geteuid") or os.geteuid() != 0:
        log(f"warning: {', '.join(packages)} not installed (needs apt-get as root); {skipped}")
        return False
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install = ["apt-get", "install", "-y", "--no-install-recommends"] + packages
    r = subprocess.run(install, env=env)
    if r.returncode != 0:  # a new machine has no package lists yet: read them, then try once more
        subprocess.run(["apt-get", "update"], env=env)
        r = subprocess.run(install, env=env)
    if r.returncode != 0 and len(packages) > 1:  # one package that cannot be installed keeps no other out
        failed = [pkg for pkg in packages if subprocess.run(install[:4] + [pkg], env=env).returncode != 0]
    else:
        failed = packages if r.returncode != 0 else []
    if failed:
        log(f"warning: apt-get could not install {', '.join(failed)}; {skipped}")
    return not failed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--venv", default=str(REPO / ".venv"), help="virtual environment folder (default: .venv)")
    ap.add_argument("--torch", choices=["auto", "cpu", "cuda", "keep"], default="auto",
                    help="which PyTorch build to install (default: auto)")
    ap.add_argument("--no-dev", action="store_true", help="skip the test tools (pytest, psutil, hypothesis)")
    ap.add_argument("--no-training", action="store_true",
                    help="skip the training package (medvoltrain: TRL, accelerate, datasets, TensorBoard)")
    ap.add_argument("--no-slicer-core", action="store_true",
                    help="skip slicer-core (3D Slicer's MRML libraries, about 190 MB; only Testing/slicer_mrml "
                         "and Testing/slicer_qt need it; implies --no-pyqt)")
    ap.add_argument("--no-pyqt", action="store_true",
                    help="skip PyQt5 5.15 (with its Qt 5.15 libraries, about 200 MB; only Testing/slicer_qt needs it)")
    ap.add_argument("--no-dicom-tools", action="store_true",
                    help="skip Debian's dicom3tools, dcmtk, orthanc and orthanc-dicomweb (the DICOM conformance "
                         "tests' validators, the PACS tests' server)")
    ap.add_argument("--no-nginx", action="store_true",
                    help="skip Debian's nginx (the reverse proxy the deployment test runs in front of two workers)")
    ap.add_argument("--no-browser", action="store_true",
                    help="skip Debian's chromium and Playwright (only the browser test of the web viewer needs them)")
    args = ap.parse_args(argv)

    venv = Path(args.venv)
    py = venv_python(venv)
    if not py.exists():
        run([sys.executable, "-m", "venv", venv])
    run([py, "-m", "pip", "install", "--quiet", "--upgrade", "pip>=23.1", "setuptools>=64", "wheel"])
    install_torch(py, args.torch)

    extras = "itk,dicom,pacs,http,mcp" if args.no_dev else "itk,dicom,pacs,http,mcp,dev"
    run([py, "-m", "pip", "install", "--quiet", "-e", f"{REPO / 'MedVolCore'}[{extras}]"] + SAM2_RUNTIME)

    if has_module(py, "sam2") != SAM2_SPEC.split("==")[1]:
        env = dict(os.environ, SAM2_BUILD_CUDA="0", SAM2_BUILD_ALLOW_ERRORS="1")
        run([py, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", SAM2_SPEC], env=env)
    else:
        log(f"{SAM2_SPEC} already installed")

    training = REPO / "Training"
    if not args.no_training and (training / "pyproject.toml").exists():
        run([py, "-m", "pip", "install", "--quiet", "-e", str(training)])
        if gpu_present() and not has_module(py, "deepspeed"):
            # DS_BUILD_OPS=0: no CUDA extension is compiled at install time (they are built on first use)
            env = dict(os.environ, DS_BUILD_OPS="0")
            r = subprocess.run([str(py), "-m", "pip", "install", "--quiet", "-e", f"{training}[deepspeed]"], env=env)
            if r.returncode != 0:
                log("warning: could not install deepspeed (only multi-GPU ZeRO-2 needs it); "
                    "retry with: pip install 'medvoltrain[deepspeed]'")

    if not args.no_slicer_core:
        if sys.version_info < (3, 10):
            log("slicer-core needs Python 3.10 or newer; skipped (Testing/slicer_mrml will be skipped)")
        elif has_module(py, "slicer-core"):
            log(f"slicer-core {has_module(py, 'slicer-core')} already installed")
        else:
            run([py, "-m", "pip", "install", "--quiet", SLICER_CORE_SPEC])

    pyqt = not (args.no_pyqt or args.no_slicer_core)
    if pyqt:
        installed = has_module(py, "PyQt5")
        if installed and installed.startswith("5.15."):
            log(f"PyQt5 {installed} already installed")
        else:
            run([py, "-m", "pip", "install", "--quiet", PYQT_SPEC])

    if not args.no_dicom_tools:
        install_dicom_tools()
    if not args.no_nginx:
        install_nginx()
    install_web_viewer(py, browser=not args.no_browser)

    # Smoke check: the engine imports and sam2 builds its config without torchvision.
    run([py, "-c", "import medvolcore, sam2.build_sam; print('medvolcore', medvolcore.__version__, 'ready')"])
    if not args.no_slicer_core and has_module(py, "slicer-core"):
        run([py, "-c", "import slicer; slicer.vtkMRMLScene(); print('slicer-core MRML ready')"])
    if pyqt:
        run([py, "-c", "from PyQt5.QtCore import QT_VERSION_STR; print('Qt', QT_VERSION_STR, 'ready')"])
    log(f"done. Activate with: source {venv}/bin/activate   (or run {py} directly)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
