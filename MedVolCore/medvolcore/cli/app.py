"""The ``medvol`` command line: the parser, and ``main`` that turns every failure into one line.

Every command has ``--help``. Errors are one line on stderr and a non-zero exit code
(``--debug`` shows the traceback); with ``--json`` the error is also a JSON object on stdout
(``{"ok": false, "error": {"code", "message", "exit_code"}}``). Python warnings of the libraries
(transformers, torch, …) say nothing a user can act on: they are silenced unless ``--debug``.
Text printed for people goes through :func:`~.common.terminal_safe`, so user text (queries, file
names, case ids) cannot drive the terminal. Long work shows a progress bar on stderr; ``--json``
prints a machine-readable result on stdout. The commands live in one module per group
(:mod:`.steps`, :mod:`.volume`, :mod:`.batch`, :mod:`.models`, :mod:`.serve`, :mod:`.mcp`, :mod:`.pacs`), each of which imports only
:mod:`.common` (and :mod:`.pacs`, the DICOMweb options) of this package; heavy libraries are imported
by the command that needs them.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import warnings
from typing import List, Optional

from .. import RESEARCH_USE_NOTICE, __version__
from ..errors import MedVolError
from .batch import add_batch_command
from .common import PROG, terminal_safe
from .mcp import add_mcp_command
from .models import add_models_command
from .pacs import add_pacs_command
from .serve import add_serve_command
from .steps import add_metrics_command, add_step_commands
from .volume import add_volume_commands

__all__ = ["PROG", "Terminated", "build_parser", "main", "main_command"]


class Terminated(KeyboardInterrupt):
    """SIGTERM (a cluster's time limit, ``kill``): unwinds like Ctrl-C, so temporary files go."""


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage dump)."""

    def error(self, message):  # noqa: D401
        self.exit(2, terminal_safe(f"{self.prog}: error: {message} (see {self.prog} --help)", one_line=True) + "\n")


class _OneLineWarnings(logging.Handler):
    def emit(self, record):
        sys.stderr.write(terminal_safe(f"{PROG}: warning: {record.getMessage()}", one_line=True) + "\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description=f"MedVol engine: CT → evidence anchor → MedSAM2 3-D mask. "
                                       f"{RESEARCH_USE_NOTICE}",
                epilog="No trained MedVol-R1 adapter is published: the shipped default preset (qwen3-vl-4b) is "
                       "Qwen3-VL-4B-Instruct answering zero-shot, not trained for this task, and often wrong; every "
                       "output says which model made it. Preset medvol-r1 needs an adapter made with medvol-train "
                       "(Training/README.md). " + RESEARCH_USE_NOTICE)
    p.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    def add(name, help_, func):
        sp = sub.add_parser(name, help=help_, description=help_)
        sp.set_defaults(func=func)
        sp.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
        sp.add_argument("--debug", action="store_true", help="show tracebacks")
        return sp

    add_step_commands(add)
    add_volume_commands(add)
    add_models_command(sub, add)
    add_serve_command(sub, add)
    add_mcp_command(sub, add)
    add_batch_command(sub, add)
    add_pacs_command(sub, add)
    add_metrics_command(add)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return 2
    logger = logging.getLogger("medvolcore")
    if not any(isinstance(h, _OneLineWarnings) for h in logger.handlers):
        logger.addHandler(_OneLineWarnings(level=logging.WARNING))
    logger.propagate = False
    previous = _on_sigterm_unwind()
    quiet = warnings.catch_warnings()
    quiet.__enter__()
    if not args.debug:  # libraries' warnings (deprecations, past_key_values, …) mean nothing to a user
        warnings.filterwarnings("ignore")
        warnings.filterwarnings("default", module=r"medvolcore(\.|$)")
        # a library's deprecation is attributed to its caller, often a medvolcore module: silenced all the same
        for category in (FutureWarning, DeprecationWarning, PendingDeprecationWarning):
            warnings.filterwarnings("ignore", category=category)
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        if "transformers" in sys.modules:
            sys.modules["transformers"].logging.set_verbosity_error()
    try:
        return int(args.func(args) or 0)
    except MedVolError as e:
        if args.debug:
            raise
        _json_error(args, e.code, str(e), e.exit_code)
        details = getattr(e, "details", None) or []
        if len(details) > 1:  # several problems found at once (a batch manifest): one line each, then the count
            for line in details:
                sys.stderr.write(terminal_safe(f"{PROG} {args.command}: {line}", one_line=True) + "\n")
        text = e.summary if len(details) > 1 and getattr(e, "summary", None) else e
        sys.stderr.write(terminal_safe(f"{PROG} {args.command}: error: {text}", one_line=True) + "\n")
        return e.exit_code
    except KeyboardInterrupt as e:
        hint = getattr(args, "interrupt_hint", "")
        how = "terminated" if isinstance(e, Terminated) else "interrupted"
        sys.stderr.write(f"{PROG} {args.command}: {how}" + (f"; {hint}" if hint else "") + "\n")
        return 143 if isinstance(e, Terminated) else 130
    except Exception as e:  # an unexpected failure: still one line, with a hint
        if args.debug:
            raise
        _json_error(args, "internal_error", f"{type(e).__name__}: {e}", 1)
        sys.stderr.write(terminal_safe(f"{PROG} {args.command}: internal error: {type(e).__name__}: {e} "
                                       "(rerun with --debug for details)", one_line=True) + "\n")
        return 1
    finally:
        quiet.__exit__(None, None, None)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _json_error(args, code: str, message: str, exit_code: int) -> None:
    """With ``--json``, the error as the JSON object a script reads on stdout (the line on stderr stays)."""
    if getattr(args, "json", False):
        sys.stdout.write(json.dumps({"ok": False, "command": args.command,
                                     "error": {"code": code, "message": message, "exit_code": exit_code}}) + "\n")


def main_command(command: str, argv: Optional[List[str]] = None) -> int:
    """``medvol COMMAND ARGV…`` in process (``argv`` None: ``sys.argv[1:]``); returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    return main([command] + [str(a) for a in argv])


def main_batch(argv: Optional[List[str]] = None) -> int:
    """``medvol batch ARGV…`` in process; returns the exit code (errors: one line on stderr)."""
    return main_command("batch", argv)


def main_serve(argv: Optional[List[str]] = None) -> int:
    """``medvol serve ARGV…`` (``python -m medvolcore.cli_serve ARGS``, how Slicer starts the worker)."""
    return main_command("serve", argv)


def _on_sigterm_unwind():
    """Make SIGTERM raise :class:`Terminated` in the main thread (so ``finally`` blocks run and
    temporary outputs are removed, as for Ctrl-C); returns the previous handler, or None."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def _term(signum, frame):
        raise Terminated()

    return signal.signal(signal.SIGTERM, _term)
