"""The delivery engine: one dispatcher an app, one link a recipient, and the background
loops a broker runs (app discovery and recipient refresh, lease reaping, heartbeats,
the ACK_WAIT sweep). Every state change goes through the store's scripts, so any
number of engines (brokers) can share one Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable

import structlog
from redis.exceptions import RedisError

from skmq.aio import cancel_and_wait, spawn
from skmq.codec import Frame
from skmq.config import Settings
from skmq.deliverylog import DeliveryLog, now_ms
from skmq.registry.heartbeat import heartbeat_round
from skmq.registry.recipients import Recipient, Registry
from skmq.store import Claimed, Failed, Store, split_delivery
from skmq.workers.answers import AnswerBatcher, Resp
from skmq.workers.dispatch import Dispatcher
from skmq.workers.link import ANSWERS, DETAILS, Delivery, RecipientLink
from skmq.workers.rotation import Rotation

log = structlog.get_logger("skmq.engine")

# Apps a refresh or reap round visits in turn (besides those it must see now: new apps,
# apps claimed for lately), so that a round's work does not grow with the number of apps.
APPS_A_ROUND = 500


class Engine:
    def __init__(
        self,
        settings: Settings,
        store: Store,
        dlog: DeliveryLog,
        broker_id: str,
        on_acked: Callable[[str, int], None] | None = None,
    ) -> None:
        self.settings = settings
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
        self._refresh_turns = Rotation(APPS_A_ROUND)
        self._reap_turns = Rotation(APPS_A_ROUND)
        # Claims of all dispatchers at once: half the Redis pool at most, so that a wave
        # of dispatchers (thousands of apps found at once) leaves producers room.
        self._claims = asyncio.Semaphore(max(1, settings.redis_pool_size // 2))
        self._stopping = False
        self.healthy = True

    # -- lifecycle ----------------------------------------------------------
    async def start(self, orphans: bool = False) -> None:
        """`orphans`: every lease in Redis is a dead process's (this broker owns its Redis
        alone, as with the embedded one): hand them back now rather than at expiry."""
        await self.store.load_scripts()
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
        async def run() -> None:
            while not self._stopping:
                await asyncio.sleep(interval)
                try:
                    await step()
                    self.healthy = True
                except (RedisError, OSError) as exc:
                    self.healthy = False
                    log.warning("background step failed", step=name, error=repr(exc))

        return asyncio.get_running_loop().create_task(run(), name=f"skmq-{name}")

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
            self._dispatch_tasks[app] = asyncio.get_running_loop().create_task(
                d.run(), name=f"skmq-dispatch-{app}"
            )
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
        if link is not None and (link.host, link.port) != (r.host, r.port):
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
                window=s.push_window,
                connect_timeout=min(s.ack_timeout, max(s.heartbeat_timeout, 1.0)),
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
        for c in claimed:
            d = Delivery(app, c.delivery_id, c.msgid, c.kind, c.content, c.attempt, c.recipient)
            r = self.registry.get(app, c.recipient)
            if r is None:
                orphans.append(d)
                continue
            self._link(app, r).push(d)
            self.dlog.event("pushed", c.msgid, app, c.kind, c.recipient, c.attempt)
        if orphans:
            spawn(
                self._unreachable(app, "", orphans, "recipient no longer registered"),
                self._side_tasks,
            )

    # -- LinkOwner ----------------------------------------------------------
    def on_arrived(self, link: RecipientLink, d: Delivery) -> None:
        self.dlog.event("arrived", d.msgid, link.app, d.kind, link.rid, d.attempt)

    def on_answer(self, link: RecipientLink, d: Delivery, outcome: str, detail: str) -> None:
        def reply(resp: Resp) -> None:
            link.send_resp(d.msgid, *resp)

        self.answers.submit(link.app, d.delivery_id, outcome, detail, link.rid, d.attempt, reply)

    def on_unknown_answer(self, link: RecipientLink, frame: Frame) -> None:
        async def late() -> None:
            status, content = await self.answer(frame, link.app, link.rid)
            link.send_resp(frame.fields.get("msgid", ""), status, content)

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

    # -- answers on the broker's own port (the recipient's own connection) ---
    def _find_local(
        self, app: str | None, msgid: str, rid: str | None
    ) -> tuple[RecipientLink, Delivery] | None:
        """The push an answer from the recipient's own connection is for. Such answers
        follow `arrived` (SPEC 3), so without a recipient named: a push that arrived, else
        one given up on (its attempt then fences the answer off from a newer attempt),
        else any push of that msgid."""
        links = [
            link
            for link in self.links.values()
            if (not app or link.app == app) and (not rid or link.rid == rid)
        ]
        pushed = [(link, d) for link in links if (d := link.inflight.get(msgid)) is not None]
        for link, d in pushed:
            if d.arrived_at or rid:
                return link, d
        for link in links:
            late = link.expired.get(msgid)
            if late is not None:
                return link, late
        return pushed[0] if pushed else None

    async def answer(self, frame: Frame, app: str | None = None, rid: str | None = None) -> Resp:
        """An `arrived`, `ack`, `reject` or `error` that did not come on a push connection
        (SPEC 3: after `arrived` the recipient may answer on its own connection)."""
        msgid = frame.fields.get("msgid")
        if not msgid:
            return ("error", "msgid required")
        app = app or frame.fields.get("appid") or None
        rid = rid or frame.fields.get("recipient") or None
        found = self._find_local(app, msgid, rid)
        if frame.type == "arrived":
            if found is None:
                return ("ack", "arrived")
            link, d = found
            d.arrived_at = time.monotonic()
            self.on_arrived(link, d)
            return ("ack", "arrived")
        outcome = ANSWERS[frame.type]
        detail = (frame.content or b"").decode("utf-8", "replace") or DETAILS[frame.type]
        if found is not None:
            link, d = found
            if link.inflight.get(msgid) is d:
                link.take(msgid)
            else:
                del link.expired[msgid]
            return await self.answers.submit_and_wait(
                link.app, d.delivery_id, outcome, detail, link.rid, d.attempt
            )
        if app is None:
            app = await self.store.find_app(msgid)
            if app is None:
                return ("error", f"unknown message {msgid!r}")
        delivery_id = await self.store.resolve(app, msgid, rid or "")
        if delivery_id is None:
            return ("error", f"unknown message {msgid!r}")
        crid = split_delivery(delivery_id)[1]
        return await self.answers.submit_and_wait(
            app, delivery_id, outcome, detail, crid or rid or ""
        )

    # -- background steps -----------------------------------------------------
    async def _refresh(self) -> None:
        """Find every broker's apps, refresh their recipients and forget the empty ones:
        apps new to this broker at once, the others APPS_A_ROUND at a time, in turn."""
        apps = await self.store.apps()
        self._known_apps.update(apps)
        new = [app for app in apps if app not in self.dispatchers]
        turn = sorted({*self._refresh_turns.take(apps), *new})
        await self.registry.refresh(turn)
        for app in new:
            self.notify(app)
        await self._forget_empty([app for app in turn if not self.registry.all(app)])
        await self.store.redis.hset(
            self.store.global_key("brokers"),
            self.broker_id,
            json.dumps(
                {"last_seen": now_ms(), "host": self.settings.host, "port": self.settings.port}
            ),
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
        APPS_A_ROUND apps in turn (leases of other brokers)."""
        recent = time.monotonic() - 2 * self.settings.ack_timeout
        turn = set(self._reap_turns.take(list(self.dispatchers)))
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
        lock = self.store.global_key("heartbeat-lock")
        ttl = max(1, int(s.heartbeat_interval * 900))
        if not await self.store.redis.set(lock, self.broker_id, nx=True, px=ttl):
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
