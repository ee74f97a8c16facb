"""Panel defaults and the small pure rules behind the panel: query history, window and worker
settings (segment names and colours are :mod:`.segments`). The parameter node
(``MedVolR1SlicerScene/parameters.py``) takes its defaults
from :data:`DEFAULTS`. The model presets and their default come from ``Resources/models.json``
(:mod:`.presets`), the windows are listed here; a test checks both agree with MedVolCore."""

from __future__ import annotations

import json
import re
from typing import Iterable, List, Optional, Sequence, Tuple, Union

from .consensus import check_consensus
from .presets import model_presets
from .session import Options

DEFAULTS = {
    "preset": model_presets().default,  # Resources/models.json "default" (see presets.py)
    "device": "auto",           # cuda when a GPU is usable, else cpu (decided by the worker)
    "window": "soft_tissue",    # = Resources/windows.json "default": centre 40 HU, width 400 HU
    "worker": "local",
    "remote_url": "http://127.0.0.1:8765",
    "history_size": 15,
}
PRESETS = model_presets().names  # offered in the panel, in manifest order
WINDOWS = ("soft_tissue", "abdomen", "liver", "mediastinum", "lung", "bone", "brain")
DEVICES = ("auto", "cuda", "cpu")


class QueryHistory:
    """Recent queries, newest first, without repeats (ignoring case and spacing)."""

    def __init__(self, items: Iterable[str] = (), size: int = DEFAULTS["history_size"]):
        self.size = int(size)
        self.items: List[str] = []
        for q in reversed(list(items)):
            self.add(q)

    @staticmethod
    def _key(q: str) -> str:
        return " ".join(q.split()).casefold()

    def add(self, query: str) -> None:
        q = " ".join(str(query or "").split())
        if not q:
            return
        self.items = [q] + [i for i in self.items if self._key(i) != self._key(q)]
        del self.items[self.size:]

    def to_json(self) -> str:
        return json.dumps(self.items)

    @classmethod
    def from_json(cls, text: Optional[str], size: int = DEFAULTS["history_size"]) -> "QueryHistory":
        """Read a stored history; anything unreadable gives an empty one (settings may be hand-edited)."""
        try:
            items = json.loads(text or "[]")
        except (TypeError, ValueError):
            items = []
        if not isinstance(items, list):
            items = []
        return cls([i for i in items if isinstance(i, str)], size)


def parse_window(text: Union[str, Sequence[float]]) -> Union[str, List[float]]:
    """A window preset name or ``"centre,width"`` (HU) from the panel → what the worker takes."""
    if not isinstance(text, str):
        vals = [float(v) for v in text]
    else:
        t = text.strip()
        if t in WINDOWS:
            return t
        try:
            vals = [float(v) for v in re.split(r"[,;\s]+", t) if v]
        except ValueError:
            raise ValueError(f"window must be one of {', '.join(WINDOWS)} or 'centre, width' in HU, got {text!r}") from None
    if len(vals) != 2 or vals[1] <= 0:
        raise ValueError(f"a custom window is 'centre, width' in HU with a positive width, got {text!r}")
    return vals


def parse_remote_url(url: str) -> str:
    u = str(url or "").strip().rstrip("/")
    if not re.match(r"^https?://[^\s/]+(:\d+)?(/.*)?$", u):
        raise ValueError(f"the remote worker address must look like http://host:8765, got {url!r}")
    return u


def options_from_panel(preset: str, adapter: str = "", device: str = "auto", window="soft_tissue",
                       worker: str = "local", remote_url: str = "", remote_token: str = "",
                       consensus: int = 1) -> Options:
    """Validated :class:`Options` from the panel's plain values (raises ValueError with a message)."""
    if device not in DEVICES and not re.match(r"^cuda:\d+$", device or ""):
        raise ValueError(f"device must be one of {', '.join(DEVICES)} or cuda:N, got {device!r}")
    if worker not in ("local", "remote"):
        raise ValueError(f"worker must be 'local' or 'remote', got {worker!r}")
    preset = (preset or "").strip() or DEFAULTS["preset"]
    url = parse_remote_url(remote_url) if worker == "remote" else ""
    token = (remote_token or "").strip() if worker == "remote" else ""  # a token goes with its address only
    return Options(preset=preset, adapter=(adapter or "").strip(), device=device, window=parse_window(window),
                   worker=worker, remote_url=url, remote_token=token,
                   consensus=check_consensus(consensus))


def progress_text(stage: Optional[str], fraction: float, message: str = "",
                  eta_s: Optional[float] = None) -> Tuple[int, str]:
    """Progress-bar value (0–100) and its label for a worker progress event.

    Stages are weighted so the bar moves forward across the whole request
    (load 0–15 %, read 15–20 %, ground 20–70 %, propagate 70–95 %, write 95–100 %: on a CPU the
    grounder's one answer is most of a request). ``eta_s``: the worker's estimate of the time left
    in the stage, shown in the label."""
    spans = {"load": (0, 15), "read": (15, 20), "ground": (20, 70), "propagate": (70, 95), "write": (95, 100)}
    lo, hi = spans.get(stage or "", (0, 100))
    f = min(1.0, max(0.0, float(fraction or 0.0)))
    names = {"load": "Loading models", "read": "Reading the volume", "ground": "Finding the key slice",
             "propagate": "Propagating", "write": "Writing the mask"}
    label = names.get(stage or "", "Working")
    if message:
        label = f"{label}: {message}"
    if eta_s is not None and eta_s >= 1:
        s = int(round(eta_s))
        label += f" (about {s // 60}:{s % 60:02d} left)"
    return int(round(lo + (hi - lo) * f)), label


def query_submitted(before: str, after: str, newLine: bool = False) -> Tuple[str, bool]:
    """Enter in the query box runs Segment. ``before`` and ``after`` are the box's text around one
    edit; when the edit typed one line break (anywhere), returns the query without it and True.
    Anything else (typing, a pasted text with its own line breaks, a line break typed with
    ``newLine``, Shift+Enter: the next query) is an edit: ``(after, False)``."""
    if len(after) == len(before) + 1 and not newLine:
        for i, ch in enumerate(after):
            if ch == "\n" and after[:i] + after[i + 1:] == before:
                return before, True
    return after, False
