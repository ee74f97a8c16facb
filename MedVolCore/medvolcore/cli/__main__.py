"""``python -m medvolcore.cli ARGS`` is ``medvol ARGS``."""

import sys

from .app import main

sys.exit(main())
