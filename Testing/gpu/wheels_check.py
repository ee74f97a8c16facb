"""``Testing/gpu/wheels.sh --check``: every import ``device.sh`` needs is covered by the wheels in the
folder or by the GPU machine's own packages, and every wheel's dependencies are too (versions where
the machine's are known). One line per problem; exit 1 when there is one, 0 otherwise.

    python Testing/gpu/wheels_check.py WHEELS_DIR PY_VERSION "name=version name=? ..."
"""

from __future__ import annotations

import re
import sys
import zipfile
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.version import Version

# the distributions device.sh imports, directly or through the project's packages
NEEDED = ("torch", "transformers", "peft", "accelerate", "safetensors", "tokenizers", "numpy", "scipy", "pillow",
          "tqdm", "pyyaml", "huggingface-hub", "sam2", "hydra-core", "omegaconf", "antlr4-python3-runtime",
          "iopath", "portalocker", "nibabel", "xgrammar", "trl", "datasets", "medvolcore", "medvoltrain")


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def wheels(folder: Path) -> dict:
    """{name: (version, [Requires-Dist])} of the wheels in ``folder``."""
    out = {}
    for whl in sorted(folder.glob("*.whl")):
        with zipfile.ZipFile(whl) as z:
            meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
            text = z.read(meta).decode("utf-8", "replace")
        head = text.split("\n\n", 1)[0]
        fields = [ln.split(": ", 1) for ln in head.splitlines() if ": " in ln]
        name = norm(next(v for k, v in fields if k == "Name"))
        if name in out:
            raise SystemExit(f"wheels check: two wheels of {name} in {folder}: keep one")
        out[name] = (next(v for k, v in fields if k == "Version"), [v for k, v in fields if k == "Requires-Dist"])
    return out


def main(argv) -> int:
    folder, pyver, machine_text = Path(argv[0]), argv[1], argv[2]
    if not folder.is_dir() or not any(folder.glob("*.whl")):
        print(f"wheels check: no wheels in {folder}: run bash Testing/gpu/wheels.sh first")
        return 1
    machine = {norm(k): (None if v == "?" else v) for k, v in (w.split("=", 1) for w in machine_text.split())}
    have = wheels(folder)
    env = dict(default_environment(), python_version=pyver, python_full_version=pyver + ".0",
               platform_system="Linux", platform_machine="x86_64", sys_platform="linux", extra="")
    problems = []
    for name in NEEDED:
        if norm(name) not in have and norm(name) not in machine:
            problems.append(f"{name}: imported by device.sh, neither a wheel nor on the machine")
    for name in have:
        if name in machine:
            problems.append(f"{name}: a wheel and on the machine: keep one (the wheel would shadow the machine's)")
    for name, (version, reqs) in have.items():
        for line in reqs:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate(env):
                continue
            dep = norm(req.name)
            if dep in have:
                found, where = have[dep][0], "wheel"
            elif dep in machine:
                found, where = machine[dep], "machine"
            else:
                if dep == "torchvision" and name == "sam2":
                    continue  # declared by sam2, never imported by its video predictor
                problems.append(f"{name} {version} needs {req}: neither a wheel nor on the machine")
                continue
            if found and req.specifier and not req.specifier.contains(Version(found), prereleases=True):
                problems.append(f"{name} {version} needs {req}; the {where} has {found}")
    for p in problems:
        print(f"wheels check: {p}")
    print(f"wheels check: {len(have)} wheels, {len(NEEDED)} needed imports, {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
