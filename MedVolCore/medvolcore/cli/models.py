"""``medvol models``: list presets, download or import their weights, print their paths.

:func:`~medvolcore.cli.app.build_parser` wires it in with ``add_models_command(sub, add)``. Every action accepts
``--json`` and ``--debug`` after its own arguments as well as before the action name.
"""

from __future__ import annotations

import argparse

from .. import RESEARCH_USE_NOTICE
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
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(header[:5], widths)) + "  " + header[5]]
    for row, r in zip(table, rows):
        lines.append("  ".join(str(c).ljust(w) for c, w in zip(row[:5], widths)) + "  " + row[5])
        lines.append(f"    runs as: {r['identity']['label']}")
        if r.get("revisions"):
            lines.append("    revision: " + "; ".join(_revision_text(v) for v in r["revisions"].values()))
    lines.append(f"* default preset. Weights folder: {models.medvol_home() / 'models'}. "
                 "GPU memory figures are estimates, not measurements. Licences are the model cards' own; "
                 "check each card before use (`--json` gives their addresses).")
    lines.append(f"No trained MedVol-R1 adapter is published: the Qwen3-VL presets answer zero-shot and are often "
                 f"wrong; make an adapter with medvol-train (Training/README.md). {RESEARCH_USE_NOTICE}")
    emit({"home": str(models.medvol_home()), "presets": rows}, args.json, "\n".join(lines))
    return 0


def _revision_text(v: dict) -> str:
    """``Qwen/Qwen3-VL-4B-Instruct@ebb281ec70b0 (downloaded)`` and the like, for ``models list``."""
    rev, pinned, state = v.get("revision"), v.get("pinned"), v.get("state")
    short = (lambda r: r[:12] if r and len(r) == 40 else r)
    if state == "registered":
        if pinned and rev != pinned:
            how = f"downloaded; the table pins {short(pinned)}"
        else:
            how = "downloaded, pinned" if pinned else "resolved at download, unpinned in the table"
        return f"{v['repo_id']}@{short(rev)} ({how})"
    if state == "unknown":
        return f"{v['repo_id']}@? (imported by hand: commit not known)"
    if state == "pinned":
        return f"{v['repo_id']}@{short(rev)} (pinned, not downloaded)"
    return f"{v['repo_id']} (unpinned: main branch at download; pass --revision)"


def cmd_download(args) -> int:
    from .. import models

    res = models.download(args.name, progress=not args.no_progress, revision=args.revision)
    p = models.get_preset(args.name)
    if p.grounder_kind == "builder":
        title = f"{args.name}: built locally, nothing to download"
    elif p.same_weights_as:
        title = (f"downloaded what {p.same_weights_as} needs (sha256 checked): {args.name} uses the same weights"
                 + _adapter_tail(p, res))
    else:
        title = f"downloaded {args.name} (sha256 checked)"
    if p.grounder_kind != "builder":
        res["revisions"] = models.revisions(args.name)
        title += "\nat " + "; ".join(f"{v['repo_id']}@{v['revision']}" for v in res["revisions"].values())
        title += f"\nHugging Face cache: {models.hub_cache_dir()} (a copy already there was reused)"
    emit(res, args.json, _paths_text(res, title))
    return 0


def _adapter_tail(p, res) -> str:
    """For a preset that needs an adapter and has none yet: what to give."""
    if p.requires_adapter and not res.get("adapter"):
        return ", plus a trained adapter you give with --adapter DIR (none is published; Training/README.md)"
    return ""


def cmd_import(args) -> int:
    from .. import models

    res = models.import_weights(args.name, args.folder, link=args.link, progress=not args.no_progress)
    how = "registered in place (--link: keep the folder where it is)" if args.link else "copied"
    p = models.get_preset(args.name)
    shared = f"; {args.name} shares these weights with {p.same_weights_as}" if p.same_weights_as else ""
    emit(res, args.json, _paths_text(res, f"imported {args.name} from {args.folder}, {how}{shared}"
                                          + _adapter_tail(p, res)))
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
    if res.get("identity"):
        lines.append(f"runs as:  {res['identity']['label']}")
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

    action("list", "Every preset: present or missing, estimated GPU memory, smoke-test flag, the weights' licences, "
           "and what it runs as (zero-shot base model, MedVol-R1 adapter, smoke model).", cmd_list)

    a = action("download", "Download a preset's weights from the Hugging Face Hub into the Hugging Face cache "
               "($HF_HOME / $HF_HUB_CACHE: a copy already there is reused; resumable; sha256-checked).",
               cmd_download)
    a.add_argument("name", metavar="NAME", help="preset name (see `medvol models list`)")
    a.add_argument("--revision", metavar="REV",
                   help="the grounder's Hub revision for this download: a 40-hex commit id or a branch/tag name "
                        "(default: the commit the preset table pins)")
    a.add_argument("--no-progress", action="store_true", help="no progress bars")

    from ..models import import_layout

    a = action("import", "Register weights copied by hand (machines without internet). Layout: "
               + import_layout() + " (for qwen3-vl-4b and medvol-r1; other presets use their own repo name).",
               cmd_import)
    a.add_argument("name", metavar="NAME", help="preset name (see `medvol models list`)")
    a.add_argument("folder", metavar="FOLDER", help="folder holding the weights (layout above)")
    a.add_argument("--link", action="store_true",
                   help="register the files where they are instead of copying them (they must stay there)")
    a.add_argument("--no-progress", action="store_true", help="no progress bars")

    a = action("path", "Print the local paths of a preset's weights (builds the tiny preset if needed).", cmd_path)
    a.add_argument("name", metavar="NAME", help="preset name (see `medvol models list`)")
    a.add_argument("--adapter", metavar="PATH", help="LoRA adapter folder overriding the preset's (checked)")
    return sp
