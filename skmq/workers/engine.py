"""The delivery engine: one dispatcher an app, one link a recipient, and the background
loops a broker runs (app discovery and recipient refresh, lease reaping, heartbeats,
the ACK_WAIT sweep). Every state change goes through the store's scripts, so any
number of engines (brokers) can share one Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

import structlog
from redis.exceptions import RedisError

from skmq.aio import cancel_and_wait, spawn
from skmq.codec import Frame
from skmq.config import Settings
from skmq.deliverylog import DeliveryLog, now_ms
from skmq.peer import Peer
from skmq.registry.heartbeat import heartbeat_round
from skmq.registry.own_addresses import OwnAddresses, same_host
from skmq.registry.recipients import Recipient, Registry
from skmq.signing import PushSigner
from skmq.store import Claimed, Failed, Store, split_delivery
from skmq.supervisor import Supervisor
from skmq.workers.answers import AnswerBatcher
from skmq.workers.dispatch import Dispatcher
from skmq.workers.link import ANSWERS, DETAILS, Delivery, LinkTimeouts, RecipientLink, Resp
from skmq.workers.tokens import DeliveryTokens

log = structlog.get_logger("skmq.engine")

# Apps a reap round checks in turn, besides those this broker claimed for lately.
REAP_SWEEP = 500


class Engine:
    def __init__(
        self,
        settings: Settings,
        store: Store,
        dlog: DeliveryLog,
        broker_id: str,
        supervisor: Supervisor,
        on_acked: Callable[[str, int], None] | None = None,
        own: OwnAddresses | None = None,
        signer: PushSigner | None = None,
    ) -> None:
        self.settings = settings
        # Addresses this broker uses itself: never a recipient's (docs/SECURITY.md).
        self.own = own or OwnAddresses()
        self.tokens = DeliveryTokens(b"")
        self.supervisor = supervisor
        self.store = store
        self.dlog = dlog
        self.broker_id = broker_id
        self.registry = Registry(store, dlog, self.notify)
        self.answers = AnswerBatcher(store, dlog, self._answered, on_acked)
        self.links: dict[tuple[str, str], RecipientLink] = {}
        self.dispatchers: dict[str, Dispatcher] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._dispatch_tasks: dict[str, asyncio.Task[None]] = {}
        self._side_tasks: set[asyncio.Task[None]] = set()
        self._known_apps: set[str] = set()
        self._reap_cursor = 0
        # Claims of all dispatchers at once: half the Redis pool at most, so that a wave
        # of dispatchers (thousands of apps found at once) leaves producers room.
        self._claims = asyncio.Semaphore(max(1, settings.redis_pool_size // 2))
        self._stopping = False
        self.healthy = True
        self.signer = signer  # None: pushes are not signed

    # -- lifecycle ----------------------------------------------------------
    async def start(self, orphans: bool = False) -> None:
        """`orphans`: every lease in Redis is a dead process's (this broker owns its Redis
        alone, as with the embedded one): hand them back now rather than at expiry."""
        await self.store.load_scripts()
        self.tokens = DeliveryTokens(await self.store.delivery_secret())
        if orphans:
            await self._release_orphans()
        await self._refresh()
        s = self.settings
        self._tasks = [
            self._loop(self._refresh, min(1.0, s.heartbeat_interval), "refresh"),
            self._loop(self._reap, min(1.0, max(0.05, s.ack_timeout / 4)), "reap"),
            self._loop(self._heartbeat, s.heartbeat_interval, "heartbeat"),
            self._loop(self._sweep_links, min(1.0, max(0.05, s.ack_wait / 2)), "links"),
        ]

    async def _release_orphans(self) -> None:
        for app in await self.store.apps():
            ids = await self.store.in_flight(app)
            released = await self.store.release(app, ids)
            if ids:
                log.info("in-flight messages of a previous run handed back", app=app,
                         count=sum(released))  # fmt: skip

    def _loop(
        self, step: Callable[[], Awaitable[None]], interval: float, name: str
    ) -> asyncio.Task[None]:
        """A background step every `interval`, under the supervisor: a Redis error marks the
        broker unhealthy until a step succeeds, anything else restarts the loop."""

        async def run() -> None:
            while not self._stopping:
                await asyncio.sleep(interval)
                try:
                    await step()
                    self.healthy = True
                except (RedisError, OSError) as exc:
                    self.healthy = False
                    log.warning("background step failed", step=name, error=repr(exc))

        return self.supervisor.start(name, run)

    async def stop(self) -> None:
        """Stop claiming, give in-flight pushes SHUTDOWN_TIMEOUT to be answered, then hand
        whatever is left back to Redis (no attempt spent), for this or another broker."""
        self._stopping = True
        for d in self.dispatchers.values():
            d.paused = True
            d.wake.set()
        await cancel_and_wait([*self._dispatch_tasks.values(), *self._tasks])
        deadline = time.monotonic() + self.settings.shutdown_timeout
        while any(link.inflight for link in self.links.values()) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        await self.answers.drain()
        by_app: dict[str, list[str]] = {}
        for link in self.links.values():
            by_app.setdefault(link.app, []).extend(d.delivery_id for d in link.inflight.values())
            link.inflight.clear()
        for app, ids in by_app.items():
            with contextlib.suppress(RedisError, OSError):
                await self.store.release(app, ids)
        for link in self.links.values():
            link.close()
        await cancel_and_wait(self._side_tasks)

    # -- dispatch -----------------------------------------------------------
    def notify(self, app: str) -> None:
        """Wake the app's dispatcher (creating it for an app seen for the first time)."""
        if self._stopping:
            return
        d = self.dispatchers.get(app)
        if d is None:
            d = self.dispatchers[app] = Dispatcher(
                app,
                self.store,
                self.registry.alive,
                self._free_slots,
                self._deliver,
                self.settings.delivery_rate,
                self._claims,
            )
            self._dispatch_tasks[app] = self.supervisor.start("dispatch", d.run, app=app)
        d.wake.set()

    def _answered(self, app: str, failed: bool) -> None:
        """Answers free window slots; failures also schedule retries whose due time the
        dispatcher must learn. A dispatcher that has neither to wait for sleeps on."""
        d = self.dispatchers.get(app)
        if d is not None and (failed or d.starved):
            d.wake.set()

    async def note_apps(self, apps: set[str]) -> None:
        """Record apps in Redis (once a process), so that every broker finds them."""
        new = apps - self._known_apps
        if new:
            await self.store.add_apps(new)
            self._known_apps |= new

    def _link(self, app: str, r: Recipient) -> RecipientLink:
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
                max_frame_bytes=s.max_frame_bytes,
            )
        return link

    def _free_slots(self, app: str, recipients: list[Recipient]) -> dict[str, int]:
        """Free window slots of each recipient that is not stalled (a full window whose
        oldest push has waited longer than a healthy recipient would take)."""
        stall_after = min(1.0, self.settings.ack_timeout / 2)
        now = time.monotonic()
        free = {}
        for r in recipients:
            link = self._link(app, r)
            if link.benched(now):
                continue
            if link.free > 0 or not link.stalled(now, stall_after):
                free[r.id] = link.free
        return free

    def _deliver(self, app: str, claimed: list[Claimed]) -> None:
        orphans: list[Delivery] = []
        forbidden: list[Delivery] = []
        for c in claimed:
            if c.kind == "dead":
                self._undeliverable(app, c)
                continue
            d = Delivery(app, c.delivery_id, c.msgid, c.kind, c.content, c.attempt, c.recipient)
            r = self.registry.get(app, c.recipient)
            if r is None:
                orphans.append(d)
                continue
            if self.own.used_by_broker(r.host, r.port):
                forbidden.append(d)
                continue
            link = self._link(app, r)
            if "token" in link.caps:
                d.token = self.tokens.make(app, c.delivery_id, c.attempt)
            link.push(d)
            self.dlog.event("pushed", c.msgid, app, c.kind, c.recipient, c.attempt)
        if orphans:
            spawn(
                self._unreachable(app, "", orphans, "recipient no longer registered"),
                self._side_tasks,
            )
        for d in forbidden:
            spawn(
                self._unreachable(
                    app, d.recipient, [d], "recipient address is one the broker uses itself"
                ),
                self._side_tasks,
            )

    def _undeliverable(self, app: str, c: Claimed) -> None:
        kind = "topic" if split_delivery(c.delivery_id)[1] is not None else "queue"
        reason = c.content.decode()
        self.dlog.event("dead_lettered", c.msgid, app, kind, c.recipient or None, 0, reason)
        log.warning("message dead-lettered", app=app, msgid=c.msgid, reason=reason)

    # -- LinkOwner ----------------------------------------------------------
    def push_fields(self, app: str, msgid: str, content: bytes) -> tuple[tuple[str, str], ...]:
        """Extension fields of a push: its signature when SIGNING_SECRET is set."""
        return self.signer.fields(app, msgid, content) if self.signer is not None else ()

    def on_arrived(self, link: RecipientLink, d: Delivery) -> None:
        self.dlog.event("arrived", d.msgid, link.app, d.kind, link.rid, d.attempt)

    def on_answer(
        self,
        link: RecipientLink,
        d: Delivery,
        outcome: str,
        detail: str,
        reply: Callable[[Resp], None],
    ) -> None:
        self.answers.submit(link.app, d.delivery_id, outcome, detail, link.rid, d.attempt, reply)

    def on_unknown_answer(
        self, link: RecipientLink, frame: Frame, reply: Callable[[Resp], None]
    ) -> None:
        async def late() -> None:
            try:
                reply(await self.answer(frame, sender=(link.app, link.rid)))
            except (RedisError, OSError):
                reply(("error", "store unavailable, answer again later"))

        spawn(late(), self._side_tasks)

    def on_broken(self, link: RecipientLink, deliveries: list[Delivery], detail: str) -> None:
        for d in deliveries:
            self.answers.submit(link.app, d.delivery_id, "errored", detail, link.rid, d.attempt)

    def on_unreachable(self, link: RecipientLink, deliveries: list[Delivery], detail: str) -> None:
        spawn(self._unreachable(link.app, link.rid, deliveries, detail), self._side_tasks)

    async def _unreachable(
        self, app: str, rid: str, deliveries: list[Delivery], detail: str
    ) -> None:
        """An unreachable recipient is lost; its queue messages go to another recipient
        without spending an attempt, its topic copies count a failed attempt."""
        try:
            if rid:
                await self.registry.mark(app, rid, False, detail)
            queue = [d for d in deliveries if d.kind == "queue"]
            released = await self.store.release(app, [d.delivery_id for d in queue])
            for d, ok in zip(queue, released, strict=True):
                if ok:
                    self.dlog.event(
                        "unreachable", d.msgid, app, d.kind, d.recipient, d.attempt, detail
                    )
            for d in deliveries:
                if d.kind == "topic":
                    self.answers.submit(
                        app, d.delivery_id, "unreachable", detail, d.recipient, d.attempt
                    )
        except (RedisError, OSError) as exc:
            log.warning("could not hand back deliveries; their leases will", error=repr(exc))
        self.notify(app)

    # -- answers that did not come with their push ------------------------------
    async def answer(
        self, frame: Frame, peer: Peer | None = None, sender: tuple[str, str] | None = None
    ) -> Resp:
        """An `arrived`, `ack`, `reject` or `error` for a push this broker may not know:
        on the broker's port (SPEC 3: after `arrived` the recipient may answer on its own
        connection), or on a push connection that did not carry it. `sender`: the (app,
        recipient) whose push connection it came on; else `peer` must be that recipient
        (its registered host, or a connection authenticated for the app), or the frame
        must echo the push's delivery token. Never guessed: an answer that fits no
        delivery in flight, or several, is refused."""
        msgid = frame.fields.get("msgid")
        if not msgid:
            return ("reject", "msgid required")
        app = sender[0] if sender else frame.fields.get("appid") or None
        if app is None:
            app = await self.store.find_app(msgid)
            if app is None:
                return ("reject", f"message {msgid!r} is not in flight")
        named = sender[1] if sender else frame.fields.get("recipient") or None
        found = await self.store.in_flight_of(app, msgid)
        if named is not None:
            found = [f for f in found if f[1] == named]
        if not found:
            return ("reject", f"message {msgid!r} is not in flight")
        token = frame.fields.get("token")
        if token is not None:
            found = [f for f in found if self.tokens.attempt_of(token, app, f[0]) == f[2]]
            if not found:
                return ("reject", "delivery token does not match a delivery in flight")
        elif sender is None:
            found = [f for f in found if self._sent_by(peer, app, f[1])]
            if not found:
                return ("reject", f"message {msgid!r} is not in flight to a recipient you are")
        if len(found) > 1:
            found = [f for f in found if self._arrived_here(app, f[1], msgid)] or found
        if len(found) > 1:
            return (
                "reject",
                f"ambiguous: {len(found)} copies of {msgid!r} are in flight to recipients at "
                "your address; name one (recipient=) or echo the push's token",
            )
        delivery_id, rid, attempt = found[0]
        link = self.links.get((app, rid))
        local = None
        if link is not None:
            local = link.inflight.get(msgid) or link.expired.get(msgid)
        if frame.type == "arrived":
            if link is not None and local is not None:
                local.arrived_at = time.monotonic()
                self.on_arrived(link, local)
            return ("ack", "arrived")
        if link is not None and local is not None:
            if link.take(msgid) is None:
                link.expired.pop(msgid, None)
            link.benched_until = 0.0
        outcome = ANSWERS[frame.type]
        detail = (frame.content or b"").decode("utf-8", "replace") or DETAILS[frame.type]
        return await self.answers.submit_and_wait(app, delivery_id, outcome, detail, rid, attempt)

    def _sent_by(self, peer: Peer | None, app: str, rid: str) -> bool:
        """True when peer is the recipient rid of app: authenticated for the app, or
        connecting from the host it registered."""
        if peer is None:
            return False
        if peer.authenticated_for(app):
            return True
        r = self.registry.get(app, rid)
        return r is not None and same_host(r.host, peer.host)

    def _arrived_here(self, app: str, rid: str, msgid: str) -> bool:
        link = self.links.get((app, rid))
        if link is None:
            return False
        d = link.inflight.get(msgid) or link.expired.get(msgid)
        return d is not None and d.arrived_at > 0

    # -- background steps -----------------------------------------------------
    async def _refresh(self) -> None:
        apps = await self.store.apps()
        self._known_apps.update(apps)
        await self.registry.refresh(apps)
        for app in apps:
            if app not in self.dispatchers:
                self.notify(app)
        await self._forget_empty([app for app in apps if not self.registry.all(app)])
        await self.store.note_broker(
            self.broker_id,
            {"last_seen": now_ms(), "host": self.settings.host, "port": self.settings.port},
        )

    async def _forget_empty(self, apps: list[str]) -> None:
        """Forget apps without recipients that hold no message (the store decides, one
        script an app): out of the apps set, no dispatcher, nothing held here."""
        gone = set()
        for app in await self.store.forget_apps(apps):
            if self.registry.all(app):  # registered here meanwhile: the next refresh has it
                continue
            gone.add(app)
            d = self.dispatchers.pop(app, None)
            if d is not None:
                d.paused = True
                d.wake.set()
            task = self._dispatch_tasks.pop(app, None)
            if task is not None:  # ends on its own now; held until then
                self._side_tasks.add(task)
                task.add_done_callback(self._side_tasks.discard)
            self._known_apps.discard(app)
            self.registry.forget(app)
            log.info("app forgotten: no recipients, no messages", app=app)
        for key in [key for key in self.links if key[0] in gone]:
            self.links.pop(key).close()  # nothing in flight: the app holds no message

    async def _reap(self) -> None:
        """Leases that ran out: pushes never answered, here or on a broker that died.

        One round trip a round: the apps this broker claimed for lately, and the next
        REAP_SWEEP apps in turn (leases of other brokers), so that a round's work does not
        grow with the number of apps."""
        recent = time.monotonic() - 2 * self.settings.ack_timeout
        apps = list(self.dispatchers)
        start = self._reap_cursor % len(apps) if apps else 0
        self._reap_cursor = start + REAP_SWEEP
        turn = set(apps[start : start + REAP_SWEEP])
        turn.update(app for app, d in self.dispatchers.items() if d.last_claim > recent)
        for app, reaped in (await self.store.reap(sorted(turn), now_ms())).items():
            for r in reaped:
                if r.result.code == Failed.STALE:
                    continue
                msgid, crid = split_delivery(r.delivery_id)
                rid = crid or r.result.recipient
                link = self.links.get((app, rid))
                if link is not None:
                    link.timed_out(msgid, time.monotonic(), self.settings.ack_timeout)
                self.answers.record_failure(
                    app,
                    r.delivery_id,
                    "timeout",
                    "no final answer within ack_timeout",
                    rid,
                    r.result,
                )
            if reaped:
                self.notify(app)

    async def _heartbeat(self) -> None:
        s = self.settings
        ttl = max(1, int(s.heartbeat_interval * 900))
        if not await self.store.take_turn("heartbeat", self.broker_id, ttl):
            return
        targets = [
            (app, r.id, r.host, r.port)
            for app in self.registry.apps()
            for r in self.registry.all(app)
        ]

        async def report(app: str, rid: str, ok: bool) -> None:
            await self.registry.mark(app, rid, ok, "" if ok else "no pong within heartbeat_timeout")

        await heartbeat_round(targets, s.heartbeat_timeout, report)

    async def _sweep_links(self) -> None:
        now = time.monotonic()
        for link in self.links.values():
            link.close_if_waiting_only(self.settings.ack_wait, now)
            if link.drop_expired(now, self.settings.ack_timeout):
                self._answered(link.app, False)
