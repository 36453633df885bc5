"""Takeover of an app (docs/OWNER-DESIGN.md): how fast another broker takes an app
over when its owner dies or stalls, whether a stalled owner's writes are fenced, and
whether anything is lost over many faults in a row.

    python -m bench.takeover [--scenarios kill,stop,loop] [--messages 100000]
                             [--lease 2] [--faults 50] [--json [PATH]]

Each scenario gets a Redis server of its own (skmq.embedded: a free port, appendonly
yes, appendfsync everysec) and two `skmq serve` (bench/chaos.py's Broker) on it with
OWNER_LEASE=--lease, PUSH_WINDOW=--messages (the window has no cap in
skmq/config.py but `ge=1`) and BROKER_ID broker0/broker1, so that the app's `owner` key
(`<broker>:<epoch>`, skmq/queue/journal.py AppKeys) names the process that owns it.
One recipient (in this process) registers for the app and holds every push (answers
nothing, pings only) or acks each, as the scenario wants.

- kill: --messages messages stored and pushed, all held by the recipient (in flight
  with the owner, ACK_TIMEOUT long enough that none times out); the owner gets kill -9.
  Figures: the seconds from the kill to the other broker's acquire of the app (its
  `epoch` increments), to its first and its last push again of a held message, how many
  were pushed again, and lost (never pushed again within --wait); target: the last one
  within lease + 1 s.
- stop: --stop-messages held as above; the owner gets SIGSTOP; messages are produced
  through both brokers meanwhile (the stopped one's are answered once it runs again);
  once the other broker pushes the held messages again, --stall-extra s more, then
  SIGCONT, and --after s of the woken owner running. Figures: its writes refused
  ("owner write fenced" lines in its log) and those that landed after the takeover:
  journal entries of its epoch (each entry carries `e`, the epoch that wrote it, read
  from the journal every 10 ms since a checkpoint trims it) and log entries of messages
  it stored (only an owner's flush writes the log: a store through a broker that does not
  own the app goes to the inbox). Then every push is acked and every message produced
  must have been received (lost = 0).
- loop: --faults faults in a row on the brokers and Redis with messages produced at
  --rate through both brokers and acked by the recipient: kill -9 of the owner (started
  again at once), SIGSTOP of the owner until the other takes over then SIGCONT, kill -9
  of Redis (started again on its AOF), in turn. Figures: each fault's recovery (seconds
  to the next push received), then lost once production stops.

Prints the figures and os.getloadavg() at the start and the end; `--json` also writes
bench/results/takeover-<time>.json. Exits 1 if a message was lost or a stale write
landed, 2 on a setup error.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import itertools
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from bench.chaos import Broker
from bench.pull_drain import loadavg
from bench.report import add_json_flag, json_path
from skmq.client import Producer
from skmq.codec import PONG, CodecError, Frame, FrameProtocol, InvalidFrame, encode_frame
from skmq.embedded import EmbeddedRedis
from skmq.logarchive import log_files, read_lines
from skmq.queue.journal import AppKeys

APP = "takeover"
PREFIX = "takeover"
FENCED_LINE = "owner write fenced"
POLL = 0.01  # seconds between reads of Redis while a takeover is awaited
SEND_TIMEOUT = 10.0


def log(message: str) -> None:
    print(f"[takeover {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# -- the recipient ------------------------------------------------------------------------


class Recipient:
    """Listens for the brokers' push connections; every push is noted (msgid -> the
    monotonic times it came) and held unanswered, or acked at once (`acking`)."""

    def __init__(self) -> None:
        self.arrivals: dict[str, list[float]] = {}
        self.count = 0  # pushes received
        self.acking = False
        self.connections: list[PushConnection] = []
        self.changed = asyncio.Event()
        self.port = 0
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: PushConnection(self), "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def register(self, broker_port: int) -> None:
        body = {"id": "holder", "app_id": APP, "host": "127.0.0.1", "port": self.port,
                "weight": 0, "caps": ["pipeline", "length", "token"]}  # fmt: skip
        async with Producer("127.0.0.1", broker_port) as producer:
            resp = await producer.request("register", (), json.dumps(body).encode())
        if not resp.ok:
            raise RuntimeError(f"registration refused: {resp.content}")

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for conn in self.connections:
            conn.close()

    def pushed(self, frame: Frame) -> None:
        self.arrivals.setdefault(frame.fields["msgid"], []).append(time.monotonic())
        self.count += 1
        self.changed.set()

    def received(self) -> set[str]:
        return set(self.arrivals)

    def first_after(self, since: float, msgids: Sequence[str]) -> dict[str, float]:
        """Each msgid's first push after `since`, seconds after it."""
        out = {}
        for msgid in msgids:
            later = [t for t in self.arrivals.get(msgid, ()) if t > since]
            if later:
                out[msgid] = later[0] - since
        return out

    def ack_all(self) -> None:
        """From now on ack every push; ack those held, each on its connection."""
        self.acking = True
        for conn in self.connections:
            conn.ack_held()

    async def until(self, done: Callable[[], bool], timeout: float) -> bool:
        """Wait (at most `timeout` s) until `done()`, checked at each push; its last value."""
        deadline = time.monotonic() + timeout
        while not done():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), min(left, 0.5))
        return True


class PushConnection(FrameProtocol):
    """One push connection a broker opened to the recipient."""

    def __init__(self, recipient: Recipient) -> None:
        super().__init__(max_frame_bytes=1 << 20)
        self.recipient = recipient
        self.held: list[Frame] = []
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.recipient.connections.append(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.held.clear()
        with contextlib.suppress(ValueError):
            self.recipient.connections.remove(self)

    def stream_broken(self, exc: CodecError) -> None:
        self.close()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def frames_received(self, frames: list[Frame | InvalidFrame]) -> None:
        acks = []
        for frame in frames:
            if not isinstance(frame, Frame):
                continue
            if frame.type == "ping":
                acks.append(PONG)
            elif frame.type == "push":
                self.recipient.pushed(frame)
                if self.recipient.acking:
                    acks.append(ack_of(frame))
                else:
                    self.held.append(frame)
        if acks and self.transport is not None:
            self.transport.write(b"".join(acks))

    def ack_held(self) -> None:
        held, self.held = self.held, []
        if self.transport is not None and held:
            self.transport.write(b"".join(ack_of(f) for f in held))


def ack_of(push: Frame) -> bytes:
    fields = {"msgid": push.fields["msgid"], "appid": push.fields.get("appid", APP)}
    if "token" in push.fields:
        fields["token"] = push.fields["token"]
    return encode_frame("ack", fields)


# -- producers ------------------------------------------------------------------------------


async def store(broker: Broker, msgids: Sequence[str], chunk: int = 2000) -> None:
    """Store every msgid through `broker`, pipelined `chunk` at a time; raise unless acked."""
    async with Producer("127.0.0.1", broker.port) as producer:
        for i in range(0, len(msgids), chunk):
            part = msgids[i : i + chunk]
            resps = await asyncio.gather(*(producer.send(APP, b"x" * 100, msgid=m) for m in part))
            refused = [r for r in resps if not r.ok]
            if refused:
                raise RuntimeError(f"{len(refused)} not stored, e.g. {refused[0].content}")


@dataclass
class Feed:
    """Messages produced through each broker at `rate` a second until stopped; a message
    not acked (an error, no answer in time, the connection lost) is sent again through
    the same broker until it is. `acked` says which broker acked each msgid."""

    brokers: Sequence[Broker]
    rate: float
    window: int = 500
    acked: dict[str, str] = field(default_factory=dict)
    sent: set[str] = field(default_factory=set)
    answers: Counter[str] = field(default_factory=Counter)  # "<broker> <status>"
    firsts: list[tuple[float, str]] = field(default_factory=list)  # (first sent, msgid)
    stopping: bool = False
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._produce(b)) for b in self.brokers]

    async def finish(self, timeout: float) -> bool:
        """Stop making new messages; wait until every one sent is acked (False: not all)."""
        self.stopping = True
        done, pending = await asyncio.wait(self._tasks, timeout=timeout)
        for task in pending:
            task.cancel()
        for task in done:
            task.result()
        return not pending

    def since(self, at: float) -> list[str]:
        """The msgids first sent after `at` (monotonic)."""
        return [m for _, m in self.firsts[bisect.bisect(self.firsts, (at, "")) :]]

    async def _produce(self, broker: Broker) -> None:
        todo: list[str] = []
        numbers = itertools.count()
        window = asyncio.Semaphore(self.window)
        tasks: set[asyncio.Task[None]] = set()
        while not self.stopping or todo or tasks:
            producer = Producer("127.0.0.1", broker.port)
            try:
                await asyncio.wait_for(producer.connect(), 2)
            except (OSError, TimeoutError):
                await asyncio.sleep(0.1)
                continue
            try:
                while producer.connected and (not self.stopping or todo or tasks):
                    if todo:
                        msgid = todo.pop()
                    elif not self.stopping:
                        msgid = f"{broker.name}-{next(numbers)}"
                    else:
                        await asyncio.sleep(0.05)  # answers on their way
                        continue
                    await window.acquire()
                    if msgid not in self.sent:
                        self.sent.add(msgid)
                        self.firsts.append((time.monotonic(), msgid))
                    task = asyncio.create_task(self._send(producer, broker, msgid, todo, window))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                    await asyncio.sleep(1 / self.rate)
            finally:
                await producer.close()
                if tasks:  # (their msgids go back to `todo`)
                    await asyncio.wait(set(tasks), timeout=SEND_TIMEOUT + 1)

    async def _send(
        self,
        producer: Producer,
        broker: Broker,
        msgid: str,
        todo: list[str],
        window: asyncio.Semaphore,
    ) -> None:
        try:
            resp = await asyncio.wait_for(producer.send(APP, b"x" * 100, msgid=msgid), SEND_TIMEOUT)
            self.answers[f"{broker.name} {resp.status}"] += 1
            if resp.ok:
                self.acked.setdefault(msgid, broker.name)
            else:
                todo.append(msgid)
        except (OSError, TimeoutError, ConnectionError):
            self.answers[f"{broker.name} no answer"] += 1
            todo.append(msgid)
        finally:
            window.release()


# -- the rig: Redis, two brokers, the recipient ----------------------------------------------


class Rig:
    """A Redis of its own, two brokers on it, the recipient registered."""

    def __init__(self, args: argparse.Namespace, workdir: Path, ack_timeout: float) -> None:
        self.args = args
        self.workdir = workdir
        self.ack_timeout = ack_timeout
        self.redis = EmbeddedRedis(workdir / "redis", appendfsync="everysec")
        self.brokers: list[Broker] = []
        self.recipient = Recipient()
        self.client: Any = None
        self.keys = AppKeys.of(PREFIX, APP)

    async def __aenter__(self) -> Rig:
        self.redis.start()
        settings = argparse.Namespace(ack_timeout=self.ack_timeout, retry_times=100)
        for i in range(2):
            broker = Broker(i, self.workdir, self.redis.url, settings)
            broker.env.update(
                SKMQ_KEY_PREFIX=PREFIX,
                SKMQ_OWNER_LEASE=str(self.args.lease),
                SKMQ_BROKER_ID=broker.name,
                SKMQ_PUSH_WINDOW=str(max(self.args.messages, self.args.stop_messages)),
                # the recipient shares this process with the run: room for a late pong
                SKMQ_HEARTBEAT_INTERVAL="2",
                SKMQ_HEARTBEAT_TIMEOUT="5",
                SKMQ_RETRY_BACKOFF="0.1,0.2,0.5",
            )
            self.brokers.append(broker)
        await asyncio.gather(*(b.start() for b in self.brokers))
        self.client = aioredis.Redis.from_url(self.redis.url)
        await self.recipient.start()
        await self.recipient.register(self.brokers[0].port)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.recipient.close()
        for broker in self.brokers:
            if broker.proc is not None and broker.proc.poll() is None:
                broker.proc.send_signal(signal.SIGCONT)  # (a stopped one acts on SIGTERM)
            with contextlib.suppress(Exception):
                await broker.stop()
            broker.force_stop()
        if self.client is not None:
            with contextlib.suppress(Exception):
                await self.client.aclose()
        self.redis.stop()

    async def holder(self) -> tuple[str, int] | None:
        """The app's owner now (broker name, epoch), or None while unowned."""
        with contextlib.suppress(OSError, aioredis.RedisError):
            raw = await self.client.get(self.keys.owner)
            if raw:
                name, _, epoch = raw.decode().rpartition(":")
                return name, int(epoch)
        return None

    async def owner(self, timeout: float = 30.0) -> tuple[Broker, int]:
        """The broker owning the app (waiting while it is unowned) and its epoch."""
        deadline = time.monotonic() + timeout
        while (held := await self.holder()) is None:
            if time.monotonic() > deadline:
                raise RuntimeError("the app has no owner")
            await asyncio.sleep(POLL)
        return next(b for b in self.brokers if b.name == held[0]), held[1]

    def other(self, broker: Broker) -> Broker:
        return next(b for b in self.brokers if b is not broker)

    async def taken_over(self, stale: int, timeout: float) -> float | None:
        """Seconds (monotonic) when an epoch above `stale` holds the app, polled."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            held = await self.holder()
            if held is not None and held[1] > stale:
                return time.monotonic()
            await asyncio.sleep(POLL)
        return None

    async def drained(self, timeout: float) -> float | None:
        """Seconds until the owner's counts (the `stats` hash it writes every round) say
        it holds nothing (pending, delayed, in flight); None: not within `timeout`."""
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            with contextlib.suppress(OSError, aioredis.RedisError):
                stats = await self.client.hgetall(self.keys.stats)
                held = [int(stats.get(k, b"1")) for k in (b"pending", b"delayed", b"in_flight")]
                if not any(held):
                    return time.monotonic() - started
            await asyncio.sleep(0.1)
        return None

    async def stored(self, msgids: set[str]) -> int:
        """How many of `msgids` the app's log and inbox hold (not yet trimmed)."""
        found = 0
        for stream in (self.keys.log, self.keys.inbox):
            for _, fields in await self.client.xrange(stream, "-", "+"):
                found += fields.get(b"m", b"").decode() in msgids
        return found

    async def redis_ms(self) -> int:
        seconds, micros = await self.client.time()
        return int(seconds) * 1000 + int(micros) // 1000

    async def hold(self, prefix: str, count: int) -> list[str]:
        """`count` messages stored and pushed to the recipient, which holds them all."""
        msgids = [f"{prefix}{i:07d}" for i in range(count)]
        started = time.monotonic()
        await store(self.brokers[0], msgids)
        wanted = set(msgids)
        if not await self.recipient.until(lambda: wanted <= self.recipient.received(), 120):
            got = len(wanted & self.recipient.received())
            raise RuntimeError(f"only {got} of {count} pushed to the recipient in 120 s")
        log(f"{count} messages stored and held in {time.monotonic() - started:.1f} s")
        return msgids


def pushes_after(broker: Broker, wall_ms: int) -> int:
    """Pushes `broker` logged (its delivery log: DATA_DIR/delivery-log) after `wall_ms`."""
    count = 0
    for path in log_files(Path(broker.env["SKMQ_DATA_DIR"]) / "delivery-log"):
        for line in read_lines(path):
            event = json.loads(line)
            count += event["event"] == "pushed" and event["ts"] > wall_ms
    return count


def fenced_lines(broker: Broker) -> int:
    return broker.log_path.read_text(errors="replace").count(FENCED_LINE)


def spread(values: Sequence[float]) -> dict[str, float | None]:
    ordered = sorted(values)
    if not ordered:
        return {"first": None, "median": None, "last": None}
    return {"first": ordered[0], "median": ordered[len(ordered) // 2], "last": ordered[-1]}


# -- scenario 1: kill -9 of the owner -------------------------------------------------------


async def kill_scenario(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    async with Rig(args, workdir, ack_timeout=args.ack_timeout) as rig:
        msgids = await rig.hold("k", args.messages)
        victim, epoch = await rig.owner()
        log(f"{victim.name} owns the app at epoch {epoch}: kill -9")
        killed_at = time.monotonic()
        assert victim.proc is not None
        victim.proc.send_signal(signal.SIGKILL)
        acquired = await rig.taken_over(epoch, args.lease + args.wait)
        await rig.recipient.until(
            lambda: len(rig.recipient.first_after(killed_at, msgids)) == len(msgids),
            max(0.0, killed_at + args.lease + args.wait - time.monotonic()),
        )
        again = rig.recipient.first_after(killed_at, msgids)
        still_stored = await rig.stored(set(msgids) - set(again))
        await asyncio.sleep(args.settle)  # (the new owner's workers run a few rounds)
        pushes = rig.recipient.count
        rig.recipient.ack_all()
        drained = await rig.drained(args.wait)
        times = spread(list(again.values()))
        last = times["last"]
        met = last is not None and len(again) == len(msgids) and last <= args.lease + 1
        return {
            "scenario": "kill",
            "in_flight": len(msgids),
            "lease_s": args.lease,
            "acquired_s": None if acquired is None else acquired - killed_at,
            "repush_first_s": times["first"],
            "repush_median_s": times["median"],
            "repush_last_s": last,
            "repushed": len(again),
            "lost": len(msgids) - len(again),
            "lost_still_stored": still_stored,
            "target_s": args.lease + 1,
            "target_met": met,
            "pushes_before_ack": pushes,
            "drained_after_ack_s": drained,
        }


# -- scenario 2: SIGSTOP of the owner past its lease ----------------------------------------


@dataclass
class JournalWatch:
    """Reads the app's journal every POLL s from `since` on, counting entries by the
    epoch that wrote them (`e`) and when (entry id's ms)."""

    client: Any
    key: str
    cursor: str
    entries: list[tuple[int, int]] = field(default_factory=list)  # (ms, epoch)

    async def run(self) -> None:
        while True:
            with contextlib.suppress(OSError, aioredis.RedisError):
                for entry, fields in await self.client.xrange(self.key, f"({self.cursor}", "+"):
                    self.cursor = entry.decode()
                    self.entries.append((int(self.cursor.split("-")[0]), int(fields[b"e"])))
            await asyncio.sleep(POLL)

    def of_epoch_after(self, epoch: int, ms: int) -> int:
        return sum(1 for at, e in self.entries if e == epoch and at > ms)


async def stale_log_entries(rig: Rig, stored_by: set[str]) -> int:
    """Log entries of messages `stored_by` the stale owner (only an owner's flush writes
    the log: a store through another broker goes to the inbox)."""
    entries = await rig.client.xrange(rig.keys.log, "-", "+")
    return sum(1 for _, fields in entries if fields.get(b"m", b"").decode() in stored_by)


async def stop_scenario(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    async with Rig(args, workdir, ack_timeout=args.ack_timeout) as rig:
        msgids = await rig.hold("s", args.stop_messages)
        victim, stale = await rig.owner()
        survivor = rig.other(victim)
        watch = JournalWatch(rig.client, rig.keys.journal, f"{await rig.redis_ms()}-0")
        watcher = asyncio.create_task(watch.run())
        assert victim.proc is not None
        log(f"{victim.name} owns the app at epoch {stale}: SIGSTOP")
        stopped_at = time.monotonic()
        victim.proc.send_signal(signal.SIGSTOP)
        feed = Feed([victim, survivor], args.rate / 2)
        feed.start()
        try:
            acquired = await rig.taken_over(stale, args.lease + args.wait)
            if acquired is None:
                raise RuntimeError("no takeover while the owner was stopped")
            takeover_ms = await rig.redis_ms()
            repushing = await rig.recipient.until(
                lambda: bool(rig.recipient.first_after(stopped_at, msgids)), args.wait
            )
            await asyncio.sleep(args.stall_extra)
        finally:
            victim.proc.send_signal(signal.SIGCONT)
        woken_at, woken_ms = time.monotonic(), int(time.time() * 1000)
        log(f"{victim.name} woken after {woken_at - stopped_at:.1f} s")
        await asyncio.sleep(args.after)
        all_acked = await feed.finish(args.wait)
        await asyncio.sleep(3 * POLL)
        watcher.cancel()
        stored_by_victim = {m for m, b in feed.acked.items() if b == victim.name}
        in_log = await stale_log_entries(rig, stored_by_victim)
        again = rig.recipient.first_after(stopped_at, msgids)
        rig.recipient.ack_all()
        produced = [*msgids, *feed.acked]
        delivered = await rig.recipient.until(
            lambda: rig.recipient.received() >= set(produced), args.wait
        )
        undelivered = set(produced) - rig.recipient.received()
        drained = await rig.drained(args.wait)
        final = await rig.holder()
        return {
            "scenario": "stop",
            "held": len(msgids),
            "lease_s": args.lease,
            "acquired_s": acquired - stopped_at,
            "repush_began": repushing,
            "repush_first_s": min(again.values(), default=None),
            "repush_last_s": max(again.values(), default=None),
            "repushed": len(again),
            "stopped_s": woken_at - stopped_at,
            "produced_during": len(feed.acked),
            "producer_answers": dict(feed.answers),
            "all_produced_acked": all_acked,
            "stale_epoch": stale,
            "final_owner": None if final is None else f"{final[0]}:{final[1]}",
            "fenced_writes": fenced_lines(victim),
            "stale_pushes": pushes_after(victim, woken_ms),
            "landed_journal": watch.of_epoch_after(stale, takeover_ms),
            "landed_log": in_log,
            "journal_entries_seen": len(watch.entries),
            "delivered_all": delivered,
            "lost": len(undelivered),
            "lost_still_stored": await rig.stored(undelivered),
            "drained_after_ack_s": drained,
        }


# -- scenario 3: faults in a row -------------------------------------------------------------


FAULTS = ("kill", "stop", "redis")  # in turn


async def fault(rig: Rig, kind: str, args: argparse.Namespace) -> tuple[str, float]:
    """Inject one fault of `kind` and undo it (restart, SIGCONT): what was done, and when
    (monotonic) the process got its signal."""
    if kind == "redis":
        assert rig.redis.proc is not None
        at = time.monotonic()
        rig.redis.proc.kill()
        rig.redis.proc.wait(10)
        rig.redis.launch()
        await rig.redis.wait_ready()
        return "redis kill -9 + restart", at
    victim, epoch = await rig.owner()
    assert victim.proc is not None
    at = time.monotonic()
    if kind == "kill":
        # started again once the other took over: a broker started with the same
        # BROKER_ID takes back its own lease at once (lua/acquire.lua)
        await victim.kill()
        taken = await rig.taken_over(epoch, args.lease + args.wait)
        await victim.start()
        return f"{victim.name} kill -9, {_taken(taken)}, restarted", at
    victim.proc.send_signal(signal.SIGSTOP)
    try:
        taken = await rig.taken_over(epoch, args.lease + args.wait)
    finally:
        victim.proc.send_signal(signal.SIGCONT)
    return f"{victim.name} SIGSTOP, {_taken(taken)}, SIGCONT", at


def _taken(at: float | None) -> str:
    return "taken over" if at is not None else "NOT taken over"


async def delivered_since(
    recipient: Recipient, feed: Feed, at: float, timeout: float
) -> float | None:
    """Seconds from `at` to the first push of a message first sent after `at` (None: none
    within `timeout`): deliveries flow again, not just pushes that were on their way."""

    def firsts() -> list[float]:
        return [recipient.arrivals[m][0] for m in feed.since(at) if m in recipient.arrivals]

    if not await recipient.until(lambda: bool(firsts()), timeout):
        return None
    return min(firsts()) - at


async def loop_scenario(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    async with Rig(args, workdir, ack_timeout=args.loop_ack_timeout) as rig:
        rig.recipient.ack_all()
        feed = Feed(rig.brokers, args.rate / 2)
        feed.start()
        recoveries: dict[str, list[float]] = {kind: [] for kind in FAULTS}
        stuck = 0
        for i, kind in zip(range(args.faults), itertools.cycle(FAULTS), strict=False):
            await asyncio.sleep(args.between)  # production goes on a while
            what, at = await fault(rig, kind, args)
            recovery = await delivered_since(rig.recipient, feed, at, args.wait)
            if recovery is None:
                stuck += 1
            else:
                recoveries[kind].append(recovery)
            log(f"fault {i + 1}/{args.faults}: {what}; a message produced since delivered "
                f"after {'-' if recovery is None else f'{recovery:.2f}'} s")  # fmt: skip
        all_acked = await feed.finish(args.wait)
        wanted = set(feed.acked)
        await rig.recipient.until(lambda: rig.recipient.received() >= wanted, args.wait)
        lost = sorted(wanted - rig.recipient.received())
        return {
            "scenario": "loop",
            "faults": args.faults,
            "produced": len(feed.acked),
            "all_produced_acked": all_acked,
            "producer_answers": dict(feed.answers),
            "recovery_s": {kind: spread(times) for kind, times in recoveries.items()},
            "not_flowing_after": stuck,
            "received": len(wanted & rig.recipient.received()),
            "lost": len(lost),
            "lost_examples": lost[:5],
            "fenced_writes": sum(fenced_lines(b) for b in rig.brokers),
        }


# -- the run -----------------------------------------------------------------------------------

SCENARIOS = {"kill": kill_scenario, "stop": stop_scenario, "loop": loop_scenario}


def _s(value: float | None, none: str = "-") -> str:
    return none if value is None else f"{value:.3f} s"


def summary(r: dict[str, Any]) -> list[str]:
    if "error" in r:
        return [f"{r['scenario']}: error: {r['error']}"]
    if r["scenario"] == "kill":
        verdict = "met" if r["target_met"] else "NOT met"
        return [
            f"kill -9 of the owner, {r['in_flight']:,} in flight, lease {r['lease_s']} s:",
            f"  acquired by the other after {_s(r['acquired_s'])}; pushed again: first "
            f"{_s(r['repush_first_s'])}, median {_s(r['repush_median_s'])}, last "
            f"{_s(r['repush_last_s'])}",
            f"  pushed again {r['repushed']:,}, not within lease + --wait {r['lost']:,} (still in "
            f"the log or inbox: {r['lost_still_stored']:,}); target last <= lease + 1 s "
            f"= {r['target_s']} s: {verdict}",
            f"  pushes received before the acks {r['pushes_before_ack']:,} (held: "
            f"{r['in_flight']:,} + as many again); all acked, the queue empty after "
            f"{_s(r['drained_after_ack_s'], 'NOT within --wait')}",
        ]
    if r["scenario"] == "stop":
        return [
            f"SIGSTOP of the owner, {r['held']:,} held, lease {r['lease_s']} s, stopped "
            f"{r['stopped_s']:.1f} s:",
            f"  acquired by the other after {_s(r['acquired_s'])}; pushed again first "
            f"{_s(r['repush_first_s'])}, last {_s(r['repush_last_s'])} ({r['repushed']:,})",
            f"  stale owner's writes: fenced {r['fenced_writes']}, landed after the takeover: "
            f"journal {r['landed_journal']} (of {r['journal_entries_seen']} entries read), "
            f"log {r['landed_log']}; its pushes once woken {r['stale_pushes']}",
            f"  produced meanwhile {r['produced_during']:,} ({r['producer_answers']}); "
            f"owner at the end {r['final_owner']}",
            f"  all acked: not delivered within --wait {r['lost']} (still in the log or inbox: "
            f"{r['lost_still_stored']}); the queue empty after "
            f"{_s(r['drained_after_ack_s'], 'NOT within --wait')}",
        ]
    lines = [
        f"{r['faults']} faults in a row (kill -9 / SIGSTOP+SIGCONT of the owner, kill -9 of "
        f"Redis, in turn), {r['produced']:,} messages produced; a message produced after a "
        f"fault delivered after:"
    ]
    for kind, rec in r["recovery_s"].items():
        lines.append(
            f"  {kind:>5}: best {_s(rec['first'])}, median {_s(rec['median'])}, "
            f"worst {_s(rec['last'])}"
        )
    return [
        *lines,
        f"  none delivered within --wait after {r['not_flowing_after']} faults; fenced "
        f"writes {r['fenced_writes']}; received {r['received']:,}, lost {r['lost']} "
        f"{r['lost_examples'] or ''}",
    ]


def failed(r: dict[str, Any]) -> bool:
    landed = r.get("landed_journal", 0) + r.get("landed_log", 0)
    return "error" in r or bool(r.get("lost")) or bool(landed)


async def run_scenario(name: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    workdir = tmp / name
    workdir.mkdir()
    try:
        return await SCENARIOS[name](args, workdir)
    except (RuntimeError, OSError, TimeoutError) as exc:
        log(f"{name}: {exc!r}")
        return {"scenario": name, "error": repr(exc)}
    finally:
        if args.keep:
            kept = Path(tempfile.mkdtemp(prefix=f"skmq-takeover-{name}-"))
            shutil.copytree(workdir, kept, dirs_exist_ok=True, ignore=_sockets)
            log(f"{name}: its directory copied to {kept}")


def _sockets(directory: str, names: list[str]) -> list[str]:
    return [n for n in names if n.endswith(".sock")]


async def amain(args: argparse.Namespace) -> int:
    started = datetime.now(UTC)
    load_start = loadavg()
    results = []
    with tempfile.TemporaryDirectory(prefix="skmq-takeover-") as tmp:
        for name in args.scenarios.split(","):
            results.append(await run_scenario(name, args, Path(tmp)))
    load_end = loadavg()
    lines = [
        f"Takeover: 2 brokers on one Redis (AOF everysec), lease {args.lease} s",
        f"load average (1, 5, 15 min): at start {load_start}; at end {load_end} "
        f"({os.cpu_count()} CPUs)",
    ]
    for r in results:
        lines += summary(r)
    print("\n".join(lines), flush=True)
    if args.json is not None:
        path = json_path(args.json, "takeover", started)
        path.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "date": started.isoformat(timespec="seconds"),
            "command": ["python", "-m", "bench.takeover", *sys.argv[1:]],
            "loadavg": {"start": load_start, "end": load_end},
            "results": results,
        }
        path.write_text(json.dumps(payload, indent=2))
        print(f"JSON written to {path}")
    if any("error" in r for r in results):
        return 2
    return 1 if any(failed(r) for r in results) else 0


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.takeover",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--scenarios", default="kill,stop,loop")
    p.add_argument("--messages", type=int, default=100_000, help="kill: held in flight")
    p.add_argument("--stop-messages", type=int, default=10_000, help="stop: held in flight")
    p.add_argument("--lease", type=float, default=2.0, help="OWNER_LEASE, seconds")
    p.add_argument("--ack-timeout", type=float, default=600.0, help="kill, stop: ACK_TIMEOUT")
    p.add_argument("--loop-ack-timeout", type=float, default=5.0, help="loop: ACK_TIMEOUT")
    p.add_argument("--rate", type=float, default=200.0, help="stop, loop: msg/s produced")
    p.add_argument("--stall-extra", type=float, default=1.0, help="stop: SIGSTOP kept after")
    p.add_argument("--after", type=float, default=5.0, help="stop: s the woken owner runs")
    p.add_argument("--faults", type=int, default=50, help="loop: faults in a row")
    p.add_argument("--between", type=float, default=1.0, help="loop: s between faults")
    p.add_argument("--settle", type=float, default=3.0, help="kill: s before the acks")
    p.add_argument("--wait", type=float, default=30.0, help="bound of each wait, seconds")
    p.add_argument("--keep", action="store_true", help="copy each scenario's logs and data")
    add_json_flag(p, "takeover")
    args = p.parse_args(argv)
    for name in args.scenarios.split(","):
        if name not in SCENARIOS:
            p.error(f"--scenarios: {name!r} is not one of {', '.join(SCENARIOS)}")
    if min(args.messages, args.stop_messages, args.faults) < 1 or args.lease <= 0:
        p.error("--messages, --stop-messages, --faults >= 1 and --lease > 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    return asyncio.run(amain(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
