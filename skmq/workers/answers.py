"""Final answers (ack, reject, error, timeout, broken connection) batched into one script
call an app an event-loop turn, then logged and answered.

Whoever submits an answer gets the `resp` (status, content) to send back through a
callback (or a future, for callers that await); the Redis state changes before the
answer goes out, so an `ack` resp means the broker recorded it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import structlog
from redis.exceptions import RedisError

from skmq.clock import now_ms
from skmq.codec import Status
from skmq.deliverylog import DeliveryLog
from skmq.events import RECOVERED_ACK, Event
from skmq.queue.owned_store import OwnedStore
from skmq.store import Extended, Failed, split_delivery
from skmq.workers.link import Verdict

log = structlog.get_logger("skmq.answers")

# Acks whose finish's answer was lost remembered at most, for the lookup that logs those
# that were recorded after all (AnswerBatcher._reconcile).
MAX_UNCERTAIN = 10_000


@dataclass(slots=True)
class Answer:
    delivery_id: str
    outcome: Event  # acked | rejected | errored | timeout | unreachable
    detail: str
    recipient: str
    attempt: int | None
    done: Callable[[Verdict], None]


def _kind(delivery_id: str) -> str:
    return "topic" if split_delivery(delivery_id)[1] is not None else "queue"


class AnswerBatcher:
    def __init__(
        self,
        store: OwnedStore,
        dlog: DeliveryLog,
        on_done: Callable[[str, bool], None],
        on_acked: Callable[[str, int], None] | None = None,
    ) -> None:
        self.store = store
        self.dlog = dlog
        self.on_done = on_done
        self.on_acked = on_acked
        self._pending: dict[str, list[Answer]] = {}
        # app -> the task settling its answers: each app's alone, so that an app whose
        # node is slow (a stalled master of a cluster) holds up no other app's answers
        self._running: dict[str, asyncio.Task[None]] = {}
        # app -> delivery id -> the ack whose finish's answer was lost
        self._uncertain: dict[str, dict[str, Answer]] = {}
        self._reconciling: asyncio.Task[None] | None = None

    def submit(
        self,
        app: str,
        delivery_id: str,
        outcome: Event,
        detail: str = "",
        recipient: str = "",
        attempt: int | None = None,
        done: Callable[[Verdict], None] = lambda resp: None,
    ) -> None:
        self._pending.setdefault(app, []).append(
            Answer(delivery_id, outcome, detail, recipient, attempt, done)
        )
        if app not in self._running:
            self._running[app] = asyncio.get_running_loop().create_task(self._run(app))

    async def _run(self, app: str) -> None:
        try:
            while answers := self._pending.pop(app, None):
                await self._flush(app, answers)
        finally:
            del self._running[app]

    async def drain(self) -> None:
        while self._running:
            await asyncio.shield(next(iter(self._running.values())))

    async def _flush(self, app: str, answers: list[Answer]) -> None:
        acks = [a for a in answers if a.outcome == Event.ACKED]
        fails = [a for a in answers if a.outcome != Event.ACKED]
        released = False  # an ack let the next message of its ordering key go
        now = now_ms()
        if acks:
            try:
                done = await self.store.finish(
                    app, [(a.delivery_id, a.attempt or 0) for a in acks], now
                )
            except (RedisError, OSError) as exc:
                self._unavailable(app, acks, exc)
                self._remember(app, acks)
            else:
                uncertain = self._uncertain.get(app, {})
                for a, f in zip(acks, done, strict=True):
                    if f.ok:
                        uncertain.pop(a.delivery_id, None)  # (the lost one was not recorded)
                    self._finished(app, a, f.ok, f.attempt, f.stored_ts, f.recipient, now)
                if not uncertain:  # (none left to look up: no lookup of nothing)
                    self._uncertain.pop(app, None)
                released = any(f.released for f in done)
                if self._uncertain and self._reconciling is None:
                    self._reconciling = asyncio.get_running_loop().create_task(self._reconcile())
        if fails:
            items = [
                (a.delivery_id, a.outcome, a.detail, a.recipient, a.attempt or 0) for a in fails
            ]
            try:
                results = await self.store.fail(app, items, now)
            except (RedisError, OSError) as exc:
                self._unavailable(app, fails, exc)
            else:
                for a, r in zip(fails, results, strict=True):
                    a.done(
                        self.record_failure(app, a.delivery_id, a.outcome, a.detail, a.recipient, r)
                    )
        self.on_done(app, bool(fails) or released)

    def _remember(self, app: str, acks: list[Answer]) -> None:
        """Acks whose finish's answer was lost: they may be recorded."""
        room = MAX_UNCERTAIN - sum(map(len, self._uncertain.values()))
        uncertain = self._uncertain.setdefault(app, {})
        for a in acks[: max(0, room)]:
            uncertain[a.delivery_id] = a

    async def _reconcile(self) -> None:
        """Log `acked` for the acks whose finish's answer was lost and that were recorded
        after all (the audit must not find them in flight for ever): looked up once
        Redis answers a finish again. The others' leases run out and they are retried."""
        try:
            while self._uncertain:
                app, entries = self._uncertain.popitem()
                now = now_ms()
                try:
                    acked = await self.store.acked_of(app, list(entries), now)
                except (RedisError, OSError) as exc:
                    log.warning("could not look up acks whose answer was lost", error=repr(exc))
                    self._uncertain.setdefault(app, {}).update(entries)  # the next finish's
                    return
                for a, ok in zip(entries.values(), acked, strict=True):
                    if ok:
                        msgid = split_delivery(a.delivery_id)[0]
                        kind = _kind(a.delivery_id)
                        self.dlog.event(Event.ACKED, msgid, app, kind, a.recipient or None,
                                        a.attempt, ts=now)  # fmt: skip
        finally:
            self._reconciling = None

    def log_recovered(self, app: str, acks: Sequence[tuple[str, int, str]]) -> None:
        """Log again the acks a new owner found in the journal's tail, (delivery id,
        attempt, recipient) each: the old owner may have died (kill -9) after their write
        and before their `acked` lines, and the audit would find them in flight for ever.
        Marked RECOVERED_ACK: the audit counts such a line only where no other says so."""
        now = now_ms()
        for delivery_id, attempt, rid in acks:
            msgid = split_delivery(delivery_id)[0]
            self.dlog.event(Event.ACKED, msgid, app, _kind(delivery_id), rid or None, attempt,
                            RECOVERED_ACK, ts=now)  # fmt: skip

    @staticmethod
    def _unavailable(app: str, answers: list[Answer], exc: BaseException) -> None:
        """The deliveries stay in flight in Redis; their leases run out and they are retried."""
        log.warning("store unavailable for answers", app=app, error=repr(exc))
        for a in answers:
            a.done((Status.ERROR, "store unavailable, answer again later"))

    def _finished(
        self, app: str, a: Answer, ok: bool, attempt: int, stored: int, rid: str, now: int
    ) -> None:
        msgid = split_delivery(a.delivery_id)[0]
        if not ok:
            a.done((Status.REJECT, "message not in flight (already settled, or a newer attempt)"))
            return
        self.dlog.event(
            Event.ACKED,
            msgid,
            app,
            _kind(a.delivery_id),
            a.recipient or rid,
            a.attempt or attempt,
            ts=now,
        )
        if self.on_acked is not None:
            self.on_acked(app, now - stored)
        a.done((Status.ACK, "acked"))

    async def extend(self, app: str, delivery_id: str, rid: str, attempt: int) -> Verdict:
        """A recipient still working: its lease pushed out (fenced to `attempt`), logged."""
        (e,) = await self.store.extend(app, [(delivery_id, attempt)], now_ms())
        msgid = split_delivery(delivery_id)[0]
        if e.code == Extended.STALE:
            return ("reject", "message not in flight (already settled, or a newer attempt)")
        limit = self.store.max_lease_extensions
        if e.code == Extended.LIMIT:
            return ("reject", f"lease not extended: MAX_LEASE_EXTENSIONS ({limit}) reached")
        detail = f"lease until {e.deadline} ({e.extensions} of {limit})"
        self.dlog.event(Event.EXTENDED, msgid, app, _kind(delivery_id), rid, attempt, detail)
        return ("ack", f"lease extended until {e.deadline} ({e.extensions} of {limit})")

    def expired(
        self, app: str, msgid: str, kind: str, rid: str, attempt: int, dead: bool
    ) -> Verdict:
        """Log a message whose TTL ran out: dead-lettered (reason `expired`) or dropped."""
        fate = self.dlog.expired(msgid, app, kind, rid or None, attempt, dead)
        return ("ack", f"expired: {fate}")

    def record_failure(
        self, app: str, delivery_id: str, outcome: Event, detail: str, recipient: str, r: Failed
    ) -> Verdict:
        """Log a failed attempt and what became of it; returns the resp for whoever answered."""
        msgid = split_delivery(delivery_id)[0]
        kind = _kind(delivery_id)
        rid = recipient or r.recipient
        if r.code == Failed.STALE:
            return (Status.REJECT, "message not in flight (already settled, or a newer attempt)")
        self.dlog.event(outcome, msgid, app, kind, rid, r.attempt, detail or None)
        if r.code in (Failed.EXPIRED, Failed.EXPIRED_DROPPED):
            return self.expired(app, msgid, kind, rid, r.attempt, r.code == Failed.EXPIRED)
        if r.code == Failed.DEAD:
            self.dlog.event(
                Event.DEAD_LETTERED,
                msgid,
                app,
                kind,
                rid,
                r.attempt,
                f"after {r.attempt} attempts; last: {outcome}",
            )
            return (Status.ACK, "dead-lettered")
        self.dlog.event(
            Event.RETRY_SCHEDULED, msgid, app, kind, rid, r.attempt, f"next attempt at {r.due}"
        )
        return (Status.ACK, "retry scheduled")
