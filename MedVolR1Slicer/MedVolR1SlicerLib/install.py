"""What is missing from Slicer's Python, and how to install it without breaking Slicer.

Nothing here installs anything: :func:`plan_install` turns "what is installed" into an
:class:`InstallPlan` (what is missing, the steps that fix it, the problems no step may fix),
which the widget shows in one dialog and runs only after the user agrees. Rules:

* ``>=`` floors, never pins (but ``sam2``, which MedSAM2's checkpoints are tied to);
* torch goes through the PyTorch extension (``PyTorchUtils``), which picks the CUDA or CPU
  build for the machine; no pip call may replace it. Its requirement may have an exclusive
  upper bound (``below`` in ``dependencies.json``) for a torch release known not to install in
  Slicer; the bound applies to what is installed, not to a torch that is already there;
* packages that Slicer ships (numpy, scipy, SimpleITK, …) are never installed, upgraded or
  replaced: every pip call gets a constraints file pinning them to the installed version, and a
  shipped package that is too old is reported, not "fixed";
* ``medvolcore`` comes from the copy the extension carries (a wheel next to this Lib, or the
  ``MedVolCore`` folder of a source checkout).

* the local worker needs **3D Slicer 5.10 or newer** (its Python, 3.12): transformers 5 and
  sam2 1.1.0 do not install on the Python 3.9 of Slicer 5.8 and older, so on those the plan
  installs nothing and offers the remote worker instead (:attr:`InstallPlan.remote_only`).

:func:`run_plan` runs a plan with the pip helper of the running Slicer (``slicer.packaging`` on
5.12 and newer, ``slicer.util.pip_install`` on 5.10) so that no Slicer dialog pops up: a failure
is one :class:`InstallError` for the module to show.

Weights are separate: :func:`download_command` runs ``medvol models download`` with progress and
:func:`import_hint` tells offline users how to import a folder instead; :func:`wait_for_process`
is the loop that waits for it without spinning, and :func:`download_outcome` says whether it
worked (a program that never started is not a success).
"""

from __future__ import annotations

import importlib
import json
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional, Sequence

LIB_DIR = Path(__file__).resolve().parent
MODULE_DIR = LIB_DIR.parent
DEPENDENCIES_JSON = MODULE_DIR / "Resources" / "dependencies.json"
SAM2_ENV = {"SAM2_BUILD_CUDA": "0", "SAM2_BUILD_ALLOW_ERRORS": "1"}


def canonical(name: str) -> str:
    """PEP 503 normalised distribution name (``Pillow`` → ``pillow``, ``hydra_core`` → ``hydra-core``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def version_tuple(version: str) -> tuple:
    """Release numbers of a version string: ``2.13.0+cpu`` → ``(2, 13, 0)``, ``1.0rc1`` → ``(1, 0)``."""
    parts = []
    for piece in str(version).split("+")[0].split("."):
        m = re.match(r"\d+", piece)
        if not m:
            break
        parts.append(int(m.group(0)))
        if m.end() != len(piece):  # a pre/post-release tag ends the release part
            break
    return tuple(parts)


def at_least(version: str, floor: str) -> bool:
    a, b = version_tuple(version), version_tuple(floor)
    n = max(len(a), len(b))
    return a + (0,) * (n - len(a)) >= b + (0,) * (n - len(b))


@dataclass
class Requirement:
    name: str
    via: str = "pip"  # pip | torch | sam2 | bundled
    floor: Optional[str] = None
    pin: Optional[str] = None
    below: Optional[str] = None  # exclusive upper bound of what is *installed* (see dependencies.json)

    def specifier(self) -> str:
        """The version part: ``==1.1.0``, ``>=2.3,<2.13``, ``>=5.0`` or ``""``."""
        if self.pin:
            return f"=={self.pin}"
        parts = ([f">={self.floor}"] if self.floor else []) + ([f"<{self.below}"] if self.below else [])
        return ",".join(parts)

    def spec(self) -> str:
        return self.name + self.specifier()

    def satisfied_by(self, version: Optional[str]) -> bool:
        """``below`` is not checked: it keeps a broken release from being installed, and a
        torch that is already there (and imports) is never replaced by the installer."""
        if version is None:
            return False
        if self.pin:
            return version_tuple(version) == version_tuple(self.pin)
        return self.floor is None or at_least(version, self.floor)


@dataclass
class Dependencies:
    requirements: List[Requirement]
    slicer_ships: List[str]
    python_floor: str = "3.10"  # the oldest Python the packages install on
    slicer_floor: str = "5.10"  # the oldest Slicer we support (the first with such a Python)


def load_dependencies(path: Path = DEPENDENCIES_JSON) -> Dependencies:
    d = json.loads(Path(path).read_text(encoding="utf-8"))
    if d.get("schema") != "medvol.slicer-deps/1":
        raise ValueError(f"{path}: schema is {d.get('schema')!r}, expected 'medvol.slicer-deps/1'")
    reqs = [Requirement(r["name"], r.get("via", "pip"), r.get("floor"), r.get("pin"), r.get("below"))
            for r in d["requirements"]]
    for r in reqs:
        if r.below is not None and (r.pin or (r.floor and at_least(r.floor, r.below))):
            raise ValueError(f"{path}: {r.name}: 'below' {r.below} must be above the floor and not used with a pin")
    return Dependencies(reqs, list(d.get("slicer_ships", [])), str(d["python_floor"]), str(d["slicer_floor"]))


def installed_versions(names: Sequence[str]) -> Dict[str, Optional[str]]:
    """Installed distribution versions in this Python (``None`` when absent). Imports nothing."""
    import importlib.metadata as md

    out = {}
    for n in names:
        try:
            out[n] = md.version(n)
        except md.PackageNotFoundError:
            out[n] = None
    return out


def find_bundled_core(module_dir: Path = MODULE_DIR) -> Optional[Path]:
    """The ``medvolcore`` the extension carries: a wheel in ``MedVolR1SlicerLib/wheels`` (built
    extension) or ``<repo>/MedVolCore`` (running from a source checkout); ``None`` if neither."""
    wheels = sorted((Path(module_dir) / "MedVolR1SlicerLib" / "wheels").glob("medvolcore-*.whl"))
    if wheels:
        return wheels[-1]
    src = Path(module_dir).parent / "MedVolCore"
    if (src / "pyproject.toml").is_file() and (src / "medvolcore" / "__init__.py").is_file():
        return src
    return None


@dataclass
class InstallStep:
    """``kind`` ``torch``: call PyTorchUtils with ``requirement``; ``pip``: run pip with ``args``
    (and ``env`` set) through ``slicer.util.pip_install``."""

    kind: str
    packages: List[str]
    args: List[str] = field(default_factory=list)
    env: Dict[str, str] = field(default_factory=dict)
    requirement: str = ""

    def describe(self) -> str:
        if self.kind == "torch":
            return f"PyTorch ({self.requirement}) through the PyTorch extension"
        return "pip install " + " ".join(self.args)


@dataclass
class InstallPlan:
    missing: List[str]  # "name (wanted; found …)" lines for the dialog
    steps: List[InstallStep]
    problems: List[str]  # what no step may fix (a shipped package too old, no bundled medvolcore)
    constraints: List[str]  # lines of the constraints file every pip step uses
    remote_only: bool = False  # this Slicer's Python is too old for a local worker: offer the remote one

    @property
    def needed(self) -> bool:
        return bool(self.steps or self.problems)

    def message(self) -> str:
        """The text of the one dialog that asks before installing."""
        lines = []
        if self.missing:
            lines.append("MedVol-R1 needs these Python packages in Slicer:")
            lines += [f"  • {m}" for m in self.missing]
        if self.steps:
            lines.append("")
            lines.append("Install them now? It takes a few minutes and downloads about 1–3 GB (PyTorch included); "
                         "Slicer's own packages are left as they are.")
        if self.remote_only:
            lines += self.problems
            lines.append("")
            lines.append("Use a remote worker instead? (Advanced → Worker: Remote, with the address of a machine running "
                         "`medvol serve --http`; nothing is installed in this Slicer for that.)")
        elif self.problems:
            lines.append("")
            lines.append("Cannot be fixed automatically:")
            lines += [f"  • {p}" for p in self.problems]
        return "\n".join(lines)


def plan_install(installed: Mapping[str, Optional[str]], deps: Optional[Dependencies] = None,
                 core_source: Optional[Path] = None, constraints_path: str = "{constraints}",
                 python_version: Optional[Sequence[int]] = None) -> InstallPlan:
    """The steps that bring ``installed`` (distribution name → version or None) up to ``deps``.

    ``constraints_path`` is the file name the pip steps pass to ``-c`` (the caller writes
    :attr:`InstallPlan.constraints` there). ``python_version`` (e.g. ``(3, 9, 10)``; default:
    this Python) below ``deps.python_floor`` gives a plan with no steps, one problem naming the
    Slicer version needed, and :attr:`InstallPlan.remote_only` set: pip would only fail there.
    """
    deps = deps or load_dependencies()
    py = tuple(int(v) for v in (python_version if python_version is not None else sys.version_info[:3]))
    if py < version_tuple(deps.python_floor):
        shown = ".".join(str(v) for v in py[:2])
        return InstallPlan(
            missing=[], steps=[], constraints=[], remote_only=True,
            problems=[f"This Slicer runs Python {shown}. Segmenting on this computer needs 3D Slicer "
                      f"{deps.slicer_floor} or newer (Python {deps.python_floor} or newer: transformers 5 and "
                      f"sam2 1.1.0 do not install on Python {shown}). Install a newer Slicer, or let a worker on "
                      f"another machine do the work."])
    have = {canonical(k): v for k, v in installed.items()}
    ships = {canonical(n) for n in deps.slicer_ships}
    missing, problems, pip_specs, constraints = [], [], [], []
    torch_step = sam2_step = None
    core_spec = None

    for req in deps.requirements:
        key = canonical(req.name)
        found = have.get(key)
        if req.satisfied_by(found):
            continue
        wanted = req.spec()
        missing.append(f"{req.name} ({wanted}; " + (f"found {found})" if found else "not installed)"))
        if key in ships:
            problems.append(f"{req.name} {found or '(missing)'} comes with Slicer and is older than MedVol needs "
                            f"({wanted}); MedVol does not replace Slicer's packages: use Slicer {deps.slicer_floor} or newer")
        elif req.via == "torch":
            torch_step = InstallStep("torch", [req.name], requirement=req.specifier())
        elif req.via == "sam2":
            sam2_step = InstallStep("pip", [req.name], ["--no-deps", "--no-build-isolation", wanted, "-c", constraints_path],
                                    env=dict(SAM2_ENV))
        elif req.via == "bundled":
            if core_source is None:
                problems.append(f"{req.name} is not bundled with this copy of the module; install it with "
                                f"`PythonSlicer -m pip install <MedVol repo>/MedVolCore`")
            else:
                core_spec = str(core_source)
        else:
            pip_specs.append(wanted)

    for name in sorted(ships | {"torch"}):
        version = have.get(name)
        if name == "torch" and torch_step is not None:
            if torch_step.requirement:  # what PyTorchUtils installs first; no later pip call may move it
                constraints.append(f"torch{torch_step.requirement}")
        elif version is not None:
            constraints.append(f"{name}=={version}")

    steps: List[InstallStep] = []
    if torch_step is not None:
        steps.append(torch_step)
    if pip_specs or core_spec:
        pkgs = pip_specs + ([core_spec] if core_spec else [])
        steps.append(InstallStep("pip", [p.split(">=")[0].split("==")[0] if p != core_spec else "medvolcore" for p in pkgs],
                                 pkgs + ["-c", constraints_path]))
    if sam2_step is not None:
        steps.append(sam2_step)  # last: its build imports torch
    return InstallPlan(missing, steps, problems, constraints)


def current_plan(core_source: Optional[Path] = None, deps: Optional[Dependencies] = None) -> InstallPlan:
    """:func:`plan_install` for the running Python, with the bundled medvolcore."""
    deps = deps or load_dependencies()
    names = sorted({r.name for r in deps.requirements} | set(deps.slicer_ships) | {"torch"})
    return plan_install(installed_versions(names), deps, core_source or find_bundled_core())


# ---- running a plan ------------------------------------------------------------------------

class InstallError(RuntimeError):
    """An install step failed. ``str(e)`` is one line for the user's dialog; ``detail`` (maybe
    empty) is what the dialog's *details* may show (the command and the original error)."""

    def __init__(self, message: str, detail: str = ""):
        super().__init__(message)
        self.detail = detail


def slicer_packaging():
    """``slicer.packaging`` where this Slicer has it (5.12 and newer), else ``None`` (5.10).

    Slicer does not import it at start-up (``slicer.util.pip_install`` imports it lazily), so it
    is imported here; only a module with ``pip_install`` counts."""
    try:
        packaging = importlib.import_module("slicer.packaging")
    except ImportError:
        return None
    return packaging if callable(getattr(packaging, "pip_install", None)) else None


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _without_constraints_option(args: Sequence[str]) -> List[str]:
    """``args`` less every ``-c FILE`` pair (``slicer.packaging.pip_install`` adds its own)."""
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a == "-c":
            skip = True
        else:
            out.append(a)
    return out


def run_plan(plan: InstallPlan, constraints_path, slicer_util, packaging=None, torch_logic=None,
             environ=None, progress: Optional[Callable[[int, int, str], None]] = None) -> None:
    """Run ``plan``'s steps in this Slicer; raise :class:`InstallError` on the first failure.

    * ``constraints_path``: where :attr:`InstallPlan.constraints` is written (every pip step
      uses it: Slicer's own packages are never upgraded or replaced);
    * ``slicer_util``: the ``slicer.util`` module; on Slicer 5.10 its
      ``pip_install(requirements)`` is the only pip helper, and it shows no dialog;
    * ``packaging``: ``slicer.packaging`` (Slicer 5.12 and newer; :func:`slicer_packaging`
      finds it). Its ``pip_install`` is called with ``blocking=True, show_progress=False`` (a
      busy cursor, no progress dialog and no error dialog of its own) and ``constraints=``, so
      the only error the user sees is the module's. ``slicer.util.pip_install`` on 5.12 is that
      function with its defaults, ``show_progress=True``: a modal progress dialog, then on
      failure an error dialog before the exception;
    * ``torch_logic``: a ``PyTorchUtils.PyTorchUtilsLogic()`` (default: made here when the
      plan has a torch step; a missing PyTorch extension is an :class:`InstallError`);
    * ``environ``: the environment the pip child inherits (default ``os.environ``): Slicer
      starts pip with ``useStartupEnvironment=False`` and no extra variables, i.e. with this
      process's environment, so a step's ``env`` (sam2's ``SAM2_BUILD_CUDA=0``) is set here
      for the call and restored after it;
    * ``progress(index, count, text)``: called before each step (index from 1), for a status line.

    sam2's step keeps its own arguments (``--no-deps --no-build-isolation sam2==1.1.0``) on
    both paths; on 5.12 its ``-c {constraints}`` becomes ``constraints=``.
    """
    environ = os.environ if environ is None else environ
    constraints_path = str(constraints_path)
    try:
        Path(constraints_path).write_text("\n".join(plan.constraints) + "\n", encoding="utf-8")
    except OSError as e:
        raise InstallError(f"Could not write the constraints file {constraints_path} ({_one_line(e)}).") from e
    count = len(plan.steps)
    for index, step in enumerate(plan.steps, 1):
        if progress is not None:
            progress(index, count, step.describe())
        if step.kind == "torch":
            torch_logic = _run_torch_step(step, torch_logic)
            continue
        args = [constraints_path if a == "{constraints}" else a for a in step.args]
        old = {k: environ.get(k) for k in step.env}
        environ.update(step.env)
        try:
            if packaging is not None:
                packaging.pip_install(_without_constraints_option(args), constraints=constraints_path,
                                      blocking=True, show_progress=False)
            else:
                slicer_util.pip_install(args)
        except Exception as e:  # noqa: BLE001 - CalledProcessError, RuntimeError, ValueError, OSError
            what = " ".join(step.packages)
            code = getattr(e, "returncode", None)
            why = f"pip exited with code {code}" if isinstance(code, int) else _one_line(e)
            raise InstallError(f"Installing {what} failed ({why}); pip's messages are in the Python console "
                               f"(View → Python Console).", "pip install " + " ".join(args) + "\n" + _one_line(e)) from e
        finally:
            for k, v in old.items():
                if v is None:
                    environ.pop(k, None)
                else:
                    environ[k] = v
    importlib.invalidate_caches()  # what pip just wrote must be visible to this process's imports


def _run_torch_step(step: InstallStep, torch_logic):
    if torch_logic is None:
        try:
            import PyTorchUtils  # the PyTorch extension (EXTENSION_DEPENDS)
        except ImportError as e:
            raise InstallError("The PyTorch extension is not installed: install it with the Extensions Manager, "
                               "restart Slicer and try again.", _one_line(e)) from e
        torch_logic = PyTorchUtils.PyTorchUtilsLogic()
    wanted = "torch" + step.requirement
    try:
        torch = torch_logic.installTorch(askConfirmation=False, torchVersionRequirement=step.requirement or None)
    except Exception as e:  # noqa: BLE001 - CalledProcessError from light-the-torch, ImportError of a broken torch
        code = getattr(e, "returncode", None)
        why = f"light-the-torch exited with code {code}" if isinstance(code, int) else _one_line(e)
        raise InstallError(f"Installing PyTorch ({wanted}) with the PyTorch extension failed ({why}); its messages "
                           f"are in the Python console.", _one_line(e)) from e
    if torch is None:
        raise InstallError(f"PyTorch ({wanted}) was not installed.")
    return torch_logic


# ---- weights ------------------------------------------------------------------------------

def download_command(python: str, preset: str) -> List[str]:
    """``medvol models download PRESET`` run with Slicer's Python (progress bars on stderr)."""
    return [str(python), "-m", "medvolcore.cli", "models", "download", preset]


_PERCENT = re.compile(r"(\d{1,3})%\|")


def download_progress(line: str) -> Optional[float]:
    """Fraction 0–1 from a progress-bar line of ``medvol models download``, or None."""
    m = None
    for m in _PERCENT.finditer(line):
        pass
    if m is None:
        return None
    return min(100, int(m.group(1))) / 100.0


def import_hint(preset: str) -> str:
    return (f"On a machine without internet: copy the weights folder there and run\n"
            f"  PythonSlicer -m medvolcore.cli models import {preset} /path/to/folder\n"
            f"(`PythonSlicer -m medvolcore.cli models import --help` shows the expected layout).")


def wait_for_process(proc, not_running, process_events: Callable[[], None], cancelled: Callable[[], bool],
                     step_ms: int = 200, kill_wait_ms: int = 5000) -> bool:
    """Wait for a ``QProcess`` (or anything with ``state()``, ``waitForFinished(ms)`` and
    ``kill()``) while keeping the GUI alive. Returns True when it ended, False when
    ``cancelled()`` turned true and it was killed.

    The loop tests the process *state*, not ``waitForFinished``'s return value: Qt returns
    false both on a time-out and when the process is already not running, so ``while not
    proc.waitForFinished(ms)`` never ends once the process has exited between two calls.
    ``not_running`` is ``qt.QProcess.NotRunning``.
    """
    while proc.state() != not_running:
        proc.waitForFinished(int(step_ms))
        process_events()
        if cancelled():
            if proc.state() != not_running:
                proc.kill()
                proc.waitForFinished(int(kill_wait_ms))
            return False
    return True


def qbytes_text(data) -> str:
    """Text of what ``QProcess.readAll()`` returned. PythonQt's ``QByteArray`` is not a buffer
    (``bytes(qba)`` raises); its ``data()`` gives the bytes. Plain bytes are accepted too."""
    raw = data.data() if hasattr(data, "data") else bytes(data)
    if isinstance(raw, str):
        return raw
    return bytes(raw).decode("utf-8", "replace")


def download_outcome(proc, qprocess, command: Sequence[str]):
    """``(ok, message)`` for a finished download ``QProcess`` (``qprocess`` is ``qt.QProcess``,
    for its enums; ``command`` the list it was started with).

    Exit status and code alone are not enough: a program that could not be started (missing,
    not executable) ends with ``error() == FailedToStart`` and ``exitStatus() == NormalExit``,
    and its ``exitCode()`` is whatever the platform left (0 where the start failed at once; 255
    measured on Linux with Qt 5.15 and 6.11). ``Timedout`` is *not* a failure: every
    ``waitForFinished(ms)`` that returns before the end sets it (the wait loop does that
    several times a second), and it stays set after a normal exit. A crash (or a kill) is
    ``exitStatus() == CrashExit``; then ``exitCode()`` is not valid (Qt's documentation).
    """
    shown = " ".join(str(c) for c in command)
    error = proc.error()
    if error == qprocess.FailedToStart:
        reason = proc.errorString() if hasattr(proc, "errorString") else ""
        return False, f"Could not start `{shown}`" + (f": {reason}" if reason else "") + "."
    if proc.exitStatus() == qprocess.CrashExit or error == qprocess.Crashed:
        return False, f"`{shown}` crashed."
    code = proc.exitCode()
    if code != 0:
        return False, f"`{shown}` failed (exit code {code})."
    return True, f"`{shown}` finished."
