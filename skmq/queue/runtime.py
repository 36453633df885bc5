"""The owner engine in a broker: its connection for the owners' writes, the apps it owns
(owners.py) behind the store's engine calls (owned_store.py), the ownership rounds
among the brokers (ownership.py), the inbox wake-ups (inbox_watch.py), and the hand-over
of every owned app when the broker stops."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Sequence
from typing import Any

import structlog

from skmq.aio import cancel_and_wait, spawn
from skmq.clock import now_ms
from skmq.codec import Frame
from skmq.config import Settings
from skmq.queue.deliveries import Policy
from skmq.queue.forward import Forwarder, answer_question
from skmq.queue.inbox_watch import InboxWatch
from skmq.queue.journal import Fenced, Lease
from skmq.queue.operator import FAULT, Request, answer_request, oldest_pending, request_of
from skmq.queue.owned_store import OwnedStore
from skmq.queue.owner import AppOwner
from skmq.queue.owners import Owners
from skmq.queue.ownership import Ownership
from skmq.queue.replica_waits import ReplicaWaits
from skmq.store.client import RedisClient
from skmq.store.wires import TROUBLE, Siblings, Wires
from skmq.supervisor import Supervisor
from skmq.workers.answering import Vouched
from skmq.workers.engine import Engine
from skmq.workers.link import Verdict

log = structlog.get_logger("skmq.queue.runtime")

# Past the moment another broker's lease runs out that an app is tried for: the lease's
# end is known to a round trip (and the Redis clock's expiry to a millisecond).
LAPSE_MARGIN = 0.01


def policy_of(s: Settings) -> Policy:
    return Policy(
        retry_times=s.retry_times,
        backoff_ms=tuple(int(b * 1000) for b in s.retry_backoff),
        jitter=s.retry_jitter,
        lease_ms=int(s.ack_timeout * 1000),
        max_extensions=s.max_lease_extensions,
        drop_expired=s.expired == "drop",
    )


class OwnerRuntime:
    def __init__(
        self,
        settings: Settings,
        wires: Wires,
        store: OwnedStore,
        broker_id: str,
        engine: Engine,
        leases: Wires,
    ) -> None:
        self.settings = settings
        self.wires = wires
        self.leases = leases
        self.store = store
        self.notify = engine.notify
        registry = engine.registry
        self.owners = Owners(
            wires,
            settings.key_prefix,
            policy_of(settings),
            store.dedupe_ms,
            lambda app: [r.id for r in registry.alive(app)],
            timeout=settings.store_timeout,
            linger=settings.ack_linger,
            settling=engine.stalls.settling,
            lister=store.list_app,
            backlog_held=settings.backlog_held,
        )
        self.lease_ms = int(settings.owner_lease * 1000)
        self.ownership = Ownership(
            broker_id,
            settings.key_prefix,
            self.lease_ms,
            leases,
            self._gained,
            self._lost,
        )
        self.owners.take = self.ownership.take
        store.owners = self.owners
        store.notify = self.notify
        # answers through other brokers (skmq/queue/forward.py)
        self.forwarder = Forwarder(wires, settings.key_prefix, broker_id, settings.store_timeout)
        router = engine.router
        router.forward = self._forward
        router.owns = lambda app: app in self.owners.owned
        self.owners.questions = self._asked
        self.tasks: set[asyncio.Task[None]] = set()
        self.apps: list[str] = []  # the apps directory as last read
        self.reader: asyncio.Task[None] | None = None

        async def answer(frame: Frame, vouched: tuple[str, ...] | None) -> Verdict:
            return await router.answer(frame, vouched=Vouched(vouched))

        self._answer = answer

    @classmethod
    async def start(
        cls,
        settings: Settings,
        url: str,
        redis: RedisClient,
        store: OwnedStore,
        broker_id: str,
        engine: Engine,
        supervisor: Supervisor,
        orphans: bool = False,
    ) -> OwnerRuntime:
        # The leases and REPLICA_ACKS's WAITs go on connections of their own: a WAIT
        # holds its connection until the replicas answer (REPLICA_ACK_TIMEOUT at most: a
        # master with no replica yet, after a failover), and the flushes, checkpoints and
        # renewals behind it waited for it (renewals timed out every round).
        wires, leases = (Wires.beside(url, redis, settings.store_timeout) for _ in range(2))
        store.confirms = ReplicaWaits(
            Siblings(settings.store_timeout), settings.replica_acks, store.replica_ack_ms
        )
        runtime = cls(settings, wires, store, broker_id, engine, leases)
        if orphans:
            await runtime.ownership.forget_the_dead(await store.apps())
        await runtime.round()  # the apps that are ours, before the first push
        supervisor.start("owner-rounds", runtime.run)
        watch = InboxWatch(
            redis,
            settings.key_prefix,
            runtime.told,
            runtime.missed,
            (runtime.forwarder.channel, runtime.forwarder.replied),
        )
        supervisor.start("owner-inbox", watch.run)
        return runtime

    def _asked(self, app: str, raw: bytes) -> None:
        """A question (an answer forwarded to us, the owner, or an operator's request:
        skmq/queue/operator.py), answered in a task."""
        request = request_of(raw)

        async def answer() -> None:
            try:
                if request is None:
                    await answer_question(self.wires, self._answer, raw)
                elif (owner := self.owners.owned.get(app)) is not None:
                    reply = await self._reply(owner, app, request)
                    await owner.wire.call("PUBLISH", request.reply, json.dumps(reply))
            except TROUBLE as exc:  # (its asker hears nothing and says `error`)
                log.warning("a question went unanswered", app=app, error=repr(exc))
            except Exception:  # (a forwarded answer's fault: logged, not left unobserved)
                log.exception("a question failed", app=app)

        spawn(answer(), self.tasks)

    async def _reply(self, owner: AppOwner, app: str, request: Request) -> Any:
        """An operator's request done by the owner: its result, or the fault it met, which
        its asker hears (OperatorFault) rather than wait for its timeout."""
        try:
            if request.op == "move":
                return await self.store.move_into(owner, app, request.source, request.ids, now_ms())
            return await answer_request(owner, request, now_ms())
        except TROUBLE:
            raise
        except Exception as exc:
            log.exception("an operator's request failed", app=app)
            return {FAULT: repr(exc)}

    async def _forward(self, app: str, frame: Frame, vouched: Sequence[str] | None) -> Verdict:
        """An answer for an app this broker does not own: if the app is unowned and ours,
        taken now and answered here (as a store takes it: no wait for the next round, and
        no asking an inbox no owner reads); else asked of its owner."""
        if await self.ownership.take(app, now_ms()):
            return await self._answer(frame, None if vouched is None else tuple(vouched))
        return await self.forwarder.ask(app, frame, vouched)

    async def _gained(self, app: str, lease: Lease) -> None:
        await self.owners.gained(app, lease, now_ms())
        log.info("app owned", app=app, epoch=lease.epoch)
        self.notify(app)

    async def _lost(self, app: str) -> None:
        self.owners.lost(app)
        log.info("app no longer owned", app=app)

    def told(self, app: str) -> None:
        """An app's inbox has news: read now (not at its next claim, which may wait for a
        free window slot that only a forwarded answer frees)."""
        if app not in self.owners.owned:
            return
        self.owners.told(app)
        if self.reader is None or self.reader.done():
            self.reader = spawn(self._read_inboxes(), self.tasks)

    async def _read_inboxes(self) -> None:
        while self.owners.unread:
            app = next(iter(self.owners.unread))
            try:
                await self.owners.read_inbox(app, now_ms())
            except TROUBLE as exc:  # (read again at its next claim)
                log.warning("inbox read failed", app=app, error=repr(exc))
                self.owners.told(app)
                return
            self.notify(app)

    def missed(self) -> None:
        for app in list(self.owners.owned):
            self.told(app)

    async def round(self) -> None:
        """Renew (`renew`), then the rest (`upkeep`)."""
        await self.renew()
        await self.upkeep()

    async def renew(self) -> None:
        """Renew the leases of what we own: not held up by the rest of a round, so that
        a node in trouble (each of its calls bounded by a third of the lease) costs no
        other app its lease."""
        self._unbind()
        await self.ownership.renew_all()

    async def upkeep(self) -> None:
        """Take what is ours, and checkpoint what we own (a new owner then replays only
        the journal since). An app whose node is in trouble does not hold up the
        others."""
        try:
            async with asyncio.timeout(self.lease_ms / 3000):
                self.apps = await self.store.apps()
        except TROUBLE as exc:  # (a node of the directory in trouble: the apps read last)
            log.warning("apps directory not read", error=repr(exc))
        before = set(self.owners.owned)
        await self.ownership.take_all(self.apps, now_ms())
        owned = list(self.owners.owned.items())
        await asyncio.gather(
            *(self._checkpoint(app, owner, app not in before) for app, owner in owned)
        )

    async def _checkpoint(self, app: str, owner: AppOwner, just_taken: bool) -> None:
        """The app's checkpoint when one is due (AppOwner.checkpoint_due) and its counts
        for status, their writes each within a third of the lease (its node in trouble
        holds up no other app). An app `just_taken` in this round is checkpointed in the
        next: its dispatcher pushes again what the old owner had in flight first (a
        checkpoint of 100,000 deliveries is some 0.1 s of CPU and a 10 MB write)."""
        now = now_ms()
        bound = self.lease_ms / 3000
        try:
            if not just_taken and owner.checkpoint_due(now):
                await owner.checkpoint(now, bound)
            async with asyncio.timeout(bound):
                due, later, in_flight = owner.counts(now)
                oldest = oldest_pending(owner) or ""
                counted = ("pending", due, "delayed", later, "in_flight", in_flight)
                stats = owner.journal.keys.stats
                await owner.wire.call_many(
                    [
                        ("HSET", stats, *counted, "oldest", oldest),
                        ("PEXPIRE", stats, 3 * self.lease_ms),
                    ]
                )
        except Fenced:
            self.owners.lost(app)
        except TROUBLE as exc:
            log.warning("checkpoint failed", app=app, error=repr(exc))

    def _unbind(self) -> None:
        """Owned apps whose connection closed (Redis restarted, a master died), whose
        master is another now (a failover) or whose owner's write failed (`diverged`: an
        error reply, as a full Redis's OOM): dropped from memory, and taken again on the
        connection to their master now, with a new epoch, their state rebuilt from what
        it holds as a new owner's would be (what was in flight is pushed again)."""
        unbound = [
            app
            for app, owner in self.owners.owned.items()
            if owner.diverged or not self.wires.serves(owner.wire, owner.journal.keys.epoch)
        ]
        for app in unbound:
            self.owners.lost(app)
            self.ownership.held.pop(app, None)
        if unbound:
            log.warning("owned apps' connection lost or write failed: taken again",
                        apps=len(unbound))  # fmt: skip
            self.wires.refresh()

    async def run(self) -> None:
        """Every third of the lease: renew, and the upkeep unless the last one still
        runs (a node in trouble holds it up to a third of a lease a step). Between
        two, as another broker's lease runs out unrenewed: its apps are tried for
        (Ownership.take_lapsed)."""
        loop = asyncio.get_running_loop()
        period = self.lease_ms / 3000
        upkeep: asyncio.Task[None] | None = None
        lapsed: asyncio.Task[None] | None = None
        next_round = loop.time() + period
        while True:
            self.ownership.lapse_seen.clear()
            wake = next_round
            lapse = self.ownership.next_lapse()
            if lapsed is not None and lapsed.done():
                ended: asyncio.Task[None] = lapsed
                lapsed = None
                ended.result()  # (an error not a node's trouble: the supervisor's)
            if lapse is not None and lapsed is None:
                wake = min(wake, loop.time() + (lapse - now_ms()) / 1000 + LAPSE_MARGIN)
            if await self._lapse_seen_before(wake):
                continue  # (when to wake again)
            if loop.time() < next_round:
                lapsed = spawn(self._take_lapsed(), self.tasks)
                continue
            next_round = loop.time() + period
            try:
                await self.renew()
            except TROUBLE as exc:
                log.warning("leases not renewed", error=repr(exc))
            if upkeep is None or upkeep.done():
                if upkeep is not None:
                    upkeep.result()  # (an error not a node's trouble: the supervisor's)
                upkeep = spawn(self._upkeep_logged(), self.tasks)

    async def _lapse_seen_before(self, when: float) -> bool:
        """Wait until `when` (the loop's time); True if a round saw another broker's
        lease first (it may run out sooner)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout_at(when):
                await self.ownership.lapse_seen.wait()
                return True
        return False

    async def _take_lapsed(self) -> None:
        try:
            await self.ownership.take_lapsed(now_ms())
        except TROUBLE as exc:
            log.warning("taking apps whose lease ran out failed", error=repr(exc))
        finally:  # (the loop wakes to see the lease ends that came meanwhile)
            self.ownership.lapse_seen.set()

    async def _upkeep_logged(self) -> None:
        try:
            await self.upkeep()
        except TROUBLE as exc:
            log.warning("ownership upkeep failed", error=repr(exc))

    async def stop(self) -> None:
        """Hand every owned app over at once (not after the lease), its state flushed."""
        with contextlib.suppress(*TROUBLE):
            async with asyncio.timeout(self.settings.shutdown_timeout or 1.0):
                for owner in list(self.owners.owned.values()):
                    await owner.checkpoint(now_ms())
                await self.ownership.release_all()
        await cancel_and_wait(self.tasks)
        for wires in (self.wires, self.leases, self.store.confirms):
            if wires is not None:
                wires.close()
