"""Which broker owns which app's queue: each broker says it is alive, keeps the leases it
holds, and takes the unowned apps that rendezvous hashing gives it among the live
brokers. An owner keeps its apps until it stops (`release_all`) or dies (its leases run
out): ownership does not move while its owner lives, so a queue's deliveries do not
change hands for balance alone. A broker takes an app hashed to another only when it
has been unowned longer than a lease (that broker is gone, or not yet counted dead).

One `round` does it all; the broker runs it every lease / 3. Only `acquire` can start
an ownership and only `renew` extends one: both are fenced scripts (journal.py).
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

import structlog

from skmq.queue.journal import AppKeys, Lease, acquire, release, renew
from skmq.store.wire import Wire

log = structlog.get_logger("skmq.queue.ownership")


def rank(app: str, broker: str) -> bytes:
    """Rendezvous hashing: the live broker with the highest rank for an app takes it."""
    return hashlib.blake2b(f"{app}\x1f{broker}".encode(), digest_size=8).digest()


def preferred(app: str, brokers: Iterable[str]) -> str | None:
    return max(brokers, key=lambda b: rank(app, b), default=None)


@dataclass
class Ownership:
    broker: str
    prefix: str
    lease_ms: int
    wire_for: Callable[[str], Wire]  # the connection to the node holding an app's keys
    members: Wire  # the node holding the live brokers' set
    gained: Callable[[str, Lease], Awaitable[None]]
    lost: Callable[[str], Awaitable[None]]
    held: dict[str, Lease] = field(default_factory=dict)
    unowned_since: dict[str, int] = field(default_factory=dict)
    brokers: list[str] = field(default_factory=list)  # alive at the last round
    taking: dict[str, asyncio.Future[bool]] = field(default_factory=dict)

    @property
    def members_key(self) -> str:
        return f"{self.prefix}:owners"

    def keys(self, app: str) -> AppKeys:
        return AppKeys.of(self.prefix, app)

    async def live(self, now: int) -> list[str]:
        """The brokers alive now (this one said so in this round)."""
        await self.members.call_many(
            [
                ("ZADD", self.members_key, now + self.lease_ms, self.broker),
                ("ZREMRANGEBYSCORE", self.members_key, "-inf", now),
            ]
        )
        return [b.decode() for b in await self.members.call("ZRANGE", self.members_key, 0, -1)]

    async def round(self, apps: Iterable[str], now: int) -> None:
        """Renew what we hold (dropping what was taken over), then take what is ours."""
        self.brokers = await self.live(now)
        for app, lease in list(self.held.items()):
            if not await renew(self.wire_for(app), self.keys(app), lease, self.lease_ms):
                log.warning("app taken over by another broker: this one's lease ran out",
                            app=app, epoch=lease.epoch)  # fmt: skip
                del self.held[app]
                await self.lost(app)
        for app in apps:
            await self.take(app, now)

    async def take(self, app: str, now: int) -> bool:
        """Whether this broker holds the app now: taken if it is unowned and ours by
        rendezvous among the brokers alive at the last round (or unowned for a lease).
        Callers at the same time (a round, a store) share one attempt: two acquires would
        give two epochs, the second fencing the first."""
        if app in self.held:
            return True
        pending = self.taking.get(app)
        if pending is not None:
            return await asyncio.shield(pending)
        attempt = asyncio.ensure_future(self._take(app, now))
        self.taking[app] = attempt
        try:
            return await asyncio.shield(attempt)
        finally:
            if self.taking.get(app) is attempt and attempt.done():
                del self.taking[app]

    async def _take(self, app: str, now: int) -> bool:
        first = preferred(app, self.brokers or [self.broker])
        since = self.unowned_since.setdefault(app, now)
        if first != self.broker and now - since < self.lease_ms:
            return False
        won = await acquire(self.wire_for(app), self.keys(app), self.broker, self.lease_ms)
        if won is None:
            self.unowned_since[app] = now  # owned by another: it is not unowned
            return False
        self.unowned_since.pop(app, None)
        self.held[app] = won
        await self.gained(app, won)
        return True

    async def release_all(self) -> None:
        """A broker stopping: its apps go to the others at once, not after the lease."""
        for app, lease in list(self.held.items()):
            await release(self.wire_for(app), self.keys(app), lease)
            del self.held[app]
            await self.lost(app)
        await self.members.call("ZREM", self.members_key, self.broker)
