"""``python -m medvolcore.cli_batch ARGS`` is ``medvol batch ARGS``; :func:`main_batch` runs it in process."""

import sys

from .cli.app import main_batch

__all__ = ["main_batch"]

if __name__ == "__main__":
    sys.exit(main_batch())
