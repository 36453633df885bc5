"""Who is at the other end of one client connection: its address, and (once an `auth`
frame succeeded) what its token grants. The handler decides every frame with it."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field


@dataclass(slots=True, eq=False)
class Peer:
    host: str
    # Apps this connection's token lets it consume for (answers, registrations);
    # "*" stands for every app. Empty: not authenticated (or auth is off).
    consume_apps: set[str] = field(default_factory=set)
    # Store calls (answers, registrations) of this connection running at once; more wait
    # here, so that one connection's flood cannot queue up ahead of everyone in the pool.
    store_calls: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(32))

    def authenticated_for(self, app: str) -> bool:
        """True only when a token authenticated this connection for `app`."""
        return "*" in self.consume_apps or app in self.consume_apps
