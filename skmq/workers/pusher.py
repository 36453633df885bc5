"""Pushing: one link a recipient (skmq/workers/link.py), the deliveries a dispatcher
claimed handed to them, and what the links report back (answers, broken connections,
unreachable recipients). Every outcome goes to the answer batcher or the store."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field

import structlog
from redis.exceptions import RedisError

from skmq.aio import spawn
from skmq.codec import Frame, Status
from skmq.config import Settings
from skmq.connections import ConnectionInfo
from skmq.deliverylog import DeliveryLog
from skmq.events import Event
from skmq.queue.owned_store import OwnedStore
from skmq.registry.own_addresses import OwnAddresses
from skmq.registry.recipients import Recipient, Registry
from skmq.signing import PushSigner
from skmq.store import Claimed, split_delivery
from skmq.workers.answers import AnswerBatcher
from skmq.workers.link import Delivery, LinkLimits, LinkTimeouts, RecipientLink, Verdict
from skmq.workers.tokens import DeliveryTokens

log = structlog.get_logger("skmq.pusher")

# An answer that came on a push connection without its push: (frame, (app, rid)) -> resp.
LateAnswer = Callable[[Frame, tuple[str, str]], Awaitable[Verdict]]


@dataclass(eq=False)
class Pusher:
    settings: Settings
    store: OwnedStore
    dlog: DeliveryLog
    registry: Registry
    answers: AnswerBatcher
    notify: Callable[[str], None]
    # Addresses this broker uses itself: never a recipient's (docs/SECURITY.md).
    own: OwnAddresses
    signer: PushSigner | None = None  # None: pushes are not signed
    # Keyed once the store's secret is read.
    tokens: DeliveryTokens = field(init=False, default_factory=lambda: DeliveryTokens(b""))
    late_answer: LateAnswer | None = field(init=False, default=None)
    links: dict[tuple[str, str], RecipientLink] = field(init=False, default_factory=dict)
    tasks: set[asyncio.Task[None]] = field(init=False, default_factory=set)

    # -- links --------------------------------------------------------------
    def link(self, app: str, r: Recipient) -> RecipientLink:
        link = self.links.get((app, r.id))
        if link is not None and (link.host, link.port, link.caps) != (r.host, r.port, r.caps):
            link.close()
            link = None
        if link is None:
            s = self.settings
            link = self.links[(app, r.id)] = RecipientLink(
                self,
                app,
                r.id,
                r.host,
                r.port,
                r.caps,
                window=s.push_window if "pipeline" in r.caps else s.legacy_window,
                timeouts=LinkTimeouts(
                    connect=min(s.ack_timeout, max(s.heartbeat_timeout, 1.0)),
                    handshake=s.handshake_timeout,
                    legacy_answer=s.legacy_answer_timeout,
                ),
                limits=LinkLimits(
                    max_frame_bytes=s.max_frame_bytes,
                    max_unanswered=s.max_unanswered_frames,
                    max_write_buffer=s.max_write_buffer_bytes,
                ),
            )
        return link

    def pushed(self, app: str, rid: str, msgid: str) -> Delivery | None:
        """This broker's push of msgid to rid, still waiting or given up on, if any."""
        link = self.links.get((app, rid))
        return None if link is None else link.pushed(msgid)

    def apps_of(self, msgid: str) -> list[str]:
        """The apps of this broker's pushes of msgid, still waiting or given up on (an
        original recipient's answer names no app)."""
        links = self.links.items()
        return list({app: None for (app, _), link in links if link.pushed(msgid) is not None})

    def settled(self, app: str, rid: str, msgid: str) -> None:
        """A final answer for that push came another way: free its window slot."""
        link = self.links.get((app, rid))
        if link is not None and link.take(msgid) is None:
            link.expired.pop(msgid, None)
        if link is not None:
            link.benched_until = 0.0

    def in_flight(self) -> Iterator[Delivery]:
        for link in self.links.values():
            yield from link.inflight.values()

    def free_slots(self, app: str, recipients: list[Recipient]) -> dict[str, int]:
        """Free window slots of each recipient that is not stalled (a full window whose
        oldest push has waited longer than a healthy recipient would take)."""
        stall_after = min(1.0, self.settings.ack_timeout / 2)
        now = time.monotonic()
        free = {}
        for r in recipients:
            link = self.link(app, r)
            if link.benched(now):
                continue
            if link.free > 0 or not link.stalled(now, stall_after):
                free[r.id] = link.free
        return free

    def sweep(self) -> set[str]:
        """SPEC 3's ACK_WAIT and ACK_TIMEOUT on this broker's pushes; returns the apps
        whose windows this freed."""
        now = time.monotonic()
        freed = set()
        for link in self.links.values():
            link.close_if_waiting_only(self.settings.ack_wait, now)
            if link.drop_expired(now, self.settings.ack_timeout):
                freed.add(link.app)
        return freed

    def timed_out(self, app: str, rid: str, msgid: str, attempt: int = 0) -> None:
        link = self.links.get((app, rid))
        if link is not None:
            link.timed_out(msgid, time.monotonic(), self.settings.ack_timeout, attempt)

    def described(self) -> Iterator[ConnectionInfo]:
        """The push links with a connection open (`skmq connections`)."""
        for link in self.links.values():
            if any(not conn.closed for conn in link.connections):
                address = f"{link.host}:{link.port}"
                yield ConnectionInfo(address, "recipient push link", (link.app,), link.since)

    def forget(self, apps: set[str]) -> None:
        for key in [key for key in self.links if key[0] in apps]:
            self.links.pop(key).close()  # nothing in flight: the app holds no message

    def close(self) -> None:
        for link in self.links.values():
            link.inflight.clear()
            link.close()

    # -- pushing ------------------------------------------------------------
    def deliver(self, app: str, claimed: list[Claimed]) -> None:
        unregistered: list[Delivery] = []
        forbidden: list[Delivery] = []
        for c in claimed:
            if c.kind == "dead":
                self._undeliverable(app, c)
                continue
            if c.kind == "expired":
                self._expired(app, c)
                continue
            d = Delivery(
                c.delivery_id, c.msgid, c.kind, c.content, c.attempt, c.recipient, c.stored_at,
                c.trace, app,
            )  # fmt: skip
            r = self.registry.get(app, c.recipient)
            if r is None:
                unregistered.append(d)
                continue
            if self.own.used_by_broker(r.host, r.port):
                forbidden.append(d)
                continue
            link = self.link(app, r)
            if "token" in link.caps:
                d.token = self.tokens.make(app, c.delivery_id, c.recipient, c.attempt)
            link.push(d)
            self.dlog.event(Event.PUSHED, c.msgid, app, c.kind, c.recipient, c.attempt,
                            f"traceparent={c.trace}" if c.trace else None)  # fmt: skip
        if unregistered:
            self._hand_back(app, "", unregistered, "recipient no longer registered")
        for d in forbidden:
            self._hand_back(
                app, d.recipient, [d], "recipient address is one the broker uses itself"
            )

    def _undeliverable(self, app: str, c: Claimed) -> None:
        kind = "topic" if split_delivery(c.delivery_id)[1] is not None else "queue"
        reason = c.content.decode()
        # never pushed: no attempt (the log's attempts count from 1)
        self.dlog.event(Event.DEAD_LETTERED, c.msgid, app, kind, c.recipient or None, None, reason)
        log.warning("message dead-lettered", app=app, msgid=c.msgid, reason=reason)

    def _expired(self, app: str, c: Claimed) -> None:
        """Its TTL ran out before a push: dead-lettered (reason `expired`) or dropped."""
        kind = "topic" if split_delivery(c.delivery_id)[1] is not None else "queue"
        self.answers.expired(app, c.msgid, kind, c.recipient, c.attempt, c.content == b"dead")

    def _hand_back(self, app: str, rid: str, deliveries: list[Delivery], detail: str) -> None:
        spawn(self._unreachable(app, rid, deliveries, detail), self.tasks)

    async def _unreachable(
        self, app: str, rid: str, deliveries: list[Delivery], detail: str
    ) -> None:
        """An unreachable recipient is lost; its queue messages go to another recipient
        without spending an attempt, its topic copies count a failed attempt."""
        try:
            if rid:
                await self.registry.mark(app, rid, False, detail)
            queue = [d for d in deliveries if d.kind == "queue"]
            released = await self.store.release(app, [(d.delivery_id, d.attempt) for d in queue])
            for d, ok in zip(queue, released, strict=True):
                if ok:
                    self.dlog.event(
                        Event.UNREACHABLE, d.msgid, app, d.kind, d.recipient, d.attempt, detail
                    )
            for d in deliveries:
                if d.kind == "topic":
                    self.answers.submit(
                        app, d.delivery_id, Event.UNREACHABLE, detail, d.recipient, d.attempt
                    )
        except (RedisError, OSError) as exc:
            log.warning("could not hand back deliveries; their leases will", error=repr(exc))
        self.notify(app)

    # -- LinkOwner: what the links report -----------------------------------
    def push_fields(self, app: str, msgid: str, content: bytes) -> tuple[tuple[str, str], ...]:
        """Extension fields of a push: its signature when SIGNING_SECRET is set."""
        return self.signer.fields(app, msgid, content) if self.signer is not None else ()

    def on_arrived(self, link: RecipientLink, d: Delivery) -> None:
        self.dlog.event(Event.ARRIVED, d.msgid, link.app, d.kind, link.rid, d.attempt)

    def on_extend(self, link: RecipientLink, d: Delivery, reply: Callable[[Verdict], None]) -> None:
        async def extend() -> None:
            try:
                resp = await self.answers.extend(link.app, d.delivery_id, link.rid, d.attempt)
            except (RedisError, OSError):
                resp = ("error", "store unavailable, answer again later")
            if resp[0] == "ack":
                d.pushed_at = time.monotonic()  # this broker's own timer follows the lease
            reply(resp)

        spawn(extend(), self.tasks)

    def on_answer(
        self,
        link: RecipientLink,
        d: Delivery,
        outcome: Event,
        detail: str,
        reply: Callable[[Verdict], None],
    ) -> None:
        self.answers.submit(link.app, d.delivery_id, outcome, detail, link.rid, d.attempt, reply)

    def on_unknown_answer(
        self, link: RecipientLink, frame: Frame, reply: Callable[[Verdict], None]
    ) -> None:
        late = self.late_answer
        assert late is not None, "the engine sets late_answer"

        async def answer() -> None:
            try:
                reply(await late(frame, (link.app, link.rid)))
            except (RedisError, OSError):
                reply((Status.ERROR, "store unavailable, answer again later"))

        spawn(answer(), self.tasks)

    def on_broken(self, link: RecipientLink, deliveries: list[Delivery], detail: str) -> None:
        for d in deliveries:
            self.answers.submit(link.app, d.delivery_id, Event.ERRORED, detail, link.rid, d.attempt)

    def on_unreachable(self, link: RecipientLink, deliveries: list[Delivery], detail: str) -> None:
        self._hand_back(link.app, link.rid, deliveries, detail)
