"""The ``medvol`` command line (entry point :func:`main`).

- :mod:`.app` — the parser and :func:`main` (one-line errors, exit codes, SIGTERM);
- :mod:`.common` — what every command shares (``--json`` output, shared options);
- :mod:`.steps` — the pipeline's steps one at a time: ``info``, ``anchor``, ``propagate``, ``metrics``;
- :mod:`.volume` — the main job on one volume: ``segment``, ``demo``;
- :mod:`.batch`, :mod:`.models`, :mod:`.serve` — ``medvol batch``, ``models``, ``serve``.

``python -m medvolcore.cli ARGS`` is ``medvol ARGS``.
"""

from .app import PROG, Terminated, build_parser, main, main_batch, main_command, main_serve

__all__ = ["PROG", "Terminated", "build_parser", "main", "main_batch", "main_command", "main_serve"]
