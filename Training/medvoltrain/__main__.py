"""``python -m medvoltrain`` (what ``accelerate launch -m medvoltrain sft …`` runs)."""

import sys

from .cli import main

sys.exit(main())
