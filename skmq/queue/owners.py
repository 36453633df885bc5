"""The apps this broker owns, and the delivery engine's calls on them: claim, finish,
fail, extend, reap, release and store, answered from the owners' memory (writes go to
the journal in one flush a loop turn), with the replies the engine's workers take.

An app this broker does not own has nothing to claim here; a store for it goes to its
inbox, which its owner reads; an answer for it is stale here (its owner holds it).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field

from redis.exceptions import TimeoutError as RedisTimeoutError

from skmq.lifecycle import Refused, State, Trigger
from skmq.queue.dead import delivery_id
from skmq.queue.deliveries import QUEUE, Change, Delivery, Policy
from skmq.queue.entries import Meta, encode_header
from skmq.queue.journal import Appended, AppKeys, Fenced, Journal, Lease, Lister, append
from skmq.queue.owner import BACKLOG_HELD, AppOwner, observed
from skmq.queue.owner import NewMessage as Stored
from skmq.stall import STALL
from skmq.store.client import ENC, text
from skmq.store.shards import WriteFailed
from skmq.store.store import (
    AliveRecipient,
    Claimed,
    ClaimResult,
    Extended,
    Failed,
    Finished,
    NewMessage,
    Reaped,
    split_delivery,
)
from skmq.store.wire import Wire
from skmq.store.wires import TROUBLE, Wires, refused_here

UNDELIVERABLE = (
    "undeliverable: content holds CR or LF and no recipient declared the length capability"
)
# How often an app's owner looks for waiting deliveries whose TTL ran out (ms): a claim
# meets those it takes, this the rest (an app with no recipient alive; at most this late).
SWEEP_MS = 1_000
FAILED_CODES = {
    Trigger.RETRY: Failed.RETRY,
    Trigger.GIVE_UP: Failed.DEAD,
    Trigger.EXPIRE: Failed.EXPIRED,
    Trigger.DROP: Failed.EXPIRED_DROPPED,
}


def _b(text: str) -> bytes:
    return text.encode("utf-8", ENC)


def _claimed(d: Delivery, kind: str | None = None, content: bytes | None = None) -> Claimed:
    return Claimed(
        delivery_id(d),
        text(d.msgid),
        kind or ("topic" if d.topic else "queue"),
        (d.content or b"") if content is None else content,
        d.attempt,
        d.recipient or d.copy,
        d.stored_at,
        d.trace,
    )


@dataclass
class _Bucket:
    """DELIVERY_RATE's token bucket of one app (a tenth of a second's burst)."""

    tokens: float = -1.0
    at: int = 0

    def take(self, rate: float, now: int, n: int) -> tuple[int, float]:
        burst = max(1.0, rate / 10)
        if self.tokens < 0:
            self.tokens = burst
        self.tokens = min(burst, self.tokens + (now - self.at) * rate / 1000)
        self.at = now
        granted = min(n, int(self.tokens))
        self.tokens -= granted
        wait = 0.0 if granted == n else (1 - self.tokens % 1) / rate
        return granted, wait


@dataclass
class Owners:
    wires: Wires
    prefix: str
    policy: Policy
    dedupe_ms: int
    recipients_of: Callable[[str], Sequence[str]]
    # take the app now if it is unowned and ours (Ownership.take): a store for an app
    # nobody owns yet need not wait for the next ownership round
    take: Callable[[str, int], Awaitable[bool]] | None = None
    # an answer another broker forwarded (skmq/queue/forward.py), for the engine's router
    questions: Callable[[str, bytes], None] | None = None
    # how long an answer waits for its write (STORE_TIMEOUT): a stalled Redis must not
    # hold a recipient's answer for ever
    timeout: float = 10.0
    # how long the records of answers and pushes wait for a store's flush to carry them
    # (ACK_LINGER) before a flush of their own
    linger: float = 0.0
    # the loop woke from a stall lately (skmq/stall.py): leases run out no sooner than
    # the answers that waited in the sockets meanwhile are read
    settling: Callable[[], bool] = lambda: False
    # lists an app in the apps directory when a store set its mark anew
    lister: Lister | None = None
    backlog_held: int = BACKLOG_HELD  # (BACKLOG_HELD: an owner's queue messages in memory)
    owned: dict[str, AppOwner] = field(default_factory=dict)
    unread: set[str] = field(default_factory=set)  # owned apps whose inbox has news
    timed_out: dict[str, list[Change]] = field(default_factory=dict)  # for the reaper
    buckets: dict[str, _Bucket] = field(default_factory=dict)
    # each app's last TTL sweep (ms) and the next expiry it found (AppQueue.expire_waiting)
    swept: dict[str, tuple[int, int | None]] = field(default_factory=dict)

    async def _durable(self, owner: AppOwner, linger: float = 0.0) -> None:
        """Until what the owner recorded is in the journal, TIMEOUT at most (then a
        store error; the write goes on, for the callers after); the flush waits up to
        `linger` for another to carry it."""
        done = owner.durable(linger)
        try:
            async with asyncio.timeout(self.timeout):
                await asyncio.shield(done)
        except TimeoutError:
            done.add_done_callback(observed)
            raise RedisTimeoutError(f"the owner's write took over {self.timeout} s") from None

    # -- ownership -----------------------------------------------------------------
    async def gained(self, app: str, lease: Lease, now: int) -> AppOwner:
        keys = AppKeys.of(self.prefix, app)
        wire = await self.wires.of(keys.epoch)  # (its master: the app's writes)
        owner = AppOwner(
            Journal(wire, keys, lease, self.dedupe_ms, self.lister),
            self.policy,
            lambda: self.recipients_of(app),
            held=self.backlog_held,
        )
        await owner.load(now)
        self.owned[app] = owner
        # (a wake-up that came while it loaded, the app not owned yet, was not heard:
        # its inbox is read again at its first claim)
        self.unread.add(app)
        if owner.adopted:  # (for the reaper: logged as timeouts)
            self.timed_out.setdefault(app, []).extend(owner.adopted)
        return owner

    def lost(self, app: str) -> None:
        self.owned.pop(app, None)
        self.timed_out.pop(app, None)
        self.swept.pop(app, None)

    def told(self, app: str) -> None:
        """Another broker appended to the app's inbox (its wake-up): read it next claim."""
        if app in self.owned:
            self.unread.add(app)

    async def read_inbox(self, app: str, now: int) -> None:
        """What other brokers appended to an owned app's inbox: messages materialised,
        questions (forwarded answers) handed on."""
        self.unread.discard(app)
        owner = self.owned.get(app)
        if owner is None:
            return
        while await owner.read_inbox(now):
            pass
        if owner.questions and self.questions is not None:
            asked, owner.questions = owner.questions, []
            for raw in asked:
                self.questions(app, raw)

    def _tick(self, app: str, owner: AppOwner, now: int) -> None:
        if self.settling():
            return
        for change in owner.queue.tick(now):
            if change.source is State.IN_FLIGHT:
                self.timed_out.setdefault(app, []).append(change)

    # -- the engine's calls ---------------------------------------------------------
    async def claim(
        self,
        app: str,
        now: int,
        n: int,
        alive: Sequence[AliveRecipient],
        assignment: Sequence[str],
        rate: float = 0.0,
        lost: Sequence[str] = (),
    ) -> ClaimResult:
        """As OwnedStore.claim: queue messages to `assignment` in order, topic copies to the
        alive recipients with room; the expired and undeliverable met on the way.

        Returns once their records are in the journal, fenced by this owner's epoch
        (as a store's carried claim does): a push leaves only when a new owner would
        know of it. An owner taken over meanwhile (stalled past its lease) claims
        nothing and drops the app; after a kill -9 every push that left is known to the
        new owner, which times it out."""
        owner = self.owned.get(app)
        if owner is None:
            return [], None, 0.0
        q = owner.queue
        if app in self.unread:
            await self.read_inbox(app, now)
        await owner.refill(now, len(assignment))
        self._tick(app, owner, now)
        self._sweep(app, owner, now)
        owner.fan_out(now)
        rate_wait = 0.0
        if rate > 0:
            n, rate_wait = self.buckets.setdefault(app, _Bucket()).take(rate, now, n)
            assignment = assignment[:n]
        out: list[Claimed] = []
        went: list[Delivery] = []  # pushed
        capable = next((r.rid for r in alive if r.takes_length), None)
        length_ok = {r.rid: r.takes_length for r in alive}
        queue_msgs = list(q.take(len(assignment), now))
        await owner.contents(queue_msgs)
        for d, rid in zip(queue_msgs, assignment, strict=False):
            content = d.content or b""
            if (b"\r" in content or b"\n" in content) and not length_ok.get(rid):
                if capable is None:
                    q.undeliverable(d, UNDELIVERABLE, now)
                    out.append(_claimed(d, "dead", UNDELIVERABLE.encode()))
                    continue
                rid = capable
            q.push(d, rid, now)
            out.append(_claimed(d))
            went.append(d)
        budget = n - len(queue_msgs)
        copies: list[Delivery] = []
        for r in alive:
            room = min(r.free - sum(1 for c in out if c.recipient == r.rid), budget)
            for d in list(q.take(max(0, room), now, r.rid)):
                q.push(d, r.rid, now)
                copies.append(d)
                budget -= 1
        # A copy of a recipient neither alive nor lost (unregistered, removed): one a
        # claim handed to it, which the pusher fails (no longer registered), its
        # attempts spent; none waits for it for ever.
        registered = {r.rid for r in alive} | set(lost)
        for line in q.lines():
            if line != QUEUE and line not in registered:
                for d in list(q.take(1, now, line)):
                    q.push(d, line, now)
                    copies.append(d)
        await owner.contents(copies)
        out.extend(_claimed(d) for d in copies)
        went.extend(copies)
        for change in q.expired:
            d = change.delivery
            out.append(_claimed(d, "expired", b"drop" if d.state is State.DROPPED else b"dead"))
        q.expired.clear()
        if out:  # (dead letters: there when the caller logs them)
            try:
                await self._durable(owner)
            except Fenced:  # taken over meanwhile: nothing of this flush landed
                self.lost(app)
                return [], None, 0.0
            except TROUBLE:  # (the write goes on: handed back, no attempt spent)
                for d in went:
                    with contextlib.suppress(Refused):  # (its lease ran out meanwhile)
                        q.release(d.msgid, d.copy, d.attempt, now)
                raise
        return out, self._due(app, owner, now), rate_wait

    def _sweep(self, app: str, owner: AppOwner, now: int) -> None:
        """Once in SWEEP_MS at most: the waiting deliveries whose TTL ran out, expired
        though no claim takes them (no recipient alive, a lost recipient's copies)."""
        if now - self.swept.get(app, (0, None))[0] >= SWEEP_MS:
            self.swept[app] = (now, owner.queue.expire_waiting(now))

    def _due(self, app: str, owner: AppOwner, now: int) -> int | None:
        """When the app's next delay, lease or TTL runs out (not before the loop settled)."""
        due = owner.queue.next_due()
        last, ahead = self.swept.get(app, (0, None))
        if ahead is not None:  # (the sweep after it)
            ahead = max(ahead, last + SWEEP_MS)
            due = ahead if due is None else min(due, ahead)
        if due is not None and self.settling():  # (leases run out once it has settled)
            due = max(due, now + int(STALL * 1000))
        return due

    async def finish(self, app: str, acks: Sequence[tuple[str, int]], now: int) -> list[Finished]:
        owner = self.owned.get(app)
        out: list[Finished] = []
        for did, attempt in acks:
            msgid, rid = split_delivery(did)
            try:
                if owner is None:
                    raise Refused(State.ACKED, Trigger.ACK)
                d = owner.queue.ack(_b(msgid), rid or QUEUE, attempt, now).delivery
            except Refused:
                out.append(Finished(False, 0, 0, ""))
                continue
            out.append(Finished(True, d.attempt, d.stored_at, d.recipient, bool(d.key)))
        if owner is not None and any(f.ok for f in out):
            await self._durable(owner, self.linger)
        return out

    async def fail(
        self, app: str, failures: Sequence[tuple[str, str, str, str, int]], now: int
    ) -> list[Failed]:
        owner = self.owned.get(app)
        out: list[Failed] = []
        for did, outcome, detail, rid_hint, attempt in failures:
            msgid, rid = split_delivery(did)
            d = owner.queue.deliveries.get((_b(msgid), rid or QUEUE)) if owner else None
            # a recipient's failure ends only an attempt pushed to it
            if owner is None or d is None or (rid is None and rid_hint and d.recipient != rid_hint):
                out.append(Failed(Failed.STALE, d.attempt if d else 0, 0, rid_hint))
                continue
            try:
                change = owner.queue.fail(d.msgid, d.copy, attempt, f"{outcome}: {detail}", now)
            except Refused:
                out.append(Failed(Failed.STALE, d.attempt, 0, rid_hint))
                continue
            out.append(Failed(FAILED_CODES[change.trigger], d.attempt, d.due or now, d.recipient))
        if owner is not None and any(f.code != Failed.STALE for f in out):
            await self._durable(owner, self.linger)
        return out

    async def extend(self, app: str, leases: Sequence[tuple[str, int]], now: int) -> list[Extended]:
        owner = self.owned.get(app)
        out: list[Extended] = []
        for did, attempt in leases:
            msgid, rid = split_delivery(did)
            try:
                if owner is None:
                    raise Refused(State.ACKED, Trigger.EXTEND)
                change = owner.queue.extend(_b(msgid), rid or QUEUE, attempt, now)
            except Refused:
                out.append(Extended(Extended.STALE, 0, 0))
                continue
            d = owner.queue.deliveries[(_b(msgid), rid or QUEUE)]
            code = Extended.LIMIT if change is None else Extended.EXTENDED
            out.append(Extended(code, d.extensions, d.due))
        return out

    async def reap(self, apps: Sequence[str], now: int) -> dict[str, list[Reaped]]:
        out: dict[str, list[Reaped]] = {}
        for app in apps:
            owner = self.owned.get(app)
            if owner is None:
                continue
            self._tick(app, owner, now)
            changes = self.timed_out.pop(app, [])
            out[app] = [
                Reaped(
                    delivery_id(c.delivery),
                    Failed(
                        FAILED_CODES[c.trigger],
                        c.attempt,
                        c.due or now,
                        c.recipient,
                    ),
                )
                for c in changes
            ]
            if changes:
                await self._durable(owner)
        return out

    def take_recovered(self, app: str) -> list[tuple[str, int, str]]:
        """The acks this broker's owner of `app` replayed as it took the app over
        (AppOwner.recovered), not taken yet: (delivery id, attempt, recipient) each."""
        owner = self.owned.get(app)
        if owner is None or not owner.recovered:
            return []
        acks, owner.recovered = owner.recovered, []
        return [(delivery_id(c.delivery), c.attempt, c.recipient) for c in acks]

    async def release(
        self, app: str, deliveries: Sequence[tuple[str, int]], now: int
    ) -> list[bool]:
        owner = self.owned.get(app)
        out = []
        for did, attempt in deliveries:
            msgid, rid = split_delivery(did)
            try:
                if owner is None:
                    raise Refused(State.ACKED, Trigger.RELEASE)
                owner.queue.release(_b(msgid), rid or QUEUE, attempt, now)
                out.append(True)
            except Refused:
                out.append(False)
        if owner is not None and any(out):
            await self._durable(owner)
        return out

    def in_flight_of(self, app: str, msgid: str) -> list[tuple[str, str, int]]:
        """The deliveries of msgid in flight: (delivery id, recipient, attempt)."""
        owner = self.owned.get(app)
        if owner is None:
            return []
        held = owner.queue.deliveries
        raw = _b(msgid)
        found = [held.get((raw, copy)) for copy in (QUEUE, *self.recipients_of(app))]
        return [
            (delivery_id(d), d.recipient, d.attempt)
            for d in found
            if d is not None and d.state is State.IN_FLIGHT
        ]

    def holding(self, msgids: Sequence[str]) -> dict[str, list[str]]:
        """The owned apps holding each msgid (an answer that names no appid)."""
        return {
            msgid: [app for app, owner in self.owned.items() if _b(msgid) in owner.live]
            for msgid in msgids
        }

    async def store(
        self,
        batches: Mapping[str, Sequence[NewMessage]],
        now: int,
        deadline: float | None = None,
        plans: Mapping[str, Sequence[str]] | None = None,
        pushed: dict[str, ClaimResult] | None = None,
        on: dict[str, Wire] | None = None,
    ) -> dict[str, list[bool] | WriteFailed]:
        """Each message stored (True) or a duplicate (False): through the owner where
        this broker owns the app, else appended to the app's inbox. Each app is answered
        for itself: an app whose write failed, or had not returned by `deadline` (the
        loop's time), gets a WriteFailed that says whether it may have landed (on a
        cluster, one master's trouble is its apps' alone). An app of `plans` (its
        dispatcher's free slots, by recipient: a claim the store carries) has its new
        messages pushed with their store where they can be (AppOwner.store_and_push):
        in `pushed`, as a claim of its own would give them (the rest wait for one).
        `on`: each app's connection its messages were written on (REPLICA_ACKS's WAIT
        asks that server)."""
        written_on = on if on is not None else {}

        waited: set[str] = set()  # the apps whose caller still waits for their store

        async def one(app: str, messages: Sequence[NewMessage]) -> list[bool]:
            stored = [
                Stored(
                    _b(m.msgid),
                    m.content,
                    Meta(m.kind == "topic", m.deliver_at, m.expires_at, m.key, m.trace),
                )
                for m in messages
            ]
            owner = self.owned.get(app)
            if owner is None and self.take is not None and await self.take(app, now):
                owner = self.owned.get(app)
            if owner is not None:
                written_on[app] = owner.wire
                try:
                    if plans is None or pushed is None or app not in plans:
                        return await owner.store(stored, now)
                    flags, went = await owner.store_and_push(stored, now, plans[app])
                    if app not in waited:  # (its caller gave up: handed back, for the
                        # dispatcher to claim again, no attempt spent)
                        await self.release(app, [(delivery_id(d), d.attempt) for d in went], now)
                        return flags
                    waiting = owner.queue.lines() or owner.unfanned or app in self.unread
                    pushed[app] = ([_claimed(d) for d in went],
                                   now if waiting else self._due(app, owner, now), 0.0)  # fmt: skip
                    return flags
                except Fenced:  # taken over meanwhile: nothing of this flush landed
                    self.lost(app)
            appended = [Appended(s.msgid, s.content, encode_header(s.meta)) for s in stored]
            keys = AppKeys.of(self.prefix, app)
            wire = written_on[app] = await self.wires.of(keys.inbox)
            ids = await append(wire, keys, now, self.dedupe_ms, appended, self.lister)
            return [i is not None for i in ids]

        async def answered(app: str) -> list[bool] | WriteFailed:
            # Shielded: a caller that stops waiting leaves the write to end, and the owner
            # materialises what its flush logged. (Cancelled, an owner would hold a message
            # its log has, never push it, and its next checkpoint trim it.)
            storing = asyncio.ensure_future(one(app, batches[app]))
            storing.add_done_callback(observed)
            waited.add(app)
            try:
                async with asyncio.timeout_at(deadline):
                    return await asyncio.shield(storing)
            except TROUBLE as exc:
                if isinstance(exc, WriteFailed):
                    return exc
                return WriteFailed(f"{app}: {exc!r}", maybe_ran=not refused_here(exc))
            finally:
                waited.discard(app)

        apps = list(batches)
        if len(apps) == 1:  # (the common case: no task to gather it)
            return {apps[0]: await answered(apps[0])}
        results = await asyncio.gather(*(answered(app) for app in apps))
        return dict(zip(apps, results, strict=True))
