"""The apps this broker serves: one dispatcher an app (skmq/workers/dispatch.py), made
when an app is first seen (stored here, or found in the store's apps set by a refresh)
and dropped when the app is forgotten (no recipients, no messages)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sized

import structlog

from skmq.queue.owned_store import OwnedStore
from skmq.registry.recipients import Recipient, Registry
from skmq.store import ClaimArgs, Claimed
from skmq.supervisor import Supervisor
from skmq.workers.dispatch import Dispatcher
from skmq.workers.rotation import APPS_A_ROUND, Rotation

log = structlog.get_logger("skmq.dispatchers")


class Dispatchers:
    def __init__(
        self,
        store: OwnedStore,
        registry: Registry,
        supervisor: Supervisor,
        free_slots: Callable[[str, list[Recipient]], dict[str, int]],
        deliver: Callable[[str, list[Claimed]], None],
        delivery_rate: float,
        max_claims: int,
    ) -> None:
        self.store = store
        self.registry = registry
        self.supervisor = supervisor
        self.free_slots = free_slots
        self.deliver = deliver
        self.delivery_rate = delivery_rate
        self.by_app: dict[str, Dispatcher] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._ending: set[asyncio.Task[None]] = set()
        self._known: set[str] = set()
        self._turns = Rotation(APPS_A_ROUND)
        # Claims of all dispatchers at once: half the Redis pool at most, so that a wave
        # of dispatchers (thousands of apps found at once) leaves producers room.
        self._claims = asyncio.Semaphore(max(1, max_claims))
        self.stopping = False

    def notify(self, app: str) -> None:
        """Wake the app's dispatcher (creating it for an app seen for the first time)."""
        if self.stopping:
            return
        d = self.by_app.get(app)
        if d is None:
            d = self.by_app[app] = Dispatcher(
                app,
                self.store,
                self.registry.all,
                self.free_slots,
                self.deliver,
                self.delivery_rate,
                self._claims,
            )
            self._tasks[app] = self.supervisor.start("dispatch", d.run, app=app)
        d.wake.set()

    def behind(self, app: str, limit: int) -> int:
        """The app's messages due and not pushed if this broker owns it, they are more
        than `limit` and its recipients had free window slots at the dispatcher's last
        look (skmq/workers/store_hold.py); else 0."""
        due = self.store.unpushed(app)
        d = self.by_app.get(app)
        return due if due > limit and d is not None and d.ready else 0

    def carry_claims(self, stored: Mapping[str, Sized], now: int) -> list[ClaimArgs]:
        """The claims of the idle dispatchers of the apps of `stored` (each app's new
        messages), for a store's round trip to carry (skmq/workers/enqueue.py); the
        others are woken once the store is done."""
        if self.stopping:
            return []
        claims = []
        for app, messages in stored.items():
            d = self.by_app.get(app)
            c = d.carry_claim(now, len(messages)) if d is not None else None
            if c is not None:
                claims.append(c)
        return claims

    def answered(self, app: str, new_work: bool) -> None:
        """Answers free window slots; `new_work`: they also scheduled retries whose due
        time the dispatcher must learn, or let the next message of an ordering key go. A
        dispatcher that has neither to wait for sleeps on."""
        d = self.by_app.get(app)
        if d is not None and (new_work or d.starved):
            d.wake.set()

    async def note_apps(self, apps: set[str]) -> None:
        """Record apps in Redis (once a process), so that every broker finds them."""
        new = apps - self._known
        if new:
            await self.store.add_apps(new)
            self._known |= new

    @property
    def known(self) -> list[str]:
        """Every app listed in the store, as of the last refresh."""
        return sorted(self._known)

    async def refresh(self) -> set[str]:
        """Every app of the store gets a dispatcher here; apps without recipients that
        hold no message are forgotten. Apps new to this broker are seen at once, the
        others APPS_A_ROUND at a time, in turn. Returns the apps forgotten."""
        apps = await self.store.apps()
        self._known.update(apps)
        new = [app for app in apps if app not in self.by_app]
        turn = sorted({*self._turns.take(apps), *new})
        await self.registry.refresh(turn)
        for app in new:
            self.notify(app)
        return await self._forget_empty([app for app in turn if not self.registry.all(app)])

    async def _forget_empty(self, apps: list[str]) -> set[str]:
        """The store decides (one script an app): out of the apps set, no dispatcher,
        nothing held here."""
        gone = set()
        for app in await self.store.forget_apps(apps):
            if self.registry.all(app):  # registered here meanwhile: the next refresh has it
                continue
            gone.add(app)
            d = self.by_app.pop(app, None)
            if d is not None:
                d.paused = True
                d.wake.set()
            task = self._tasks.pop(app, None)
            if task is not None:  # ends on its own now; held until then
                self._ending.add(task)
                task.add_done_callback(self._ending.discard)
            self._known.discard(app)
            self.registry.forget(app)
            log.info("app forgotten: no recipients, no messages", app=app)
        return gone

    def pause(self) -> list[asyncio.Task[None]]:
        """Stop claiming; returns the dispatchers' tasks, for the caller to wait on."""
        self.stopping = True
        for d in self.by_app.values():
            d.paused = True
            d.wake.set()
        return [*self._tasks.values(), *self._ending]
