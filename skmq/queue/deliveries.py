"""The deliveries of one app, in its owner's memory: sans-IO (no sockets, no Redis, no
clock: `now` is passed in), every change through skmq/lifecycle.py's table.

Only what is materialised costs memory: deliveries read from the log and not over (in
flight, waiting for a retry or their time or their key, dead). Pending ones wait in a
FIFO, due times and leases in one heap: no task, timer or future a message. Each
change that must survive the owner appends a record (`records`), which the owner
flushes to the journal in its next write; a new owner runs `apply` over them.
"""

from __future__ import annotations

import collections
import heapq
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from skmq.jsonbody import dump_json, load_json
from skmq.lifecycle import OVER, TRIGGER_OF, Record, Refused, State, Trigger, detour, step
from skmq.queue.entries import entry_order

# The states a delivery leaves at a time of its own (`due`): each has an entry in `timers`.
TIMED = (State.DELAYED, State.WAITING_RETRY, State.IN_FLIGHT)  # (a tuple: Enum hashes in Python)
STATE_OF = {s.value: s for s in State}  # (a checkpoint's states: State(value) is a Python call)
QUEUE = ""  # the copy of a queue message: one delivery for all the app's recipients
SEP = b"\x1f"  # between a record's fields
END = b"\x1e"  # between records
_KINDS = {kind: kind.value.encode() for kind in Record}  # a record's first field


@dataclass(frozen=True, slots=True)
class Policy:
    """How failures are retried and leases run (the broker's settings, in ms)."""

    retry_times: int = 5
    backoff_ms: tuple[int, ...] = (1_000,)
    jitter: float = 0.1
    lease_ms: int = 30_000
    max_extensions: int = 10
    drop_expired: bool = False  # EXPIRED=drop: an expired message is not dead-lettered


@dataclass(slots=True, eq=False)
class Delivery:
    """One message for one consumer: the app's recipients (copy QUEUE), or one
    recipient's copy of a topic message (copy: the recipient id)."""

    entry: bytes  # its log entry id (b"<ms>-<seq>"): the ms is when it was stored
    msgid: bytes
    copy: str
    state: State
    content: bytes | None = None
    topic: bool = False
    key: str = ""  # ordering key ("": none)
    deliver_at: int = 0
    expires: int = 0  # unix ms; 0: never
    attempt: int = 0
    due: int = 0  # when it falls due (delayed, waiting retry) or its lease ends (in flight)
    recipient: str = ""  # in flight: who holds it; dead: who held it last
    extensions: int = 0
    error: str = ""  # the last failure
    inbox: bool = False  # its entry is in the inbox (stored through another broker)
    trace: str = ""  # the producer's W3C traceparent
    history: list[str] = field(default_factory=list)  # each failed attempt: when, who, why
    # in its pending line (perhaps since before it moved on: `take` skips it then, and it
    # serves again if the delivery comes back to pending before its turn)
    in_line: bool = False

    @property
    def ident(self) -> tuple[bytes, str]:
        return (self.msgid, self.copy)

    @property
    def stored_at(self) -> int:
        return int(self.entry.split(b"-", 1)[0])


@dataclass(slots=True)
class Change:
    """A transition made: what the caller logs (the delivery log) and tells. The delivery
    goes on changing; `attempt`, `recipient` and `due` are its own at this transition (a
    timed out attempt logged after the message was pushed again names the attempt that
    failed, and when its retry was due)."""

    delivery: Delivery
    trigger: Trigger
    source: State
    attempt: int = 0
    recipient: str = ""
    due: int = 0


@dataclass
class AppQueue:
    policy: Policy
    rand: Callable[[], float] = field(default=random.random)
    deliveries: dict[tuple[bytes, str], Delivery] = field(default_factory=dict)
    # pending deliveries in stored order, a line for the app's recipients (QUEUE) and one
    # for each recipient's topic copies (a copy goes only when its recipient has room)
    pending: dict[str, collections.deque[Delivery]] = field(default_factory=dict)
    # (when, tiebreak, delivery): due times and lease ends; an entry whose delivery
    # moved on since is skipped when it comes up
    timers: list[tuple[int, int, Delivery]] = field(default_factory=list)
    keys: dict[str, collections.deque[Delivery]] = field(default_factory=dict)
    copies: dict[bytes, int] = field(default_factory=dict)  # a topic message's copies left
    records: list[bytes] = field(default_factory=list)
    settled: list[bytes] = field(default_factory=list)  # msgids acked, for dedupe
    forgotten: list[bytes] = field(default_factory=list)  # msgids over, every copy
    dead: list[Delivery] = field(default_factory=list)  # for the app's dead letters
    expired: list[Change] = field(default_factory=list)  # met by `take`, for the caller
    recording: bool = True  # False while a new owner replays the journal
    behind_keys: int = 0  # deliveries WAITING_KEY (an earlier one of their key not over)
    _seq: int = 0

    # -- the table ---------------------------------------------------------
    def _move(
        self, d: Delivery, trigger: Trigger, now: int, extra: str = "", timed: bool = True
    ) -> Change:
        """One transition by the table (`timed` False: a timed state left again at once,
        as an adopted retry due now, gets no timer entry)."""
        source = d.state
        rule = step(source, trigger)
        d.state = rule.target
        if source is State.WAITING_KEY:
            self.behind_keys -= 1
        if rule.record is not None and self.recording:
            self.records.append(_record(rule.record, d, extra))
        target = rule.target
        if target is State.PENDING and not d.in_line:
            self._line(d.copy).append(d)
            d.in_line = True
        elif target in TIMED and timed:
            self._timer(d)
        if target in OVER:
            self._over(d, now)
        return Change(d, trigger, source, d.attempt, d.recipient, d.due)

    def _timer(self, d: Delivery) -> None:
        self._seq += 1
        heapq.heappush(self.timers, (d.due, self._seq, d))

    def _over(self, d: Delivery, now: int) -> None:
        """A delivery over (acked, dead, dropped, purged): the next of its key goes, and
        it leaves memory (a dead one for the app's dead letters)."""
        if d.key and d.copy == QUEUE:
            waiting = self.keys.get(d.key)
            if waiting and waiting[0] is d:
                waiting.popleft()
                if waiting:
                    nxt = waiting[0]
                    nxt.due = max(nxt.deliver_at, now)
                    self._move(nxt, Trigger.KEY_FREE, now)
                    if nxt.due <= now:
                        self._move(nxt, Trigger.DUE, now)
                else:
                    del self.keys[d.key]
            elif waiting and d in waiting:  # (behind its key's head: purged, or expired)
                waiting.remove(d)
        del self.deliveries[d.ident]
        # (replaying the journal: the old owner flushed these with the record)
        if d.state is State.DEAD and self.recording:
            self.dead.append(d)
        if self._last_copy(d):
            self.forgotten.append(d.msgid)
            if d.state is State.ACKED and self.recording:
                self.settled.append(d.msgid)

    def _last_copy(self, d: Delivery) -> bool:
        """Whether d was the message's last copy not over (a queue message: its only)."""
        if not d.topic:
            return True
        left = self.copies[d.msgid] - 1
        if left:
            self.copies[d.msgid] = left
            return False
        del self.copies[d.msgid]
        return True

    # -- materialising ------------------------------------------------------
    def add(self, d: Delivery, now: int) -> None:
        """A delivery read from the log (d.state: the state it is stored in, DELAYED)."""
        if d.ident in self.deliveries:
            return
        self.deliveries[d.ident] = d
        if d.topic:
            self.copies[d.msgid] = self.copies.get(d.msgid, 0) + 1
        d.state = State.DELAYED
        d.due = d.deliver_at
        if d.expires and d.due > d.expires:
            d.due = d.expires
        if d.key and d.copy == QUEUE:
            waiting = self.keys.setdefault(d.key, collections.deque())
            waiting.append(d)
            if len(waiting) > 1:
                d.state = State.WAITING_KEY
                self.behind_keys += 1
                return
        if d.due <= now:
            self._move(d, Trigger.DUE, now)
        else:
            self._timer(d)

    # -- time ---------------------------------------------------------------
    def next_due(self) -> int | None:
        while self.timers:
            when, _, d = self.timers[0]
            if d.due == when and d.state in TIMED:
                return when
            heapq.heappop(self.timers)
        return None

    def tick(self, now: int) -> list[Change]:
        """Delays run out (-> pending) and leases run out (a failed attempt)."""
        changes: list[Change] = []
        while (when := self.next_due()) is not None and when <= now:
            _, _, d = heapq.heappop(self.timers)
            if d.state is State.IN_FLIGHT:
                changes.append(self._failed(d, "timeout: no answer in time", now))
            else:
                changes.append(self._move(d, Trigger.DUE, now))
        return changes

    # -- pushing --------------------------------------------------------------
    def _line(self, copy: str) -> collections.deque[Delivery]:
        line = self.pending.get(copy)
        if line is None:
            line = self.pending[copy] = collections.deque()
        return line

    def lines(self) -> list[str]:
        """The pending lines that hold something: QUEUE, and recipients with copies."""
        return [copy for copy, line in self.pending.items() if line]

    def take(self, n: int, now: int, copy: str = QUEUE) -> Iterator[Delivery]:
        """Up to n pending deliveries of a line (the queue's, or one recipient's copies),
        oldest first; those whose TTL ran out are expired on the way (their changes in
        `expired`)."""
        line = self.pending.get(copy)
        taken = 0
        while line and taken < n:
            d = line.popleft()
            d.in_line = False
            if d.state is not State.PENDING:
                continue  # (it moved on since it was queued: purged, expired)
            if d.expires and now >= d.expires:
                self.expired.append(self._expire(d, now))
                continue
            taken += 1
            yield d

    def push(self, d: Delivery, recipient: str, now: int) -> Change:
        """d (from `take`) handed to `recipient` for attempt n + 1, under a lease."""
        d.attempt += 1
        d.recipient = recipient
        d.extensions = 0
        d.due = now + self.policy.lease_ms
        return self._move(d, Trigger.PUSH, now, f"{d.due} {recipient}")

    def push_record(self, msgid: bytes, recipient: str, now: int) -> bytes:
        """The record `push` makes of a queue message's first attempt, made before the
        message is held: its store and its push go in one flush (`add_pushed`)."""
        d = Delivery(b"", msgid, QUEUE, State.PENDING, attempt=1)
        return _record(Record.PUSHED, d, f"{now + self.policy.lease_ms} {recipient}")

    def add_pushed(self, d: Delivery, recipient: str, now: int) -> Change:
        """A queue message due now, stored with its first push (`push_record`, written
        by the same flush): materialised as `add` does, and pushed at once, through the
        table, without recording the push again."""
        self.add(d, now)
        if d.state is not State.PENDING:  # (held already, or not due: not for this)
            raise Refused(d.state, Trigger.PUSH)
        self.pending[d.copy].pop()  # (`add` put it last in its line)
        d.in_line = False
        recording, self.recording = self.recording, False
        try:
            return self.push(d, recipient, now)
        finally:
            self.recording = recording

    def drop_moved(self) -> None:
        """The pending lines without the deliveries that moved on since they joined
        (`take` skips them as it meets them; after a purge, at once: the line's length
        is what `AppOwner.refill` goes by)."""
        for copy, line in self.pending.items():
            kept: collections.deque[Delivery] = collections.deque()
            for d in line:
                if d.state is State.PENDING:
                    kept.append(d)
                else:
                    d.in_line = False
            self.pending[copy] = kept

    def expire_waiting(self, now: int) -> int | None:
        """The pending deliveries and those behind their key whose TTL ran out, expired
        though no claim takes them (an app with no recipient alive, a lost recipient's
        copies; their changes in `expired`); returns the next such expiry. (A delayed
        one or a retry wait falls due at its expiry at the latest: `tick`, then this.)"""
        ahead: int | None = None
        moved = False
        for d in list(self.deliveries.values()):
            if not d.expires or (d.state is not State.PENDING and d.state is not State.WAITING_KEY):
                continue
            if now >= d.expires:
                self.expired.append(self._expire(d, now))
                moved = True
            elif ahead is None or d.expires < ahead:
                ahead = d.expires
        if moved:
            self.drop_moved()
        return ahead

    def put_back(self, d: Delivery) -> None:
        """A delivery `take` gave that the caller could not push now: first again."""
        self._line(d.copy).appendleft(d)
        d.in_line = True

    def undeliverable(self, d: Delivery, reason: str, now: int) -> Change:
        d.error = reason
        _note(d, now, reason)
        return self._move(d, Trigger.UNDELIVERABLE, now, reason)

    # -- answers --------------------------------------------------------------
    def _in_flight(self, msgid: bytes, copy: str, attempt: int) -> Delivery:
        """The delivery an answer names: in flight, and (unless 0) that attempt."""
        d = self.deliveries.get((msgid, copy))
        if d is None:
            raise Refused(State.ACKED, Trigger.ACK)  # (over, or never held: nothing to do)
        if d.state is not State.IN_FLIGHT or (attempt and d.attempt != attempt):
            raise Refused(d.state, Trigger.ACK)
        return d

    def ack(self, msgid: bytes, copy: str, attempt: int, now: int) -> Change:
        return self._move(self._in_flight(msgid, copy, attempt), Trigger.ACK, now)

    def fail(self, msgid: bytes, copy: str, attempt: int, error: str, now: int) -> Change:
        return self._failed(self._in_flight(msgid, copy, attempt), error, now)

    def extend(self, msgid: bytes, copy: str, attempt: int, now: int) -> Change | None:
        """A lease extended (arrived): None once MAX_LEASE_EXTENSIONS are spent."""
        d = self._in_flight(msgid, copy, attempt)
        if d.extensions >= self.policy.max_extensions:
            return None
        d.extensions += 1
        d.due = now + self.policy.lease_ms
        return self._move(d, Trigger.EXTEND, now)

    def release(self, msgid: bytes, copy: str, attempt: int, now: int) -> Change:
        """Never seen by its recipient (a push that did not leave): no attempt spent."""
        d = self._in_flight(msgid, copy, attempt)
        d.attempt -= 1
        return self._move(d, Trigger.RELEASE, now)

    def _failed(self, d: Delivery, error: str, now: int) -> Change:
        d.error = error
        _note(d, now, error)
        if d.expires and now >= d.expires:
            return self._expire(d, now)
        if d.attempt >= self.policy.retry_times:
            return self._move(d, Trigger.GIVE_UP, now, error)
        backoff = self.policy.backoff_ms
        wait = backoff[min(max(d.attempt, 1), len(backoff)) - 1]
        wait = int(wait * (1 + self.policy.jitter * (2 * self.rand() - 1)))
        d.due = now + wait
        if d.expires and d.due > d.expires:
            d.due = d.expires
        return self._move(d, Trigger.RETRY, now, f"{d.due} {error}")

    def _expire(self, d: Delivery, now: int) -> Change:
        d.error = "expired"
        d.history.append(
            f"{now} attempt={d.attempt} recipient={d.recipient} expired: its ttl ran out"
        )
        return self._move(d, Trigger.DROP if self.policy.drop_expired else Trigger.EXPIRE, now)

    # -- operators --------------------------------------------------------------
    def purge(self, msgid: bytes, copy: str, now: int) -> Change:
        """A waiting delivery removed (one in flight is refused: its answer decides)."""
        d = self.deliveries.get((msgid, copy))
        if d is None:
            raise Refused(State.ACKED, Trigger.PURGE)
        return self._move(d, Trigger.PURGE, now)

    # -- a new owner -------------------------------------------------------------
    def apply(
        self, kind: Record, msgid: bytes, copy: str, attempt: int, extra: str, now: int
    ) -> Change | None:
        """Replay one journal record (None: its delivery is not held, e.g. over in an
        earlier checkpoint): the derived transitions it needs, then its own, through the
        same table as live; nothing is recorded again. Returns its own transition."""
        d = self.deliveries.get((msgid, copy))
        if d is None:
            return None
        trigger = TRIGGER_OF[kind]
        self.recording = False
        try:
            for derived in detour(d.state, trigger):
                self._move(d, derived, now)
            d.attempt = attempt
            if kind is Record.PUSHED or kind is Record.RETRIED:
                due, _, rest = extra.partition(" ")
                d.due = int(due)
                if kind is Record.PUSHED:
                    d.recipient = rest
                else:
                    d.error = rest
            elif kind is Record.DEAD or kind is Record.UNDELIVERABLE:
                d.error = extra
            return self._move(d, trigger, now)
        finally:
            self.recording = True

    def adopt(self, now: int) -> list[Change]:
        """After a takeover: what the old owner had in flight is pushed again now (its
        push connections are gone with it), the attempt counted, or dead when that was
        the last one. Returns the failed attempts (a retry or a give_up each), which the
        reaper logs as timeouts."""
        changes = []
        error = "timeout: its owner stopped"
        retried = f"{now} {error}"
        for d in [d for d in self.deliveries.values() if d.state is State.IN_FLIGHT]:
            d.error = error
            if d.attempt >= self.policy.retry_times:
                changes.append(self._move(d, Trigger.GIVE_UP, now, error))
            else:
                d.due = now
                changes.append(self._move(d, Trigger.RETRY, now, retried, timed=False))
                self._move(d, Trigger.DUE, now)
        self._compact_timers()
        return changes

    def _compact_timers(self) -> None:
        """The timers' entries whose delivery moved on since, dropped at once (next_due
        drops them one pop at a time: after an adopt of 100,000 in flight, two each, 0.75
        s of a takeover)."""
        self.timers = [t for t in self.timers if t[2].due == t[0] and t[2].state in TIMED]
        heapq.heapify(self.timers)

    def snapshot(self) -> bytes:
        """Every delivery held, for a checkpoint (content stays in the log)."""
        return dump_json(
            [
                [
                    d.entry.decode(),
                    d.msgid.decode("latin-1"),
                    d.copy,
                    d.state.value,
                    d.attempt,
                    d.due,
                    d.recipient,
                    d.key,
                    d.deliver_at,
                    d.expires,
                    int(d.topic),
                    d.error,
                    int(d.inbox),
                ]
                for d in self.deliveries.values()
            ]
        )

    def restore(self, snapshot: bytes, now: int) -> None:
        """Hold the deliveries of a checkpoint, as they were (a fresh AppQueue)."""
        rows = load_json(snapshot)
        rows.sort(key=lambda r: entry_order(r[0].encode()))  # keys and pending in stored order
        for row in rows:
            entry, msgid, copy, state, attempt, due, rid, key, at, expires, topic, error = row[:12]
            d = Delivery(
                entry.encode(),
                msgid.encode("latin-1"),
                copy,
                STATE_OF[state],
                None,
                bool(topic),
                key,
                at,
                expires,
                attempt,
                due,
                rid,
                0,
                error,
                inbox=bool(row[12:13] == [1]),  # (a checkpoint made before the field: none)
            )
            self.deliveries[d.ident] = d
            if d.topic:
                self.copies[d.msgid] = self.copies.get(d.msgid, 0) + 1
            if d.key and d.copy == QUEUE:
                self.keys.setdefault(d.key, collections.deque()).append(d)
            if d.state is State.WAITING_KEY:
                self.behind_keys += 1
            if d.state is State.PENDING:
                self._line(d.copy).append(d)
                d.in_line = True
            elif d.state in TIMED:
                self._seq += 1
                self.timers.append((d.due, self._seq, d))
        heapq.heapify(self.timers)  # (once, not a push a delivery)

    def counts(self, now: int) -> tuple[int, int, int]:
        """Deliveries held: (due, not yet due or waiting for their key, in flight)."""
        due = later = in_flight = 0
        for d in self.deliveries.values():
            if d.state is State.IN_FLIGHT:
                in_flight += 1
            elif d.state is State.WAITING_KEY or (
                d.state in (State.DELAYED, State.WAITING_RETRY) and d.due > now
            ):
                later += 1
            else:
                due += 1
        return due, later, in_flight

    def drain(self) -> tuple[bytes, list[bytes], list[bytes], list[Delivery]]:
        """The records, the msgids acked, the msgids over and the deliveries dead since
        the last drain, for the next flush."""
        out = END.join(self.records), self.settled, self.forgotten, self.dead
        self.records, self.settled, self.forgotten, self.dead = [], [], [], []
        return out


def _note(d: Delivery, now: int, why: str) -> None:
    """A line of a delivery's history (its dead letter shows it)."""
    d.history.append(f"{now} attempt={d.attempt} recipient={d.recipient} {why}")


def _record(kind: Record, d: Delivery, extra: str) -> bytes:
    # (a msgid holds no \x1e nor \x1f: the protocol refuses control characters in one)
    copy = d.copy.encode() if d.copy else b""
    return SEP.join((_KINDS[kind], d.msgid, copy, b"%d" % d.attempt, extra.encode()))


def parse_records(blob: bytes) -> Iterator[tuple[Record, bytes, str, int, str]]:
    """(kind, msgid, copy, attempt, extra) of each record of a journal entry."""
    for raw in blob.split(END):
        kind, msgid, copy, attempt, extra = raw.split(SEP, 4)
        yield Record(kind.decode()), msgid, copy.decode(), int(attempt), extra.decode()
