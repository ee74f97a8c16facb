"""``medvol models``: list presets, download or import their weights, print their paths.

:func:`~medvolcore.cli.app.build_parser` wires it in with ``add_models_command(sub, add)``. Every action accepts
``--json`` and ``--debug`` after its own arguments as well as before the action name.
"""

from __future__ import annotations

import argparse

from ..errors import InputError
from .common import emit

ACTIONS = "list, download NAME, import NAME FOLDER, path NAME"


def _gpu_text(row) -> str:
    g = row.get("gpu_memory_gb")
    if g is None:
        return "?"
    return f"~{g:g} GB" + (" (est.)" if "estimat" in (row.get("gpu_memory_note") or "") else "")


def cmd_list(args) -> int:
    from .. import models

    rows = models.list_status()
    header = ("NAME", "STATUS", "GPU MEMORY", "SMOKE", "LICENCE (GROUNDER / MEDSAM2)", "DESCRIPTION")
    table = [(r["name"] + (" *" if r["default"] else ""), r["status"], _gpu_text(r), "yes" if r["smoke"] else "no",
              f"{r.get('grounder_licence') or '?'} / {r.get('medsam2_licence') or '?'}", r["description"])
             for r in rows]
    widths = [max(len(str(x[i])) for x in [header] + table) for i in range(5)]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(row[:5], widths)) + "  " + row[5] for row in [header] + table]
    lines.append(f"* default preset. Weights folder: {models.medvol_home() / 'models'}. "
                 "GPU memory figures are estimates, not measurements. Licences are the model cards' own; "
                 "check each card before use (`--json` gives their addresses).")
    emit({"home": str(models.medvol_home()), "presets": rows}, args.json, "\n".join(lines))
    return 0


def cmd_download(args) -> int:
    from .. import models

    res = models.download(args.name, progress=not args.no_progress)
    built = models.get_preset(args.name).grounder_kind == "builder"
    emit(res, args.json, _paths_text(res, f"{args.name}: built locally, nothing to download" if built
                                      else f"downloaded {args.name} (sha256 checked)"))
    return 0


def cmd_import(args) -> int:
    from .. import models

    res = models.import_weights(args.name, args.folder, link=args.link, progress=not args.no_progress)
    how = "registered in place (--link: keep the folder where it is)" if args.link else "copied"
    emit(res, args.json, _paths_text(res, f"imported {args.name} from {args.folder}, {how}"))
    return 0


def cmd_path(args) -> int:
    from .. import models

    res = models.path(args.name, adapter=args.adapter)
    emit(res, args.json, _paths_text(res, None))
    return 0


def _paths_text(res: dict, title) -> str:
    lines = [title] if title else []
    lines.append(f"grounder: {res['grounder']}")
    if res.get("adapter"):
        lines.append(f"adapter:  {res['adapter']}")
    if res.get("medsam2"):
        lines.append(f"medsam2:  {res['medsam2']}")
    elif res.get("medsam2_random"):
        seed, size = res["medsam2_random"]
        lines.append(f"medsam2:  random weights (seed {seed}, image size {size})")
    if res.get("smoke"):
        lines.append("smoke-test model: results made with it are meaningless")
    return "\n".join(lines)


def _dispatch(args) -> int:
    func = getattr(args, "models_func", None)
    if func is None:
        raise InputError(f"give an action: medvol models {{{ACTIONS}}} (see medvol models --help)")
    return func(args)


def add_models_command(sub, add) -> argparse.ArgumentParser:
    """Add ``medvol models {list,download,import,path}`` to :func:`~.app.build_parser`'s subparsers.

    ``add(name, help, func)`` is :func:`~.app.build_parser`'s helper (it adds --json/--debug). The action parsers
    add --json/--debug with ``default=SUPPRESS`` so a flag given before the action survives,
    and record the action in ``models_func`` (``func`` stays the dispatcher).
    """
    sp = add("models", "List model presets, download or import their weights, print their paths.", _dispatch)
    actions = sp.add_subparsers(dest="models_action", metavar="ACTION", parser_class=type(sp))

    def action(name, help_, func):
        a = actions.add_parser(name, help=help_, description=help_)
        a.set_defaults(models_func=func)
        a.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                       help="print the result as JSON on stdout")
        a.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
        return a

    action("list", "Every preset: present or missing, estimated GPU memory, smoke-test flag, the weights' licences.",
           cmd_list)

    a = action("download", "Download a preset's weights from the Hugging Face Hub (resumable; sha256-checked).",
               cmd_download)
    a.add_argument("name", metavar="NAME", help="preset name (see `medvol models list`)")
    a.add_argument("--no-progress", action="store_true", help="no progress bars")

    from ..models import import_layout

    a = action("import", "Register weights copied by hand (machines without internet). Layout: "
               + import_layout() + " (for medvol-r1; other presets use their own repo name).", cmd_import)
    a.add_argument("name", metavar="NAME", help="preset name (see `medvol models list`)")
    a.add_argument("folder", metavar="FOLDER", help="folder holding the weights (layout above)")
    a.add_argument("--link", action="store_true",
                   help="register the files where they are instead of copying them (they must stay there)")
    a.add_argument("--no-progress", action="store_true", help="no progress bars")

    a = action("path", "Print the local paths of a preset's weights (builds the tiny preset if needed).", cmd_path)
    a.add_argument("name", metavar="NAME", help="preset name (see `medvol models list`)")
    a.add_argument("--adapter", metavar="PATH", help="LoRA adapter folder overriding the preset's (checked)")
    return sp
