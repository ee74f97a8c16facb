"""Build hook: ship the repository's ``Resources/`` inside the wheel as ``medvolcore/_resources``.

Editable installs read ``Resources/`` from the checkout instead (see ``medvolcore.resources``).
"""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
REPO_RESOURCES = HERE.parent / "Resources"


class BuildWithResources(build_py):
    def run(self):
        super().run()
        if REPO_RESOURCES.is_dir() and not self.editable_mode:
            target = Path(self.build_lib) / "medvolcore" / "_resources"
            if target.exists():
                shutil.rmtree(target)
            shutil.copytree(REPO_RESOURCES, target, ignore=shutil.ignore_patterns("*.png", "*.svg"))


setup(cmdclass={"build_py": BuildWithResources})
