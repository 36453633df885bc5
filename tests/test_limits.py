"""Limits that hold under abuse, each hit over real TCP sockets against a real broker:
FRAME_TIMEOUT (slowloris), MAX_PARTIAL_BYTES, MAX_CONNECTIONS_PER_HOST, the Redis pool
under a burst, per-connection fairness of answers, hostile register JSON and arbitrary
frames, and memory while Redis is stalled."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from skmq.broker import Broker
from skmq.clock import now_ms
from skmq.codec import Decoder, Frame, encode_frame
from skmq.embedded import EmbeddedRedis
from skmq.workers.rotation import Rotation
from tests.conftest import FAST, BrokerFactory, BrokerProcess, eventually
from tests.peers import FakeRecipient, RawClient


def queue_frame(msgid: str, content: bytes = b"x", appid: str = "a") -> bytes:
    return encode_frame("queue", {"appid": appid, "msgid": msgid}, content)


# -- MAX_DELAY, MAX_TTL -------------------------------------------------------------
async def test_delays_and_ttls_past_their_limits_are_refused(make_broker: BrokerFactory) -> None:
    broker = await make_broker(max_delay=60_000, max_ttl=120_000)
    client = await RawClient.connect(broker.server.port)
    an_hour_ahead = str(time.time_ns() // 1_000_000 + 3_600_000)
    refused = [
        ({"delay": "60001"}, "(MAX_DELAY)"),
        ({"deliver_at": an_hour_ahead}, "(MAX_DELAY)"),
        # Once stored, Redis read such a due time as infinity in every claim of its app.
        ({"delay": "1" + "0" * 309}, "(MAX_DELAY)"),
        ({"ttl": "120001"}, "(MAX_TTL)"),
    ]
    try:
        for i, (fields, setting) in enumerate(refused):
            resp = await client.request("queue", b"x", appid="a", msgid=f"far{i}", **fields)
            assert (resp["status"], setting in resp["content"]) == ("error", True), fields
        resp = await client.request(
            "queue", b"x", appid="a", msgid="near", delay="60000", ttl="120000"
        )
        assert resp["status"] == "ack"
        waiting = await broker.store.peek("a", 10, now_ms())
        assert [w.msgid for w in waiting] == ["near"]
    finally:
        await client.close()


# -- MAX_RECIPIENTS_PER_APP, HEARTBEAT_CONCURRENCY -----------------------------------
async def test_an_app_holds_at_most_max_recipients(make_broker: BrokerFactory) -> None:
    broker = await make_broker(max_recipients_per_app=2)
    client = await RawClient.connect(broker.server.port)

    async def register(app: str, rid: str) -> dict[str, object]:
        reg = {"id": rid, "app_id": app, "host": "127.0.0.1", "port": 9}
        return await client.request("register", json.dumps(reg).encode())

    try:
        assert [(await register("a", r))["status"] for r in ("r1", "r2")] == ["ack", "ack"]
        refused = await register("a", "r3")
        assert refused["status"] == "reject" and "MAX_RECIPIENTS_PER_APP" in str(refused["content"])
        assert (await register("a", "r1"))["status"] == "ack"  # a known one, again
        assert (await register("b", "r3"))["status"] == "ack"  # another app's own count
        assert await broker.store.redis.hlen(broker.store.base("a") + "recipients") == 2
    finally:
        await client.close()


async def test_a_heartbeat_round_holds_at_most_its_concurrency_in_connections(
    make_broker: BrokerFactory,
) -> None:
    """Recipients whose address accepts and never answers each hold a heartbeat's
    connection for HEARTBEAT_TIMEOUT: a round opens HEARTBEAT_CONCURRENCY at a time."""
    open_now = peak = accepted = 0
    held: list[asyncio.StreamWriter] = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal open_now, peak, accepted
        open_now += 1
        accepted += 1
        peak = max(peak, open_now)
        held.append(writer)
        await reader.read()  # until the broker gives up on it
        open_now -= 1
        writer.close()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    broker = await make_broker(
        heartbeat_interval=0.2, heartbeat_timeout=0.3, heartbeat_concurrency=2
    )
    client = await RawClient.connect(broker.server.port)
    try:
        for i in range(6):
            reg = {"id": f"r{i}", "app_id": "hb", "host": "127.0.0.1", "port": port}
            resp = await client.request("register", json.dumps(reg).encode())
            assert resp["status"] == "ack"

        async def a_round_done() -> bool:
            return accepted >= 6

        await eventually(a_round_done)
        assert peak <= 2
    finally:
        await client.close()
        server.close()


# -- FRAME_TIMEOUT ------------------------------------------------------------------
async def test_slowloris_frame_is_refused_after_frame_timeout(make_broker: BrokerFactory) -> None:
    broker = await make_broker(frame_timeout=1.0, idle_timeout=30.0)
    client = await RawClient.connect(broker.server.port)
    frame = queue_frame("slow", b"y" * 200)

    async def one_byte_at_a_time() -> None:
        for byte in frame:
            client.send_raw(bytes([byte]))
            await client.writer.drain()
            await asyncio.sleep(0.2)  # the attack's pace, not a synchronisation

    drip = asyncio.create_task(one_byte_at_a_time())
    try:
        resp = await client.resp(timeout=10)
        assert resp["status"] == "error" and "FRAME_TIMEOUT" in resp["content"]
        assert await client.closed(timeout=5)
        assert not drip.done()  # refused while the frame was still dripping in
    finally:
        drip.cancel()
        await client.close()


async def test_frames_completing_in_time_keep_a_connection_open(
    make_broker: BrokerFactory,
) -> None:
    """FRAME_TIMEOUT times one frame, not the connection: each complete frame restarts it."""
    broker = await make_broker(frame_timeout=0.6, idle_timeout=30.0)
    client = await RawClient.connect(broker.server.port)
    for i in range(8):  # ~1.6 s in all, well past FRAME_TIMEOUT
        frame = queue_frame(f"k{i}")
        client.send_raw(frame[:10])
        await asyncio.sleep(0.1)
        client.send_raw(frame[10:] + queue_frame(f"k{i}b")[:5])
        await asyncio.sleep(0.1)
        client.send_raw(queue_frame(f"k{i}b")[5:])
        assert (await client.resp())["status"] == "ack"
        assert (await client.resp())["status"] == "ack"
    await client.close()


# -- MAX_PARTIAL_BYTES --------------------------------------------------------------
async def test_partial_frames_over_the_global_cap_close_the_largest(
    make_broker: BrokerFactory,
) -> None:
    broker = await make_broker(max_partial_bytes=100_000, max_frame_bytes=1 << 20)
    big = await RawClient.connect(broker.server.port)
    small = await RawClient.connect(broker.server.port)
    big.send_raw(b"type=queue\r\nappid=a\r\nmsgid=big\r\ncontent=" + b"b" * 60_000)

    async def big_is_held() -> bool:
        return broker.server.partial_bytes >= 60_000

    await eventually(big_is_held)
    small_frame = queue_frame("small", b"s" * 50_000)
    small.send_raw(small_frame[:-10])
    resp = await big.resp()
    assert resp["status"] == "error" and "MAX_PARTIAL_BYTES" in resp["content"]
    assert await big.closed()
    small.send_raw(small_frame[-10:])
    assert (await small.resp())["status"] == "ack"
    assert broker.server.partial_bytes == 0
    await small.close()


# -- MAX_CONNECTIONS_PER_HOST -------------------------------------------------------
async def test_connections_per_host_are_capped(make_broker: BrokerFactory) -> None:
    broker = await make_broker(max_connections_per_host=3)
    clients = [await RawClient.connect(broker.server.port) for _ in range(3)]
    for c in clients:
        c.send_raw(b"ping\r\n\r\n")
        assert (await c.recv()).type == "pong"
    extra = await RawClient.connect(broker.server.port)
    resp = await extra.resp()
    assert resp["status"] == "error" and "MAX_CONNECTIONS_PER_HOST" in resp["content"]
    assert await extra.closed()
    await clients[0].close()

    async def slot_free() -> bool:
        return broker.server.admission.per_host["127.0.0.1"] == 2

    await eventually(slot_free)
    again = await RawClient.connect(broker.server.port)
    assert (await again.request("queue", b"x", appid="a"))["status"] == "ack"
    for c in [*clients[1:], again]:
        await c.close()


# -- fairness between connections ---------------------------------------------------
async def test_a_flood_does_not_delay_another_connections_answers(
    make_broker: BrokerFactory,
) -> None:
    """12,000 answers for unknown messages (each one a store look-up: a consumer group's
    ack of a stale receipt) on one connection; a producer on another
    connection hears `ack` while the flood is still being answered."""
    broker = await make_broker()
    n = 12_000
    flood = await RawClient.connect(broker.server.port)
    group = {"appid": "junk", "group": "g"}
    assert (await flood.request("pull", op="create", **group))["status"] == "ack"
    flood.send_raw(
        b"".join(
            encode_frame("pull", {**group, "op": "ack"}, b'{"receipts":["%d-0.1.1"]}' % (i + 1))
            for i in range(n)
        )
    )
    answered = 0
    first = asyncio.Event()

    async def read_flood() -> None:
        nonlocal answered
        while answered < n:
            resp = await flood.resp()
            assert (resp["status"], '"status":"stale"' in resp["content"]) == ("ack", True)
            answered += 1
            first.set()

    reader = asyncio.create_task(read_flood())
    async with asyncio.timeout(10):
        await first.wait()
    producer = await RawClient.connect(broker.server.port)
    resp = await producer.request("queue", b"urgent", appid="a", msgid="urgent")
    answered_meanwhile = answered
    async with asyncio.timeout(60):
        await reader
    assert resp["status"] == "ack"
    assert answered_meanwhile < n, "the producer waited for the whole flood"
    await flood.close()
    await producer.close()


# -- the Redis pool under a burst ---------------------------------------------------
async def test_a_burst_of_store_calls_waits_for_the_pool_instead_of_failing(
    make_broker: BrokerFactory,
) -> None:
    """200 connections pipelining register and ack frames through a pool of 4 Redis
    connections, and a producer: every frame is answered, none `Too many connections`."""
    broker = await make_broker(redis_pool_size=4)
    port = broker.server.port
    per_conn = 20

    async def burst(i: int) -> list[dict[str, object]]:
        client = await RawClient.connect(port)
        frames = []
        for j in range(per_conn // 2):
            reg = {"id": f"r{i}", "app_id": f"burst{i % 7}", "host": "127.0.0.1", "port": 9}
            frames.append(encode_frame("register", {"msgid": f"g{j}"}, json.dumps(reg).encode()))
            frames.append(encode_frame("ack", {"appid": f"burst{i % 7}", "msgid": f"u{i}-{j}"}))
        client.send_raw(b"".join(frames))
        try:
            return [await client.resp(timeout=30) for _ in range(per_conn)]
        finally:
            await client.close()

    async def produce() -> list[dict[str, object]]:
        client = await RawClient.connect(port)
        client.send_raw(b"".join(queue_frame(f"p{i}") for i in range(100)))
        try:
            return [await client.resp(timeout=30) for _ in range(100)]
        finally:
            await client.close()

    *bursts, produced = await asyncio.gather(*(burst(i) for i in range(200)), produce())
    answers = [a for b in bursts for a in b]
    assert len(answers) == 200 * per_conn
    contents = {(a["status"], str(a["content"]).partition(" '")[0]) for a in answers}
    assert contents == {("ack", "registered"), ("reject", "message")}, contents
    assert all(a["status"] == "ack" and a["content"] == "stored" for a in produced)


async def test_a_sustained_flood_from_many_connections_holds_bounded_frames(
    make_broker: BrokerFactory,
) -> None:
    """100 connections each pipeline 1,000 answers for unknown messages (every one a store
    look-up) while a producer sends one message at a time: every message is `ack`ed, and
    the frames read but not yet answered stay within MAX_UNANSWERED_TOTAL's bound (each
    connection at its share, plus at most one small read past it) instead of up to 100 x
    MAX_UNANSWERED_FRAMES."""
    total, conns, per_conn = 2000, 100, 1000
    broker = await make_broker(max_unanswered_total=total, redis_pool_size=8)
    port = broker.server.port
    peak = 0

    async def flood(i: int) -> int:
        client = await RawClient.connect(port)
        frames = [encode_frame("ack", {"appid": "j", "msgid": f"{i}-{j}"}) for j in range(per_conn)]
        client.send_raw(b"".join(frames))
        try:
            for _ in range(per_conn):
                await client.resp(timeout=60)
            return per_conn
        finally:
            await client.close()

    async def sample() -> None:
        nonlocal peak
        while True:
            peak = max(peak, sum(c.unanswered for c in broker.server.connections))
            await asyncio.sleep(0.005)

    async def produce() -> list[tuple[object, object]]:
        client = await RawClient.connect(port)
        try:
            answers = []
            for i in range(50):
                resp = await client.request("queue", b"x", appid="a", msgid=f"p{i}")
                answers.append((resp["status"], resp["content"]))
            return answers
        finally:
            await client.close()

    sampler = asyncio.create_task(sample())
    floods = [asyncio.create_task(flood(i)) for i in range(conns)]
    produced = await produce()
    answered = await asyncio.gather(*floods)
    sampler.cancel()
    assert produced == [("ack", "stored")] * 50
    assert sum(answered) == conns * per_conn
    one_read = 256 // 13 + 1  # MIN_READ bytes of the shortest answer frames
    assert 0 < peak <= 2 * total + (conns + 1) * one_read, peak


# -- hostile input ------------------------------------------------------------------
HOSTILE_REGISTRATIONS = [
    (b"[" * 100_000, "MAX_REGISTRATION_BYTES"),
    (b"[" * 4000, "nested too deeply"),
    (b'{"app_id": {"a": 1}, "id": "r", "port": 9}', "flat"),
    (b'{"app_id": "\\ud800", "id": "r", "port": 9}', "surrogate"),
    (b'{"app_id": "a", "id": "r", "port": 9, "weight": 10000000000}', "weight"),
    (b'{"app_id": "a", "id": "r"}', "port is required"),
    (b'{"id": "r", "port": 9}', "app_id"),
    (b'{"app_id": "a", "id": 7, "port": 9}', "id must be"),
    (b'{"app_id": "a", "id": "r", "port": 9.5}', "port must be"),
    (b'["app_id"]', "JSON object"),
    (b'{"app_id": "\xff\xfe", "id": "r", "port": 9}', "not valid JSON"),
    (b"\xff" * 10, "not valid JSON"),
]


async def test_hostile_register_content_is_rejected(broker_process: BrokerProcess) -> None:
    broker_process.env["SKMQ_MAX_FRAME_BYTES"] = str(1 << 20)
    broker_process.start()
    client = await RawClient.connect(broker_process.port)
    for content, reason in HOSTILE_REGISTRATIONS:
        for kind in ("register", "unregister"):
            resp = await client.request(kind, content, msgid="h")
            if kind == "register" or not reason.startswith(("weight", "port")):
                assert resp["status"] == "reject", (content[:60], resp)
            if kind == "register":
                assert reason in resp["content"], (content[:60], resp)
    assert (await client.request("queue", b"x", appid="a"))["status"] == "ack"
    await client.close()
    assert "Traceback" not in broker_process.log_path.read_text()


TYPES = ["queue", "topic", "ack", "reject", "error", "arrived", "register", "unregister",
         "ping", "status", "", "junk"]  # fmt: skip
KEYS = ["appid", "msgid", "delay", "deliver_at", "recipient", "id", "x"]
# Any byte but CR and LF in a field value (CRLF ends a line of the wire format).
VALUE = st.binary(max_size=40).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b""))
JSON_CONTENT = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=10,
).map(lambda v: json.dumps(v).encode())
CONTENT = st.none() | st.binary(max_size=200) | JSON_CONTENT


@st.composite
def raw_frame(draw: st.DrawFn) -> bytes:
    """One frame as bytes: a type, arbitrary field values, and content with length=."""
    kind = draw(st.sampled_from(TYPES))
    if kind == "ping":
        return b"ping\r\n\r\n"
    lines = [b"type=" + kind.encode()] if kind else []
    for key in draw(st.lists(st.sampled_from(KEYS), max_size=4, unique=True)):
        lines.append(key.encode() + b"=" + draw(VALUE))
    content = draw(CONTENT)
    if content is not None:
        lines.append(b"length=%d" % len(content))
        lines.append(b"content=" + content)
    return b"\r\n".join(lines or [b"x="]) + b"\r\n\r\n"  # blank lines alone are no frame


@pytest.fixture
def running_broker(broker_process: BrokerProcess) -> Iterator[BrokerProcess]:
    yield broker_process.start()


def exchange(port: int, frames: list[bytes]) -> list[Frame]:
    """Send the frames on one connection; read one answer a frame (blocking, bounded)."""
    decoder = Decoder()
    answers: list[Frame] = []
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"".join(frames))
        while len(answers) < len(frames):
            data = sock.recv(65536)
            if not data:
                break
            answers += [f for f in decoder.feed(data) if isinstance(f, Frame)]
    return answers


@settings(
    max_examples=int(os.environ.get("SKMQ_HOSTILE_EXAMPLES", "60")),
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(frames=st.lists(raw_frame(), min_size=1, max_size=12))
def test_every_arbitrary_frame_gets_an_answer(
    running_broker: BrokerProcess, frames: list[bytes]
) -> None:
    answers = exchange(running_broker.port, frames)
    assert len(answers) == len(frames)
    for frame, answer in zip(frames, answers, strict=True):
        assert answer.type == ("pong" if frame == b"ping\r\n\r\n" else "resp"), (frame, answer)
    assert exchange(running_broker.port, [queue_frame("after")])[0].content is not None
    log = running_broker.log_path.read_text(errors="replace")
    assert "Traceback" not in log and "[error" not in log, log[-3000:]


# -- a stalled Redis ----------------------------------------------------------------
@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[EmbeddedRedis]:
    """A Redis of this test alone (it gets SIGSTOPped), never the session one."""
    server = EmbeddedRedis(tmp_path / "own-redis")
    server.start()
    try:
        yield server
    finally:
        if server.proc is not None:
            os.kill(server.proc.pid, signal.SIGCONT)
        server.stop()


async def test_redis_stall_gives_backpressure_then_errors(
    make_broker: BrokerFactory, own_redis: EmbeddedRedis
) -> None:
    cap = 200_000
    broker = await make_broker(
        redis_url=own_redis.url, store_timeout=1.0, max_store_pending_bytes=cap,
        max_frame_bytes=1 << 20,
    )  # fmt: skip
    client = await RawClient.connect(broker.server.port)
    assert (await client.request("queue", b"before", appid="s", msgid="before"))["status"] == "ack"
    assert own_redis.proc is not None
    os.kill(own_redis.proc.pid, signal.SIGSTOP)
    peak = 0

    async def watch() -> None:
        nonlocal peak
        while True:
            peak = max(peak, broker.enqueuer.pending_bytes)
            await asyncio.sleep(0.005)

    watcher = asyncio.create_task(watch())
    n, size = 40, 25_000  # 1 MB sent, five times the cap
    try:
        client.send_raw(b"".join(queue_frame(f"s{i}", b"z" * size, "s") for i in range(n)))
        first = await client.resp(timeout=5)  # STORE_TIMEOUT (1 s) and slack
        answers = [first] + [await client.resp(timeout=10) for _ in range(n - 1)]
    finally:
        watcher.cancel()
        os.kill(own_redis.proc.pid, signal.SIGCONT)
    assert first["status"] == "error" and "store unavailable" in first["content"]
    assert all(a["status"] == "error" for a in answers)
    # Content held for the store never grew past twice the cap (the cap, then one run of
    # frames handled together), though five times as much was sent.
    assert 0 < peak <= 2 * cap, peak
    resp = await client.request("queue", b"after", appid="s", msgid="after")
    assert resp["status"] == "ack" and resp["content"] == "stored"
    await client.close()


async def test_a_stop_while_redis_is_stalled_answers_every_frame_and_ends_in_bounded_time(
    make_broker: BrokerFactory, own_redis: EmbeddedRedis
) -> None:
    """SIGTERM with the store stalled: a frame read is answered (`error`, by STORE_TIMEOUT)
    before its connection closes, and the broker stops within about twice
    SHUTDOWN_TIMEOUT, though a push in flight cannot be handed back (it took 31 s)."""
    broker = await make_broker(redis_url=own_redis.url, store_timeout=1.0, shutdown_timeout=2.0)
    holder = FakeRecipient("st", "holder", lambda f: "silent")
    await holder.start()
    assert (await holder.register(broker.server.port))["status"] == "ack"
    client = await RawClient.connect(broker.server.port)
    assert (await client.request("queue", b"x", appid="st", msgid="held"))["status"] == "ack"
    await holder.next_push()
    assert own_redis.proc is not None
    os.kill(own_redis.proc.pid, signal.SIGSTOP)
    client.send("queue", b"y", appid="st", msgid="during")

    async def storing() -> bool:  # read, and waiting for the store
        return broker.enqueuer.pending_bytes > 0

    await eventually(storing)
    broker.stopping.set()
    started = asyncio.get_running_loop().time()
    stopping = asyncio.create_task(broker.stop())
    resp = await client.resp(timeout=5)
    assert resp["status"] == "error" and "store unavailable" in resp["content"], resp
    async with asyncio.timeout(15):
        await stopping
    assert asyncio.get_running_loop().time() - started < 2 * 2.0 + 2.5  # + STORE_TIMEOUT etc.
    os.kill(own_redis.proc.pid, signal.SIGCONT)
    await client.close()
    await holder.stop()


# -- apps are forgotten -------------------------------------------------------------
async def test_apps_with_no_recipients_and_no_messages_are_forgotten(
    broker: Broker, redis: aioredis.Redis
) -> None:
    """An app whose message was delivered and whose recipient left is forgotten (apps set
    and dispatcher); one still holding a message is kept; a forgotten app comes back
    with its next message."""
    rec = await FakeRecipient("gone", "r1").start()
    assert (await rec.register(broker.server.port))["status"] == "ack"
    client = await RawClient.connect(broker.server.port)
    assert (await client.request("queue", b"x", appid="gone", msgid="g1"))["status"] == "ack"
    assert (await client.request("queue", b"y", appid="kept", msgid="k1"))["status"] == "ack"
    await rec.next_push()
    unreg = json.dumps({"app_id": "gone", "id": "r1"}).encode()
    assert (await client.request("unregister", unreg))["content"] == "unregistered"

    async def forgotten() -> bool:
        return "gone" not in await broker.store.apps() and "gone" not in broker.engine.dispatchers

    await eventually(forgotten)
    assert "kept" in await broker.store.apps()  # a message waits for a recipient
    assert "kept" in broker.engine.dispatchers
    assert (await client.request("queue", b"z", appid="gone", msgid="g2"))["status"] == "ack"
    assert "gone" in await broker.store.apps()
    rec2 = await FakeRecipient("gone", "r2").start()
    await rec2.register(broker.server.port)
    assert (await rec2.next_push()).fields["msgid"] == "g2"
    await client.close()
    await rec.stop()
    await rec2.stop()


def test_rotation_visits_every_app_a_share_at_a_time() -> None:
    turns = Rotation(3)
    apps = [f"a{i}" for i in range(7)]
    seen = [turns.take(apps) for _ in range(3)]
    assert seen == [["a0", "a1", "a2"], ["a3", "a4", "a5"], ["a6", "a0", "a1"]]
    assert turns.take(apps[:2]) == ["a0", "a1"]  # few apps: all of them, every round


async def test_the_largest_content_accepted_fits_in_a_push_every_recipient_can_read(
    make_broker: BrokerFactory,
) -> None:
    """Content up to MAX_FRAME_BYTES less PUSH_ROOM is accepted; its push, with the
    longest fields the broker adds (appid, msgid and recipient id at their limits,
    token, traceparent, signature, length=), still fits in MAX_FRAME_BYTES, the frame
    our Consumer reads. One byte more is refused when sent."""
    from skmq.client import Consumer, Message
    from tests.test_signing import SECRET

    broker = await make_broker(signing_secret=SECRET)
    limit = broker.settings.max_content_bytes
    app, rid, msgid = "é" * 128, "\U0001f600" * 256, "m" * 256  # 256, 1024, 256 bytes
    got: asyncio.Queue[Message] = asyncio.Queue()

    async def handle(msg: Message) -> None:
        got.put_nowait(msg)

    content = (b"x" * 99 + b"\n") * (limit // 100) + b"y" * (limit % 100)
    assert len(content) == limit
    port = broker.server.port
    async with Consumer(
        app, rid, handle, broker_port=port, signing_secret=SECRET,
        max_frame_bytes=broker.settings.max_frame_bytes,
    ):  # fmt: skip
        client = await RawClient.connect(port)
        trace = "00-" + "a" * 32 + "-" + "b" * 16 + "-01"
        over = await client.request("topic", content + b"z", appid=app, msgid="over")
        assert (over["status"], over["content"]) == (
            "error", f"content over {limit} bytes (MAX_FRAME_BYTES less the push's fields)"
        )  # fmt: skip
        sent = await client.request("topic", content, appid=app, msgid=msgid, traceparent=trace)
        assert sent["status"] == "ack", sent
        msg = await asyncio.wait_for(got.get(), 10)
        assert (msg.msgid, msg.content) == (msgid, content)
        await client.close()


async def test_a_redis_refusing_writes_answers_acks_and_fails_no_task(
    make_broker: BrokerFactory, own_redis: EmbeddedRedis
) -> None:
    """Redis at its maxmemory with noeviction refuses every write with an error reply
    (`-OOM ...`), as a master demoted by a failover does (`-MOVED`, `-READONLY`). A
    recipient's ack then is answered `store unavailable` (it was answered nothing: the
    task settling the app's answers died on the reply, and the push stayed in flight
    until ACK_TIMEOUT), no task fails, and once Redis takes writes again the message
    goes out again and is acked."""
    broker = await make_broker(redis_url=own_redis.url)
    sync_admin = redis.Redis.from_url(own_redis.url)
    full = {"now": True}

    def fill_then_ack(frame: Frame) -> str:
        if full["now"]:
            full["now"] = False
            sync_admin.config_set("maxmemory", 1)  # (the ack below meets a full Redis)
        return "ack"

    recipient = await FakeRecipient("full", "r1", fill_then_ack).start()
    try:
        assert (await recipient.register(broker.server.port))["status"] == "ack"
        client = await RawClient.connect(broker.server.port)
        assert (await client.request("queue", b"x", appid="full", msgid="f1"))["status"] == "ack"
        await client.close()
        assert (await recipient.next_push()).fields["msgid"] == "f1"

        async def answered() -> bool:
            return bool(recipient.resps)

        await eventually(answered)
        answer = json.loads(recipient.resps[0].content or b"{}")
        assert answer["status"] == "error" and "store unavailable" in answer["content"], answer
        sync_admin.config_set("maxmemory", 0)
        again = await recipient.next_push(timeout=8 * FAST["ack_timeout"])
        assert again.fields["msgid"] == "f1"
        assert sum(broker.supervisor.restarts.values()) == 0, broker.supervisor.restarts
    finally:
        sync_admin.config_set("maxmemory", 0)
        sync_admin.close()
        await recipient.stop()
