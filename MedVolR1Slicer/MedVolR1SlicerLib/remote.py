"""What the panel remembers about remote workers for this Slicer session only, in memory: the
token typed for each address and the addresses the user agreed to send CTs to.

The worker choice and the address are application settings (``qt.QSettings``, see
``MedVolR1SlicerPanel/worker_settings.py``), never a scene's; the token is never written
anywhere (Slicer offers no secret store, and plain settings are a readable file). A token belongs
to the address it was typed for: it is sent to that address only, and a changed address starts
with no token (typing the first address again brings its token back). The first upload to an
address in a session is confirmed by the user, who is shown what the server says it is (its
``hello`` reply, :func:`identity_text`); a "no" is not remembered, a "yes" is, until Slicer exits.
"""

from __future__ import annotations

import re
from typing import Dict

SETTINGS_WORKER = "MedVolR1Slicer/Worker"  # "local" or "remote"
SETTINGS_REMOTE_URL = "MedVolR1Slicer/RemoteUrl"
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def address(url: str) -> str:
    """The address a token and a confirmation belong to: the URL as the worker client uses it
    (spaces and a trailing ``/`` dropped; see :func:`.params.parse_remote_url`)."""
    return str(url or "").strip().rstrip("/")


def printable(value, limit: int = 80) -> str:
    """A value a server sent, as it may be shown: control characters replaced, length capped."""
    text = _CONTROL.sub("?", str(value)).strip()
    return text if len(text) <= limit else text[:limit - 1] + "…"


def identity_text(hello: dict) -> str:
    """What a worker says it is, from its ``hello`` reply (docs/protocol.md, "hello"): the
    MedVolCore version and protocol, the model it runs and its preset. A reply without them is
    said to be so; every value is the server's own claim, shown as sent."""
    if not isinstance(hello, dict):
        hello = {}
    parts = []
    if hello.get("medvolcore") is not None:
        parts.append(f"MedVolCore {printable(hello['medvolcore'], 40)}")
    if hello.get("protocol") is not None:
        parts.append(f"protocol {printable(hello['protocol'], 10)}")
    models = hello.get("models") if isinstance(hello.get("models"), dict) else {}
    identity = models.get("identity") if isinstance(models.get("identity"), dict) else {}
    label = hello.get("model_label") or identity.get("label")
    if label:
        parts.append(f"model: {printable(label)}")
    if models.get("preset"):
        parts.append(f"preset {printable(models['preset'], 40)}")
    if hello.get("transport"):
        parts.append(f"transport {printable(hello['transport'], 20)}")
    return "; ".join(parts) if parts else "it did not say what it is (no MedVolCore version in its reply)"


class RemoteAccess:
    """Tokens per address and the addresses confirmed for uploads, for this session (memory only)."""

    def __init__(self):
        self._tokens: Dict[str, str] = {}
        self._confirmed: Dict[str, str] = {}  # address → the identity the user was shown

    def set_token(self, url: str, token: str) -> None:
        """``token`` was typed while ``url`` was the address: it is that address's token only."""
        key, token = address(url), str(token or "").strip()
        if token:
            self._tokens[key] = token
        else:
            self._tokens.pop(key, None)

    def token_for(self, url: str) -> str:
        """The token typed for ``url`` (``""``: none); never another address's."""
        return self._tokens.get(address(url), "")

    def confirmed(self, url: str) -> bool:
        return address(url) in self._confirmed

    def confirm(self, url: str, identity: str) -> None:
        """The user agreed to send CTs to ``url`` (shown ``identity``), for this session."""
        self._confirmed[address(url)] = identity

    def forget(self) -> None:
        self._tokens.clear()
        self._confirmed.clear()
