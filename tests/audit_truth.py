"""A delivery-log generator with known truth, for the Spark audit's tests.

The generator plays a broker's life for each message (received, stored, delayed
delivery, duplicates, pushes, retries, acks, dead letters, operator replays that reset
the attempts, purges and moves, expiries, undeliverable content, pending purges, topic
copies per recipient, lost recipients, pulls by consumer groups with nacks and leases
that run out) and records, *while it builds the events*, what each delivery became: its
due time, first push, acks, time spent in the dead-letter queue, attempts, and how it
ended or waits (its outcome).  The truth is computed from
those records in plain Python, not by re-reading the events, so it checks the audit
independently.  The events are then scattered over files in nested folders, shuffled,
with bad lines of every kind docs/AUDIT.md names (``BAD_LINES``).

Definitions: docs/AUDIT.md.  Percentiles are linear interpolation.
"""

from __future__ import annotations

import json
import math
import random
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BASE_TS = 1_760_000_000_000
RETRY_WAITS = (1000, 5000, 10000, 30000, 60000)
RETRY_TIMES = 5
QUEUE_APPS = {"orders": ["o1", "o2", "o3"], "billing": ["b1", "b2"]}
TOPIC_APPS = {"notify": ["n1", "n2", "n3"]}
MIXED_APPS = {"mixed": ["x1", "x2"]}
# An app whose messages consumer groups pull: each group's copy is a delivery.
PULL_APPS = {"pulls": ["group:ga", "group:gb"]}
CONSUMERS = ("c1", "c2")
ARCHIVE_APP = "archive"  # where dead letters are moved (`dlq replay --to-app`)
UNDELIVERABLE = "undeliverable: content holds CR or LF and no recipient declared the length"
IDLE_RECIPIENTS = [("orders", "o9-idle")]
EVENT_COLUMNS = {"pushed": "pushes", "acked": "acked", "rejected": "rejected"}
EVENT_COLUMNS |= {"errored": "errored", "timeout": "timeouts"}
STUCK_AFTER_MS = 120_000
FAR_FUTURE_MS = 86_400_000
_NEXT_AT = re.compile(r"next attempt at (\d+)")

# Every outcome of docs/AUDIT.md with the group its message counts in, and the order in
# which a message takes the outcome of one of its deliveries.
OUTCOME_GROUPS = {
    "acked": "acked",
    "dead_lettered_attempts": "dead_lettered",
    "dead_lettered_rejected": "dead_lettered",
    "dead_lettered_undeliverable": "dead_lettered",
    "dead_lettered_expired": "dead_lettered",
    "dead_lettered_unnamed": "dead_lettered",
    "dead_letter_purged": "dead_lettered",
    "dead_letter_moved": "dead_lettered",
    "expired_dropped": "dropped",
    "purged_pending": "dropped",
    "not_yet_due": "unresolved",
    "waiting_for_recipient": "unresolved",
    "in_flight": "unresolved",
    "stuck": "unresolved",
}
PRECEDENCE = (
    *[o for o, g in OUTCOME_GROUPS.items() if g == "dead_lettered"],
    "expired_dropped",
    "purged_pending",
    "stuck",
    "in_flight",
    "waiting_for_recipient",
    "not_yet_due",
    "acked",
)
_DEAD_OUTCOME = {
    "rejected": "dead_lettered_rejected",
    "errored": "dead_lettered_attempts",
    "timeout": "dead_lettered_attempts",
    "unreachable": "dead_lettered_attempts",
    "undeliverable": "dead_lettered_undeliverable",
    "expired": "dead_lettered_expired",
    "unknown": "dead_lettered_unnamed",
}

Ref = tuple[str, str, str | None]


def _good(**fields: Any) -> dict[str, Any]:
    line = {"ts": BASE_TS + 7, "event": "pushed", "msgid": "bad", "appid": "orders"}
    line |= {"kind": "queue", "recipient": "o1", "attempt": 1, "broker": "b1", "detail": None}
    return line | fields


# The bad lines mixed into the logs (37), by the reason the audit must give.
BAD_LINES: dict[str, list[str]] = {
    "not_json": [
        '{"ts": 1760000000123, "event": "pus',  # the torn last line of a killed broker
        "not json at all",
        "[1, 2, 3]",
        "\x00\x01binary\x02",
        '{"ts": 1760000000000, "event": "acked",,}',
        '{"ts": 1760000000000',
        '"just a string"',
        "1760000000000",
    ],
    "ts_not_an_integer": [
        json.dumps(_good(ts="1760000000000")),
        json.dumps(_good(ts=1760000000000.5)),
        json.dumps(_good(ts=True)),
    ],
    "attempt_not_an_integer": [
        json.dumps(_good(attempt="2")),
        json.dumps(_good(attempt=2.5)),
        json.dumps(_good(attempt="one")),
        json.dumps(_good(attempt=[1])),
    ],
    "missing_ts": [json.dumps({k: v for k, v in _good().items() if k != "ts"}) for _ in range(2)],
    "missing_event": [json.dumps(_good(event=None)), json.dumps(_good(event=None, ts=BASE_TS))],
    "missing_appid": [json.dumps(_good(appid=None)), json.dumps(_good(appid=None, msgid="z"))],
    "missing_msgid": [json.dumps(_good(msgid="")), json.dumps(_good(msgid=None))],
    "ts_in_seconds": [json.dumps(_good(ts=1_760_000_000)), json.dumps(_good(ts=1_760_000_001))],
    "ts_out_of_range": [
        json.dumps(_good(ts=-5)),
        json.dumps(_good(ts=12)),
        json.dumps(_good(ts=1 << 43)),
    ],
    "unknown_event": [
        json.dumps(_good(event="ACKED")),
        json.dumps(_good(event="Pushed")),
        json.dumps(_good(event="delivered")),
        json.dumps(_good(event="")),
    ],
    "bad_kind": [
        json.dumps(_good(kind="QUEUE")),
        json.dumps(_good(kind=None)),
        json.dumps(_good(kind="fanout")),
    ],
    "attempt_below_1": [json.dumps(_good(attempt=0)), json.dumps(_good(attempt=-1))],
}


def percentile_linear(values: list[int], fraction: float) -> float | None:
    """Exact percentile, linear interpolation between closest ranks (numpy 'linear')."""
    if not values:
        return None
    ordered = sorted(values)
    rank = fraction * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (rank - low) * (ordered[high] - ordered[low])


def _pcts(values: list[int]) -> dict[str, float | int | None]:
    out: dict[str, float | int | None] = {
        key: percentile_linear(values, p) for key, p in (("p50", 0.5), ("p95", 0.95), ("p99", 0.99))
    }
    out["max"] = max(values) if values else None
    return out


@dataclass
class Delivery:
    """What happened to one delivery (a queue message, or one topic copy)."""

    recipient: str | None
    acks: list[tuple[int, int]] = field(default_factory=list)  # (ts, attempt as the audit counts)
    first_push: int | None = None
    dead: bool = False  # in the dead-letter queue at the end
    purged: bool = False  # dead, then purged by an operator
    moved: bool = False  # dead, then moved to another app by an operator
    dropped: bool = False  # its TTL ran out with EXPIRED=drop
    purged_pending: bool = False  # its message purged while pending
    last_to: str | None = None  # the last recipient (group:<name>/<consumer>) it went to
    dead_since: int | None = None
    dead_reason: str = "unknown"
    tries: int = 0  # attempts recorded by its dead letters
    attempts_before: int = 0  # attempts of dead letters replayed so far
    in_dlq: int = 0  # ms spent in the dead-letter queue before the first ack
    flags: set[str] = field(default_factory=set)

    def first_ack(self) -> tuple[int, int]:
        return min(self.acks)

    def ended(self) -> str | None:
        """How it ended (an outcome), None while it is open."""
        if self.acks:
            return "acked"
        if self.moved:
            return "dead_letter_moved"
        if self.purged:
            return "dead_letter_purged"
        if self.dead:
            return _DEAD_OUTCOME[self.dead_reason]
        if self.dropped:
            return "expired_dropped"
        if self.purged_pending:
            return "purged_pending"
        return None


@dataclass
class Message:
    appid: str
    msgid: str
    kind: str
    stored_ts: int | None
    due_ts: int
    deliveries: list[Delivery] = field(default_factory=list)


@dataclass
class Truth:
    totals: dict[str, int]
    latencies: list[int]
    latency_ms: dict[str, float | int | None]
    first_push_ms: dict[str, float | int | None]
    attempts: dict[str, int]
    unresolved: dict[str, int]
    dead_letters: dict[str, Any]
    by_app: list[dict[str, Any]]
    by_recipient: list[dict[str, Any]]
    anomalies: dict[str, int]
    unresolved_refs: list[Ref]
    flagged: dict[str, list[Ref]]
    outcomes: list[dict[str, Any]] = field(default_factory=list)
    delivery_outcomes: dict[Ref, str] = field(default_factory=dict)
    message_outcomes: dict[tuple[str, str], str] = field(default_factory=dict)
    events: int = 0
    bad_lines: dict[str, int] = field(default_factory=dict)


def _is_group(recipient: str | None) -> bool:
    return recipient is not None and recipient.startswith("group:")


def _order(ref: Ref) -> tuple[str, str, int, str]:
    return (ref[0], ref[1], 0 if ref[2] is None else 1, ref[2] or "")


class LogBuilder:
    """Builds events and records the truth; ``truth()`` and ``write()`` at the end."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.events: list[dict[str, Any]] = []
        self.messages: list[Message] = []
        self.unstored = 0
        self.recipient_counts: dict[tuple[str, str], Counter[str]] = defaultdict(Counter)
        self.counters: Counter[str] = Counter()
        # per delivery key (appid, msgid, topic recipient or None): last event, last retry
        self.last_ts: dict[Ref, int] = {}
        self.last_retry: dict[Ref, tuple[int, int]] = {}

    # -- events

    def emit(
        self,
        ts: int,
        event: str,
        msgid: str,
        appid: str,
        kind: str | None,
        recipient: str | None = None,
        attempt: int | None = None,
        detail: str | None = None,
    ) -> None:
        broker = self.rng.choice(("b1", "b2", "b3"))
        self.events.append(
            {
                "ts": ts,
                "event": event,
                "msgid": msgid,
                "appid": appid,
                "kind": kind,
                "recipient": recipient,
                "attempt": attempt,
                "broker": broker,
                "detail": detail,
            }
        )
        self.counters[event] += 1
        if recipient is not None:
            counts = self.recipient_counts[(appid, recipient)]
            if event in EVENT_COLUMNS:
                counts[EVENT_COLUMNS[event]] += 1
        if msgid:
            copy = kind == "topic" or (recipient or "").startswith("group:")
            key = (appid, msgid, recipient if copy else None)
            self.last_ts[key] = max(self.last_ts.get(key, ts), ts)
            found = _NEXT_AT.match(detail or "")
            if event == "retry_scheduled" and found is not None:
                next_at = int(found.group(1))
                self.last_retry[key] = max(self.last_retry.get(key, (ts, next_at)), (ts, next_at))

    # -- one delivery: attempts until acked, dead, expired or left open

    def _attempts(
        self, msg: Message, d: Delivery, t: int, recipients: list[str], outcome: str
    ) -> int:
        """Attempts 1, 2, ...: ``outcome`` acked (at a chosen attempt), dead, open, or
        expired (dead-lettered or dropped after 0 to 2 failed attempts). A consumer
        group's copy is pulled: a pull is logged as `pushed`, a nack as `errored`, a lease
        that ran out as `timeout`, each with its receipt."""
        rng = self.rng
        pull = _is_group(d.recipient)
        if outcome == "acked":
            last = rng.choices([1, 2, 3, 4, 5], [70, 15, 8, 4, 3])[0]
        elif outcome == "dead":
            last = RETRY_TIMES
        elif outcome.startswith("expired"):
            last = rng.randint(0, 2)
        else:
            last = rng.randint(1, 3)
        failure, receipt = "unknown", ""
        for attempt in range(1, last + 1):
            target = d.recipient or rng.choice(recipients)
            if not pull and rng.random() < 0.05:  # unreachable: marked lost, no attempt used
                self.emit(t, "unreachable", msg.msgid, msg.appid, msg.kind, target)
                self.emit(t + 1, "recipient_lost", "", msg.appid, None, target)
                self.emit(t + 2000, "recipient_alive", "", msg.appid, None, target)
                t += rng.randint(2, 30)
            detail = None
            d.last_to = target
            if pull:
                consumer = rng.choice(CONSUMERS)
                receipt = f"; receipt {msg.stored_ts}-0.{d.attempts_before + attempt}"
                detail = f"pulled by {consumer}{receipt}"
                d.last_to = f"{target}/{consumer}"
            self.emit(t, "pushed", msg.msgid, msg.appid, msg.kind, target, attempt, detail)
            if d.first_push is None:
                d.first_push = t
            t += rng.randint(1, 400)
            final = attempt == last
            if final and outcome == "acked":
                if not pull and rng.random() < 0.5:
                    self.emit(t, "arrived", msg.msgid, msg.appid, msg.kind, target, attempt)
                    t += rng.randint(1, 50)
                self.emit(t, "acked", msg.msgid, msg.appid, msg.kind, target, attempt,
                          receipt[2:] or None)  # fmt: skip
                d.acks.append((t, d.attempts_before + attempt))
                return t
            if final and outcome == "open" and rng.random() < 0.5:
                return t  # in flight: pushed, no answer yet
            if pull:  # a nack, or a lease that ran out (logged at the group's next receive)
                failure = rng.choice(("errored", "timeout"))
                said = "nack" if failure == "errored" else "lease ran out"
                self.emit(t, failure, msg.msgid, msg.appid, msg.kind, target, attempt,
                          said + receipt)  # fmt: skip
            else:
                failure = rng.choice(("rejected", "errored", "timeout"))
                self.emit(t, failure, msg.msgid, msg.appid, msg.kind, target, attempt)
            if attempt < RETRY_TIMES:
                due = t + RETRY_WAITS[attempt - 1]
                detail = f"next attempt at {due}{receipt}"
                self.emit(
                    t + 1,
                    "retry_scheduled",
                    msg.msgid,
                    msg.appid,
                    msg.kind,
                    target,
                    attempt,
                    detail,
                )
                if final and outcome == "open":  # open, waiting for its retry
                    return t + 1
                t = due + rng.randint(0, 50)
            else:
                t += rng.randint(1, 20)
        if outcome == "dead":
            detail = f"after {RETRY_TIMES} attempts; last: {failure}{receipt}"
            self.emit(
                t, "dead_lettered", msg.msgid, msg.appid, msg.kind, d.recipient, RETRY_TIMES, detail
            )
            d.dead, d.dead_since, d.dead_reason = True, t, failure
            d.tries += RETRY_TIMES
        elif outcome.startswith("expired"):  # its TTL ran out, found at its next claim
            self._expire(msg, d, t, last, outcome == "expired_dead")
        return t

    def _expire(self, msg: Message, d: Delivery, t: int, attempts: int, dead: bool) -> None:
        made = attempts or None  # never pushed: no attempt
        if d.last_to is None:  # a copy's events name its recipient, pushed or not
            d.last_to = d.recipient
        fate = "dead-lettered" if dead else "dropped (EXPIRED=drop)"
        self.emit(t, "expired", msg.msgid, msg.appid, msg.kind, d.recipient, made, fate)
        if dead:
            self.emit(t, "dead_lettered", msg.msgid, msg.appid, msg.kind, d.recipient, made,
                      "expired")  # fmt: skip
            d.dead, d.dead_since, d.dead_reason = True, t, "expired"
            d.tries += attempts
        else:
            d.dropped = True

    def _deliver(self, msg: Message, d: Delivery, t: int, recipients: list[str]) -> None:
        rng = self.rng
        roll = rng.random()
        if roll < 0.72:
            outcome = "acked"
        elif roll < 0.84:
            outcome = "dead"
        elif roll < 0.87:
            outcome = "expired_dead"
        elif roll < 0.89:
            outcome = "expired_drop"
        elif roll < 0.90 and msg.kind == "queue" and not _is_group(d.recipient):
            # content no recipient can take: dead-lettered by the claim, never pushed
            self.emit(t, "dead_lettered", msg.msgid, msg.appid, msg.kind, None, None,
                      UNDELIVERABLE)  # fmt: skip
            d.dead, d.dead_since, d.dead_reason = True, t, "undeliverable"
            return
        else:
            outcome = "open"
        t = self._attempts(msg, d, t, recipients, outcome)
        target = d.recipient or rng.choice(recipients)
        if outcome == "acked":
            self._after_ack(msg, d, t, target)
        elif outcome == "dead":
            self._after_dead(msg, d, t, target, recipients)

    def _after_ack(self, msg: Message, d: Delivery, t: int, target: str) -> None:
        rng = self.rng
        roll = rng.random()
        ack_attempt = d.acks[0][1] - d.attempts_before  # as the broker numbers it
        if roll < 0.03:  # a redelivery after a crash, acked again
            t += rng.randint(100, 5000)
            self.emit(t, "pushed", msg.msgid, msg.appid, msg.kind, target, ack_attempt + 1)
            self.emit(t + 5, "acked", msg.msgid, msg.appid, msg.kind, target, ack_attempt + 1)
            d.acks.append((t + 5, d.attempts_before + ack_attempt + 1))
            d.flags |= {"acked_more_than_once", "pushed_after_ack"}
        elif roll < 0.06:  # the same ack written twice (two brokers)
            t += rng.randint(1, 50)
            self.emit(t, "acked", msg.msgid, msg.appid, msg.kind, target, ack_attempt)
            d.acks.append((t, d.acks[0][1]))
            d.flags.add("acked_more_than_once")
        elif roll < 0.09:  # pushed again after the ack, no answer
            t += rng.randint(100, 5000)
            self.emit(t, "pushed", msg.msgid, msg.appid, msg.kind, target, ack_attempt + 1)
            d.flags.add("pushed_after_ack")

    def _after_dead(
        self, msg: Message, d: Delivery, t: int, target: str, recipients: list[str]
    ) -> None:
        rng = self.rng
        roll = rng.random()
        if roll < 0.1:  # a late ack after the dead letter: an anomaly, yet acked
            t += rng.randint(10, 500)
            self.emit(t, "acked", msg.msgid, msg.appid, msg.kind, target, RETRY_TIMES)
            assert d.dead_since is not None
            d.in_dlq += t - d.dead_since  # a dead letter never replayed lasts until the ack
            d.acks.append((t, RETRY_TIMES))
            d.dead = False
            d.flags.add("acked_after_dead_letter")
        elif roll < 0.15:  # purged by an operator: gone from the dead-letter queue
            t += rng.randint(60_000, 600_000)
            self.emit(t, "purged", msg.msgid, msg.appid, msg.kind, d.recipient, None,
                      "dead letter purged by an operator")  # fmt: skip
            d.dead, d.purged = False, True
        elif roll < 0.2 and msg.kind == "queue" and not _is_group(d.recipient):
            # moved to another app by an operator (dlq replay --to-app): a new message there
            t += rng.randint(60_000, 600_000)
            self.emit(t, "purged", msg.msgid, msg.appid, msg.kind, d.recipient, None,
                      f"dead letter moved to app {ARCHIVE_APP}")  # fmt: skip
            d.dead, d.moved = False, True
            self.emit(t, "stored", msg.msgid, ARCHIVE_APP, "queue", None, None,
                      f"moved from the dead letters of app {msg.appid}")  # fmt: skip
            moved = Message(ARCHIVE_APP, msg.msgid, "queue", t, t)
            moved.deliveries.append(Delivery(None))  # no recipient there: it waits
            self.messages.append(moved)
        elif roll < 0.55:  # replayed by an operator: attempts start again at 1
            t += rng.randint(60_000, 600_000)
            self.emit(t, "replayed", msg.msgid, msg.appid, msg.kind, d.recipient, None, "replay")
            assert d.dead_since is not None
            d.in_dlq += t - d.dead_since
            d.dead, d.dead_since = False, None
            d.attempts_before += RETRY_TIMES
            t += rng.randint(1, 100)
            then = rng.choices(("acked", "open", "dead"), (60, 25, 15))[0]
            self._attempts(msg, d, t, recipients, then)

    # -- messages

    def message(self, index: int, appid: str, kind: str, recipients: list[str]) -> None:
        rng = self.rng
        msgid = f"m{index:05d}"  # the same msgids in every app: identity is (appid, msgid)
        t = BASE_TS + index * 97 + rng.randint(0, 90)
        self.emit(t, "received", msgid, appid, kind)
        t += rng.randint(1, 5)
        due = t
        detail = None
        if rng.random() < 0.1:  # delayed delivery: due later; latency counts from then
            due = t + rng.randint(1000, 20000)
            detail = f"deliver_at={due}"
        self.emit(t, "stored", msgid, appid, kind, detail=detail)
        msg = Message(appid, msgid, kind, t, due)
        self.messages.append(msg)
        if rng.random() < 0.06:
            for k in range(rng.randint(1, 2)):
                dt = t + rng.randint(10, 3000) + k
                self.emit(dt, "received", msgid, appid, kind)
                self.emit(dt + 1, "duplicate", msgid, appid, kind)
        t = due + rng.randint(1, 30)
        if rng.random() < 0.02:  # purged by an operator while pending, before any push
            self.emit(t, "purged", msgid, appid, kind, None, None,
                      "pending message purged by an operator")  # fmt: skip
            msg.deliveries.append(Delivery(None, purged_pending=True))
            return
        if appid in PULL_APPS:  # each group pulls its own copy
            for group in recipients:
                delivery = Delivery(group)
                msg.deliveries.append(delivery)
                self._deliver(msg, delivery, t + rng.randint(0, 3), recipients)
            return
        if kind == "queue":
            delivery = Delivery(None)
            msg.deliveries.append(delivery)
            self._deliver(msg, delivery, t, recipients)
            return
        if rng.random() < 0.04:  # no recipient alive: nothing to deliver
            return
        alive = rng.sample(recipients, rng.randint(1, len(recipients)))
        for recipient in sorted(alive):
            delivery = Delivery(recipient)
            msg.deliveries.append(delivery)
            self._deliver(msg, delivery, t + rng.randint(0, 3), recipients)

    def special_cases(self, index: int) -> None:
        """Hand-made cases: a topic copy dead twice, delayed far ahead, a message without
        a stored event."""
        t = BASE_TS + index * 97
        msg = Message("notify", "special-1", "topic", t + 1, t + 1)
        self.messages.append(msg)
        self.emit(t, "received", msg.msgid, msg.appid, "topic")
        self.emit(t + 1, "stored", msg.msgid, msg.appid, "topic")
        a, b = Delivery("n1"), Delivery("n2")
        msg.deliveries += [a, b]
        self.emit(t + 10, "pushed", msg.msgid, msg.appid, "topic", "n2", 1)
        self.emit(t + 20, "acked", msg.msgid, msg.appid, "topic", "n2", 1)
        b.first_push, b.acks = t + 10, [(t + 20, 1)]
        # n1: dead after 5 timeouts, replayed, dead again after 5: 10 tries, in the DLQ.
        a.first_push = t + 100
        for run, start in enumerate((t, t + 10_000)):
            for attempt in range(1, RETRY_TIMES + 1):
                at = start + 100 * attempt
                self.emit(at, "pushed", msg.msgid, msg.appid, "topic", "n1", attempt)
                self.emit(at + 5, "timeout", msg.msgid, msg.appid, "topic", "n1", attempt)
            dead_at = start + 600
            detail = f"after {RETRY_TIMES} attempts; last: timeout"
            self.emit(
                dead_at, "dead_lettered", msg.msgid, msg.appid, "topic", "n1", RETRY_TIMES, detail
            )
            if run == 0:
                self.emit(t + 9_000, "replayed", msg.msgid, msg.appid, "topic", "n1", None, "r")
        a.dead, a.dead_since, a.dead_reason, a.tries = True, t + 10_600, "timeout", 10
        a.last_to, b.last_to = "n1", "n2"
        # A topic message dead for 2 of its 3 recipients: 2 dead-letter entries, 1 message.
        two = Message("notify", "special-2", "topic", t + 2, t + 2)
        self.messages.append(two)
        self.emit(t + 2, "stored", two.msgid, two.appid, "topic")
        for recipient in ("n1", "n2", "n3"):
            d = Delivery(recipient, first_push=t + 50, last_to=recipient)
            two.deliveries.append(d)
            self.emit(t + 50, "pushed", two.msgid, two.appid, "topic", recipient, 1)
            if recipient == "n3":
                self.emit(t + 60, "acked", two.msgid, two.appid, "topic", recipient, 1)
                d.acks.append((t + 60, 1))
                continue
            self.emit(t + 70, "rejected", two.msgid, two.appid, "topic", recipient, 1)
            detail = "after 1 attempts; last: rejected"
            self.emit(t + 71, "dead_lettered", two.msgid, two.appid, "topic", recipient, 1, detail)
            d.dead, d.dead_since, d.dead_reason, d.tries = True, t + 71, "rejected", 1
        # Delayed a day ahead: not yet due at the end of the log.
        later = Message("billing", "tomorrow", "queue", t + 3, t + 3 + FAR_FUTURE_MS)
        self.messages.append(later)
        later.deliveries.append(Delivery(None))
        detail = f"deliver_at={later.due_ts}"
        self.emit(t + 3, "stored", later.msgid, later.appid, "queue", detail=detail)
        # Pulled by group ga: every lease runs out, the last one's too: dead for the group.
        lease = Message("pulls", "lease-1", "queue", t + 4, t + 4)
        self.messages.append(lease)
        self.emit(t + 4, "stored", lease.msgid, lease.appid, "queue")
        copy = Delivery("group:ga", first_push=t + 100, last_to="group:ga/c2")
        lease.deliveries.append(copy)
        for attempt in range(1, RETRY_TIMES + 1):
            at, receipt = t + 1000 * attempt, f"receipt {t + 4}-0.{attempt}"
            consumer = "c1" if attempt < RETRY_TIMES else "c2"
            self.emit(at - 900, "pushed", lease.msgid, lease.appid, "queue", "group:ga", attempt,
                      f"pulled by {consumer}; {receipt}")  # fmt: skip
            self.emit(at, "timeout", lease.msgid, lease.appid, "queue", "group:ga", attempt,
                      f"lease ran out; {receipt}")  # fmt: skip
            if attempt < RETRY_TIMES:
                self.emit(at, "retry_scheduled", lease.msgid, lease.appid, "queue", "group:ga",
                          attempt, f"next attempt at {at + 50}; {receipt}")  # fmt: skip
        dead_at = t + 1000 * RETRY_TIMES
        self.emit(dead_at, "dead_lettered", lease.msgid, lease.appid, "queue", "group:ga",
                  RETRY_TIMES, f"after {RETRY_TIMES} attempts; last: timeout; "
                  f"receipt {t + 4}-0.{RETRY_TIMES}")  # fmt: skip
        copy.dead, copy.dead_since, copy.dead_reason, copy.tries = True, dead_at, "timeout", 5
        # Dead-lettered with no reason in the detail (an older broker's line).
        bare = Message("billing", "no-reason", "queue", t + 6, t + 6)
        self.messages.append(bare)
        self.emit(t + 6, "stored", bare.msgid, bare.appid, "queue")
        self.emit(t + 7, "pushed", bare.msgid, bare.appid, "queue", "b2", 1)
        self.emit(t + 8, "dead_lettered", bare.msgid, bare.appid, "queue", None, 1)
        bare.deliveries.append(
            Delivery(None, first_push=t + 7, dead=True, dead_since=t + 8, tries=1, last_to="b2")
        )
        # Events of a message whose stored event is not in the logs.
        self.emit(t + 5, "pushed", "ghost-1", "billing", "queue", "b1", 1)
        self.emit(t + 9, "acked", "ghost-1", "billing", "queue", "b1", 1)
        self.unstored += 1

    def generate(self, n_messages: int) -> None:
        rng = self.rng
        apps = {**QUEUE_APPS, **TOPIC_APPS, **MIXED_APPS, **PULL_APPS}
        for appid, recipients in apps.items():
            for recipient in recipients:
                if not _is_group(recipient):
                    self.emit(BASE_TS - 5000, "recipient_registered", "", appid, None, recipient)
        for appid, recipient in IDLE_RECIPIENTS:
            self.emit(BASE_TS - 4000, "recipient_registered", "", appid, None, recipient)
            self.recipient_counts[(appid, recipient)] += Counter()
        names = list(apps)
        for index in range(n_messages):
            appid = rng.choices(names, [36, 22, 18, 12, 12])[0]
            if appid in TOPIC_APPS:
                kind = "topic"
            elif appid in MIXED_APPS:
                kind = rng.choice(("queue", "topic"))
            else:
                kind = "queue"
            self.message(index, appid, kind, apps[appid])
        self.special_cases(n_messages)

    # -- truth

    def _outcome(self, msg: Message, d: Delivery, as_of: int) -> str:
        ended = d.ended()
        if ended is not None:
            return ended
        key = (msg.appid, msg.msgid, d.recipient)
        last = self.last_ts.get(key, msg.stored_ts or 0)
        retry = self.last_retry.get(key)
        pending_until = msg.due_ts
        if retry is not None and retry[0] == last:
            pending_until = max(pending_until, retry[1])
        if pending_until > as_of:
            return "not_yet_due"
        if d.first_push is None:
            return "waiting_for_recipient"
        return "in_flight" if last >= as_of - STUCK_AFTER_MS else "stuck"

    def truth(self) -> Truth:
        as_of = max(e["ts"] for e in self.events)
        stored = [m for m in self.messages if m.stored_ts is not None]
        pairs = [(m, d) for m in stored for d in m.deliveries]
        pairs += [(m, Delivery(None)) for m in stored if not m.deliveries]
        outcome = {id(d): self._outcome(m, d, as_of) for m, d in pairs}
        rank = {o: i for i, o in enumerate(PRECEDENCE)}
        message_outcome: dict[tuple[str, str], str] = {}
        for m, d in pairs:
            key, mine = (m.appid, m.msgid), outcome[id(d)]
            if key not in message_outcome or rank[mine] < rank[message_outcome[key]]:
                message_outcome[key] = mine

        def status(m: Message) -> str:
            return OUTCOME_GROUPS[message_outcome[(m.appid, m.msgid)]]

        statuses = Counter(status(m) for m in stored)
        acked = [(m, d) for m, d in pairs if d.acks]
        latency = {id(d): d.first_ack()[0] - m.due_ts - d.in_dlq for m, d in acked}
        latencies = list(latency.values())
        pushes = [d.first_push - m.due_ts for m, d in pairs if d.first_push is not None]
        attempts = Counter(d.first_ack()[1] for _, d in acked)
        dead = [(m, d) for m, d in pairs if d.dead]
        open_ones = [(m, d) for m, d in pairs if OUTCOME_GROUPS[outcome[id(d)]] == "unresolved"]
        states = Counter(outcome[id(d)] for _, d in open_ones)
        by_app = []
        for appid in sorted({m.appid for m in stored}):
            of_app = [m for m in stored if m.appid == appid]
            p99 = percentile_linear([latency[id(d)] for m, d in acked if m.appid == appid], 0.99)
            by_app.append(
                {
                    "appid": appid,
                    "messages": len(of_app),
                    **{
                        g: sum(status(m) == g for m in of_app)
                        for g in ("acked", "dead_lettered", "dropped", "unresolved")
                    },
                    "dead_letter_entries": sum(m.appid == appid for m, _ in dead),
                    "p99_ms": None if p99 is None else round(p99, 3),
                }
            )
        by_recipient = [
            {
                "appid": appid,
                "recipient": recipient,
                **{c: counts[c] for c in ("pushes", "acked", "rejected", "errored", "timeouts")},
            }
            for (appid, recipient), counts in sorted(self.recipient_counts.items())
        ]
        flagged: dict[str, list[Ref]] = defaultdict(list)
        for m, d in pairs:
            for flag in d.flags:
                flagged[flag].append((m.appid, m.msgid, d.recipient))
        unresolved = [(m.appid, m.msgid, d.recipient) for m, d in open_ones]
        reasons = Counter((m.appid, d.dead_reason) for m, d in dead)

        def entry(m: Message, d: Delivery) -> dict[str, Any]:
            return {
                "appid": m.appid,
                "msgid": m.msgid,
                "recipient": d.recipient,
                "last_recipient": d.last_to,
                "reason": d.dead_reason,
                "attempts": d.tries,
                "dead_since": d.dead_since,
            }

        def ref_key(pair: tuple[Message, Delivery]) -> tuple[str, str, int, str]:
            return _order((pair[0].appid, pair[0].msgid, pair[1].recipient))

        oldest = sorted(dead, key=lambda p: (p[1].dead_since or 0, ref_key(p)))
        most = sorted(dead, key=lambda p: (-p[1].tries, ref_key(p)))
        by_outcome = Counter(message_outcome[(m.appid, m.msgid)] for m in stored)
        deliveries_by_outcome = Counter(outcome.values())
        return Truth(
            totals={
                "messages": len(stored),
                "acked": statuses["acked"],
                "dead_lettered": statuses["dead_lettered"],
                "dropped": statuses["dropped"],
                "unresolved": statuses["unresolved"],
                "deliveries": len(pairs),
                "dead_letter_entries": len(dead),
                "purged_dead_letters": sum(d.purged or d.moved for _, d in pairs),
                "duplicates": self.counters["duplicate"],
                "pushes": self.counters["pushed"],
            },
            latencies=latencies,
            latency_ms=_pcts(latencies),
            first_push_ms=_pcts(pushes),
            attempts={str(k): attempts[k] for k in sorted(attempts)},
            unresolved={s: states[s] for s in OUTCOME_GROUPS if OUTCOME_GROUPS[s] == "unresolved"},
            dead_letters={
                "entries": len(dead),
                "messages": len({(m.appid, m.msgid) for m, _ in dead}),
                "by_app_reason": [
                    {"appid": a, "reason": r, "entries": n} for (a, r), n in sorted(reasons.items())
                ],
                "oldest": [entry(m, d) for m, d in oldest[:20]],
                "most_tried": [entry(m, d) for m, d in most[:20]],
            },
            by_app=by_app,
            by_recipient=by_recipient,
            anomalies={
                "acked_more_than_once": len(flagged["acked_more_than_once"]),
                "pushed_after_ack": len(flagged["pushed_after_ack"]),
                "acked_after_dead_letter": len(flagged["acked_after_dead_letter"]),
                "unstored_messages": self.unstored,
            },
            unresolved_refs=sorted(unresolved, key=_order),
            flagged={k: sorted(v, key=_order) for k, v in flagged.items()},
            outcomes=[
                {
                    "outcome": o,
                    "group": g,
                    "messages": by_outcome[o],
                    "deliveries": deliveries_by_outcome[o],
                }
                for o, g in OUTCOME_GROUPS.items()
            ],
            delivery_outcomes={(m.appid, m.msgid, d.recipient): outcome[id(d)] for m, d in pairs},
            message_outcomes=message_outcome,
        )

    # -- files

    def write(self, directory: Path, n_files: int = 6) -> list[Path]:
        """Scatter the events and BAD_LINES over ``n_files`` files (shuffled) in nested
        folders."""
        rng = self.rng
        directory.mkdir(parents=True, exist_ok=True)
        buckets: list[list[str]] = [[] for _ in range(n_files)]
        for event in self.events:
            buckets[rng.randrange(n_files)].append(json.dumps(event))
        bad = [line for lines in BAD_LINES.values() for line in lines]
        torn = bad[0]
        for i, line in enumerate(bad):
            buckets[i % n_files].append(line)
        paths: list[Path] = []
        for i, lines in enumerate(buckets):
            rng.shuffle(lines)
            if i == 0:  # the torn line ends its file, without a newline
                lines.remove(torn)
                lines.append(torn)
            sub = directory / ("b1/2025/11" if i % 2 else "")  # some in nested folders
            sub.mkdir(parents=True, exist_ok=True)
            path = sub / f"delivery-b{i % 3 + 1}-{i}.jsonl"
            path.write_text("\n".join(lines), encoding="utf-8")
            paths.append(path)
        (directory / "README.txt").write_text("not a log\n", encoding="utf-8")
        return paths


def build(seed: int, n_messages: int, directory: Path, n_files: int = 6) -> Truth:
    """Generate, write and return the truth (with the bad lines per reason)."""
    builder = LogBuilder(seed)
    builder.generate(n_messages)
    builder.write(directory, n_files)
    truth = builder.truth()
    truth.bad_lines = {reason: len(lines) for reason, lines in BAD_LINES.items()}
    truth.events = len(builder.events)
    return truth
