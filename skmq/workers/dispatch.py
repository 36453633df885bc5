"""The dequeue worker of one app: claims pending deliveries from Redis as fast as the
app's recipients have free window slots, and hands them to their links.

One dispatcher an app, so an app without recipients, or with slow ones, never holds up
another. It sleeps until woken (a message stored, a slot freed, a recipient back) or
until the next delayed message falls due, and polls now and then for work stored by
other brokers.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import structlog
from redis.exceptions import RedisError

from skmq.deliverylog import now_ms
from skmq.registry.balance import Balancer
from skmq.registry.recipients import Recipient
from skmq.store import AliveRecipient, Claimed, Store

log = structlog.get_logger("skmq.dispatch")

CLAIM_BATCH = 512
FIRST_CLAIM = 4
POLL = 0.25


class Dispatcher:
    def __init__(
        self,
        app: str,
        store: Store,
        alive: Callable[[str], list[Recipient]],
        free_slots: Callable[[str, list[Recipient]], dict[str, int]],
        deliver: Callable[[str, list[Claimed]], None],
        delivery_rate: float = 0.0,
    ) -> None:
        self.app = app
        self.store = store
        self.alive = alive
        self.free_slots = free_slots
        self.deliver = deliver
        self.wake = asyncio.Event()
        self.balancer = Balancer()
        self.delivery_rate = delivery_rate
        self.paused = False
        # Waiting for window slots: then (only) a finished delivery is worth a wake-up.
        self.starved = False
        # Claims start small and double while they come back full: a lone message does
        # not pay for a batch of 512 picks and arguments.
        self.batch = FIRST_CLAIM

    async def run(self) -> None:
        backoff = 0.05
        while not self.paused:
            try:
                timeout = await self.step()
                backoff = 0.05
            except (RedisError, OSError) as exc:
                log.warning("dispatch failed, retrying", app=self.app, error=repr(exc))
                timeout, backoff = backoff, min(backoff * 2, 2.0)
            if timeout > 0:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(timeout):
                        await self.wake.wait()

    async def step(self) -> float:
        """Claim and push once; returns how long to sleep unless woken (0: go on now)."""
        self.wake.clear()
        recipients = [] if self.paused else self.alive(self.app)
        if not recipients:
            return POLL
        free = self.free_slots(self.app, recipients)
        n = min(sum(free.values()), self.batch)
        self.starved = n <= 0
        if n <= 0:
            return POLL
        weights = {r.id: r.weight for r in recipients if r.id in free}
        assignment = self.balancer.pick(weights, free, n)
        n = len(assignment)
        if n == 0:
            self.starved = True
            return POLL
        now = now_ms()
        alive = [AliveRecipient(r.id, free.get(r.id, 0), "length" in r.caps) for r in recipients]
        claimed, next_due, rate_wait = await self.store.claim(
            self.app, now, n, alive, assignment, self.delivery_rate
        )
        self.balancer.commit(sum(1 for c in claimed if c.kind == "queue"))
        if claimed:
            self.deliver(self.app, claimed)
        if rate_wait > 0:
            return rate_wait
        if len(claimed) >= n:
            self.batch = min(CLAIM_BATCH, self.batch * 2)
            return 0.0
        self.batch = FIRST_CLAIM
        if next_due is not None:
            return min(POLL, max(0.0, (next_due - now_ms()) / 1000))
        return POLL
