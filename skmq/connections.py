"""Who is connected to one broker, by role, for `skmq connections` and GET /v1/connections.

Each broker keeps this in memory only and publishes it in its broker note (written on the
engine's refresh, about once a second: skmq/workers/engine.py); the command and the route
read the notes of the live brokers. A note lists at most MAX_LISTED connections and says
how many more there were (`truncated`), so a flood of connections cannot swell a note.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

from skmq.clock import now_ms
from skmq.console import ALIVE_MS

Role = Literal["producer", "recipient push link", "pull consumer", "http"]
ROLES: Final = ("producer", "recipient push link", "pull consumer", "http")
MAX_LISTED = 1000
MAX_APPS = 16  # apps named for one connection and role


def peer_address(transport: asyncio.BaseTransport | None) -> str:
    """host:port of the peer ("" when it has none)."""
    peer = transport.get_extra_info("peername") if transport is not None else None
    return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else ""


@dataclass(frozen=True, slots=True)
class ConnectionInfo:
    peer: str  # its address, host:port
    role: Role
    apps: tuple[str, ...]
    since: int  # unix ms: since it took this role (a push link: since it was made)

    def as_json(self) -> dict[str, Any]:
        return {"peer": self.peer, "role": self.role, "apps": list(self.apps), "since": self.since}


class Connections:
    """Where this broker's connections are found when its note is written: each source
    (the TCP peers, the push links) lists its own; HTTP long polls are held here while
    they wait."""

    def __init__(self) -> None:
        self._sources: list[Callable[[], Iterable[ConnectionInfo]]] = []
        self._polls: dict[int, ConnectionInfo] = {}
        self._ids = itertools.count()

    def add_source(self, source: Callable[[], Iterable[ConnectionInfo]]) -> None:
        self._sources.append(source)

    @contextlib.contextmanager
    def polling(self, peer: str, app: str) -> Iterator[None]:
        """An HTTP long poll of `peer` for `app`, listed while it waits."""
        key = next(self._ids)
        self._polls[key] = ConnectionInfo(peer, "http", (app,), now_ms())
        try:
            yield
        finally:
            del self._polls[key]

    def note(self, most: int = MAX_LISTED) -> dict[str, Any]:
        """For the broker note: `connections` (at most `most`) and `truncated` (how many
        more there were)."""
        every = itertools.chain(self._polls.values(), *(source() for source in self._sources))
        listed = [c.as_json() for c in itertools.islice(every, most)]
        return {"connections": listed, "truncated": sum(1 for _ in every)}


def live_connections(
    notes: Mapping[str, Mapping[str, Any]], now: int
) -> tuple[list[dict[str, Any]], int]:
    """The connections the live brokers' notes list, as the console shows them
    ({broker, peer, role, apps, since_s}), and how many their notes left out. A note of
    another shape (an older broker's) lists nothing."""
    rows: list[dict[str, Any]] = []
    truncated = 0
    for broker, note in sorted(notes.items()):
        if now - _int(note.get("last_seen")) >= ALIVE_MS:
            continue
        listed = note.get("connections")
        for c in listed if isinstance(listed, list) else []:
            if isinstance(c, dict) and c.get("role") in ROLES:
                apps = c.get("apps")
                rows.append(
                    {
                        "broker": broker,
                        "peer": str(c.get("peer", "")),
                        "role": c["role"],
                        "apps": [str(a) for a in apps] if isinstance(apps, list) else [],
                        "since_s": round(max(0, now - _int(c.get("since"))) / 1000, 1),
                    }
                )
        truncated += _int(note.get("truncated"))
    return rows, truncated


def visible(rows: list[dict[str, Any]], only: frozenset[str] | None) -> list[dict[str, Any]]:
    """The rows a token with the admin role for the apps `only` (None: every app) may see:
    those of its apps, naming only its apps."""
    if only is None:
        return rows
    return [
        {**r, "apps": [a for a in r["apps"] if a in only]}
        for r in rows
        if only.intersection(r["apps"])
    ]


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0
