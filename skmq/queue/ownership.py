"""Which broker owns which app's queue: each broker says it is alive, keeps the leases it
holds, and takes the unowned apps that rendezvous hashing gives it among the live
brokers. An owner keeps its apps until it stops (`release_all`) or dies (its leases run
out): ownership does not move while its owner lives, so a queue's deliveries do not
change hands for balance alone. A broker takes an app hashed to another only when it
has been unowned longer than a lease (that broker is gone, or not yet counted dead).

One `round` does it all; the broker runs it every lease / 3. Only `acquire` can start
an ownership and only `renew` extends one: both are fenced scripts (journal.py).

A refused acquire says when the holder's lease runs out (`lapsing`); the broker tries
again then (`take_lapsed`), not at its next round: a dead owner's apps are taken a lease
after its last renewal, not up to a third of a lease later. A holder whose lease ran out
unrenewed is dead or stalled, and is no longer preferred for that app.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

import structlog

from skmq.logs import Throttled
from skmq.queue.journal import AppKeys, HeldBy, Lease, release, renew, try_acquire
from skmq.store.wire import Wire
from skmq.store.wires import TROUBLE, Wires

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
    wires: Wires  # the connections to the nodes holding an app's keys, the brokers' set
    gained: Callable[[str, Lease], Awaitable[None]]
    lost: Callable[[str], Awaitable[None]]
    held: dict[str, Lease] = field(default_factory=dict)
    unowned_since: dict[str, int] = field(default_factory=dict)
    brokers: list[str] = field(default_factory=list)  # alive at the last round
    taking: dict[str, asyncio.Future[bool]] = field(default_factory=dict)
    # app -> (the broker holding it, when its lease runs out unless renewed: ms), as its
    # last refused acquire said
    lapsing: dict[str, tuple[str, int]] = field(default_factory=dict)
    lapse_seen: asyncio.Event = field(default_factory=asyncio.Event)  # (one added since)
    _faults: Throttled = field(init=False, default_factory=lambda: Throttled(log))

    @property
    def members_key(self) -> str:
        return f"{self.prefix}:owners"

    def keys(self, app: str) -> AppKeys:
        return AppKeys.of(self.prefix, app)

    async def live(self, now: int) -> list[str]:
        """The brokers alive now (this one said so in this round)."""
        members = await self.wires.of(self.members_key)
        await members.call_many(
            [
                ("ZADD", self.members_key, now + self.lease_ms, self.broker),
                ("ZREMRANGEBYSCORE", self.members_key, "-inf", now),
            ]
        )
        return [b.decode() for b in await members.call("ZRANGE", self.members_key, 0, -1)]

    async def round(self, apps: Iterable[str], now: int) -> None:
        """`renew_all`, then `take_all`."""
        await self.renew_all()
        await self.take_all(apps, now)

    async def renew_all(self) -> None:
        """Renew what we hold, dropping what was taken over: every app at once, each
        call bounded by a third of the lease. An app whose node is in trouble (down,
        stalled) is skipped and holds up no other (its lease runs out, or its owner is
        dropped when its connection closes: the runtime's round)."""
        await asyncio.gather(*(self._renew(app, lease) for app, lease in list(self.held.items())))

    async def take_all(self, apps: Iterable[str], now: int) -> None:
        """Say this broker is alive, then take what is ours of `apps`, as `renew_all`
        does each call bounded."""
        try:
            async with asyncio.timeout(self.lease_ms / 3000):
                self.brokers = await self.live(now)
        except TROUBLE as exc:  # (its node in trouble: the brokers seen last)
            log.warning("live brokers not read", error=repr(exc))
        apps = list(apps)
        for gone in self.lapsing.keys() - set(apps):  # (apps forgotten meanwhile)
            del self.lapsing[gone]
        await self._take_each(apps, now)

    def next_lapse(self) -> int | None:
        """When the first of the other brokers' leases seen runs out unless renewed (ms),
        or None."""
        return min((when for _, when in self.lapsing.values()), default=None)

    async def take_lapsed(self, now: int) -> None:
        """Try for the apps whose holder's lease has run out by `now`, each once (a
        refusal says when to try again)."""
        apps = [app for app, (_, when) in self.lapsing.items() if when <= now]
        await self._take_each(apps, now)
        for app in apps:
            lapse = self.lapsing.get(app)
            if lapse is not None and lapse[1] <= now:  # (not refused again: not retried)
                del self.lapsing[app]

    async def _take_each(self, apps: list[str], now: int) -> None:
        await asyncio.gather(*(self._take_bounded(app, now) for app in apps))

    async def _take_bounded(self, app: str, now: int) -> None:
        """`take`, waited for as `_bounded` waits; a take that won the lease and still
        loads the app's state (a large one: seconds) goes on, and is no failure."""
        bound = asyncio.timeout(self.lease_ms / 3000)
        try:
            async with bound:
                await self.take(app, now)
        except TROUBLE as exc:  # (the attempt's own failure: logged as it ends, `_taken`)
            if bound.expired() and app not in self.held:
                log.warning("ownership call failed", app=app, error=repr(exc))
        except Exception:  # (a state this broker cannot load: that app's trouble alone,
            pass  # not the round's; logged as the attempt ends, `_taken`)

    async def _renew(self, app: str, lease: Lease) -> None:
        async def renewed() -> bool:
            return await renew(await self._wire(app), self.keys(app), lease, self.lease_ms)

        kept = await self._bounded(renewed(), app)
        if kept is False and self.held.get(app) == lease:
            log.warning("app taken over by another broker: this one's lease ran out",
                        app=app, epoch=lease.epoch)  # fmt: skip
            del self.held[app]
            await self.lost(app)

    async def _bounded(self, call: Awaitable[bool], app: str) -> bool | None:
        """`call`'s answer, or None (logged) when its node failed or took over a third
        of the lease."""
        try:
            async with asyncio.timeout(self.lease_ms / 3000):
                return await call
        except TROUBLE as exc:
            log.warning("ownership call failed", app=app, error=repr(exc))
            return None

    async def take(self, app: str, now: int) -> bool:
        """Whether this broker holds the app now: taken if it is unowned and ours by
        rendezvous among the brokers alive at the last round (or unowned for a lease).
        Callers at the same time (a round, a store) share one attempt: two acquires would
        give two epochs, the second fencing the first; and a caller while the attempt
        loads the app's state (its lease already held, for renewals) waits for the load,
        since the app is not owned before it ends."""
        pending = self.taking.get(app)
        if pending is not None:
            return await asyncio.shield(pending)
        if app in self.held:
            return True
        attempt = asyncio.ensure_future(self._take(app, now))
        self.taking[app] = attempt
        attempt.add_done_callback(functools.partial(self._taken, app))
        return await asyncio.shield(attempt)

    def _taken(self, app: str, attempt: asyncio.Future[bool]) -> None:
        """An attempt ended, whether or not anyone still waits for it (a round stops
        waiting after a third of the lease, a large state loads for longer): the next
        take makes a new one, and a failure is logged once."""
        if self.taking.get(app) is attempt:
            del self.taking[app]
        if not attempt.cancelled() and (exc := attempt.exception()) is not None:
            if isinstance(exc, TROUBLE):  # (a failover: every produce tries, for a while)
                self._faults.warning("taking an app failed", app=app, error=repr(exc))
            else:
                log.error("taking an app failed", app=app, error=repr(exc))

    async def _take(self, app: str, now: int) -> bool:
        brokers = self.brokers or [self.broker]
        lapsed = self.lapsing.get(app)
        if lapsed is not None and lapsed[1] <= now:  # (its holder did not renew in time)
            brokers = [b for b in brokers if b != lapsed[0]] or [self.broker]
        first = preferred(app, brokers)
        since = self.unowned_since.setdefault(app, now)
        if first != self.broker and now - since < self.lease_ms:
            return False
        won = await try_acquire(await self._wire(app), self.keys(app), self.broker, self.lease_ms)
        if isinstance(won, HeldBy):
            self.unowned_since[app] = now  # owned by another: it is not unowned
            if won.ms_left >= 0:  # (-1: a lease with no end, which no broker sets)
                self.lapsing[app] = (won.broker, now + won.ms_left)
                self.lapse_seen.set()
            return False
        self.unowned_since.pop(app, None)
        self.lapsing.pop(app, None)
        self.held[app] = won
        try:
            await self.gained(app, won)
        except Exception:  # (its state not loaded: let go, for this or another broker)
            del self.held[app]
            with contextlib.suppress(*TROUBLE):
                await release(await self._wire(app), self.keys(app), won)
            raise
        return True

    async def forget_the_dead(self, apps: Iterable[str]) -> None:
        """This broker's Redis is its alone (the embedded one): every lease and live
        broker in it is a dead process's, a kill -9's. Forgotten at start, its apps are
        ours at once, not a lease later (or two, where rendezvous ranked it first)."""
        for app in apps:
            await (await self._wire(app)).call("DEL", self.keys(app).owner)
        await (await self.wires.of(self.members_key)).call("DEL", self.members_key)

    async def release_all(self) -> None:
        """A broker stopping: its apps go to the others at once, not after the lease."""
        for app, lease in list(self.held.items()):
            await release(await self._wire(app), self.keys(app), lease)
            del self.held[app]
            await self.lost(app)
        await (await self.wires.of(self.members_key)).call("ZREM", self.members_key, self.broker)

    async def _wire(self, app: str) -> Wire:
        return await self.wires.of(self.keys(app).epoch)
