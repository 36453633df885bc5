"""A delivery-log generator with known truth, for the Spark audit's tests.

The generator plays a broker's life for each message (received, stored, duplicates,
pushes, retries, acks, dead letters, replays, topic copies per recipient, lost
recipients) and records, *while it builds the events*, what each message and each
delivery became.  The truth is computed from those records in plain Python, not by
re-reading the events, so it checks the audit independently.  The events are then
scattered over several files, shuffled, with a torn line and other invalid lines.

Definitions follow spark/audit.py's docstring; percentiles are linear interpolation.
"""

from __future__ import annotations

import json
import math
import random
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
IDLE_RECIPIENTS = [("orders", "o9-idle")]
EVENT_COLUMNS = {"pushed": "pushes", "acked": "acked", "rejected": "rejected"}
EVENT_COLUMNS |= {"errored": "errored", "timeout": "timeouts"}

Ref = tuple[str, str, str | None]


def percentile_linear(values: list[int], fraction: float) -> float | None:
    """Exact percentile, linear interpolation between closest ranks (numpy 'linear')."""
    if not values:
        return None
    ordered = sorted(values)
    rank = fraction * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (rank - low) * (ordered[high] - ordered[low])


@dataclass
class Delivery:
    """What happened to one delivery (a queue message, or one topic copy)."""

    recipient: str | None
    acks: list[tuple[int, int]] = field(default_factory=list)  # (ts, attempt)
    dead: bool = False
    flags: set[str] = field(default_factory=set)


@dataclass
class Message:
    appid: str
    msgid: str
    kind: str
    stored_ts: int | None
    deliveries: list[Delivery] = field(default_factory=list)

    def status(self) -> str:
        if any(d.acks for d in self.deliveries):
            return "acked"
        if any(d.dead for d in self.deliveries):
            return "dead_lettered"
        return "unresolved"

    def first_ack(self) -> tuple[int, int]:
        return min(a for d in self.deliveries for a in d.acks)


@dataclass
class Truth:
    totals: dict[str, int]
    latencies: list[int]
    latency_ms: dict[str, float | int | None]
    attempts: dict[str, int]
    by_app: list[dict[str, Any]]
    by_recipient: list[dict[str, Any]]
    anomalies: dict[str, int]
    unresolved: list[Ref]
    flagged: dict[str, list[Ref]]


class LogBuilder:
    """Builds events and records the truth; ``truth()`` and ``write()`` at the end."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.events: list[dict[str, Any]] = []
        self.messages: list[Message] = []
        self.unstored = 0
        self.recipient_counts: dict[tuple[str, str], Counter[str]] = defaultdict(Counter)
        self.counters: Counter[str] = Counter()

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

    # -- one delivery: attempts until acked, dead or left open

    def _attempts(
        self, msg: Message, d: Delivery, t: int, start: int, recipients: list[str], outcome: str
    ) -> int:
        """Attempts from ``start``: ``outcome`` acked (at a chosen attempt), dead, open."""
        rng = self.rng
        if outcome == "acked":
            last = start - 1 + rng.choices([1, 2, 3, 4, 5], [70, 15, 8, 4, 3])[0]
        elif outcome == "dead":
            last = RETRY_TIMES
        else:
            last = start - 1 + rng.randint(1, 3)
        for attempt in range(start, last + 1):
            target = d.recipient or rng.choice(recipients)
            if rng.random() < 0.05:  # unreachable: marked lost, no attempt used
                self.emit(t, "unreachable", msg.msgid, msg.appid, msg.kind, target)
                self.emit(t + 1, "recipient_lost", "", msg.appid, None, target)
                self.emit(t + 2000, "recipient_alive", "", msg.appid, "queue", target)
                t += rng.randint(2, 30)
            self.emit(t, "pushed", msg.msgid, msg.appid, msg.kind, target, attempt)
            t += rng.randint(1, 400)
            final = attempt == last
            if final and outcome == "acked":
                if rng.random() < 0.5:
                    self.emit(t, "arrived", msg.msgid, msg.appid, msg.kind, target, attempt)
                    t += rng.randint(1, 50)
                self.emit(t, "acked", msg.msgid, msg.appid, msg.kind, target, attempt)
                d.acks.append((t, attempt))
                return t
            if final and outcome == "open":
                if rng.random() < 0.5:  # in flight: pushed, no answer yet
                    return t
            failure = rng.choice(("rejected", "errored", "timeout"))
            self.emit(t, failure, msg.msgid, msg.appid, msg.kind, target, attempt)
            if attempt < RETRY_TIMES:
                wait = RETRY_WAITS[attempt - 1]
                self.emit(t + 1, "retry_scheduled", msg.msgid, msg.appid, msg.kind, target, attempt)
                t += wait + rng.randint(0, 50)
            else:
                t += rng.randint(1, 20)
        if outcome == "dead":
            self.emit(t, "dead_lettered", msg.msgid, msg.appid, msg.kind, d.recipient)
            d.dead = True
        return t

    def _deliver(self, msg: Message, d: Delivery, t: int, recipients: list[str]) -> None:
        rng = self.rng
        roll = rng.random()
        outcome = "acked" if roll < 0.75 else "dead" if roll < 0.87 else "open"
        t = self._attempts(msg, d, t, 1, recipients, outcome)
        target = d.recipient or rng.choice(recipients)
        if outcome == "acked":
            roll = rng.random()
            if roll < 0.03:  # a redelivery after a crash, acked again
                t += rng.randint(100, 5000)
                attempt = d.acks[0][1] + 1
                self.emit(t, "pushed", msg.msgid, msg.appid, msg.kind, target, attempt)
                self.emit(t + 5, "acked", msg.msgid, msg.appid, msg.kind, target, attempt)
                d.acks.append((t + 5, attempt))
                d.flags |= {"acked_more_than_once", "pushed_after_ack"}
            elif roll < 0.06:  # the same ack written twice (two brokers)
                t += rng.randint(1, 50)
                self.emit(t, "acked", msg.msgid, msg.appid, msg.kind, target, d.acks[0][1])
                d.acks.append((t, d.acks[0][1]))
                d.flags.add("acked_more_than_once")
            elif roll < 0.09:  # pushed again after the ack, no answer
                t += rng.randint(100, 5000)
                attempt = d.acks[0][1] + 1
                self.emit(t, "pushed", msg.msgid, msg.appid, msg.kind, target, attempt)
                d.flags.add("pushed_after_ack")
        elif outcome == "dead":
            roll = rng.random()
            if roll < 0.1:  # a late ack after the dead letter: an anomaly, yet acked
                t += rng.randint(10, 500)
                self.emit(t, "acked", msg.msgid, msg.appid, msg.kind, target, RETRY_TIMES)
                d.acks.append((t, RETRY_TIMES))
                d.flags.add("acked_after_dead_letter")
            elif roll < 0.4:  # replayed by an operator
                t += rng.randint(60_000, 600_000)
                self.emit(t, "replayed", msg.msgid, msg.appid, msg.kind, d.recipient)
                t += rng.randint(1, 100)
                then = "acked" if rng.random() < 0.6 else "open"
                self._attempts(msg, d, t, 1, recipients, then)

    # -- messages

    def message(self, index: int, appid: str, kind: str, recipients: list[str]) -> None:
        rng = self.rng
        msgid = f"m{index:05d}"  # the same msgids in every app: identity is (appid, msgid)
        t = BASE_TS + index * 97 + rng.randint(0, 90)
        self.emit(t, "received", msgid, appid, kind)
        t += rng.randint(1, 5)
        self.emit(t, "stored", msgid, appid, kind)
        msg = Message(appid, msgid, kind, t)
        self.messages.append(msg)
        if rng.random() < 0.06:
            for k in range(rng.randint(1, 2)):
                dt = t + rng.randint(10, 3000) + k
                self.emit(dt, "received", msgid, appid, kind)
                self.emit(dt + 1, "duplicate", msgid, appid, kind)
        if rng.random() < 0.1:  # delayed delivery
            t += rng.randint(1000, 20000)
        t += rng.randint(1, 30)
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
        """Hand-made cases: message-wide replay on a topic, a message without stored."""
        # A topic copy dead-lettered, replayed by a message-wide (recipient null) event,
        # then acked: not an anomaly.  The other copy is acked at once.
        t = BASE_TS + index * 97
        msg = Message("notify", "special-1", "topic", t + 1)
        self.messages.append(msg)
        self.emit(t, "received", msg.msgid, msg.appid, "topic")
        self.emit(t + 1, "stored", msg.msgid, msg.appid, "topic")
        a, b = Delivery("n1"), Delivery("n2")
        msg.deliveries += [a, b]
        self.emit(t + 10, "pushed", msg.msgid, msg.appid, "topic", "n2", 1)
        self.emit(t + 20, "acked", msg.msgid, msg.appid, "topic", "n2", 1)
        b.acks.append((t + 20, 1))
        for attempt in range(1, RETRY_TIMES + 1):
            self.emit(t + 100 * attempt, "pushed", msg.msgid, msg.appid, "topic", "n1", attempt)
            self.emit(
                t + 100 * attempt + 5, "timeout", msg.msgid, msg.appid, "topic", "n1", attempt
            )
        self.emit(t + 600, "dead_lettered", msg.msgid, msg.appid, "topic", "n1")
        self.emit(t + 700, "replayed", msg.msgid, msg.appid, "topic", None)
        self.emit(t + 800, "pushed", msg.msgid, msg.appid, "topic", "n1", 1)
        self.emit(t + 900, "acked", msg.msgid, msg.appid, "topic", "n1", 1)
        a.dead = True
        a.acks.append((t + 900, 1))
        # Events of a message whose stored event is not in the logs.
        self.emit(t + 5, "pushed", "ghost-1", "billing", "queue", "b1", 1)
        self.emit(t + 9, "acked", "ghost-1", "billing", "queue", "b1", 1)
        self.unstored += 1

    def generate(self, n_messages: int) -> None:
        rng = self.rng
        apps = {**QUEUE_APPS, **TOPIC_APPS, **MIXED_APPS}
        for appid, recipients in apps.items():
            for recipient in recipients:
                self.emit(BASE_TS - 5000, "recipient_registered", "", appid, None, recipient)
        for appid, recipient in IDLE_RECIPIENTS:
            self.emit(BASE_TS - 4000, "recipient_registered", "", appid, "queue", recipient)
            self.recipient_counts[(appid, recipient)] += Counter()
        names = list(apps)
        for index in range(n_messages):
            appid = rng.choices(names, [40, 25, 20, 15])[0]
            if appid in TOPIC_APPS:
                kind = "topic"
            elif appid in MIXED_APPS:
                kind = rng.choice(("queue", "topic"))
            else:
                kind = "queue"
            self.message(index, appid, kind, apps[appid])
        self.special_cases(n_messages)

    # -- truth

    def truth(self) -> Truth:
        stored = [m for m in self.messages if m.stored_ts is not None]
        statuses = Counter(m.status() for m in stored)
        acked = [m for m in stored if m.status() == "acked"]
        latencies = [m.first_ack()[0] - int(m.stored_ts or 0) for m in acked]
        attempts = Counter(m.first_ack()[1] for m in acked)
        by_app = []
        for appid in sorted({m.appid for m in stored}):
            mine = [m for m in stored if m.appid == appid]
            mine_acked = [m for m in mine if m.status() == "acked"]
            p99 = percentile_linear(
                [m.first_ack()[0] - int(m.stored_ts or 0) for m in mine_acked], 0.99
            )
            by_app.append(
                {
                    "appid": appid,
                    "messages": len(mine),
                    "acked": len(mine_acked),
                    "dead_lettered": sum(m.status() == "dead_lettered" for m in mine),
                    "unresolved": sum(m.status() == "unresolved" for m in mine),
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
        unresolved: list[Ref] = []
        for m in stored:
            for d in m.deliveries:
                for flag in d.flags:
                    flagged[flag].append((m.appid, m.msgid, d.recipient))
                if not d.acks and not d.dead:
                    unresolved.append((m.appid, m.msgid, d.recipient))
            if not m.deliveries:
                unresolved.append((m.appid, m.msgid, None))

        def order(ref: Ref) -> tuple[str, str, int, str]:
            return (ref[0], ref[1], 0 if ref[2] is None else 1, ref[2] or "")

        pcts = {
            key: percentile_linear(latencies, p)
            for key, p in (("p50", 0.5), ("p95", 0.95), ("p99", 0.99))
        }
        return Truth(
            totals={
                "messages": len(stored),
                "duplicates": self.counters["duplicate"],
                "acked": statuses["acked"],
                "dead_lettered": statuses["dead_lettered"],
                "unresolved": statuses["unresolved"],
                "pushes": self.counters["pushed"],
            },
            latencies=latencies,
            latency_ms={**pcts, "max": max(latencies) if latencies else None},
            attempts={str(k): attempts[k] for k in sorted(attempts)},
            by_app=by_app,
            by_recipient=by_recipient,
            anomalies={
                "acked_more_than_once": len(flagged["acked_more_than_once"]),
                "pushed_after_ack": len(flagged["pushed_after_ack"]),
                "acked_after_dead_letter": len(flagged["acked_after_dead_letter"]),
                "unresolved": len(unresolved),
                "unstored_messages": self.unstored,
            },
            unresolved=sorted(unresolved, key=order),
            flagged={k: sorted(v, key=order) for k, v in flagged.items()},
        )

    # -- files

    def write(self, directory: Path, n_files: int = 6) -> tuple[list[Path], int]:
        """Scatter the events over ``n_files`` files (shuffled); returns files, invalid lines."""
        rng = self.rng
        directory.mkdir(parents=True, exist_ok=True)
        buckets: list[list[str]] = [[] for _ in range(n_files)]
        for event in self.events:
            buckets[rng.randrange(n_files)].append(json.dumps(event))
        invalid = [
            '{"ts": 1760000000123, "event": "pus',  # torn last line of a killed broker
            "not json at all",
            json.dumps({"ts": BASE_TS, "event": "pushed", "msgid": "x", "appid": None}),
            json.dumps({"ts": -5, "event": "stored", "msgid": "neg", "appid": "orders"}),
        ]
        for i, line in enumerate(invalid):
            buckets[i % n_files].append(line)
        paths: list[Path] = []
        for i, lines in enumerate(buckets):
            rng.shuffle(lines)
            if i == 0:  # the torn line ends its file, without a newline
                lines.remove(invalid[0])
                lines.append(invalid[0])
            sub = directory / ("b1" if i % 2 else "")  # some in a sub-directory
            sub.mkdir(parents=True, exist_ok=True)
            path = sub / f"delivery-b{i % 3 + 1}-{i}.jsonl"
            path.write_text("\n".join(lines), encoding="utf-8")
            paths.append(path)
        (directory / "README.txt").write_text("not a log\n", encoding="utf-8")
        return paths, len(invalid)


def build(seed: int, n_messages: int, directory: Path, n_files: int = 6) -> Truth:
    """Generate, write and return the truth (``invalid_lines`` in its anomalies)."""
    builder = LogBuilder(seed)
    builder.generate(n_messages)
    _, invalid = builder.write(directory, n_files)
    truth = builder.truth()
    truth.anomalies["invalid_lines"] = invalid
    return truth
