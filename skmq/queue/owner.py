"""One app's queue as its owner holds it: the deliveries in memory (deliveries.py), what
must survive in Redis (journal.py), and the two joined: stores, the inbox, flushes,
checkpoints, and the rebuild of a new owner.

A store is durable when its flush returns, and the flush carries every record made
since the last one: at a steady rate one Redis call a loop turn serves every message
of it, stored and settled alike. A topic message is fanned out to the app's registered
recipients when it is read (the `f` record names them), a copy each.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import structlog

from skmq.clock import now_ms
from skmq.jsonbody import dump_json, load_json
from skmq.lifecycle import Refused, State, Trigger
from skmq.queue.dead import flush_args
from skmq.queue.deliveries import (
    END,
    QUEUE,
    SEP,
    AppQueue,
    Change,
    Delivery,
    Policy,
    parse_records,
)
from skmq.queue.entries import (
    PLAIN,
    Entry,
    Meta,
    encode_header,
    entry_order,
    is_question,
    parse_entry,
)
from skmq.queue.journal import GROUPS_ONLY, Appended, Flushed, Journal
from skmq.store.wire import ReplyError, Wire

log = structlog.get_logger("skmq.owner")

FANNED = b"f"  # a journal record outside the table: a topic message's copies, by recipient
CHECKPOINTED = b"k"  # a journal record outside the table: the flush a checkpoint names
READ_BATCH = 512
# Queue messages held in memory, waiting, before more stay in the log: past it a plain
# queue message (no topic, key or delay) costs the owner its msgid alone (`live`, for
# dedupe) until `refill` reads it back as the line runs short, so that a backlog of a
# million is a range of the log, not a million deliveries in memory.
BACKLOG_HELD = 2_048
# A checkpoint writes the whole state: it is written once the journal and log since the
# last one hold as many entries as the state has deliveries, or CHECKPOINT_AGE_MS has
# passed, so that a new owner replays a tail no longer than the state, and a round does
# not cost a large, quiet backlog's snapshot each time. (A small state is checkpointed
# every round that wrote anything: its log trimmed, an app that holds nothing forgotten.)
CHECKPOINT_AGE_MS = 60_000
SEEN = [b"seen", b"1"]  # the fields lib.lua's mark_seen adds to an inbox entry read


@dataclass(frozen=True, slots=True)
class NewMessage:
    msgid: bytes
    content: bytes
    meta: Meta = PLAIN


class AppOwner:
    def __init__(
        self,
        journal: Journal,
        policy: Policy,
        recipients: Callable[[], Sequence[str]],
        clock: Callable[[], int] = now_ms,
        held: int = BACKLOG_HELD,
    ) -> None:
        self.journal = journal
        self.held = held
        self.clock = clock
        self.queue = AppQueue(policy)
        self.recipients = recipients
        self.live: set[bytes] = set()  # msgids stored and not over (dedupe)
        # A flush refused (an error reply): the records it took are not in the journal,
        # so this memory is ahead of it (an ack applied here, not written). The runtime
        # drops the owner and takes the app again, its state rebuilt from the journal
        # (what was in flight is pushed again), as after a lost connection.
        self.diverged = False
        # msgids whose store's flush is on its way, and its end: a second store of one
        # waits for it (live, or not, once it is done), as one script a msgid would
        self._storing: dict[bytes, asyncio.Future[None]] = {}
        # Stores whose flush carries first pushes (`store_and_push`): their deliveries are
        # held only once the flush returns, so a checkpoint waits for them (its state
        # must hold every delivery whose records precede its mark), and stores wait for
        # a checkpoint waiting so (`_pushes_done`, `_checkpointing`).
        self._pushing = 0
        self._pushes_done: asyncio.Future[None] | None = None
        self._checkpointing: asyncio.Future[None] | None = None
        # the log: every entry up to `log_cursor` read; after it, `backlog` plain queue
        # messages not read yet (in `live`, not held), and entries that were read as
        # they were stored (the rest); `log_last`, the last entry stored
        self.log_cursor = b"0-0"
        self.log_last = b"0-0"
        self.backlog = 0
        self._refilling = asyncio.Lock()
        self.inbox_cursor = b"0-0"  # the last inbox entry read
        self.fanned: list[bytes] = []  # FANNED records for the next flush
        # topic messages stored while the app had no recipient: fanned out to the first
        self.unfanned: collections.deque[tuple[Entry, bool]] = collections.deque()
        # what callers of `durable` wait for: the next flush to start settles it when done
        self._next: asyncio.Future[None] | None = None
        self._flush_timer: asyncio.Handle | None = None  # the flush `durable` asked for, and when
        self._flush_at = 0.0
        self._stored_at = float("-inf")  # (the loop's time) when a flush last stored some
        self._last: asyncio.Future[None] | None = None  # done when the latest flush is
        self.questions: list[bytes] = []  # answers forwarded by other brokers, unanswered
        self.adopted: list[Change] = []  # the old owner's in flight, failed by `load`
        # The acks `load` replayed: logged again (Owners.take_recovered), since the old
        # owner may have died between their write and their `acked` lines.
        self.recovered: list[Change] = []
        self.unchecked = 0  # log entries and records written since the last checkpoint
        self.checked_at = clock()  # when the last checkpoint was written (or the start)

    @property
    def wire(self) -> Wire:
        return self.journal.wire

    # -- materialising -----------------------------------------------------------
    def _materialise(
        self, e: Entry, now: int, inbox: bool = False, copies: Sequence[str] | None = None
    ) -> None:
        meta = e.meta
        if meta.topic:
            if copies is None and meta.only:
                copies = [meta.only]
            if copies is None:
                copies = list(self.recipients())
                if not copies:
                    self.unfanned.append((e, inbox))
                    return
                self.fanned.append(SEP.join((FANNED, e.msgid, ",".join(copies).encode())))
            names: Sequence[str] = copies
        else:
            names = (QUEUE,)
        for copy in names:
            self.queue.add(_delivery(e, copy, inbox), now)

    def fan_out(self, now: int) -> None:
        """The topic messages that waited for a recipient, copied to those there now."""
        while self.unfanned and self.recipients():
            e, inbox = self.unfanned.popleft()
            self._materialise(e, now, inbox)

    # -- stores -----------------------------------------------------------------
    async def store(self, messages: Sequence[NewMessage], now: int) -> list[bool]:
        """Store and flush (durable when this returns); False: a duplicate, not stored.
        Raises Fenced when the queue was taken over."""
        return (await self.store_and_push(messages, now))[0]

    async def store_and_push(
        self, messages: Sequence[NewMessage], now: int, recipients: Sequence[str] = ()
    ) -> tuple[list[bool], list[Delivery]]:
        """As `store`; and the first new messages, when nothing waits before them, pushed
        to `recipients` in order (a dispatcher's free window slots), their push records
        in the same flush: the deliveries to hand to the pusher, in flight."""
        while self._checkpointing is not None:  # (its state is being taken: after it)
            await asyncio.shield(self._checkpointing)
        # (a store of the same msgid on its way: its outcome first, then live says)
        while waits := {self._storing[m.msgid] for m in messages if m.msgid in self._storing}:
            await asyncio.wait(waits)
        fresh: list[NewMessage] = []
        seen: set[bytes] = set()
        for m in messages:
            if m.msgid not in self.live and m.msgid not in seen:
                fresh.append(m)
                seen.add(m.msgid)
        plan = self._push_plan(fresh, now, recipients)
        pushes = [self.queue.push_record(msgid, rid, now) for msgid, rid in plan.items()]
        appended = [Appended(m.msgid, m.content, encode_header(m.meta)) for m in fresh]
        storing = asyncio.get_running_loop().create_future()
        for msgid in seen:
            self._storing[msgid] = storing
        self._pushing += bool(pushes)
        try:
            try:
                flushed = await self._flush(now, appended, read_inbox=True, pushes=pushes)
            finally:
                for msgid in seen:
                    del self._storing[msgid]
                storing.set_result(None)
            stored: dict[bytes, bool] = {}
            pushed: list[Delivery] = []
            # (No wait from the flush's reply to here: the stores' entries are taken in
            # the order written, which `backlog` and the log's cursor need.)
            for m, entry in zip(fresh, flushed.ids, strict=True):
                stored[m.msgid] = entry is not None
                if entry is not None and entry != GROUPS_ONLY:
                    self.live.add(m.msgid)
                    self.log_last = entry
                    e = Entry(entry, m.msgid, m.content, m.meta)
                    rid = plan.get(m.msgid)
                    if rid is not None:  # (its push record is in the flush)
                        pushed.append(self._materialise_pushed(e, rid, now))
                    elif in_log(m.meta) and (self.backlog or self._waiting() >= self.held):
                        self.backlog += 1  # (stays in the log: `refill` reads it)
                    else:
                        self._materialise(e, now)
                    if not self.backlog:
                        self.log_cursor = entry
        finally:
            self._pushed(bool(pushes))
        await self.journal.list_app(flushed)
        return [stored.pop(m.msgid, False) for m in messages], pushed

    def _pushed(self, pushes: bool) -> None:
        """A store whose flush carried first pushes is over (held, or failed)."""
        if not pushes:
            return
        self._pushing -= 1
        done = self._pushes_done
        if not self._pushing and done is not None and not done.done():
            done.set_result(None)

    def _waiting(self) -> int:
        """How long the queue's pending line is (an upper bound: it may hold deliveries
        that moved on since they joined it)."""
        line = self.queue.pending.get(QUEUE)
        return len(line) if line else 0

    def unpushed(self) -> int:
        """Queue messages due and not pushed: the pending line, the backlog the log holds
        and those waiting behind their key (an upper bound, as `_waiting`)."""
        return self._waiting() + self.backlog + self.queue.behind_keys

    async def refill(self, now: int, want: int | None = 0) -> None:
        """Read back the backlog the log holds (`backlog`), in stored order, until the
        pending line is `held` + `want` long (None: all of it); nothing while it is at
        least half that."""
        if not self.backlog or (want is not None and self._waiting() >= self.held // 2 + want):
            return
        async with self._refilling:
            while self.backlog:
                short = READ_BATCH if want is None else self.held + want - self._waiting()
                if short <= 0:
                    return
                page = await self.wire.call(
                    "XRANGE", self.journal.keys.log, b"(" + self.log_cursor, "+",
                    "COUNT", min(short, READ_BATCH),
                )  # fmt: skip
                if not page:  # (none: the log says otherwise while the owner holds it)
                    self.backlog, self.log_cursor = 0, self.log_last
                for entry, fields in page:
                    self._read_back(entry, fields, now)

    def _read_back(self, entry: bytes, fields: list[bytes], now: int) -> None:
        """One log entry after the cursor: held now if it is the backlog's."""
        if not self.backlog:
            return  # (the cursor is past it: read when it was stored)
        self.log_cursor = entry
        e = parse_entry(entry, fields)
        # (not live: over since; held: read when it was stored)
        if (
            in_log(e.meta)
            and e.msgid in self.live
            and (e.msgid, QUEUE) not in self.queue.deliveries
        ):
            self._materialise(e, now)
            self.backlog -= 1
            if not self.backlog:  # (what follows it was read when it was stored)
                self.log_cursor = self.log_last

    def _push_plan(
        self, fresh: Sequence[NewMessage], now: int, recipients: Sequence[str]
    ) -> dict[bytes, str]:
        """The new messages to push as they are stored: plain queue messages due now, in
        order, while nothing of the app's queue waits before them (its line empty), up
        to one a recipient slot. One that is not (a topic, a key, a delay, a line break
        its recipient may not read) ends the plan: the dispatcher takes the rest."""
        plan: dict[bytes, str] = {}
        if not recipients or self.queue.pending.get(QUEUE) or self.unfanned or self.backlog:
            return plan
        for m, rid in zip(fresh, recipients, strict=False):
            meta = m.meta
            if meta.topic or meta.key or meta.deliver_at > now or meta.only:
                break
            if (meta.expires and meta.expires <= now) or b"\r" in m.content or b"\n" in m.content:
                break
            plan[m.msgid] = rid
        return plan

    def _materialise_pushed(self, e: Entry, recipient: str, now: int) -> Delivery:
        d = _delivery(e, QUEUE)
        self.queue.add_pushed(d, recipient, now)
        return d

    async def flush(self, now: int) -> None:
        """One fenced write of every record made since the last flush."""
        await self._flush(now)

    async def _flush(
        self,
        now: int,
        appended: Sequence[Appended] = (),
        read_inbox: bool = False,
        mark: bool = False,
        pushes: Sequence[bytes] = (),
    ) -> Flushed:
        # (Up to the script's send, nothing here waits: the records drained are sent before
        # any other coroutine makes more, so the journal keeps them in the order made.)
        loop = asyncio.get_running_loop()
        waiting, self._next = self._next, None
        if self._flush_timer is not None:
            self._flush_timer.cancel()
            self._flush_timer = None
        records, settled, forgotten, dead = self.queue.drain()
        if self.fanned:
            records = END.join([*self.fanned, records] if records else self.fanned)
            self.fanned = []
        if pushes:  # (the first pushes of the messages this flush stores)
            records = END.join([records, *pushes] if records else pushes)
        if mark:
            records = END.join([records, CHECKPOINTED]) if records else CHECKPOINTED
        self.live.difference_update(forgotten)
        if not appended and not records and not settled and not dead:
            if waiting is not None:  # (what it waits for went with a flush still going)
                _chain(self._last, waiting)
            return Flushed([], [])
        done = loop.create_future() if waiting is None else waiting
        done.add_done_callback(observed)  # (its failure is the caller's to raise, once)
        self._last = done
        if not mark:  # (the records a checkpoint's flush carries, it covers)
            self.unchecked += len(appended) + (records.count(END) + 1 if records else 0)
        after = self.inbox_cursor if read_inbox else b""
        try:
            flushed = await self.journal.flush(
                now, appended, records, settled, flush_args(dead, now), after
            )
        except BaseException as exc:
            # (Refused by an error reply: not written. A flush cancelled or timed out is
            # still on its way, in order on the connection; a lost one, the runtime sees.)
            self.diverged = isinstance(exc, ReplyError)
            _fail(done, exc)
            raise
        if not done.done():
            done.set_result(None)
        if appended:
            self._stored_at = loop.time()
        self._inbox_entries(flushed.inbox, now)
        return flushed

    def durable(self, linger: float = 0.0) -> asyncio.Future[None]:
        """A future done when what was recorded so far is in the journal. The next flush
        to start carries it, whichever that is: a store's, or the one asked for here,
        `linger` seconds from now (ACK_LINGER) unless one starts first; so at a steady
        rate the records of answers ride with the next store's round trip. (No store in
        the last `linger`: at once; a drain with no producer does not wait each time.)
        (Flushes may overlap: each takes its records when it starts, and the one
        connection keeps their order.)"""
        loop = asyncio.get_running_loop()
        if self._next is None:
            self._next = loop.create_future()
        if loop.time() - self._stored_at > linger:  # (no store lately: none to wait for)
            linger = 0.0
        at = loop.time() + linger
        if self._flush_timer is None or self._flush_at > at:
            if self._flush_timer is not None:
                self._flush_timer.cancel()
            self._flush_at = at
            self._flush_timer = loop.call_at(at, self._start_flush)
        return self._next

    def _start_flush(self) -> None:
        self._flush_timer = None
        task = asyncio.get_running_loop().create_task(self.flush(self.clock()))
        task.add_done_callback(observed)

    async def read_inbox(self, now: int) -> int:
        """Materialise what other brokers stored since the last read (a duplicate of a
        live message dropped); how many entries were read."""
        reply = await self.journal.read_inbox(now, b"(" + self.inbox_cursor, READ_BATCH)
        self._inbox_entries(reply, now)
        return len(reply)

    def _inbox_entries(self, reply: list[tuple[bytes, list[bytes]]], now: int) -> None:
        for entry, fields in reply:
            if entry_order(entry) <= entry_order(self.inbox_cursor):
                continue  # (read by a read that overlapped this one)
            self.inbox_cursor = entry
            if is_question(fields):
                self.questions.append(fields[1])
                continue
            e = parse_entry(entry, fields)
            if e.meta.only:  # (a dead copy replayed: new unless that copy is held)
                new = (e.msgid, e.meta.only) not in self.queue.deliveries
            else:  # (not live, nor ended since it was appended: lib.lua's mark_seen)
                new = e.msgid not in self.live and fields[-2:] != SEEN
            if new:
                self.live.add(e.msgid)
                self._materialise(e, now, inbox=True)

    async def contents(self, deliveries: Sequence[Delivery]) -> None:
        """Read back the content of deliveries that do not hold it (restored from a
        checkpoint), in one round trip."""
        missing = [d for d in deliveries if d.content is None]
        if not missing:
            return
        keys = self.journal.keys
        replies = await self.wire.call_many(
            [("XRANGE", keys.inbox if d.inbox else keys.log, d.entry, d.entry) for d in missing]
        )
        for d, reply in zip(missing, replies, strict=True):
            d.content = parse_entry(*reply[0]).content if reply else b""

    def counts(self, now: int) -> tuple[int, int, int]:
        """(due, not yet due or waiting for their key, in flight), as AppQueue.counts
        has them, with the backlog the log holds and the topic messages that wait for
        a first recipient."""
        due, later, in_flight = self.queue.counts(now)
        return due + self.backlog + len(self.unfanned), later, in_flight

    # -- checkpoints and a new owner ---------------------------------------------
    def checkpoint_due(self, now: int) -> bool:
        """Whether a checkpoint is worth its write now (CHECKPOINT_AGE_MS)."""
        if self.unchecked <= 0:
            return False
        held = len(self.queue.deliveries) + len(self.unfanned)
        return self.unchecked >= held or now - self.checked_at >= CHECKPOINT_AGE_MS

    async def checkpoint(self, now: int, bound: float | None = None) -> None:
        """Keep the state as of the journal's last entry, and drop what no delivery needs
        any more. The state is taken, and every record made up to it drained into one
        flush, with no wait between (no other coroutine makes a record meanwhile): the
        checkpoint names that flush's journal entry, and a new owner replays exactly the
        records made after it. `bound` (seconds) bounds the writes, not the taking of
        the state: a large state on a slow machine is written, not taken again and
        again by checkpoints that ran out of time before their first write.
        A store whose flush carries first pushes and has not returned yet holds up the
        state's taking (and new stores wait meanwhile): its push records come before
        the mark, and its deliveries are held only once it returns."""
        async with asyncio.timeout(bound):
            await self._stores_pushing_done()
        held = [(d.entry, d.inbox) for d in self.queue.deliveries.values()]
        held += [(e.entry, inbox) for e, inbox in self.unfanned]
        # (what follows a cursor is needed still: a backlog unread, a tail to replay)
        oldest = [
            min([e for e, i in held if i is inbox] + [_after(cursor)], key=entry_order)
            for inbox, cursor in ((False, self.log_cursor), (True, self.inbox_cursor))
        ]
        waiting = dump_json([[e.entry.decode(), inbox] for e, inbox in self.unfanned])
        state = SEP.join(
            (self.log_cursor, self.inbox_cursor, self.queue.snapshot(), waiting, self.log_last)
        )
        self.unchecked, self.checked_at = 0, now
        async with asyncio.timeout(bound):
            flushed = await self._flush(now, mark=True)
            await self.journal.checkpoint(state, flushed.journaled, *oldest)

    async def _stores_pushing_done(self) -> None:
        """Until no store's flush with first pushes is on its way; stores that start
        meanwhile wait for this to end (then for the checkpoint's mark, which the caller
        sends before it next waits: the gate opens at once, its waiters run later)."""
        if not self._pushing:
            return
        loop = asyncio.get_running_loop()
        gate = self._checkpointing = loop.create_future()
        try:
            while self._pushing:
                self._pushes_done = loop.create_future()
                await self._pushes_done
        finally:
            self._pushes_done = self._checkpointing = None
            gate.set_result(None)

    async def load(self, now: int, adopt: bool = True) -> None:
        """A new owner: the checkpoint, the log and inbox after it (the old owner's
        materialised entries), the journal's records replayed through the table; then
        what was in flight is pushed again (unless not `adopt`: a look at what Redis
        holds, as tests take it, leaves every delivery as recorded, in flight or due).
        A plain queue message of the log's tail that no record names is left there, in
        the backlog, as its pending delivery would be. Nothing is written."""
        keys = self.journal.keys
        saved = await self.wire.call("GET", keys.checkpoint)
        if saved:
            self.log_cursor, self.inbox_cursor, snapshot, waiting, *last = saved.split(SEP, 4)
            self.log_last = last[0] if last else self.log_cursor  # (a checkpoint before it)
            self.queue.restore(snapshot, now)
            for d in self.queue.deliveries.values():
                self.live.add(d.msgid)
            await self._restore_unfanned(load_json(waiting))
        journal = await self._read_all(keys.journal, b"-")
        fanned: dict[bytes, list[str]] = {}
        records = []
        for _, fields in journal:
            blob = dict(zip(fields[::2], fields[1::2], strict=True))[b"r"]
            for raw in blob.split(END):
                if raw == CHECKPOINTED:
                    continue
                if raw.startswith(FANNED + SEP):
                    _, msgid, names = raw.split(SEP, 2)
                    fanned[msgid] = names.decode().split(",") if names else []
                else:
                    records.append(raw)
        named = {raw.split(SEP, 3)[1] for raw in records}
        # both streams after the checkpoint, in the order they were written (an inbox
        # entry first in a tie: the old owner read it before it wrote its next log entry)
        entries = [
            (entry_order(entry), True, entry, fields)
            for entry, fields in await self._read_all(keys.inbox, b"(" + self.inbox_cursor, now)
        ]
        tail, parked = 0, set()
        read_before = entry_order(self.log_last)  # (the checkpoint's last store)
        async for entry, fields in self._read(keys.log, b"(" + self.log_cursor):
            tail += 1
            self.log_last = entry
            e = parse_entry(entry, fields)
            if e.msgid in self.live or e.msgid in parked:
                continue
            if in_log(e.meta) and e.msgid not in named:
                parked.add(e.msgid)  # (the backlog's: `refill` reads it back)
            elif in_log(e.meta) or entry_order(entry) > read_before:
                entries.append((entry_order(entry), False, entry, fields))
            # (else read as it was stored, before the checkpoint, and over since)
        self.backlog = len(parked)
        entries.sort(key=lambda e: (e[0], not e[1]))
        for _, inbox, entry, fields in entries:
            if inbox:
                self.inbox_cursor = entry
            if is_question(fields):
                continue  # (its asker heard no verdict and sends it again)
            if inbox and fields[-2:] == SEEN:
                continue  # (a copy of a msgid that ended: lib.lua's mark_seen)
            e = parse_entry(entry, fields)
            if e.msgid not in self.live:
                self.live.add(e.msgid)
                copies = fanned.get(e.msgid) if e.meta.topic else None
                self._materialise(e, now, inbox, copies)
        if not self.backlog:
            self.log_cursor = self.log_last
        for record in parse_records(END.join(records)) if records else ():
            try:
                change = self.queue.apply(*record, now)
            except Refused as exc:  # (its delivery is left as it stands: at least once)
                log.error("a journal record its delivery cannot take, skipped",
                          app=self.journal.keys.app, record=record[0].name,
                          msgid=record[1].decode("utf-8", "replace"), error=str(exc))  # fmt: skip
            else:
                if change is not None and change.trigger is Trigger.ACK:
                    self.recovered.append(change)
        self.unchecked = len(records) + len(entries) + tail  # (a long tail: checkpoint it soon)
        if adopt:
            self.adopted = self.queue.adopt(now)
            self.queue.tick(now)
        self.live = {d.msgid for d in self.queue.deliveries.values()}
        self.live.update(e.msgid for e, _ in self.unfanned)
        self.live.update(parked)
        await self.refill(now)

    async def _restore_unfanned(self, waiting: list[tuple[str, bool]]) -> None:
        """The topic messages a checkpoint says wait for a first recipient."""
        keys = self.journal.keys
        replies = await self.wire.call_many(
            [("XRANGE", keys.inbox if inbox else keys.log, e, e) for e, inbox in waiting]
        )
        for (_, inbox), reply in zip(waiting, replies, strict=True):
            if reply:
                e = parse_entry(*reply[0])
                self.unfanned.append((e, inbox))
                self.live.add(e.msgid)

    async def _read(
        self, stream: str, start: bytes, inbox_at: int | None = None
    ) -> AsyncIterator[tuple[bytes, list[bytes]]]:
        """A stream from `start`, a page at a time (a backlog of a million is read, not
        held); the inbox (`inbox_at`: now) as its owner reads it, the entries of a msgid
        that has ended marked (Journal.read_inbox)."""
        while True:
            if inbox_at is not None:
                page = await self.journal.read_inbox(inbox_at, start, READ_BATCH)
            else:
                page = await self.wire.call("XRANGE", stream, start, "+", "COUNT", READ_BATCH)
            for item in page:
                yield item
            if len(page) < READ_BATCH:
                return
            start = b"(" + page[-1][0]

    async def _read_all(
        self, stream: str, start: bytes, inbox_at: int | None = None
    ) -> list[tuple[bytes, list[bytes]]]:
        """`_read`'s entries, held."""
        return [item async for item in self._read(stream, start, inbox_at)]


def in_log(meta: Meta) -> bool:
    """Whether a message may wait in the log, unread, behind a backlog: a queue message
    with no key (its turn is its key's) and no delay (its time is its own)."""
    return not (meta.topic or meta.key or meta.only or meta.deliver_at)


def _delivery(e: Entry, copy: str, inbox: bool = False) -> Delivery:
    """A delivery of a log or inbox entry to `copy`, as stored (DELAYED: `add` moves it)."""
    meta = e.meta
    d = Delivery(e.entry, e.msgid, copy, State.DELAYED, e.content, meta.topic)
    d.key, d.deliver_at, d.expires = meta.key, meta.deliver_at, meta.expires
    d.inbox, d.trace = inbox, meta.trace
    return d


def _chain(last: asyncio.Future[None] | None, waiting: asyncio.Future[None]) -> None:
    """`waiting` done when `last` is (at once if there is none, or it is done)."""
    if last is None or last.done():
        _copy(last, waiting)
    else:
        last.add_done_callback(lambda f: _copy(f, waiting))


def _copy(source: asyncio.Future[None] | None, target: asyncio.Future[None]) -> None:
    if target.done():
        return
    if source is not None and source.cancelled():
        target.cancel()
    elif source is not None and (exc := source.exception()) is not None:
        target.set_exception(exc)
    else:
        target.set_result(None)


def _fail(done: asyncio.Future[None], exc: BaseException) -> None:
    if done.done():
        return
    if isinstance(exc, asyncio.CancelledError):
        done.cancel()
    else:
        done.set_exception(exc)


def observed(done: asyncio.Future[Any]) -> None:
    """For a write nobody awaits: its failure is seen (not "never retrieved")."""
    if not done.cancelled():
        done.exception()


def _after(entry: bytes) -> bytes:
    ms, _, seq = entry.partition(b"-")
    return b"%s-%d" % (ms, int(seq) + 1)
