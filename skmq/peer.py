"""Who is at the other end of one client connection: its address, and (once an `auth`
frame succeeded) what its token grants. The handler decides every frame with it."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass, field

from skmq.auth import EVERY_APP, Grant, Role
from skmq.clock import now_ms
from skmq.connections import MAX_APPS, ConnectionInfo
from skmq.connections import Role as ConnectionRole


@dataclass(slots=True, eq=False)
class Peer:
    host: str
    # Apps this connection's token lets it consume for (answers, registrations);
    # "*" stands for every app. Empty: not authenticated (or auth is off).
    consume_apps: set[str] = field(default_factory=set)
    produce_apps: set[str] = field(default_factory=set)
    admin_apps: set[str] = field(default_factory=set)
    # The name of the token that authenticated this connection (never the token); "": none.
    principal: str = ""
    address: str = ""  # host:port, for `skmq connections`
    # What it has done on this connection (`skmq connections`): role -> (since, apps).
    roles: dict[ConnectionRole, tuple[int, set[str]]] = field(default_factory=dict)

    def took(self, role: ConnectionRole, app: str) -> None:
        """It acted as `role` for `app` (at most MAX_APPS apps named a role)."""
        taken = self.roles.get(role)
        if taken is None:
            self.roles[role] = (now_ms(), {app})
        elif len(taken[1]) < MAX_APPS:
            taken[1].add(app)

    def described(self) -> Iterator[ConnectionInfo]:
        for role, (since, apps) in self.roles.items():
            yield ConnectionInfo(self.address, role, tuple(sorted(apps)), since)

    @property
    def authenticated(self) -> bool:
        return bool(self.principal)

    def admit(self, grant: Grant) -> None:
        """An `auth` frame presented the token of `grant`."""
        self.principal = grant.name
        self.consume_apps = set(grant.apps("consume"))
        self.produce_apps = set(grant.apps("produce"))
        self.admin_apps = set(grant.apps("admin"))

    def may(self, role: Role, app: str) -> bool:
        """True only when a token authenticated this connection for `role` on `app`."""
        if role == "consume":
            apps = self.consume_apps
        elif role == "produce":
            apps = self.produce_apps
        else:
            apps = self.admin_apps
        return EVERY_APP in apps or app in apps

    # Store calls (answers, registrations) of this connection running at once; more wait
    # here, so that one connection's flood cannot queue up ahead of everyone in the pool.
    store_calls: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(32))
    # Set once the peer sent its last byte or the connection closed: a long poll of its
    # then waits no longer (it would take a message for a consumer that may be gone).
    gone: asyncio.Event = field(default_factory=asyncio.Event)

    def authenticated_for(self, app: str) -> bool:
        """True only when a token authenticated this connection for `app`."""
        return self.may("consume", app)
