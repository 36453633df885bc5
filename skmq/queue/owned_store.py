"""The store every broker and operator command makes: the delivery engine's calls
(claim, finish, fail, extend, reap, release, store) go to the apps this broker owns
(owners.py), each app's queue held in its owner's memory and written to Redis in fenced
batches (docs/OWNER-DESIGN.md); operators' calls (counts, peek, purges, dead letters)
read what the owners write, or ask an app's owner through its inbox; everything else
(recipients, the apps directory, brokers, tallies) is the Store's (skmq/store/store.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from skmq.clock import now_ms
from skmq.queue.dead import letter, moved
from skmq.queue.deliveries import Policy
from skmq.queue.entries import Meta, encode_header
from skmq.queue.journal import (
    Appended,
    AppKeys,
    Journal,
    Lease,
    NotAtRest,
    append,
    script_source,
)
from skmq.queue.operator import NoOwner, Request, answer_request, ask_owner, oldest_pending
from skmq.queue.owner import AppOwner
from skmq.queue.owner import NewMessage as NewLetter
from skmq.queue.owners import Owners
from skmq.queue.replica_waits import ReplicaWaits
from skmq.store.client import ENC
from skmq.store.shards import ReplicasMissing, WriteFailed
from skmq.store.store import (
    AliveRecipient,
    AppCounts,
    AppStored,
    ClaimArgs,
    ClaimResult,
    DeadLetter,
    Extended,
    Failed,
    Finished,
    NewMessage,
    Purged,
    Reaped,
    Retries,
    Store,
    Waiting,
    hand_over,
    split_delivery,
)
from skmq.store.wire import Wire
from skmq.store.wires import Wires

if TYPE_CHECKING:
    from skmq.config import Settings
    from skmq.store.client import RedisClient

STORED_LOOKBACK = 10_000
# An app no broker owns read again at most this often while a move into it runs (each
# time a broker took it and let it go meanwhile)
MOVE_READS = 3
Letter = tuple[bytes, bytes, Meta]  # a dead letter as it is stored again: msgid, content, header


class OwnedStore(Store):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.owners: Owners | None = None  # set by the broker once its wire is up
        # an operator command's connections to the owners' Redis (a broker's: its owners')
        self.wires: Wires | None = None
        # a broker's REPLICA_ACKS's WAITs (`_unconfirmed`)
        self.confirms: ReplicaWaits | None = None
        # an app's dispatcher told of new messages not stored through the enqueuer (a move)
        self.notify: Callable[[str], None] = lambda app: None
        self._dead_out = self.redis.register_script(script_source("dead_out"))
        self._dead_purge = self.redis.register_script(script_source("dead_purge"))
        self._forget = self.redis.register_script(script_source("forget"))

    @classmethod
    def configured(cls, settings: Settings, redis: RedisClient) -> OwnedStore:
        """The store as `settings` say, for a broker and an operator command alike."""
        return cls(
            redis,
            settings.key_prefix,
            retries=Retries(settings.retry_times, settings.retry_backoff, settings.retry_jitter),
            ack_timeout=settings.ack_timeout,
            dedupe_window=settings.dedupe_window,
            replica_acks=settings.replica_acks,
            replica_ack_timeout=settings.replica_ack_timeout,
            expired_drop=settings.expired == "drop",
            max_lease_extensions=settings.max_lease_extensions,
        )

    async def list_app(self, app: str) -> None:
        """The app in the apps directory (a `Lister`: its mark in Redis was new)."""
        await self.directory.add([app])

    @property
    def _owners(self) -> Owners:
        assert self.owners is not None, "the owners start with the broker"
        return self.owners

    def _owned(self, app: str) -> AppOwner | None:
        """The app's owner when it is this process (None in an operator's command)."""
        return self.owners.owned.get(app) if self.owners is not None else None

    def unpushed(self, app: str) -> int:
        """The app's queue messages due and not pushed, if this process owns it; else 0."""
        owner = self._owned(app)
        return owner.unpushed() if owner is not None else 0

    @property
    def carries_claims(self) -> bool:
        """A store pushes what it can of its new messages in its own flush (the push
        records with the messages): not under REPLICA_ACKS, whose pushes wait for the
        replicas' acknowledgement."""
        return not self.replica_acks

    def claim_args(
        self,
        now: int,
        n: int,
        alive: Sequence[AliveRecipient],
        assignment: Sequence[str],
        rate: float = 0.0,
        lost: Sequence[str] = (),
    ) -> list[Any]:
        """A carried claim, for `store`: the recipients of its queue messages in order
        (none under DELIVERY_RATE: the dispatcher claims those itself)."""
        return [] if rate > 0 else list(assignment)

    async def store(
        self,
        batches: dict[str, list[NewMessage]],
        now: int,
        stored: Callable[[dict[str, list[bool]]], None] | None = None,
        claims: Sequence[ClaimArgs] = (),
        deadline: float | None = None,
    ) -> dict[str, AppStored]:
        """Store the messages of several apps: for each, True stored or False a duplicate,
        or a WriteFailed (ReplicasMissing when fewer than REPLICA_ACKS replicas
        acknowledged it). `stored` hears the results as soon as the owners have them,
        before anything else is awaited. The carried `claims` are pushes made with the
        store (Owners.store's `plans`); each hears its result, after `stored`. `deadline`
        (the event loop's time) bounds the call."""
        plans = {c.app: c.args for c in claims}
        pushed: dict[str, ClaimResult] = {}
        on: dict[str, Wire] = {}
        try:
            outcome = await self._owners.store(batches, now, deadline, plans, pushed, on)
            if stored is not None:
                stored({app: r for app, r in outcome.items() if not isinstance(r, WriteFailed)})
        finally:  # every claim hears its end, whatever happens (none pushed: claim again)
            for c in claims:
                hand_over(c, pushed.get(c.app) or ([], now, 0.0))
        if self.replica_acks:
            outcome.update(await self._unconfirmed(outcome, on, deadline))
        return outcome

    async def _unconfirmed(
        self, outcome: dict[str, AppStored], on: dict[str, Wire], deadline: float | None
    ) -> dict[str, WriteFailed]:
        """REPLICA_ACKS: for each server that stored (`on`: the connection each app was
        written on), the replicas holding each app's mark touched after the store was
        answered (`confirms`: a WAIT on a second connection to that very server, shared
        by the stores meanwhile, ReplicaWaits). WAIT counts the replicas holding the
        connection's last write, and so every write the server made before it (a
        duplicate's first store through another connection included). The apps with
        fewer replicas acknowledging within REPLICA_ACK_TIMEOUT, or `deadline`: stored,
        not confirmed (ReplicasMissing)."""
        confirms = self.confirms
        assert confirms is not None, "the owners start with the broker"
        by_wire: dict[Wire, dict[str, str]] = {}
        for app, result in outcome.items():
            if not isinstance(result, WriteFailed):
                by_wire.setdefault(on[app], {})[AppKeys.of(self.prefix, app).listed] = app
        missing: dict[str, WriteFailed] = {}

        async def confirm(stored_on: Wire, apps: dict[str, str]) -> None:
            try:
                async with asyncio.timeout_at(deadline):
                    acked = await confirms.acked(stored_on, list(apps))
            except TimeoutError:
                acked = {}
            for mark, app in apps.items():
                if (replicas := acked.get(mark, 0)) < self.replica_acks:
                    reason = f"{replicas} of {self.replica_acks} replicas acknowledged"
                    missing[app] = ReplicasMissing(reason)

        await asyncio.gather(*(confirm(wire, apps) for wire, apps in by_wire.items()))
        return missing

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
        """Take up to n deliveries in flight; queue ones go to `assignment` in order, topic
        copies only to recipients with free slots (the others wait; those of a `lost`
        recipient wait, without spending an attempt, until it is back).

        Returns them (kind `dead` for one dead-lettered as undeliverable, its content the
        reason; kind `expired` for one whose TTL ran out, its content `dead` or `drop`),
        when the next delayed one falls due (unix ms), and how long the app's
        DELIVERY_RATE bucket needs before the next push (seconds, 0: not limited)."""
        return await self._owners.claim(app, now, n, alive, assignment, rate, lost)

    async def finish(self, app: str, acks: Sequence[tuple[str, int]], now: int) -> list[Finished]:
        return await self._owners.finish(app, acks, now)

    async def fail(
        self, app: str, failures: Sequence[tuple[str, str, str, str, int]], now: int
    ) -> list[Failed]:
        return await self._owners.fail(app, failures, now)

    async def extend(self, app: str, leases: Sequence[tuple[str, int]], now: int) -> list[Extended]:
        return await self._owners.extend(app, leases, now)

    async def reap(
        self, apps: Sequence[str], now: int, limit: int = 500
    ) -> dict[str, list[Reaped]]:
        return await self._owners.reap(apps, now)

    def recovered_acks(self, app: str) -> list[tuple[str, int, str]]:
        """The acks this broker's new ownership of `app` found in the journal (Owners:
        take_recovered), for the reaper to log again."""
        return self._owners.take_recovered(app)

    async def in_flight(self, app: str) -> list[str]:
        return []  # an owner's in flight are its own: a new owner pushes them again

    async def release(self, app: str, deliveries: Sequence[tuple[str, int]]) -> list[bool]:
        return await self._owners.release(app, deliveries, now_ms())

    async def in_flight_of(self, app: str, msgid: str) -> list[tuple[str, str, int]]:
        return self._owners.in_flight_of(app, msgid)

    async def find_apps(self, msgids: Sequence[str]) -> dict[str, list[str]]:
        """The owned apps holding each msgid, and every app owned elsewhere (whose owner
        alone knows: the router asks it, skmq/queue/forward.py)."""
        elsewhere = [app for app in await self.apps() if app not in self._owners.owned]
        held = self._owners.holding(msgids)
        return {msgid: [*held[msgid], *elsewhere] for msgid in msgids}

    async def forget_apps(self, apps: Sequence[str]) -> list[str]:
        """Forget each app that holds no recipient and no message; returns those forgotten
        (skmq/store/directory.py: why this is safe against a store at the same time)."""
        return await self.unlist(await self.drop_empty(apps))

    async def drop_empty(self, apps: Sequence[str]) -> list[str]:
        """Drop the keys and `listed` mark of each app holding nothing (lua/forget.lua);
        returns those dropped, still to be taken out of the directory (`unlist`)."""
        dropped = []
        for app in apps:
            k = AppKeys.of(self.prefix, app)
            keys = [k.log, k.inbox, k.dead_order, k.base + "recipients", k.base + "groups"]
            keys += [k.checkpoint, k.journal, k.stats, k.owner]
            keys += [k.base + name for name in ("rstate", "rbeat", "rate", "listed", "tally")]
            keys.append(k.dead_copies)
            if await self._forget(keys, []):
                dropped.append(app)
        return dropped

    async def stored_of(self, app: str, msgids: Sequence[str], now: int) -> list[int | None]:
        """For messages whose store's answer was lost: each one's stored ms (found among
        the last STORED_LOOKBACK entries of the app's log and inbox), 0 when settled
        since (within DEDUPE_WINDOW), None when not found."""
        keys = AppKeys.of(self.prefix, app)
        pipe = self.redis.pipeline(transaction=False)
        pipe.xrevrange(keys.log, count=STORED_LOOKBACK)
        pipe.xrevrange(keys.inbox, count=STORED_LOOKBACK)
        for done in keys.dedupe(now, self.dedupe_ms):
            pipe.smismember(done, [m.encode("utf-8", ENC) for m in msgids])
        log, inbox, cur, prev = await pipe.execute()
        at = {fields[b"m"]: int(entry.split(b"-", 1)[0]) for entry, fields in [*inbox, *log]}
        out: list[int | None] = []
        for msgid, in_cur, in_prev in zip(msgids, cur, prev, strict=True):
            raw = msgid.encode("utf-8", ENC)
            out.append(0 if in_cur or in_prev else at.get(raw))
        return out

    async def acked_of(self, app: str, delivery_ids: Sequence[str], now: int) -> list[bool]:
        """For deliveries whose finish's answer was lost: whether each was acked, as far
        as the app's dedupe sets tell (its message completed within DEDUPE_WINDOW; a topic
        copy's message only once every copy is over)."""
        if not delivery_ids:  # (SMISMEMBER takes one member at least)
            return []
        keys = AppKeys.of(self.prefix, app)
        msgids = [split_delivery(d)[0].encode("utf-8", ENC) for d in delivery_ids]
        pipe = self.redis.pipeline(transaction=False)
        for done in keys.dedupe(now, self.dedupe_ms):
            pipe.smismember(done, msgids)
        cur, prev = await pipe.execute()
        return [bool(a or b) for a, b in zip(cur, prev, strict=True)]

    # -- what operators see and do (from any process) --------------------------------
    async def counts(self, apps: Sequence[str], now: int) -> dict[str, AppCounts]:
        """Waiting and in flight as each app's owner has them (another broker's: as it
        last said, every ownership round), dead as its dead letters hold."""
        pipe = self.redis.pipeline(transaction=False)
        for app in apps:
            keys = AppKeys.of(self.prefix, app)
            pipe.hmget(keys.stats, "pending", "delayed", "in_flight")
            pipe.zcard(keys.dead_order)
        res = await pipe.execute()
        out = {}
        for i, app in enumerate(apps):
            owner = self._owned(app)
            if owner is not None:  # (this broker's own: as they are now)
                pending, delayed, in_flight = owner.counts(now)
            else:
                pending, delayed, in_flight = (int(x or 0) for x in res[2 * i])
            out[app] = AppCounts(pending, delayed, in_flight, int(res[2 * i + 1]))
        return out

    async def oldest_pending(self, apps: Sequence[str], now: int) -> dict[str, int | None]:
        """As each app's owner has it (another broker's: as it last said, each round)."""
        pipe = self.redis.pipeline(transaction=False)
        for app in apps:
            pipe.hget(AppKeys.of(self.prefix, app).stats, "oldest")
        said = await pipe.execute()
        out: dict[str, int | None] = {}
        for app, oldest in zip(apps, said, strict=True):
            owner = self._owned(app)
            if owner is not None:
                out[app] = oldest_pending(owner)
            else:
                out[app] = int(oldest) if oldest else None
        return out

    async def _ask(self, app: str, request: Request) -> list[Any]:
        """An operator's request, done by the app's owner: here, or asked through its
        inbox (skmq/queue/operator.py)."""
        owner = self._owned(app)
        if owner is not None:
            return await answer_request(owner, request, now_ms())
        if not await self.directory.holds(app):  # (no such app: nothing waits in it, and
            return []  # no owner to ask: a name mistyped is no "try again")
        return await ask_owner(self.redis, self.prefix, app, request)

    async def peek(self, app: str, limit: int, now: int) -> list[Waiting]:
        seen = await self._ask(app, Request("peek", limit))
        return [
            Waiting(msgid, stored, attempts, key or None, size, preview.encode("latin-1"), due)
            for msgid, stored, attempts, key, size, preview, due in seen
        ]

    async def purge_waiting(
        self, app: str, older_than_ms: int | None, limit: int | None, dry_run: bool, now: int
    ) -> list[Purged]:
        before = None if older_than_ms is None else now - older_than_ms
        purged = await self._ask(app, Request("purge", limit, before, dry_run))
        return [Purged(msgid, kind, copy or None) for msgid, kind, copy in purged]

    async def dead_letters(self, app: str, limit: int | None = None) -> list[DeadLetter]:
        keys = AppKeys.of(self.prefix, app)
        stop = -1 if limit is None else limit - 1
        entries = await self.redis.zrange(keys.dead_order, 0, stop, withscores=True)
        if not entries:
            return []
        values = await self.redis.hmget(keys.dead, [member for member, _ in entries])
        return [
            letter(app, member, value, died)
            for (member, died), value in zip(entries, values, strict=True)
            if value is not None
        ]

    async def replay(self, app: str, delivery_ids: Sequence[str], now: int) -> list[bool]:
        if not delivery_ids:
            return []
        keys = AppKeys.of(self.prefix, app)
        dead = [keys.dead, keys.dead_order, keys.dead_copies, keys.inbox]
        args = [keys.wakeup, *(i.encode("utf-8", ENC) for i in delivery_ids)]
        return [x == 1 for x in await self._dead_out(dead, args)]

    async def move(self, app: str, to_app: str, delivery_ids: Sequence[str], now: int) -> list[int]:
        """Each dead letter stored as a new message of `to_app`, then taken out of `app`'s
        dead letters (a crash between leaves it in both, never in neither): 1 moved, 0 not
        a dead letter, -1 a duplicate there (live, settled within the dedupe window or held
        as a dead letter: the letter stays). Into an app a broker owns, its owner stores
        them (only it knows the msgids live in its memory: an inbox entry of one would be
        dropped as its duplicate), here or asked through its inbox; into one none owns,
        appended to its inbox but for the msgids live in its stored state, read as a new
        owner would read it (`_append_at_rest`). Each step is one app's keys: a Cluster
        may put the two apps on two nodes."""
        if not delivery_ids:
            return []
        owner = self._owned(to_app)
        if owner is None and self.owners is not None and self.owners.take is not None:
            if await self.owners.take(to_app, now):  # (a broker: unowned and ours)
                owner = self._owned(to_app)
        if owner is not None:
            return await self.move_into(owner, to_app, app, delivery_ids, now)
        letters = await self._letters(app, delivery_ids)
        stored = await self._append_at_rest(to_app, letters, now)
        if stored is None:
            request = Request("move", None, source=app, ids=tuple(delivery_ids))
            return [int(x) for x in await ask_owner(self.redis, self.prefix, to_app, request)]
        return await self._taken(app, delivery_ids, stored)

    async def move_into(
        self, owner: AppOwner, app: str, source: str, ids: Sequence[str], now: int
    ) -> list[int]:
        """At the owner of `app`: `move` of `source`'s dead letters `ids` into it."""
        letters = await self._letters(source, ids)
        messages = [NewLetter(*m) for m in letters.values()]
        stored = dict(zip(letters, await owner.store(messages, now), strict=True))
        result = await self._taken(source, ids, stored)
        if 1 in result:
            self.notify(app)
        return result

    async def _letters(self, app: str, ids: Sequence[str]) -> dict[str, Letter]:
        """What each dead letter of `ids` that `app` holds is stored with elsewhere."""
        dead = AppKeys.of(self.prefix, app).dead
        values = await self.redis.hmget(dead, [i.encode("utf-8", ENC) for i in ids])
        return {i: moved(i, v) for i, v in zip(ids, values, strict=True) if v is not None}

    async def _append_at_rest(
        self, app: str, letters: dict[str, Letter], now: int
    ) -> dict[str, bool] | None:
        """Into `app` while no broker owns it: its stored state read as a new owner reads
        it (nothing written), the letters of a msgid live there are duplicates (False),
        the others appended to its inbox (lua/append.lua), unless a broker owns it by
        then (None: its owner's to store) or took it and let go since (read again)."""
        if not letters:
            return {}
        wires = self.owners.wires if self.owners is not None else self.wires
        if wires is None:
            raise RuntimeError("no connection to the owners' Redis (OwnedStore.wires)")
        keys = AppKeys.of(self.prefix, app)
        wire = await wires.of(keys.epoch)

        for _ in range(MOVE_READS):
            epoch = await wire.call("GET", keys.epoch) or b"0"
            look = AppOwner(Journal(wire, keys, Lease("", int(epoch)), self.dedupe_ms),
                            Policy(), tuple)  # fmt: skip
            await look.load(now, adopt=False)
            fresh = {i: m for i, m in letters.items() if m[0] not in look.live}
            if not fresh:
                return dict.fromkeys(letters, False)
            appended = [Appended(m, c, encode_header(meta)) for m, c, meta in fresh.values()]
            try:
                at_rest = (epoch, look.inbox_cursor)
                ids = await append(
                    wire, keys, now, self.dedupe_ms, appended, self.list_app, at_rest
                )
            except NotAtRest as exc:
                if exc.owned:
                    return None
                continue
            stored = dict(zip(fresh, (i is not None for i in ids), strict=True))
            return {i: stored.get(i, False) for i in letters}
        raise NoOwner(
            f"app {app!r} was taken over {MOVE_READS} times while the dead letters moved: "
            "move them again"
        )

    async def _taken(self, app: str, ids: Sequence[str], stored: dict[str, bool]) -> list[int]:
        """The letters stored elsewhere (`stored`: by delivery id, the letters `app`
        held) taken out of `app`'s dead letters; each id's end."""
        if taken := [i.encode("utf-8", ENC) for i, ok in stored.items() if ok]:
            keys = AppKeys.of(self.prefix, app)
            await self._dead_purge([keys.dead, keys.dead_order, keys.dead_copies], taken)
        return [0 if i not in stored else 1 if stored[i] else -1 for i in ids]

    async def purge(self, app: str, delivery_ids: Sequence[str]) -> list[bool]:
        if not delivery_ids:
            return []
        keys = AppKeys.of(self.prefix, app)
        ids = [i.encode("utf-8", ENC) for i in delivery_ids]
        dead = [keys.dead, keys.dead_order, keys.dead_copies]
        return [bool(x) for x in await self._dead_purge(dead, ids)]
