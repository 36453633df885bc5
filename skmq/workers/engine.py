"""The delivery engine: wires the parts of delivery together and runs a broker's
background loops. Each part has one job:

- `Dispatchers` (dispatchers.py): one dispatcher an app, claiming what is due;
- `Pusher` (pusher.py): the links to recipients, and what they report back;
- `AnswerBatcher` (answers.py): every final answer, settled in the store;
- `AnswerRouter` (answering.py): answers that did not come with their push, fenced;
- `Reaper` (reaper.py): leases that ran out;
- heartbeats (skmq/registry/heartbeat.py) and the recipient registry.

Every state change goes to the app's owner (skmq/queue/: the broker that holds its
queue, here or through its inbox), so any number of brokers can share one Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

import structlog
from redis.exceptions import RedisError

from skmq.aio import cancel_and_wait
from skmq.clock import now_ms
from skmq.codec import Frame
from skmq.config import Settings
from skmq.connections import Connections
from skmq.deliverylog import DeliveryLog
from skmq.errors import redis_error_text
from skmq.peer import Peer
from skmq.queue.owned_store import OwnedStore
from skmq.registry.heartbeat import heartbeat_round
from skmq.registry.own_addresses import OwnAddresses
from skmq.registry.recipients import Registry
from skmq.signing import PushSigner
from skmq.stall import StallWatch
from skmq.supervisor import Supervisor
from skmq.workers.answering import AnswerRouter
from skmq.workers.answers import AnswerBatcher
from skmq.workers.app_search import AppSearch
from skmq.workers.dispatch import Dispatcher
from skmq.workers.dispatchers import Dispatchers
from skmq.workers.link import RecipientLink, Verdict
from skmq.workers.pusher import Pusher
from skmq.workers.reaper import Reaper
from skmq.workers.routes import Routes
from skmq.workers.store_hold import StoreHold
from skmq.workers.tokens import DeliveryTokens

log = structlog.get_logger("skmq.engine")


class Engine:
    def __init__(
        self,
        settings: Settings,
        store: OwnedStore,
        dlog: DeliveryLog,
        broker_id: str,
        supervisor: Supervisor,
        on_acked: Callable[[str, int], None] | None = None,
        own: OwnAddresses | None = None,
        signer: PushSigner | None = None,
        throughput: Callable[[], dict[str, list[int]]] | None = None,
    ) -> None:
        self.settings = settings
        self.store = store
        self.broker_id = broker_id
        self.supervisor = supervisor
        self.own = own or OwnAddresses()
        # per app, [in, out] over the last minute, published in the broker's note
        self.throughput = throughput
        self.registry = Registry(store, dlog, self.notify, settings.max_recipients_per_app)
        self.routes = Routes(store)
        self.connections = Connections()
        # a loop woken from a stall reads its sockets before it reaps (skmq/stall.py)
        self.stalls = StallWatch()
        self.answers = AnswerBatcher(store, dlog, self._answered, on_acked)
        self.pusher = Pusher(
            settings, store, dlog, self.registry, self.answers, self.notify, self.own, signer
        )
        self.apps = Dispatchers(
            store,
            self.registry,
            supervisor,
            self.pusher.free_slots,
            self.pusher.deliver,
            settings.delivery_rate,
            settings.redis_pool_size // 2,
        )
        # deliveries before stores on a full CPU (skmq/workers/store_hold.py)
        self.store_hold = StoreHold(
            [self.apps.behind], settings.store_hold_backlog, settings.store_hold_cpu
        )
        self.router = AnswerRouter(
            store,
            self.registry,
            self.pusher,
            self.answers,
            AppSearch(store.find_apps, settings.max_searches_per_host),
        )
        self.connections.add_source(self.pusher.described)
        self.pusher.late_answer = lambda frame, sender: self.router.answer(frame, sender=sender)
        self.reaper = Reaper(
            store, self.apps.by_app, self.pusher, self.answers, self.notify, settings.ack_timeout
        )
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False
        self.healthy = True
        self.trouble = ""  # why the last background step failed (while not healthy)

    @property
    def links(self) -> dict[tuple[str, str], RecipientLink]:
        return self.pusher.links

    @property
    def dispatchers(self) -> dict[str, Dispatcher]:
        return self.apps.by_app

    def notify(self, app: str) -> None:
        self.apps.notify(app)

    async def note_apps(self, apps: set[str]) -> None:
        await self.apps.note_apps(apps)

    async def answer(
        self, frame: Frame, peer: Peer | None = None, apps: list[str] | str | None = None
    ) -> Verdict:
        """An answer on the broker's port (skmq/workers/answering.py); `apps`: what
        AnswerRouter.apps_of said of it."""
        return await self.router.answer(frame, peer, apps=apps)

    def _answered(self, app: str, new_work: bool) -> None:
        self.apps.answered(app, new_work)

    # -- lifecycle ----------------------------------------------------------
    async def start(self, orphans: bool = False) -> None:
        """`orphans`: every lease in Redis is a dead process's (this broker owns its Redis
        alone, as with the embedded one): hand them back now rather than at expiry."""
        self.stalls.start()
        self.store_hold.start()
        await self.store.load_scripts()
        self.pusher.tokens = DeliveryTokens(await self.store.delivery_secret())
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
            released = await self.store.release(app, [(i, 0) for i in ids])
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
                    self.healthy, self.trouble = True, ""
                except (RedisError, OSError) as exc:
                    self.healthy, self.trouble = False, redis_error_text(exc) or repr(exc)
                    log.warning("background step failed", step=name, error=self.trouble)

        return self.supervisor.start(name, run)

    async def stop(self) -> None:
        """Stop claiming, give in-flight pushes SHUTDOWN_TIMEOUT to be answered, then hand
        whatever is left back to Redis (no attempt spent), for this or another broker.
        Recording the answers and handing back share that time (at least a second): with
        the store stalled, what is not done by then runs out its lease instead."""
        self._stopping = True
        await cancel_and_wait([*self.apps.pause(), *self._tasks])
        deadline = time.monotonic() + self.settings.shutdown_timeout
        while any(True for _ in self.pusher.in_flight()) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        with contextlib.suppress(TimeoutError, RedisError, OSError):
            async with asyncio.timeout(max(1.0, deadline - time.monotonic())):
                await self.answers.drain()
                by_app: dict[str, list[tuple[str, int]]] = {}
                for d in self.pusher.in_flight():
                    by_app.setdefault(d.app, []).append((d.delivery_id, d.attempt))
                await asyncio.gather(
                    *(self.store.release(app, ids) for app, ids in by_app.items()),
                    return_exceptions=True,
                )
        self.pusher.close()
        self.stalls.stop()
        self.store_hold.stop()
        await cancel_and_wait(self.pusher.tasks)

    # -- background steps -----------------------------------------------------
    async def _refresh(self) -> None:
        self.pusher.forget(await self.apps.refresh())
        await self.routes.refresh(self.apps.known)
        note = {
            "last_seen": now_ms(),
            "host": self.settings.host,
            "port": self.settings.port,
            **self.connections.note(),
        }
        if self.throughput is not None:
            note["minute"] = self.throughput()
        await self.store.note_broker(self.broker_id, note)

    async def _heartbeat(self) -> None:
        s = self.settings
        ttl = max(1, int(s.heartbeat_interval * 900))
        if not await self.store.take_turn("heartbeat", self.broker_id, ttl):
            return
        targets = [
            (app, r.id, r.host, r.port, "identity" in r.caps)
            for app in self.registry.apps()
            for r in self.registry.all(app)
        ]

        async def report(app: str, rid: str, ok: bool) -> None:
            await self.registry.mark(app, rid, ok, "" if ok else "no pong within heartbeat_timeout")

        await heartbeat_round(targets, s.heartbeat_timeout, report, s.heartbeat_concurrency)

    async def _reap(self) -> None:
        await self.stalls.settled()  # (answers that came during a stall first)
        await self.reaper.step()

    async def _sweep_links(self) -> None:
        await self.stalls.settled()
        for app in self.pusher.sweep():
            self._answered(app, False)
