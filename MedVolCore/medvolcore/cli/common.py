"""What every ``medvol`` command shares: output, the shared options, memory figures, label ids."""

from __future__ import annotations

import json
import sys
from typing import List, Optional

from ..errors import InputError

PROG = "medvol"


def emit(result: dict, as_json: bool, text: str) -> None:
    """The command's result on stdout: JSON with ``--json``, else the text for people."""
    if as_json:
        sys.stdout.write(json.dumps(result, indent=2) + "\n")
    else:
        sys.stdout.write(text + "\n")


def peak_memory_mb() -> Optional[float]:
    """This process's peak resident memory in MB (None where it cannot be read: Windows)."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(rss / (1024 * 1024) if sys.platform == "darwin" else rss / 1024, 1)


def parse_labels(values: Optional[List[str]]):
    """``--label 5``, ``--label 2,3`` or ``--label 2 --label 3`` → int or list of ints (None: all)."""
    if not values:
        return None
    ids = []
    for v in values:
        for part in str(v).split(","):
            part = part.strip()
            if not part:
                continue
            try:
                n = int(part)
            except ValueError:
                raise InputError(f"--label takes integer label ids, got {part!r}") from None
            if n <= 0:
                raise InputError(f"--label ids must be positive (0 is background), got {n}")
            ids.append(n)
    return ids[0] if len(ids) == 1 else ids


def add_stop_option(sp) -> None:
    """``--stop-after-empty K`` (early stop), as every command that propagates has it."""
    from ..propagation import DEFAULT_STOP_AFTER_EMPTY

    sp.add_argument("--stop-after-empty", type=int, default=DEFAULT_STOP_AFTER_EMPTY, metavar="K",
                    help="in each direction, stop once every box's mask has been empty on K consecutive slices "
                         f"(default {DEFAULT_STOP_AFTER_EMPTY}; 0 = propagate through the whole volume, as the paper)")


def add_preset_option(sp) -> None:
    """``--preset NAME``: None unless given, resolved at run time to the manifest's default."""
    sp.add_argument("--preset", default=None,
                    help="model preset (medvol models list); default: the manifest's default preset "
                         "(Resources/models.json or $MEDVOL_MODELS_JSON; `medvol models list` marks it with *)")


def stop_text(propagation: Optional[dict]) -> str:
    """'; stopped early (every mask empty on K slices): forward at 47, backward at 8' when a direction
    ended before the edge of the stack (or window), else '' (``propagation``: the anchor's record)."""
    if not propagation:
        return ""
    parts = [f"{d} at {v['last_slice']}" for d, v in (propagation.get("directions") or {}).items()
             if v.get("stopped_early")]
    return (f"; stopped early (every mask empty on {propagation['stop_after_empty']} slices): " + ", ".join(parts)
            if parts else "")
