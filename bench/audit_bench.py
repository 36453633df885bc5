"""Benchmark of the Spark delivery-log audit on a generated log of about 1,000,000 events.

    python bench/audit_bench.py [--events 1000000] [--master 'local[*]'] [--keep DIR]

Generates a realistic log into a temporary directory: about 190k messages over four
apps, ~8% of them topic messages to 2 or 3 recipients, ~7% of deliveries retried after
rejected/errored/timeout, ~2% dead-lettered (a fifth of those replayed and acked),
~6% left in flight, 2% duplicates, a few recipients unreachable and back, a few
redeliveries acked twice; four brokers, each rotating its file every 100k lines
(12 files, ~160 MB).  Then it runs the audit in
local mode and prints the generation time, the Spark start-up time and the audit time
separately.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import TextIO

from skmq.audit_job.audit import build_spark, run_audit

BASE_TS = 1_760_000_000_000
APPS = {
    "orders": ["o1", "o2", "o3", "o4"],
    "billing": ["b1", "b2"],
    "search": ["s1", "s2", "s3"],
    "notify": ["n1", "n2", "n3"],
}
APP_WEIGHTS = [45, 20, 27, 8]
BROKERS = ("b-1", "b-2", "b-3", "b-4")
ROTATE_LINES = 100_000
RETRY_WAITS = (1000, 5000, 10000, 30000, 60000)
LINE = (
    '{{"ts":{ts},"event":"{event}","msgid":"{msgid}","appid":"{appid}","kind":"{kind}",'
    '"recipient":{recipient},"attempt":{attempt},"broker":"{broker}","detail":null}}\n'
)


class RotatingLogs:
    """One file per broker, rotated every ROTATE_LINES lines."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.handles: dict[str, TextIO] = {}
        self.lines: dict[str, int] = {}
        self.serial: dict[str, int] = {}
        self.files: list[Path] = []
        self.total = 0

    def write(self, broker: str, line: str) -> None:
        if self.lines.get(broker, ROTATE_LINES) >= ROTATE_LINES:
            if broker in self.handles:
                self.handles[broker].close()
            n = self.serial.get(broker, 0)
            self.serial[broker] = n + 1
            path = self.directory / f"delivery-{broker}-{n}.jsonl"
            self.files.append(path)
            self.handles[broker] = open(path, "w", encoding="utf-8")
            self.lines[broker] = 0
        self.handles[broker].write(line)
        self.lines[broker] += 1
        self.total += 1

    def close(self) -> None:
        for handle in self.handles.values():
            handle.close()


def generate(directory: Path, target_events: int, seed: int) -> tuple[int, int, list[Path]]:
    """Write about ``target_events`` events; returns (events, messages, files)."""
    rng = random.Random(seed)
    logs = RotatingLogs(directory)
    names = list(APPS)
    index = 0

    def emit(
        ts: int,
        event: str,
        msgid: str,
        appid: str,
        kind: str,
        recipient: str | None = None,
        attempt: int | None = None,
        broker: str | None = None,
    ) -> None:
        writer = broker or rng.choice(BROKERS)
        logs.write(
            writer,
            LINE.format(
                ts=ts,
                event=event,
                msgid=msgid,
                appid=appid,
                kind=kind,
                recipient="null" if recipient is None else f'"{recipient}"',
                attempt="null" if attempt is None else attempt,
                broker=writer,
            ),
        )

    for appid, recipients in APPS.items():
        for recipient in recipients:
            emit(BASE_TS - 1000, "recipient_registered", "", appid, "queue", recipient)

    def deliver(msgid: str, appid: str, kind: str, copy: str | None, t: int) -> None:
        recipients = APPS[appid]
        roll = rng.random()
        if roll < 0.92:
            outcome, last = "acked", rng.choices([1, 2, 3, 4, 5], [93, 4, 1.5, 1, 0.5])[0]
        elif roll < 0.94:
            outcome, last = "dead", 5
        else:
            outcome, last = "open", rng.randint(1, 3)
        for attempt in range(1, last + 1):
            target = copy or rng.choice(recipients)
            broker = rng.choice(BROKERS)
            if rng.random() < 0.01:
                emit(t, "unreachable", msgid, appid, kind, target, None, broker)
                emit(t + 1, "recipient_lost", "", appid, kind, target, None, broker)
                emit(t + 3000, "recipient_alive", "", appid, kind, target, None, broker)
                t += 2
            emit(t, "pushed", msgid, appid, kind, target, attempt, broker)
            t += int(rng.lognormvariate(3.5, 1.0)) + 1
            if attempt == last and outcome == "acked":
                if rng.random() < 0.05:
                    emit(t, "arrived", msgid, appid, kind, target, attempt, broker)
                    t += rng.randint(1, 20)
                emit(t, "acked", msgid, appid, kind, target, attempt, broker)
                if rng.random() < 0.002:  # redelivered after a broker crash, acked again
                    emit(t + 900, "pushed", msgid, appid, kind, target, attempt + 1)
                    emit(t + 950, "acked", msgid, appid, kind, target, attempt + 1)
                return
            if attempt == last and outcome == "open":
                return
            emit(
                t,
                rng.choice(("rejected", "errored", "timeout")),
                msgid,
                appid,
                kind,
                target,
                attempt,
                broker,
            )
            if attempt < 5:
                emit(t + 1, "retry_scheduled", msgid, appid, kind, target, attempt, broker)
                t += RETRY_WAITS[attempt - 1]
        emit(t + 1, "dead_lettered", msgid, appid, kind, copy)
        if rng.random() < 0.2:  # replayed by an operator, then acked
            t += rng.randint(60_000, 600_000)
            emit(t, "replayed", msgid, appid, kind, copy)
            target = copy or rng.choice(recipients)
            emit(t + 5, "pushed", msgid, appid, kind, target, 1)
            emit(t + 40, "acked", msgid, appid, kind, target, 1)

    while logs.total < target_events:
        appid = rng.choices(names, APP_WEIGHTS)[0]
        kind = "topic" if appid == "notify" else "queue"
        msgid = f"{index:08x}-{rng.getrandbits(32):08x}"
        t = BASE_TS + index * 5 + rng.randint(0, 4)  # ~200 messages a second
        broker = rng.choice(BROKERS)
        emit(t, "received", msgid, appid, kind, None, None, broker)
        t += rng.randint(1, 3)
        emit(t, "stored", msgid, appid, kind, None, None, broker)
        if rng.random() < 0.02:
            emit(t + 500, "received", msgid, appid, kind, None, None, broker)
            emit(t + 501, "duplicate", msgid, appid, kind, None, None, broker)
        t += rng.randint(0, 10)
        if kind == "queue":
            deliver(msgid, appid, kind, None, t)
        else:
            alive = APPS[appid] if rng.random() < 0.5 else APPS[appid][:2]
            for recipient in alive:
                deliver(msgid, appid, kind, recipient, t + rng.randint(0, 3))
        index += 1
    logs.close()
    return logs.total, index, logs.files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--master", default="local[*]")
    parser.add_argument("--seed", type=int, default=1734)
    parser.add_argument("--keep", default=None, help="write the logs and reports here, keep them")
    args = parser.parse_args(argv)

    base = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="skmq-audit-bench-"))
    logs_dir, out_dir = base / "logs", base / "out"
    logs_dir.mkdir(parents=True, exist_ok=True)
    try:
        start = time.perf_counter()
        events, messages, files = generate(logs_dir, args.events, args.seed)
        generated = time.perf_counter() - start
        size = sum(f.stat().st_size for f in files) / 1e6
        print(
            f"generated {events:,} events ({messages:,} messages, {len(files)} files, "
            f"{size:.0f} MB) in {generated:.1f}s"
        )

        start = time.perf_counter()
        spark = build_spark(args.master)
        started = time.perf_counter() - start
        parallelism = spark.sparkContext.defaultParallelism
        print(
            f"Spark {spark.version} started ({args.master}, {parallelism} cores) in {started:.1f}s"
        )
        try:
            start = time.perf_counter()
            report = run_audit(str(logs_dir), str(out_dir), spark=spark)
            audited = time.perf_counter() - start
        finally:
            spark.stop()
        totals = report["totals"]
        print(
            f"audit of {events:,} events in {audited:.1f}s "
            f"({events / audited:,.0f} events/s; {started + audited:.1f}s with Spark start-up)"
        )
        print(f"totals: {totals}")
        print(f"latency_ms: {report['latency_ms']}")
        print(f"python {sys.version.split()[0]}, {os.cpu_count()} cpus; reports in {out_dir}")
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
