"""Benchmark of the Spark delivery-log audit on generated logs of 100k, 1M, 5M, 10M events.

    python bench/audit_bench.py [--events 100k,1M,5M,10M] [--master 'local[2]']
                                [--keep DIR] [--cold [--runs N] [--conf KEY=VALUE ...]]

Generates a realistic log into a temporary directory: about 190k messages over four
apps, ~8% of them topic messages to 2 or 3 recipients, ~7% of deliveries retried after
rejected/errored/timeout, ~2% dead-lettered (a fifth of those replayed and acked),
~6% left in flight, 2% duplicates, a few recipients unreachable and back, a few
redeliveries acked twice; four brokers, each rotating its file every 100k lines
(12 files, ~160 MB a million events), the delivery-log format the broker writes
(details of delayed messages, retries and dead letters included).  Then it runs the
audit in local mode and prints, per size, the audit time, the machine's load average
before and after, and the share of CPU other processes used meanwhile (the machine may
be shared); the generation and Spark start-up times are printed apart.

With ``--cold`` each size is audited by a fresh ``skmq audit`` process instead (JVM
start included, as a user runs it), ``--runs`` times; it prints the wall time, the CPU
seconds of the process and its JVM, and the load average before and after.  With
``--keep DIR`` a size whose logs are already in ``DIR/<events>/logs`` is not generated
again.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TextIO

import psutil
from pyspark.sql import SparkSession
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
    '"recipient":{recipient},"attempt":{attempt},"broker":"{broker}","detail":{detail}}}\n'
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
        detail: str | None = None,
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
                detail="null" if detail is None else f'"{detail}"',
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
        failure = "unknown"
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
            failure = rng.choice(("rejected", "errored", "timeout"))
            emit(t, failure, msgid, appid, kind, target, attempt, broker)
            if attempt < 5:
                due = t + RETRY_WAITS[attempt - 1]
                detail = f"next attempt at {due}"
                emit(t + 1, "retry_scheduled", msgid, appid, kind, target, attempt, broker, detail)
                t = due
        detail = f"after 5 attempts; last: {failure}"
        emit(t + 1, "dead_lettered", msgid, appid, kind, copy, 5, None, detail)
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
        detail, due = None, t
        if rng.random() < 0.05:  # delayed delivery
            due = t + rng.randint(1000, 60_000)
            detail = f"deliver_at={due}"
        emit(t, "stored", msgid, appid, kind, None, None, broker, detail)
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


def _load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f} {five:.2f} {fifteen:.2f} on {os.cpu_count()} cpus"


def _own_cpu() -> dict[int, float]:
    """CPU seconds of this process and its children (the JVM), by pid."""
    found: dict[int, float] = {}
    me = psutil.Process()
    for proc in [me, *me.children(recursive=True)]:
        try:
            times = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        found[proc.pid] = times.user + times.system
    return found


def _tree_cpu(
    proc: psutil.Process, members: dict[int, psutil.Process], seen: dict[int, float]
) -> None:
    """The CPU seconds so far of ``proc``, its children and the ``members`` found before
    (the JVM outlives ``skmq audit`` by its own exit), by pid, into ``seen``; a member
    gone leaves ``members``."""
    with contextlib.suppress(psutil.NoSuchProcess):
        for member in [proc, *proc.children(recursive=True)]:
            members.setdefault(member.pid, member)
    for pid, member in list(members.items()):
        try:
            times = member.cpu_times()
        except psutil.NoSuchProcess:  # a zombie too
            del members[pid]
            continue
        seen[pid] = max(seen.get(pid, 0.0), times.user + times.system)


def _cold_run(logs_dir: Path, out_dir: Path, master: str, conf: list[str]) -> tuple[float, float]:
    """One ``skmq audit`` in a fresh process: (wall seconds to its exit, CPU seconds of its
    tree, the JVM's until it is gone)."""
    skmq = Path(sys.executable).parent / "skmq"
    command = [str(skmq)] if skmq.exists() else [sys.executable, "-m", "skmq.cli"]
    command += ["audit", "--logs", str(logs_dir), "--out", str(out_dir), "--master", master]
    command += [arg for item in conf for arg in ("--conf", item)]
    members: dict[int, psutil.Process] = {}
    cpu: dict[int, float] = {}
    start = time.perf_counter()
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    watched = psutil.Process(child.pid)
    while True:  # the tree's CPU sampled every 0.2 s; the wall clock to the exit itself
        _tree_cpu(watched, members, cpu)
        try:
            child.wait(timeout=0.2)
            break
        except subprocess.TimeoutExpired:
            continue
    wall = time.perf_counter() - start
    _, err = child.communicate(timeout=60)
    deadline = time.monotonic() + 60
    while members and time.monotonic() < deadline:
        _tree_cpu(watched, members, cpu)
        time.sleep(0.05)
    if child.returncode != 0:
        raise RuntimeError(f"skmq audit exited with {child.returncode}: {err[-2000:]}")
    return wall, sum(cpu.values())


def _cold_size(events: int, args: argparse.Namespace) -> float:
    """Audit ``events`` events with fresh ``skmq audit`` processes; the best wall time."""
    base = Path(args.keep) / str(events) if args.keep else Path(tempfile.mkdtemp(prefix="skmq-"))
    logs_dir = base / "logs"
    try:
        if not (logs_dir.is_dir() and any(logs_dir.iterdir())):
            logs_dir.mkdir(parents=True, exist_ok=True)
            written, messages, files = generate(logs_dir, events, args.seed)
            print(f"{written:,} events ({messages:,} messages, {len(files)} files) generated")
        walls: list[float] = []
        for run in range(1, args.runs + 1):
            before = _load()
            wall, cpu = _cold_run(logs_dir, base / "out", args.master, args.conf)
            walls.append(wall)
            print(
                f"  cold skmq audit of {events:,} events, run {run}: {wall:.1f}s wall, "
                f"{cpu:.1f} CPU s (python + JVM); before: {before}; after: {_load()}",
                flush=True,
            )
        return min(walls)
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)


def _run_size(spark: SparkSession, events: int, seed: int, keep: str | None) -> float:
    """Generate ``events`` events, audit them; returns the audit's seconds."""
    base = Path(keep) / str(events) if keep else Path(tempfile.mkdtemp(prefix="skmq-audit-"))
    logs_dir, out_dir = base / "logs", base / "out"
    logs_dir.mkdir(parents=True, exist_ok=True)
    try:
        start = time.perf_counter()
        written, messages, files = generate(logs_dir, events, seed)
        generated = time.perf_counter() - start
        size = sum(f.stat().st_size for f in files) / 1e6
        print(
            f"{written:,} events ({messages:,} messages, {len(files)} files, {size:.0f} MB) "
            f"generated in {generated:.1f}s; before the audit: {_load()}",
            flush=True,
        )
        cpu = psutil.cpu_times()
        own = _own_cpu()
        start = time.perf_counter()
        report = run_audit(str(logs_dir), str(out_dir), spark=spark, progress=False)
        audited = time.perf_counter() - start
        busy = psutil.cpu_times()
        after = _own_cpu()
        used = (busy.user + busy.system) - (cpu.user + cpu.system)
        ours = sum(after[pid] - own[pid] for pid in after.keys() & own.keys())
        others = max(0.0, used - ours) / audited / (os.cpu_count() or 1) * 100
        totals = report["totals"]
        print(
            f"  audit of {written:,} events: {audited:.1f}s ({written / audited:,.0f} events/s); "
            f"other processes used {others:.0f}% of the machine's CPU meanwhile; after: {_load()}"
        )
        print(
            f"  {totals['messages']:,} messages, {totals['acked']:,} acked, "
            f"{totals['dead_letter_entries']:,} dead-letter entries; "
            f"latency p99 {report['latency_ms']['p99']} ms",
            flush=True,
        )
        return audited
    finally:
        if not keep:
            shutil.rmtree(base, ignore_errors=True)


_SIZE = re.compile(r"([0-9]+)([kKmM]?)")
_UNITS = {"": 1, "k": 1_000, "m": 1_000_000}


def event_counts(text: str) -> list[int]:
    """``--events``: comma-separated sizes, each a whole number, or one with ``k`` or
    ``M`` after it (``1M``, ``10M``, ``500k``, ``1000000``)."""
    sizes: list[int] = []
    for item in text.split(","):
        found = _SIZE.fullmatch(item.strip())
        if found is None or int(found.group(1)) == 0:
            raise ValueError(
                f"{item.strip()!r} is not a number of events (e.g. 1M, 10M, 500k, 1000000)"
            )
        sizes.append(int(found.group(1)) * _UNITS[found.group(2).lower()])
    return sizes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--events",
        default="100k,1M,5M,10M",
        help="comma-separated log sizes, each audited in turn: 1M, 10M, 500k or 1000000 "
        "(default 100k,1M,5M,10M: 100k's Arrow batches are under Spark's local-relation size)",
    )
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--seed", type=int, default=1734)
    parser.add_argument("--keep", default=None, help="write the logs and reports here, keep them")
    parser.add_argument(
        "--cold", action="store_true", help="time fresh `skmq audit` processes (JVM start included)"
    )
    parser.add_argument("--runs", type=int, default=1, help="with --cold: runs of each size")
    parser.add_argument(
        "--conf", action="append", default=[], metavar="KEY=VALUE", help="with --cold: a setting"
    )
    args = parser.parse_args(argv)
    try:
        sizes = event_counts(args.events)
    except ValueError as exc:
        parser.exit(2, f"{parser.prog}: --events: {exc}\n")
    if args.cold:
        print(
            f"method: a fresh `skmq audit --master {args.master}` process per run, its wall "
            "clock from start to exit (Python and JVM start, reading, every report section, "
            "writing the four files); CPU: the process tree's user + system seconds, the "
            "JVM's until it is gone (it ends its Spark session after `skmq audit` exits)"
        )
        print(f"machine: python {sys.version.split()[0]}, {_load()}", flush=True)
        best = [(events, _cold_size(events, args)) for events in sizes]
        print("summary (best run): " + ", ".join(f"{n / 1e6:g}M events {s:.1f}s" for n, s in best))
        return 0
    print(
        f"method: each size generated into a fresh directory (4 brokers, files rotated every "
        f"{ROTATE_LINES:,} lines), then audited by run_audit() in one Spark session "
        f"({args.master}) started once; the time is run_audit's wall clock: reading and "
        "parsing, every report section, writing the four files. JVM start-up is separate."
    )
    print(f"machine: python {sys.version.split()[0]}, {_load()}", flush=True)
    start = time.perf_counter()
    spark = build_spark(args.master)
    print(
        f"Spark {spark.version} started ({args.master}, "
        f"{spark.sparkContext.defaultParallelism} cores) in {time.perf_counter() - start:.1f}s",
        flush=True,
    )
    results: list[tuple[int, float]] = []
    try:
        for events in sizes:
            results.append((events, _run_size(spark, events, args.seed, args.keep)))
    finally:
        spark.stop()
    print("summary: " + ", ".join(f"{n / 1e6:g}M events {s:.1f}s" for n, s in results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
