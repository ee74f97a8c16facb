"""``python -m medvolcore.cli_serve ARGS`` is ``medvol serve ARGS`` (how Slicer starts the worker)."""

import sys

from .cli.app import main_serve

if __name__ == "__main__":
    sys.exit(main_serve())
