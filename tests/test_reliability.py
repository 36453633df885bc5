"""Reliability under faults (SPEC 5): at-least-once delivery when brokers are killed,
frozen or stopped, when Redis goes away, and when peers misbehave.

Every test runs real `skmq serve` children (or in-process brokers) on a real Redis over
real TCP, injects one fault and checks the guarantee: a message the broker answered
`ack` to its producer is pending, in flight, acked or dead, never gone, and gets
delivered once nothing fails any more. A redelivery is allowed, a loss is not.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import psutil
import pytest
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from skmq.clock import now_ms
from skmq.codec import Frame, encode_frame
from skmq.embedded import EmbeddedRedis, read_info
from skmq.lifecycle import Refused, State
from skmq.logarchive import log_files, read_lines
from skmq.queue.deliveries import Policy as QueuePolicy
from skmq.queue.journal import AppKeys, Journal, Lease
from skmq.queue.owned_store import OwnedStore
from skmq.queue.owner import AppOwner
from skmq.store.wire import Wire
from skmq.store.wires import Wires
from tests.conftest import (
    BrokerFactory,
    BrokerProcess,
    answers_ping,
    eventually,
    free_port,
    port_was_taken,
)
from tests.peers import FakeRecipient, Policy, RawClient

ACK_TIMEOUT = 1.5  # as in broker_env
APP = "app"
DEDUPE_MS = 3_600_000  # (DEDUPE_WINDOW's default: the brokers here keep it)

# -- peers and brokers -------------------------------------------------------------

SERVE = [sys.executable, "-c", "import sys; from skmq.cli import main; sys.exit(main())", "serve"]


class Serve(BrokerProcess):
    """A `skmq serve` child driven without blocking the event loop (the recipients of a
    test run in that loop and must go on answering pushes and heartbeats meanwhile)."""

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def spawn(self) -> None:
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            SERVE, env=self.env, stdout=log, stderr=log, stdin=subprocess.DEVNULL
        )
        log.close()

    async def up(self, timeout: float = 20.0) -> Serve:
        if not self.alive:
            self.spawn()
        retries = 3
        async with asyncio.timeout(timeout):
            while True:
                if not self.alive:
                    if retries and port_was_taken(self.log_path):
                        # Another process of this busy machine took the port: another one.
                        retries -= 1
                        self.port = free_port()
                        self.env["SKMQ_PORT"] = str(self.port)
                        self.spawn()
                        continue
                    raise RuntimeError(f"broker exited: {self.log_path.read_text()[-2000:]}")
                if await asyncio.to_thread(answers_ping, self.port):
                    return self
                await asyncio.sleep(0.02)

    async def exited(self, timeout: float = 10.0) -> int:
        assert self.proc is not None
        async with asyncio.timeout(timeout):
            while (rc := self.proc.poll()) is None:
                await asyncio.sleep(0.01)
        return rc

    async def sigkill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        await self.exited()

    async def restart(self) -> None:
        await self.sigkill()
        await self.up()

    def log_dir(self) -> Path:
        return Path(self.env["SKMQ_DATA_DIR"]) / "delivery-log"

    def redis_url(self) -> str:
        """The Redis this broker uses: REDIS_URL, or its embedded one."""
        if self.env.get("SKMQ_REDIS_URL"):
            return self.env["SKMQ_REDIS_URL"]
        info = read_info(Path(self.env["SKMQ_DATA_DIR"]))
        assert info is not None
        return str(info["url"])


Spawn = Callable[..., Serve]


@pytest.fixture
def spawn(broker_env: dict[str, str], tmp_path: Path) -> Iterator[Spawn]:
    """`spawn(name, **settings)`: a `skmq serve` child with broker_env's short timings, its
    own port and DATA_DIR; settings are SKMQ_* names in lower case. Killed at teardown."""
    procs: list[Serve] = []

    def make(name: str = "b", **settings: Any) -> Serve:
        env = dict(broker_env)
        env["SKMQ_PORT"] = str(free_port())
        env["SKMQ_DATA_DIR"] = str(tmp_path / name)
        env["SKMQ_SHUTDOWN_TIMEOUT"] = "1.0"
        env.update({f"SKMQ_{k.upper()}": str(v) for k, v in settings.items()})
        proc = Serve(env, tmp_path / f"{name}.log")
        procs.append(proc)
        return proc

    yield make
    for proc in procs:
        if proc.alive:
            assert proc.proc is not None
            proc.proc.kill()
            proc.proc.wait(10)


def answer(writer: asyncio.StreamWriter, push: Frame, action: str) -> None:
    """Answer a push on the connection it came on: ack | reject | error | arrived."""
    fields = {"msgid": push.fields["msgid"], "appid": push.fields.get("appid", "")}
    if "recipient" in push.fields:
        fields["recipient"] = push.fields["recipient"]
    content = b"handler failed" if action == "error" else None
    writer.write(encode_frame(action, fields, content))


class Holder(FakeRecipient):
    """A FakeRecipient whose policy can also be "hold" (answer nothing now, keep the push
    to answer it later on its own connection)."""

    def __init__(self, app: str, rid: str, policy: Policy | str = "ack") -> None:
        super().__init__(app, rid)
        self.mode = policy
        self.policy = lambda f: self.mode(f) if callable(self.mode) else self.mode
        self.held: list[tuple[asyncio.StreamWriter, Frame]] = []
        self.at: dict[str, float] = {}

    def msgids(self) -> list[str]:
        return [f.fields["msgid"] for f in self.received]

    def _answer(self, writer: asyncio.StreamWriter, frame: Frame) -> None:
        self.at.setdefault(frame.fields["msgid"], time.time())
        action = self.policy(frame)
        if action == "hold":
            self.held.append((writer, frame))
        elif action == "arrived":
            answer(writer, frame, "arrived")
            self.held.append((writer, frame))
        elif action == "close":
            writer.close()
        elif action != "silent":
            answer(writer, frame, action)

    def answer_held(self, action: str) -> int:
        held, self.held = self.held, []
        for writer, frame in held:
            if not writer.is_closing():
                answer(writer, frame, action)
        return len(held)


def queue_frames(msgids: list[str], app: str = APP, **fields: str) -> bytes:
    """Queue frames whose content is their msgid."""
    return b"".join(
        encode_frame("queue", {"appid": app, "msgid": m, **fields}, m.encode()) for m in msgids
    )


async def start_recipient(
    broker_port: int, rid: str = "r1", policy: Policy | str = "ack"
) -> Holder:
    recipient = await Holder(APP, rid, policy).start()
    assert (await recipient.register(broker_port))["status"] == "ack"
    return recipient


async def produce(port: int, msgids: list[str], app: str = APP, **fields: str) -> list[str]:
    """Send queue messages pipelined; the msgids the broker answered `ack`."""
    client = await RawClient.connect(port)
    try:
        client.send_raw(queue_frames(msgids, app, **fields))
        answers = [await client.resp() for _ in msgids]
    finally:
        await client.close()
    return [a["msgid"] for a in answers if a["status"] == "ack"]


class Producer:
    """Sends batches until stopped or its broker goes away; records what got `ack`."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.acked: list[str] = []
        self.sent = 0

    async def run(self, port: int, batch: int = 50, pause: float = 0.0) -> None:
        try:
            client = await RawClient.connect(port)
        except OSError:
            return
        try:
            while True:
                ids = [f"{self.prefix}-{self.sent + i}" for i in range(batch)]
                self.sent += batch
                client.send_raw(queue_frames(ids))
                for _ in ids:
                    resp = await client.resp(timeout=5)
                    if resp["status"] == "ack":
                        self.acked.append(resp["msgid"])
                if pause:
                    await asyncio.sleep(pause)
        except (ConnectionError, OSError, TimeoutError):
            pass
        finally:
            await client.close()


# -- what Redis and the delivery log say -------------------------------------------

# One atomic snapshot (a script) of where each msgid is: its hash (m), its places in
# ready / delayed / inflight / dead, and the done sets holding it.
OWNED_PLACES = {
    State.PENDING: "pending",
    State.IN_FLIGHT: "inflight",
    State.DELAYED: "delayed",
    State.WAITING_RETRY: "delayed",
    State.WAITING_KEY: "delayed",
}


async def rebuild(wire: Wire, keys: AppKeys, now: int) -> AppOwner:
    """The app's state as its journal has it, read while its owner goes on: a checkpoint
    written between the reads (the journal trimmed under them) is read again."""
    for _ in range(20):
        before = await wire.call("GET", keys.checkpoint)
        rebuilt = AppOwner(Journal(wire, keys, Lease("test", 0), DEDUPE_MS), QueuePolicy(), list)
        try:
            await rebuilt.load(now, adopt=False)
            await rebuilt.refill(now, None)  # (the backlog the log holds, read back)
        except Refused:  # (records after a newer checkpoint, on the older one's state)
            continue
        if await wire.call("GET", keys.checkpoint) == before:
            return rebuilt
    raise AssertionError("the owner checkpointed under every read")


async def where(redis: aioredis.Redis, prefix: str, msgids: list[str]) -> dict[str, str]:
    """msgid -> pending | delayed | inflight | dead | done, or what is wrong with it: where
    each msgid is as a new owner would rebuild it from Redis (its checkpoint, journal, log
    and inbox; what is in flight left in flight), else among the
    app's dead letters or the dedupe window's settled msgids. These are read after the
    rebuild: a message that left the owner's state meanwhile is found there (they only
    grow), so an owner's writes between the reads never make a message look lost; one
    found there is over, whatever the rebuild said."""
    keys = AppKeys.of(prefix, APP)
    if isinstance(redis, RedisCluster):  # (the app's master)
        await redis.initialize()  # (its slot map: a no-op once known)
        wires = Wires("redis://", 2.0, redis)
        wire = await wires.of(keys.epoch)
    else:
        kw = redis.connection_pool.connection_kwargs
        auth = f":{quote(kw['password'], safe='')}@" if kw.get("password") else ""
        url = (
            f"unix://{auth}{kw['path']}"
            if kw.get("path")
            else f"redis://{auth}{kw['host']}:{kw['port']}"
        )
        wire = await Wire.connect(url)
    try:
        now = now_ms()
        rebuilt = await rebuild(wire, keys, now)
        held = {d.msgid.decode(): d.state for d in rebuilt.queue.deliveries.values()}
        held.update((e.msgid.decode(), State.PENDING) for e, _ in rebuilt.unfanned)
        done: set[bytes] = set()
        for bucket in keys.dedupe(now, DEDUPE_MS):
            done.update(await wire.call("SMEMBERS", bucket))
        dead = set(await wire.call("ZRANGE", keys.dead_order, 0, -1))
    finally:
        wire.close()
    out = {}
    for msgid in msgids:
        raw = msgid.encode()
        places = [p for p, there in (("dead", raw in dead), ("done", raw in done)) if there]
        if not places and held.get(msgid) in OWNED_PLACES:  # (else: over since the rebuild)
            places = [OWNED_PLACES[held[msgid]]]
        if len(places) == 1:
            out[msgid] = places[0]
        else:
            out[msgid] = "CORRUPT:" + ",".join(places) if places else "LOST"
    return out


async def assert_none_lost(redis: aioredis.Redis, prefix: str, msgids: list[str]) -> dict[str, str]:
    states = await where(redis, prefix, msgids)
    bad = {m: s for m, s in states.items() if s.startswith(("LOST", "CORRUPT"))}
    assert not bad, f"acknowledged messages gone or corrupt: {bad}"
    return states


async def all_in(
    redis: aioredis.Redis, prefix: str, msgids: list[str], states: tuple[str, ...], timeout: float
) -> dict[str, str]:
    """Wait until every msgid is in one of `states`; fail with where each one is."""
    last: dict[str, str] = {}

    async def check() -> bool:
        nonlocal last
        last = await assert_none_lost(redis, prefix, msgids)
        return all(s in states for s in last.values())

    try:
        await eventually(check, timeout)
    except TimeoutError:
        pytest.fail(f"not all {states} after {timeout}s: {Counter(last.values())}")
    return last


def log_events(*dirs: Path) -> list[dict[str, Any]]:
    out = []
    for d in dirs:
        for path in log_files(d):
            for line in read_lines(path):
                with contextlib.suppress(ValueError):
                    out.append(json.loads(line))
    return out


def shared(redis_url: str, prefix: str) -> dict[str, str]:
    return {"redis_url": redis_url, "key_prefix": prefix}


async def until(check: Callable[[], bool], timeout: float = 10.0) -> None:
    async def acheck() -> bool:
        return check()

    await eventually(acheck, timeout)


# -- 1. crash safety: kill -9 at any moment ------------------------------------------


@pytest.mark.parametrize(
    ("sig", "after"), [(signal.SIGKILL, 0.1), (signal.SIGKILL, 0.3), (signal.SIGTERM, 0.2)]
)
async def test_stop_while_storing_loses_no_acked_message(
    spawn: Spawn, sig: signal.Signals, after: float
) -> None:
    """Producers pipeline messages into a broker with its embedded Redis; kill -9 (or a
    SIGTERM) lands in the middle of storing. Every message answered `ack` is delivered
    after the restart."""
    broker = await spawn("b").up()
    producers = [Producer(f"p{i}") for i in range(3)]
    tasks = [asyncio.create_task(p.run(broker.port)) for p in producers]
    await asyncio.sleep(after)  # the fault lands at a moment chosen by the test
    assert broker.proc is not None
    broker.proc.send_signal(sig)
    assert await broker.exited(15) in (0, -signal.SIGKILL)
    await asyncio.wait_for(asyncio.gather(*tasks), 10)
    acked = [m for p in producers for m in p.acked]
    sent = sum(p.sent for p in producers)
    assert 0 < len(acked) < sent, "the fault must land while messages are being stored"

    await broker.up()
    recipient = await start_recipient(broker.port)
    want = set(acked)
    await until(lambda: want <= set(recipient.msgids()), 15)
    redis = aioredis.Redis.from_url(broker.redis_url())
    try:
        await all_in(redis, "skmq", acked, ("done",), 5)
    finally:
        await redis.aclose()
        await recipient.stop()


def _every_other(first: str, second: str) -> Callable[[Frame], str]:
    return lambda f: first if int(f.fields["msgid"].rsplit("-", 1)[1]) % 2 else second


STAGES: dict[str, dict[str, Any]] = {
    # pushed, waiting for the final answer (half of them answered `arrived` first)
    "in_flight": {"policy": _every_other("hold", "arrived"), "settings": {}},
    # rejected, waiting in the delayed set for their retry
    "retrying": {"policy": "reject", "settings": {"retry_backoff": "1.0,1.0,1.0"}},
    # failing over and over, some already dead, others on their way there
    "dead_lettering": {"policy": "error", "settings": {}},
}


@pytest.mark.parametrize("stage", list(STAGES))
async def test_kill9_at_each_stage_loses_nothing(
    spawn: Spawn, redis: aioredis.Redis, redis_url: str, prefix: str, stage: str
) -> None:
    spec = STAGES[stage]
    broker = await spawn("b", **shared(redis_url, prefix), **spec["settings"]).up()
    recipient = await start_recipient(broker.port, policy=spec["policy"])
    msgids = [f"{stage}-{i}" for i in range(20)]
    for i in range(0, len(msgids), 4):
        # Staggered, so that the kill finds messages at different points of their way.
        assert await produce(broker.port, msgids[i : i + 4]) == msgids[i : i + 4]
        await asyncio.sleep(0.05)

    def logged(event: str) -> int:
        return sum(e["event"] == event for e in log_events(broker.log_dir()))

    if stage == "in_flight":
        await until(lambda: len(recipient.received) == len(msgids))
        await until(lambda: logged("arrived") == len(msgids) // 2)
    elif stage == "retrying":
        await all_in(redis, prefix, msgids, ("delayed",), 5)
    else:
        await until(lambda: logged("dead_lettered") > 0)
    await broker.sigkill()
    if stage != "dead_lettering":
        recipient.mode = "ack"
    await broker.up()

    if stage == "dead_lettering":
        await all_in(redis, prefix, msgids, ("dead",), 15)
        store = OwnedStore(redis, prefix)
        dead = await store.dead_letters(APP)
        assert sorted((d.msgid, d.content) for d in dead) == sorted((m, m.encode()) for m in msgids)
    else:
        await all_in(redis, prefix, msgids, ("done",), ACK_TIMEOUT + 8)
        counts = Counter(recipient.msgids())
        assert all(counts[m] >= 2 for m in msgids), "in-flight messages are delivered again"
    await recipient.stop()


async def test_kill9_at_random_moments_under_mixed_load(
    spawn: Spawn, redis: aioredis.Redis, redis_url: str, prefix: str
) -> None:
    """Kill -9 at random moments while producers send and a recipient acks, rejects, errors
    or falls silent; after the faults stop, every acknowledged message is acked or dead."""
    rng = random.Random(7)
    choices = ["ack"] * 6 + ["reject", "error", "hold", "arrived"]
    broker = await spawn("b", **shared(redis_url, prefix)).up()
    recipient = await start_recipient(broker.port, policy=lambda f: rng.choice(choices))
    producers: list[Producer] = []
    for round_ in range(3):
        batch = [Producer(f"k{round_}p{i}") for i in range(2)]
        producers += batch
        tasks = [asyncio.create_task(p.run(broker.port, batch=20, pause=0.01)) for p in batch]
        await asyncio.sleep(rng.uniform(0.3, 0.9))  # the fault: kill -9 at a random moment
        await broker.sigkill()
        await asyncio.wait_for(asyncio.gather(*tasks), 10)
        await broker.up()
    acked = [m for p in producers for m in p.acked]
    assert len(acked) > 100
    await assert_none_lost(redis, prefix, acked)
    recipient.mode = "ack"
    recipient.answer_held("ack")
    states = await all_in(redis, prefix, acked, ("done", "dead"), 3 * ACK_TIMEOUT + 10)
    assert Counter(states.values())["done"] > len(acked) // 2
    await recipient.stop()


# -- 2. several brokers on one Redis -------------------------------------------------


async def test_two_brokers_share_the_work_and_deliver_each_message_once(
    spawn: Spawn, redis: aioredis.Redis, redis_url: str, prefix: str
) -> None:
    a = spawn("a", **shared(redis_url, prefix))
    b = spawn("b", **shared(redis_url, prefix))
    await asyncio.gather(a.up(), b.up())
    r1 = await start_recipient(a.port, "r1")
    r2 = await start_recipient(b.port, "r2")
    sent = [f"a-{i}" for i in range(200)], [f"b-{i}" for i in range(200)]
    acked = await asyncio.gather(produce(a.port, sent[0]), produce(b.port, sent[1]))
    msgids = acked[0] + acked[1]
    assert len(msgids) == 400
    await all_in(redis, prefix, msgids, ("done",), 10)
    received = Counter(r1.msgids() + r2.msgids())
    assert {m: c for m, c in received.items() if c != 1} == {}
    assert set(received) == set(msgids)
    events = log_events(a.log_dir(), b.log_dir())
    acks = Counter(e["msgid"] for e in events if e["event"] == "acked")
    assert {m: c for m, c in acks.items() if c != 1} == {}
    pushers = {e["broker"] for e in events if e["event"] == "pushed"}
    # (one app's queue is pushed by its owner alone; the brokers share the apps, and both
    # stored and answered here)
    assert len(pushers) == 1, "the app's owner delivers"
    await r1.stop()
    await r2.stop()


async def test_dead_brokers_in_flight_messages_are_taken_over_within_ack_timeout(
    spawn: Spawn, redis: aioredis.Redis, redis_url: str, prefix: str
) -> None:
    """A's pushes, which the recipient holds unanswered, are in flight at A when A is
    killed; the other broker delivers every one within ACK_TIMEOUT of the kill. The
    leases here outlast B's start on a loaded machine (seconds): A dies before they run
    out, and B has pushed none of them."""
    ack_timeout = 6.0
    settings = {**shared(redis_url, prefix), "ack_timeout": ack_timeout}
    a = await spawn("a", **settings).up()
    recipient = await start_recipient(a.port, policy="hold")
    msgids = [f"m-{i}" for i in range(20)]
    assert await produce(a.port, msgids) == msgids
    await until(lambda: len(recipient.received) == len(msgids))
    b = await spawn("b", **settings).up()
    assert (await assert_none_lost(redis, prefix, msgids)) == dict.fromkeys(msgids, "inflight")

    await a.sigkill()
    killed, killed_ms = time.monotonic(), now_ms()
    recipient.mode = "ack"
    await all_in(redis, prefix, msgids, ("done",), ack_timeout + 10)
    took = time.monotonic() - killed
    # A's leases run out within ACK_TIMEOUT of the kill (its ownership, within
    # OWNER_LEASE); then a round (the reaper's, or the ownership's) and the push.
    assert took < ack_timeout + 1.5, f"took {took:.2f}s to take over"

    def acked_by_b() -> set[str]:  # (its log lines reach the file a moment after Redis)
        return {e["msgid"] for e in log_events(b.log_dir()) if e["event"] == "acked"}

    await until(lambda: acked_by_b() == set(msgids))
    b_events = log_events(b.log_dir())
    assert min(e["ts"] for e in b_events if e["event"] == "pushed") >= killed_ms  # A's alone
    await recipient.stop()


async def test_two_brokers_do_not_double_heartbeats(
    spawn: Spawn, redis_url: str, prefix: str
) -> None:
    a = spawn("a", **shared(redis_url, prefix))
    b = spawn("b", **shared(redis_url, prefix))
    await asyncio.gather(a.up(), b.up())
    recipient = await start_recipient(a.port)
    await until(lambda: recipient.pings > 0)
    start, window = recipient.pings, 3.0
    await asyncio.sleep(window)  # a measurement period, not a synchronisation
    pings = recipient.pings - start
    interval = float(a.env["SKMQ_HEARTBEAT_INTERVAL"])
    # One round an interval for the whole cluster; two brokers each pinging would double it.
    assert 1 <= pings <= 1.5 * window / interval, pings
    await recipient.stop()


async def test_delayed_messages_are_delivered_once_by_two_brokers(
    spawn: Spawn, redis: aioredis.Redis, redis_url: str, prefix: str
) -> None:
    a = spawn("a", **shared(redis_url, prefix))
    b = spawn("b", **shared(redis_url, prefix))
    await asyncio.gather(a.up(), b.up())
    recipient = await start_recipient(a.port)
    due = int(time.time() * 1000) + 700
    sent = [f"a-{i}" for i in range(20)], [f"b-{i}" for i in range(20)]
    acked = await asyncio.gather(
        produce(a.port, sent[0], deliver_at=str(due)), produce(b.port, sent[1], deliver_at=str(due))
    )
    msgids = acked[0] + acked[1]
    assert len(msgids) == 40
    await all_in(redis, prefix, msgids, ("done",), 10)
    assert Counter(recipient.msgids()) == Counter(msgids)
    early = {m: t for m, t in recipient.at.items() if t * 1000 < due - 5}
    assert not early, "delivered before deliver_at"
    await recipient.stop()


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[EmbeddedRedis]:
    """A Redis of the test's own (AOF on), on a fixed port so it can be restarted."""
    server = EmbeddedRedis(tmp_path / "own-redis")
    server.port = free_port()
    server.start()
    yield server
    server.stop()


@pytest.mark.parametrize("how", ["restart", "kill9"])
async def test_redis_outage(spawn: Spawn, own_redis: EmbeddedRedis, prefix: str, how: str) -> None:
    """While Redis is down producers get `error`, never `ack`; the broker resumes by itself
    when it is back, and (AOF) every message acknowledged before is still delivered."""
    broker = await spawn("b", **shared(own_redis.url, prefix)).up()
    recipient = await start_recipient(broker.port, policy="hold")
    before = [f"before-{i}" for i in range(30)]
    assert await produce(broker.port, before) == before
    waiting = [f"waiting-{i}" for i in range(30)]  # for an app without recipients yet
    assert await produce(broker.port, waiting, app="later") == waiting
    await until(lambda: len(recipient.received) == len(before))

    if how == "kill9":
        assert own_redis.proc is not None
        own_redis.proc.kill()
        own_redis.proc.wait(5)
    own_redis.stop()
    during = [f"during-{i}" for i in range(20)]
    client = await RawClient.connect(broker.port)
    for msgid in during:
        resp = await client.request("queue", b"x", appid=APP, msgid=msgid)
        assert resp["status"] == "error", f"{msgid} answered {resp} while Redis is down"
    assert broker.alive

    own_redis.start()
    after: list[str] = []

    async def accepted() -> bool:
        msgid = f"after-{len(after)}"
        if (await client.request("queue", b"x", appid=APP, msgid=msgid))["status"] == "ack":
            after.append(msgid)
        return bool(after)

    await eventually(accepted, 15)
    await client.close()
    later = await Holder("later", "r2").start()

    async def registered() -> bool:  # `error` means "register again later" (PROTOCOL.md)
        return (await later.register(broker.port))["status"] == "ack"

    await eventually(registered, 15)
    recipient.mode = "ack"
    want = set(before + after)
    await until(lambda: want <= set(recipient.msgids()), ACK_TIMEOUT + 15)
    await until(lambda: set(waiting) <= set(later.msgids()), 10)
    await recipient.stop()
    await later.stop()


async def test_broker_started_before_its_redis_waits_for_it(
    spawn: Spawn, own_redis: EmbeddedRedis, prefix: str
) -> None:
    own_redis.stop()
    broker = spawn("b", **shared(own_redis.url, prefix))
    broker.spawn()
    await asyncio.sleep(1.0)  # the fault: Redis stays away for a while
    assert broker.alive
    own_redis.start()
    await broker.up()
    recipient = await start_recipient(broker.port)
    assert await produce(broker.port, ["m"]) == ["m"]
    await recipient.next_push()
    await recipient.stop()


# -- 4. limits against abuse ---------------------------------------------------------


class NotReading:
    """A recipient that answers heartbeats but, once it got a push on a connection, never
    reads that connection again (a hung consumer whose process is still up)."""

    def __init__(self) -> None:
        self.port = 0
        self.pushed = 0
        self._server: asyncio.Server | None = None
        self._stuck: list[asyncio.StreamWriter] = []

    async def start(self) -> NotReading:
        sock = socket.socket()
        # A small receive buffer, so the kernel does not absorb megabytes first.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.bind(("127.0.0.1", 0))
        self._server = await asyncio.start_server(self._serve, sock=sock)
        self.port = sock.getsockname()[1]
        return self

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        data = b""
        while chunk := await reader.read(4096):
            data += chunk
            if b"type=push" in data:
                self.pushed += 1
                self._stuck.append(writer)
                return  # stop reading, keep the connection open
            if data.startswith(b"ping"):
                writer.write(b"pong\r\n\r\n")
                data = b""
        writer.close()

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in self._stuck:
            writer.close()


async def test_recipient_that_stops_reading(
    make_broker: BrokerFactory, redis: aioredis.Redis, prefix: str
) -> None:
    """One recipient stops reading its push connection. Its pushes time out and go to the
    healthy recipient, nothing is lost or dead-lettered, and what the broker buffers for
    the stuck one stays bounded (by its push window), however long it lasts."""
    window, frame = 16, 60_000
    broker = await make_broker(ack_timeout=0.5, push_window=window, retry_backoff=[0.05])
    stuck = await NotReading().start()
    reg = {"id": "stuck", "app_id": APP, "host": "127.0.0.1", "port": stuck.port}
    client = await RawClient.connect(broker.server.port)
    assert (await client.request("register", json.dumps(reg).encode()))["status"] == "ack"
    good = await start_recipient(broker.server.port, "good")

    msgids: list[str] = []
    buffered = 0
    loop = asyncio.get_running_loop()
    end = loop.time() + 4.0
    while loop.time() < end:
        ids = [f"m-{len(msgids) + i}" for i in range(20)]
        client.send_raw(
            b"".join(encode_frame("queue", {"appid": APP, "msgid": m}, b"x" * frame) for m in ids)
        )
        for _ in ids:
            assert (await client.resp())["status"] == "ack"
        msgids += ids
        link = broker.engine.links.get((APP, "stuck"))
        transport = getattr(link, "_transport", None)
        if transport is not None:
            buffered = max(buffered, transport.get_write_buffer_size())
        await asyncio.sleep(0.1)  # a steady stream of bursts
    await client.close()
    assert stuck.pushed > 0, "the stuck recipient got pushes"

    states = await all_in(redis, prefix, msgids, ("done", "dead"), 10)
    dead = [m for m, s in states.items() if s == "dead"]
    bound = window * (frame + 200)
    assert (len(dead), buffered <= bound) == (0, True), (
        f"{len(dead)} of {len(msgids)} messages dead-lettered because of one stuck recipient; "
        f"up to {buffered} bytes buffered for it (bound {bound})"
    )
    await good.stop()
    await stuck.stop()


async def test_delivery_rate_is_per_app(make_broker: BrokerFactory) -> None:
    """DELIVERY_RATE caps pushes per second for each app (messages beyond it wait in
    Redis, none dropped); another app's messages do not wait behind them."""
    rate = 20
    broker = await make_broker(delivery_rate=rate)
    busy = await start_recipient(broker.server.port, "busy")
    other = await Holder("other", "o1").start()
    assert (await other.register(broker.server.port))["status"] == "ack"
    n = 3 * rate
    loop = asyncio.get_running_loop()
    start = loop.time()
    assert len(await produce(broker.server.port, [f"m-{i}" for i in range(n)])) == n
    assert len(await produce(broker.server.port, ["o-0", "o-1"], app="other")) == 2
    await until(lambda: len(other.received) == 2, 5)
    other_took = loop.time() - start
    await until(lambda: len(busy.received) == n, 10)
    took = loop.time() - start
    # A burst of one second's worth, then `rate` a second: (n - rate) / rate seconds.
    assert took >= (n - rate) / rate * 0.9, f"{n} pushes in {took:.2f}s"
    assert other_took < 0.5 * took, "the other app waited behind the busy one"
    assert sorted(busy.msgids()) == sorted(f"m-{i}" for i in range(n))
    await busy.stop()
    await other.stop()


# -- 5. graceful shutdown ------------------------------------------------------------


async def _refused(port: int) -> bool:
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return True
    writer.close()
    return False


@pytest.mark.parametrize("recipient_answers", [False, True])
async def test_sigterm_drains_or_hands_back_and_exits_clean(
    spawn: Spawn, recipient_answers: bool
) -> None:
    """SIGTERM: the broker stops accepting at once; pushes answered during the grace
    period are recorded, the others are handed back (no attempt spent) and delivered
    after the restart; the embedded Redis stops with it and the broker exits in time."""
    broker = await spawn("b").up()  # embedded Redis, AOF in its DATA_DIR
    children = psutil.Process(broker.pid).children(recursive=True)
    assert children, "the embedded Redis runs as a child"
    recipient = await start_recipient(broker.port, policy="hold")
    msgids = [f"m-{i}" for i in range(10)]
    assert await produce(broker.port, msgids) == msgids
    await until(lambda: len(recipient.held) == len(msgids))

    assert broker.proc is not None
    broker.proc.send_signal(signal.SIGTERM)
    stopped = time.monotonic()

    async def refused() -> bool:
        return await _refused(broker.port)

    await eventually(refused, 2)
    assert broker.alive, "still draining its in-flight pushes"
    if recipient_answers:
        recipient.answer_held("ack")
    assert await broker.exited(15) == 0
    shutdown_timeout = float(broker.env["SKMQ_SHUTDOWN_TIMEOUT"])
    assert time.monotonic() - stopped < shutdown_timeout + 4
    await until(lambda: not any(c.is_running() for c in children), 2)

    first_run = {e["broker"] for e in log_events(broker.log_dir())}
    recipient.mode = "ack"
    await broker.up()
    redis = aioredis.Redis.from_url(broker.redis_url())
    try:
        if recipient_answers:
            await all_in(redis, "skmq", msgids, ("done",), 1)
        else:
            await all_in(redis, "skmq", msgids, ("done",), 10)
            again = [
                e
                for e in log_events(broker.log_dir())
                if e["event"] == "pushed" and e["broker"] not in first_run
            ]
            assert sorted(e["msgid"] for e in again) == sorted(msgids), "pushed once again"
            assert {e["attempt"] for e in again} == {1}, "handing back spends no attempt"
    finally:
        await redis.aclose()
        await recipient.stop()


async def test_sigterm_right_after_a_freeze_exits_in_bounded_time(
    spawn: Spawn, redis_url: str, prefix: str
) -> None:
    """A broker frozen for a while (SIGSTOP: a long GC or VM pause) and stopped as soon as
    it runs again still shuts down within its bounded time."""
    broker = await spawn("b", **shared(redis_url, prefix)).up()
    recipient = await start_recipient(broker.port)
    assert await produce(broker.port, ["m"]) == ["m"]
    await recipient.next_push()
    os.kill(broker.pid, signal.SIGSTOP)
    await asyncio.sleep(2.0)  # the fault: the process is frozen this long
    os.kill(broker.pid, signal.SIGCONT)
    os.kill(broker.pid, signal.SIGTERM)
    shutdown_timeout = float(broker.env["SKMQ_SHUTDOWN_TIMEOUT"])
    try:
        rc = await broker.exited(shutdown_timeout + 6)
    except TimeoutError:
        pytest.fail("SIGTERM after a freeze: the broker never exits")
    assert rc == 0
    await recipient.stop()
