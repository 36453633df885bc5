"""The enqueue worker: producer messages of one handle batch stored in one Redis round
trip (one script call an app, pipelined), logged, and then answered.

A batch's replies are `resp` bytes to be, ready once the batch is stored; each
connection writes them in frame order, so several batches can wait on Redis at once while
every connection still gets its answers in order.

Each app of a batch is answered for itself: on a Redis Cluster, trouble on one master
fails only the apps it holds (skmq/store/shards.py), and an `error` says whether the
message may be stored all the same (UNKNOWN) or certainly is not (NOT_STORED).

Memory while the store is slow or stalled is bounded: a store call (the wait for a
Redis connection included) gives up after STORE_TIMEOUT, its producers then hear
`error` "outcome unknown: store unavailable"; and while MAX_STORE_PENDING_BYTES of
content wait for the store, `room()` holds the handle stage back (backpressure down
to TCP). While the embedded Redis's disk is nearly full nothing is stored or
acknowledged (skmq/store/disk.py). While the broker's CPU is full and an app's
deliveries fall behind, the app's messages wait before they are stored, other apps'
are stored meanwhile (skmq/workers/store_hold.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Mapping, Sized
from dataclasses import KW_ONLY, dataclass, field
from typing import TYPE_CHECKING, Any

import structlog
from redis.exceptions import RedisError

from skmq import tracing
from skmq.aio import spawn
from skmq.clock import now_ms
from skmq.codec import encode_resp
from skmq.deliverylog import DeliveryLog
from skmq.events import Event
from skmq.logs import Throttled
from skmq.queue.owned_store import OwnedStore
from skmq.store import ClaimArgs, NewMessage
from skmq.store.disk import DiskSpace
from skmq.store.shards import ReplicasMissing, WriteFailed
from skmq.store.store import AppStored
from skmq.workers.routes import Routes
from skmq.workers.store_hold import StoreHold

if TYPE_CHECKING:
    from opentelemetry.trace import Span

log = structlog.get_logger("skmq.enqueue")

# A message not acknowledged: its producer hears `error` and one of these. Those that
# start with UNKNOWN (docs/PROTOCOL.md, section 3) may be stored: the store's answer
# was lost after the write (a timeout, a connection lost), or REPLICA_ACKS replicas did
# not confirm it; sent again with the same msgid, it is stored once. NOT_STORED: the
# store certainly did not run (its master unreachable, a refusal such as MOVED).
UNKNOWN = "outcome unknown"
UNAVAILABLE = f"{UNKNOWN}: store unavailable: send it again with the same msgid (it may be stored)"
REPLICAS_MISSING = (
    f"{UNKNOWN}: stored on its master, not confirmed by REPLICA_ACKS replicas: send it again "
    "with the same msgid"
)
NOT_STORED = "not stored: store unavailable: send it again"
# Messages of batches whose store's answer was lost remembered at most, for the lookup
# that logs those that were stored after all (Enqueuer._reconcile).
MAX_UNCERTAIN = 10_000
DISK_LOW = (
    "the store's disk is nearly full (DISK_FREE_LIMIT): send it again later with the same "
    "msgid (it may be stored)"
)


class StoreReply:
    """The resp for one message of a batch, ready once its app's store answered."""

    __slots__ = ("answer", "index", "msgid")

    def __init__(self, answer: asyncio.Future[AppAnswer], index: int, msgid: str) -> None:
        self.answer = answer
        self.index = index
        self.msgid = msgid

    def done(self) -> bool:
        return self.answer.done()

    def add_done_callback(self, callback: Callable[[Any], object]) -> None:
        self.answer.add_done_callback(callback)

    def result(self) -> bytes:
        results = self.answer.result()
        if isinstance(results, str):
            return encode_resp("error", results, self.msgid)
        if results[self.index]:
            return encode_resp("ack", "stored", self.msgid)
        return encode_resp(
            "ack", "duplicate: a message with this msgid is already stored", self.msgid
        )


# An app's answer: each message stored (or a duplicate), or why none is acknowledged
AppAnswer = list[bool] | str


class EnqueueBatch:
    def __init__(self) -> None:
        self.messages: dict[str, list[NewMessage]] = {}
        self.received: list[int] = []
        self.size = 0  # content bytes
        # Each app's answer, given as soon as the store of its master answered (on a
        # cluster, a master in trouble holds up no other master's apps); `future`, once
        # every app is answered, all of them.
        self.answers: dict[str, asyncio.Future[AppAnswer]] = {}
        self.future: asyncio.Future[dict[str, AppAnswer]] = (
            asyncio.get_running_loop().create_future()
        )
        self.spans: list[tuple[str, Span]] | None = None  # (app, its `skmq store` span)

    def add(self, app: str, message: NewMessage) -> StoreReply:
        msgs = self.messages.get(app)
        if msgs is None:
            msgs = self.messages[app] = []
            self.answers[app] = asyncio.get_running_loop().create_future()
        msgs.append(message)
        self.size += len(message.content)
        return StoreReply(self.answers[app], len(msgs) - 1, message.msgid)

    def answer(self, answers: Mapping[str, AppAnswer]) -> None:
        """Answer these apps (an app answered already keeps its answer)."""
        for app, answer in answers.items():
            future = self.answers[app]
            if not future.done():
                future.set_result(answer)
        if not self.future.done() and all(f.done() for f in self.answers.values()):
            self.future.set_result({app: f.result() for app, f in self.answers.items()})

    def answer_rest(self, why: str) -> None:
        """Every app not answered yet: `why`."""
        self.answer({app: why for app, f in self.answers.items() if not f.done()})

    def add_traced(self, app: str, message: NewMessage) -> StoreReply:
        """Add a message within a `skmq store` span, a child of its traceparent: it is
        stored with the span's, the parent of its pushes and pulls."""
        span = tracing.start("store", message.trace, app, message.msgid)
        if self.spans is None:
            self.spans = []
        self.spans.append((app, span))
        message.trace = tracing.traceparent(span)
        return self.add(app, message)

    def end_spans(self) -> None:
        """The store spans end with the batch's answer (failed: its error's text)."""
        results = self.future.result()
        for app, span in self.spans or ():
            why = results.get(app)
            tracing.end(span, why if isinstance(why, str) else None)


@dataclass(eq=False)
class Enqueuer:
    store: OwnedStore
    dlog: DeliveryLog
    on_stored: Callable[[set[str]], None]
    note_apps: Callable[[set[str]], Any]
    _: KW_ONLY
    max_pending_bytes: int = 64 << 20
    timeout: float = 5.0
    # The claims of idle dispatchers of the batch's apps, carried by its round trip
    # (skmq/workers/dispatch.py: carry_claim); the other apps are woken (on_stored).
    carry_claims: Callable[[Mapping[str, Sized], int], list[ClaimArgs]] | None = None
    disk: DiskSpace | None = None  # the embedded Redis's (None: a Redis of REDIS_URL)
    # Why nothing may be stored now (an evicting Redis: skmq/store/checks.py), or None.
    refusal: Callable[[], str | None] = lambda: None
    # Which apps have a recipient or a group: messages stored for others are counted.
    routes: Routes | None = None
    # Deliveries first: an app's new messages wait while the CPU is full and its pushes
    # fall behind (skmq/workers/store_hold.py).
    hold: StoreHold | None = None
    pending_bytes: int = field(init=False, default=0)
    disk_low: bool = field(init=False, default=False)
    # app -> msgid -> (message, received ms): stored or not, nobody knows yet
    _uncertain: dict[str, dict[str, tuple[NewMessage, int]]] = field(
        init=False, default_factory=dict
    )
    _reconciling: bool = field(init=False, default=False)
    _noted: set[str] = field(init=False, default_factory=set)  # apps noted by this process
    _noting: asyncio.Task[None] | None = field(init=False, default=None)
    _room: asyncio.Event = field(init=False, default_factory=asyncio.Event)
    # app -> the end of the wait of its last held batch (_store_held)
    _held: dict[str, asyncio.Future[None]] = field(init=False, default_factory=dict)
    _faults: Throttled = field(init=False, default_factory=lambda: Throttled(log))
    _tasks: set[asyncio.Task[None]] = field(init=False, default_factory=set)

    def __post_init__(self) -> None:
        if not self.store.carries_claims:
            self.carry_claims = None
        self._room.set()

    async def room(self) -> None:
        """Return once less than MAX_STORE_PENDING_BYTES of content waits for the store
        (at most STORE_TIMEOUT: every waiting batch is stored or failed by then)."""
        await self._room.wait()

    def held(self, app: str) -> asyncio.Future[None] | None:
        """The wait of the app's last batch held for its deliveries, while it waits."""
        return self._held.get(app)

    def has_room(self) -> bool:
        """Whether less than MAX_STORE_PENDING_BYTES of content waits for the store now."""
        return self._room.is_set()

    @property
    def refusing(self) -> str | None:
        """Why stores are refused now (an evicting Redis, the disk nearly full at the last
        store), or None."""
        return self.refusal() or (DISK_LOW if self.disk_low else None)

    def submit(self, batch: EnqueueBatch) -> None:
        if not batch.messages:
            batch.answer({})
            return
        self.pending_bytes += batch.size
        if self.pending_bytes >= self.max_pending_bytes:
            self._room.clear()
        spawn(self._store(batch), self._tasks)

    async def drain(self) -> None:
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _store(self, batch: EnqueueBatch) -> None:
        """Store and log a batch; its producers get an answer whatever fails."""
        try:
            await self._store_and_log(batch)
        except Exception:  # not a store error (those are answered): a fault, logged once
            log.exception("storing a batch failed")
        finally:
            batch.answer_rest(UNAVAILABLE)
            if batch.spans is not None:
                batch.end_spans()
            self.pending_bytes -= batch.size
            if self.pending_bytes < self.max_pending_bytes:
                self._room.set()

    def _log(self, batch: EnqueueBatch, received: int, results: dict[str, list[bool]]) -> None:
        """The results of the apps whose store ran. `stored` carries the time the store
        stamped on the message (`received`): a dispatcher may push it, on another
        connection, before this broker hears it is stored, and the log must not show a
        push before the store."""
        event = self.dlog.event
        routes = self.routes
        for app, res in results.items():
            if routes is not None and not routes.routable(app) and (n := sum(res)):
                routes.count(app, n)
            uncertain = self._uncertain.get(app, {})
            for m, ok in zip(batch.messages[app], res, strict=True):
                if ok:
                    uncertain.pop(m.msgid, None)  # (the earlier try was not stored)
                    self._log_stored(app, m, received, received)
                else:
                    event(Event.RECEIVED, m.msgid, app, m.kind, ts=received)
                    event(Event.DUPLICATE, m.msgid, app, m.kind, ts=received)

    def _log_stored(self, app: str, m: NewMessage, received: int, stored: int) -> None:
        details = [f"deliver_at={m.deliver_at}"] if m.deliver_at else []
        details += [f"traceparent={m.trace}"] if m.trace else []
        self.dlog.event(Event.RECEIVED, m.msgid, app, m.kind, ts=received)
        self.dlog.event(Event.STORED, m.msgid, app, m.kind, detail=" ".join(details) or None,
                        ts=stored)  # fmt: skip

    def _remember(self, batch: EnqueueBatch, received: int, apps: Iterable[str]) -> None:
        """Apps of a batch whose store's answer was lost: their messages may be stored."""
        room = MAX_UNCERTAIN - sum(map(len, self._uncertain.values()))
        for app in apps:
            msgs = batch.messages[app]
            uncertain = self._uncertain.setdefault(app, {})
            for m in msgs[: max(0, room)]:
                uncertain[m.msgid] = (m, received)
            room -= len(msgs)

    async def _reconcile(self) -> None:
        """Log `stored` for the messages whose store's answer was lost and that were
        stored after all (the audit must not find them pushed and acked, never stored):
        looked up once Redis answers a store again. Those not stored are forgotten: their
        producers heard `error` and send them again."""
        self._reconciling = True
        try:
            while self._uncertain:
                app, entries = self._uncertain.popitem()
                try:
                    found = await self.store.stored_of(app, list(entries), now_ms())
                except (RedisError, OSError, TimeoutError) as exc:
                    log.warning("could not look up messages whose store's answer was lost",
                                error=str(exc) or repr(exc))  # fmt: skip
                    self._uncertain.setdefault(app, {}).update(entries)  # the next store's
                    return
                for (m, received), at in zip(entries.values(), found, strict=True):
                    if at is not None:
                        self._log_stored(app, m, received, at or received)
        finally:
            self._reconciling = False

    def _disk_is_low(self) -> bool:
        """Read the disk's free space; log when it goes under DISK_FREE_LIMIT and back."""
        if self.disk is None:
            return False
        low = self.disk.low()
        if low != self.disk_low:
            self.disk_low = low
            if low:
                log.error("store's disk nearly full: messages refused until space is freed",
                          path=str(self.disk.path), limit=self.disk.limit)  # fmt: skip
            else:
                log.warning("store's disk has room again: storing messages")
        return low

    def _note(self, apps: set[str]) -> None:
        """Record new apps in Redis (note_apps), in the background: the store lists an app
        itself when it must, and the node holding a directory shard (on a cluster,
        perhaps down) must not hold up the store."""
        new = apps - self._noted
        if new and (self._noting is None or self._noting.done()):
            self._noting = spawn(self._note_now(new), self._tasks)

    async def _note_now(self, apps: set[str]) -> None:
        try:
            async with asyncio.timeout(self.timeout):
                await self.note_apps(apps)
        except (RedisError, OSError, TimeoutError) as exc:
            log.warning("apps not noted", error=str(exc) or repr(exc))
        else:
            self._noted |= apps

    async def _store_and_log(self, batch: EnqueueBatch) -> None:
        refused = self.refusal()
        if refused is not None or self._disk_is_low():
            batch.answer_rest(refused or DISK_LOW)
            return
        wait = self.hold.holding(batch.messages) if self.hold is not None else set()
        wait |= self._held.keys() & batch.messages.keys()  # (never before one held)
        if not wait:
            await self._store_apps(batch, batch.messages)
            return
        now = {app: msgs for app, msgs in batch.messages.items() if app not in wait}
        await asyncio.gather(
            self._store_apps(batch, now),
            *(self._store_held(batch, app) for app in batch.messages if app in wait),
        )

    async def _store_held(self, batch: EnqueueBatch, app: str) -> None:
        """An app whose deliveries fall behind, each on its own (one app's hold must not
        hold another's messages of the same batch): stored once it need not wait, and
        after its batches held before (a producer's messages to an app are stored in the
        order sent: its keys' order is theirs)."""
        assert self.hold is not None
        messages = batch.messages[app]
        before = self._held.get(app)
        turn = self._held[app] = asyncio.get_running_loop().create_future()
        try:
            if before is not None:
                await asyncio.wait((before,))
            await self.hold.wait(app, len(messages))
        finally:
            if self._held.get(app) is turn:
                del self._held[app]
            turn.set_result(None)
        await self._store_apps(batch, {app: messages})  # (before the next held one goes on)

    async def _store_apps(self, batch: EnqueueBatch, messages: dict[str, list[NewMessage]]) -> None:
        if not messages:
            return
        received = now_ms()
        deadline = asyncio.get_running_loop().time() + self.timeout
        self._note(set(messages))
        # Stored a master at a time (one Redis: the batch at once), each answered as soon
        # as it is: a master in trouble holds up only its own apps' producers.
        parts = self.store.by_master(messages)
        if len(parts) == 1:
            ran = await self._store_part(batch, parts[0], received, deadline)
        else:
            done = await asyncio.gather(
                *(self._store_part(batch, part, received, deadline) for part in parts)
            )
            ran = {app: r for part in done for app, r in part.items()}
        if self._uncertain and not self._reconciling and ran:  # (Redis answers again)
            spawn(self._reconcile(), self._tasks)

    async def _store_part(
        self,
        batch: EnqueueBatch,
        messages: dict[str, list[NewMessage]],
        received: int,
        deadline: float,
    ) -> dict[str, list[bool]]:
        """Store, log and answer the apps of one master; the results of those whose
        store ran."""
        ran: dict[str, list[bool]] = {}  # the results of the apps whose store ran

        def stored(results: dict[str, list[bool]]) -> None:
            ran.update(results)
            self._log(batch, received, results)

        # (made right before the store: it hands each its end, whatever happens)
        claims = self.carry_claims(messages, received) if self.carry_claims else []
        try:
            results = await self.store.store(messages, received, stored, claims, deadline)
        except WriteFailed as exc:  # (one Redis: the part as a whole)
            results = dict.fromkeys(messages, exc)
        except (RedisError, OSError, TimeoutError) as exc:
            self._faults.warning("store unavailable", error=str(exc) or repr(exc))
            self._remember(batch, received, set(messages) - set(ran))
            batch.answer(dict.fromkeys(messages, UNAVAILABLE))
            return ran
        answers: dict[str, AppAnswer] = {app: self._answer(r) for app, r in results.items()}
        failed = {app: res for app, res in results.items() if isinstance(res, WriteFailed)}
        if failed:
            error = str(next(iter(failed.values())))
            self._faults.warning("store failed", apps=len(failed), of=len(results), error=error)
            maybe = [app for app, f in failed.items() if f.maybe_ran and app not in ran]
            self._remember(batch, received, maybe)
        # The log lines reach the kernel before any producer hears `ack`.
        self.dlog.flush()
        # Redis appended the batch to its AOF before it answered: a disk low now may
        # have failed that append.
        batch.answer(dict.fromkeys(answers, DISK_LOW) if self._disk_is_low() else answers)
        self.on_stored({app for app, res in ran.items() if any(res)} - {c.app for c in claims})
        return ran

    @staticmethod
    def _answer(result: AppStored) -> list[bool] | str:
        """An app's results, or the `error` text its producers hear (see UNKNOWN)."""
        if isinstance(result, ReplicasMissing):
            return REPLICAS_MISSING
        if isinstance(result, WriteFailed):
            return UNAVAILABLE if result.maybe_ran else NOT_STORED
        return result
