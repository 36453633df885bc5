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
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import structlog
from redis.exceptions import RedisError

from skmq.clock import now_ms
from skmq.queue.owned_store import OwnedStore
from skmq.queue.owners import SWEEP_MS
from skmq.registry.balance import Balancer
from skmq.registry.recipients import Recipient
from skmq.store import AliveRecipient, ClaimArgs, Claimed, ClaimResult

log = structlog.get_logger("skmq.dispatch")

CLAIM_BATCH = 512
FIRST_CLAIM = 4
POLL = 0.25
# An app with nothing to do polls less and less often, down to once in IDLE_POLL: its
# own work wakes it at once; only work stored by another broker waits for a poll. An app
# without recipients waits for one (a registration or a recipient back wakes it).
IDLE_POLL = 5.0
NO_RECIPIENT_POLL = 60.0
# An app with no recipient alive still claims now and then, for nothing but what its owner
# does on the way: delays and leases that ran out, and TTLs (at most this often).
SWEEP = SWEEP_MS / 1000


class Plan(NamedTuple):
    """A claim to make: how many, the alive recipients, the queue messages' recipients in
    order, and the lost recipients (whose topic copies wait)."""

    n: int
    alive: list[AliveRecipient]
    assignment: list[str]
    lost: list[str]


@dataclass(eq=False)
class Dispatcher:
    app: str
    store: OwnedStore
    registered: Callable[[str], list[Recipient]]
    free_slots: Callable[[str, list[Recipient]], dict[str, int]]
    deliver: Callable[[str, list[Claimed]], None]
    delivery_rate: float = 0.0
    claims: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(1))
    wake: asyncio.Event = field(init=False, default_factory=asyncio.Event)
    balancer: Balancer = field(init=False, default_factory=Balancer)
    paused: bool = field(init=False, default=False)
    # Waiting for window slots: then (only) a finished delivery is worth a wake-up.
    starved: bool = field(init=False, default=False)
    # Its last plan found recipients alive with free window slots, and no delivery rate
    # held it back: what is due and not pushed waits for the broker (store_hold.py).
    ready: bool = field(init=False, default=False)
    # Claims start small and double while they come back full: a lone message does
    # not pay for a batch of 512 picks and arguments.
    batch: int = field(init=False, default=FIRST_CLAIM)
    # When the last claim took something (monotonic): the engine reaps this app's
    # leases often only while it has been claiming.
    last_claim: float = field(init=False, default=float("-inf"))
    idle_wait: float = field(init=False, default=POLL)
    # A claim in flight: this dispatcher's own, or one a store's round trip carries.
    claiming: bool = field(init=False, default=False)
    carried: bool = field(init=False, default=False)
    missed: bool = field(init=False, default=False)  # woken while a store carried its claim
    swept_at: float = field(init=False, default=float("-inf"))  # its last claim of none

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
                        self.idle_wait = POLL
            else:  # (a claim from the owner's memory need not wait for anything: the
                # sockets are read between two, whatever the window)
                await asyncio.sleep(0)

    def _idle(self) -> float:
        """Nothing to do: sleep twice as long as last time, up to IDLE_POLL."""
        wait, self.idle_wait = self.idle_wait, min(IDLE_POLL, self.idle_wait * 2)
        return wait

    async def step(self) -> float:
        """Claim and push once; returns how long to sleep unless woken (0: go on now)."""
        self.wake.clear()
        if self.carried:  # a store's round trip carries a claim: it wakes us again
            self.missed = True
            return POLL
        plan = self._plan()
        if isinstance(plan, float):
            return plan
        n, alive, assignment, lost = plan
        if n == 0 and (wait := self.swept_at + SWEEP - time.monotonic()) > 0:
            return wait
        self.claiming = True
        try:
            async with self.claims:
                now = now_ms()
                result = await self.store.claim(
                    self.app, now, n, alive, assignment, self.delivery_rate, lost
                )
        finally:
            self.claiming = False
        if n == 0:
            return self._swept(result)
        return self._claimed(n, result)

    def _swept(self, result: ClaimResult) -> float:
        """A claim of none (no recipient alive) made: what expired meanwhile goes to the
        pusher, which logs it; sleep until the next delay, lease or TTL runs out."""
        claimed, next_due, _ = result
        self.swept_at = time.monotonic()
        if claimed:
            self.deliver(self.app, claimed)
        if next_due is None:
            return NO_RECIPIENT_POLL
        return min(NO_RECIPIENT_POLL, max(SWEEP, (next_due - now_ms()) / 1000))

    def _plan(self, at_least: int = 0) -> Plan | float:
        """How many to claim (the batch, or `at_least` up to CLAIM_BATCH), for which
        recipients; or how long to sleep (nothing to do)."""
        self.ready = False
        if self.paused:
            return NO_RECIPIENT_POLL
        registered = self.registered(self.app)
        recipients = [r for r in registered if r.alive]
        if not recipients:  # (a claim of none: see SWEEP)
            return Plan(0, [], [], [r.id for r in registered])
        free = self.free_slots(self.app, recipients)
        n = min(sum(free.values()), max(self.batch, min(at_least, CLAIM_BATCH)))
        self.starved = n <= 0
        if n <= 0:
            return POLL
        weights = {r.id: r.weight for r in recipients if r.id in free}
        assignment = self.balancer.pick(weights, free, n)
        n = len(assignment)
        if n == 0:
            self.starved = True
            return POLL
        alive = [AliveRecipient(r.id, free.get(r.id, 0), "length" in r.caps) for r in recipients]
        self.ready = True
        return Plan(n, alive, assignment, [r.id for r in registered if not r.alive])

    def _claimed(self, n: int, result: ClaimResult) -> float:
        """Push what a claim of n took; returns how long to sleep unless woken."""
        claimed, next_due, rate_wait = result
        self.balancer.commit(sum(1 for c in claimed if c.kind == "queue"))
        if claimed:
            self.last_claim = time.monotonic()
            self.idle_wait = POLL
            self.deliver(self.app, claimed)
        if rate_wait > 0:
            self.ready = False
            return rate_wait
        if len(claimed) >= n:
            self.batch = min(CLAIM_BATCH, self.batch * 2)
            return 0.0
        self.batch = FIRST_CLAIM
        if any(c.kind in ("dead", "expired") for c in claimed):
            return 0.0  # (one may have let the next message of its ordering key go)
        if next_due is not None:
            return min(POLL, max(0.0, (next_due - now_ms()) / 1000))
        return POLL if claimed else self._idle()

    # -- a claim carried by a store's round trip (skmq/workers/enqueue.py) ----------
    def carry_claim(self, now: int, stored: int) -> ClaimArgs | None:
        """The claim a wake-up would make now, for the round trip storing `stored` new
        messages of this app to carry (run after the store, it sees them): one round trip
        a message less at a low rate. It asks for one more than were stored, so that it
        comes back full (and the dispatcher claims again) only if more were waiting.
        None while this dispatcher claims itself (or its wake-up is due anyway), or has
        nothing to claim for: then the store wakes it as before."""
        if self.carried or self.claiming or self.paused or self.wake.is_set():
            return None
        plan = self._plan(at_least=stored + 1)
        if isinstance(plan, float) or plan.n == 0:
            return None
        n, alive, assignment, lost = plan
        self.carried = True
        args = self.store.claim_args(now, n, alive, assignment, self.delivery_rate, lost)

        def done(result: ClaimResult | BaseException) -> None:
            self.carried = False
            again, self.missed = self.missed, False
            if isinstance(result, BaseException):
                again = True  # it claims again itself
            elif self._claimed(n, result) < POLL:
                again = True  # more to take now, or soon: its own loop times that
            if again or self.paused:
                self.wake.set()

        return ClaimArgs(self.app, args, done)
