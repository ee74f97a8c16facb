"""The HTTP transport's sessions: ids issued per client address, never pushing out a session
with a request in flight (``docs/protocol.md``, "Sessions")."""

from __future__ import annotations

import collections
import functools
import ipaddress
import secrets
import threading
import time
from typing import Callable, Optional

__all__ = ["SessionTable", "SessionsFull", "client_key", "MAX_SESSIONS_PER_CLIENT", "MAX_SESSIONS"]

from .limits import limit

MAX_SESSIONS_PER_CLIENT = int(limit("sessions_per_client").default)  # a client forgets its own oldest beyond this
MAX_SESSIONS = int(limit("sessions").default)  # all clients together: a bound on memory only


@functools.lru_cache(maxsize=4096)
def client_key(address: str) -> str:
    """The client a session is counted under: its IPv4 address, or its IPv6 /64 (one machine
    usually holds a whole /64, so counting single IPv6 addresses would not bound anything)."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return address
    if ip.version == 6:
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip)


class SessionsFull(Exception):
    """Every session a client address may hold has a request in flight: no new one is issued."""


class SessionTable:
    """The session ids this server issued, per client address (:func:`client_key`), least
    recently used first, in two pools per address. A session is *fresh* until its client sends
    its id back, then *known*: the session secret is the client's identity (the server's one
    token is shared by all its clients, and one address is every client behind a proxy or a
    tunnel). Each pool holds at most ``per_client`` sessions per address: a new fresh session
    beyond that pushes out that address's least recently used fresh one, a session becoming
    known pushes out its least recently used known one, and never a session with a request
    queued or running (``busy(sid)``): when every candidate is busy, :meth:`session` raises
    :class:`SessionsFull`. So session-less requests (``GET /hello``, ``status``) from one
    address never push out a client that uses its session. ``total`` bounds the memory of all
    of them (then the address holding the most sessions loses its oldest idle one, fresh ones
    first). Thread-safe."""

    def __init__(self, per_client: int = MAX_SESSIONS_PER_CLIENT, total: int = MAX_SESSIONS,
                 busy: Optional[Callable[[str], bool]] = None):
        self.per_client = int(per_client)
        self.total = int(total)
        self.busy = busy or (lambda sid: False)
        self._lock = threading.Lock()
        self._last = {}  # session id -> [client, last request (monotonic s), known]
        self._pools: "dict[tuple, collections.OrderedDict]" = {}  # (client, known) -> sessions, LRU first

    def __len__(self) -> int:
        return len(self._last)

    def session(self, sid: Optional[str], client: str) -> str:
        """``sid`` when this server issued it and still knows it (now its most recent use, and
        known), else a new fresh session of ``client``."""
        now = time.monotonic()
        with self._lock:
            entry = self._last.get(sid) if sid else None
            if entry is not None:
                entry[1] = now
                if not entry[2]:  # sent back by its client: now a known session
                    self._pools[(entry[0], False)].pop(sid, None)
                    self._drop_empty((entry[0], False))
                    entry[2] = True
                    known = self._pools.setdefault((entry[0], True), collections.OrderedDict())
                    known[sid] = None
                    self._trim(known, keep=sid)
                else:
                    self._pools[(entry[0], True)].move_to_end(sid)
                return sid
            fresh = self._pools.setdefault((client, False), collections.OrderedDict())
            if len(fresh) >= self.per_client and self._idle(fresh) is None:
                self._drop_empty((client, False))
                raise SessionsFull(f"this address already holds {len(fresh)} new sessions with requests in flight; "
                                   "send your session id (X-MedVol-Session) or wait for a reply")
            sid = secrets.token_urlsafe(18)
            fresh[sid] = None
            self._last[sid] = [client, now, False]
            self._trim(fresh, keep=sid)
            while len(self._last) > self.total:
                pools = sorted(self._pools.values(), key=len, reverse=True)
                victim = next((v for pool in pools for v in [self._idle(pool)] if v is not None and v != sid), None)
                if victim is None:
                    break
                self._forget(victim)
            return sid

    def _idle(self, pool) -> Optional[str]:
        """The least recently used session of ``pool`` with no request in flight, or None."""
        return next((sid for sid in pool if not self.busy(sid)), None)

    def _trim(self, pool, keep: str) -> None:
        while len(pool) > self.per_client:
            victim = next((s for s in pool if s != keep and not self.busy(s)), None)
            if victim is None:
                return  # every other one is busy: kept (the bound is exceeded by busy sessions only)
            self._forget(victim)

    def touch(self, sid: Optional[str]) -> None:
        """Mark ``sid`` as used now (a reply was delivered to it)."""
        with self._lock:
            entry = self._last.get(sid) if sid else None
            if entry is not None:
                entry[1] = time.monotonic()

    def expire(self, idle_s: float) -> list:
        """Forget the sessions unused for more than ``idle_s`` seconds; returns their ids."""
        cutoff = time.monotonic() - idle_s
        with self._lock:
            old = [sid for sid, (_, t, _k) in self._last.items() if t < cutoff]
            for sid in old:
                self._forget(sid)
        return old

    def _forget(self, sid: str) -> None:
        client, _, known = self._last.pop(sid)
        pool = self._pools.get((client, known))
        if pool is not None:
            pool.pop(sid, None)
        self._drop_empty((client, known))

    def _drop_empty(self, key) -> None:
        if not self._pools.get(key):
            self._pools.pop(key, None)
