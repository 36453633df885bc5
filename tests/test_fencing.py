"""Attacks on the delivery path over real sockets (issue 11 items 1-2, issue 12 item 1):
recipient addresses turned against the broker's own Redis or another loopback service,
forged answers from other source addresses, topic windows, content an original peer
cannot read."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from skmq.broker import Broker
from skmq.clock import now_ms
from skmq.codec import PONG, Decoder, Frame, encode_frame
from skmq.embedded import EmbeddedRedis
from tests.conftest import BrokerFactory, eventually
from tests.peers import WAIT, FakeRecipient, RawClient

ATTACKER = "127.0.0.2"  # another source address on this machine's loopback network


async def produce(port: int, app: str, contents: dict[str, bytes], **fields: str) -> None:
    client = await RawClient.connect(port)
    try:
        for msgid, content in contents.items():
            kind = "topic" if fields.get("topic") else "queue"
            extra = {k: v for k, v in fields.items() if k != "topic"}
            client.send(kind, content, appid=app, msgid=msgid, **extra)
        for _ in contents:
            assert (await client.resp())["status"] == "ack"
    finally:
        await client.close()


async def register(port: int, rec: FakeRecipient, **extra: object) -> dict[str, object]:
    client = await RawClient.connect(port)
    try:
        return await client.request("register", rec.registration(**extra))
    finally:
        await client.close()


async def register_at(broker_port: int, app: str, rid: str, port: int) -> None:
    """Register a pipelining recipient at 127.0.0.1:`port` (a test's own raw service)."""
    registration = {"id": rid, "app_id": app, "host": "127.0.0.1", "port": port,
                    "caps": ["pipeline"]}  # fmt: skip
    client = await RawClient.connect(broker_port)
    try:
        resp = await client.request("register", json.dumps(registration).encode())
        assert resp["status"] == "ack", resp
    finally:
        await client.close()


async def answer_from(port: int, source: str, kind: str, **fields: str) -> dict[str, object]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
    client = RawClient(reader, writer)
    try:
        return await client.request(kind, None, **fields)
    finally:
        await client.close()


async def stored(broker: Broker, app: str) -> int:
    """The app's messages held (waiting, in flight or dead)."""
    c = (await broker.store.counts([app], now_ms()))[app]
    return c.pending + c.delayed + c.in_flight + c.dead


async def in_flight(broker: Broker, app: str, msgid: str, recipient: str = "") -> bool:
    found = await broker.store.in_flight_of(app, msgid)
    return any(not recipient or rid == recipient for _, rid, _ in found)


class Listener:
    """A loopback service that is not an SKMQ recipient: records every byte it is sent
    (and answers `+OK` to each read, as a Redis-like service would, unless `silent`)."""

    def __init__(self, silent: bool = False) -> None:
        self.silent = silent
        self.data = bytearray()
        self.port = 0
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> Listener:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            while chunk := await reader.read(65536):
                self.data += chunk
                if not self.silent:
                    writer.write(b"+OK\r\n")
        writer.close()


@pytest.fixture
async def other_redis(tmp_path: Path) -> AsyncIterator[EmbeddedRedis]:
    server = EmbeddedRedis(tmp_path / "victim")
    server.start()
    yield server
    server.stop()


# -- 1. recipient addresses -----------------------------------------------------------


async def test_the_brokers_own_redis_and_ports_cannot_be_registered(
    broker: Broker, redis_server: EmbeddedRedis
) -> None:
    for port in (redis_server.port, broker.server.port):
        rec = FakeRecipient("ssrf", "evil")
        rec.port = port
        resp = await register(broker.server.port, rec)
        assert resp["status"] == "reject", resp
        assert "uses itself" in str(resp["content"])
        rec.port = port
        resp = await register(broker.server.port, rec, host="localhost")
        assert resp["status"] == "reject", resp


async def test_a_store_wipe_through_a_push_is_impossible(
    broker: Broker, redis: aioredis.Redis, prefix: str, other_redis: EmbeddedRedis
) -> None:
    """The SSRF of issue 11 against a Redis the broker does not know: registration passes
    (it is loopback), but the handshake gets `+PONG`, not `pong`, so no push is written;
    CR/LF content is never written to a peer without the `length` capability either."""
    victim = aioredis.Redis.from_url(other_redis.url)
    await victim.set("canary", "alive")
    rec = FakeRecipient("wipe", "evil", caps=())
    rec.port = other_redis.port
    assert (await register(broker.server.port, rec))["status"] == "ack"
    attack = {f"w{i}": b"x\r\nFLUSHALL\r\n" for i in range(50)}
    attack |= {f"p{i}": b"FLUSHALL" for i in range(50)}
    await produce(broker.server.port, "wipe", attack)
    await eventually(lambda: recipient_lost(broker, "wipe", "evil"))
    assert await victim.get("canary") == b"alive"
    stats = await victim.info("commandstats")
    assert "cmdstat_flushall" not in stats
    assert await stored(broker, "wipe") == 100  # every acked message still there
    await victim.aclose()


async def recipient_lost(broker: Broker, app: str, rid: str) -> bool:
    r = broker.engine.registry.get(app, rid)
    return r is not None and not r.alive


async def test_a_service_that_does_not_answer_pong_never_receives_a_message(
    broker: Broker, redis: aioredis.Redis, prefix: str
) -> None:
    async with Listener() as service:
        rec = FakeRecipient("probe", "svc", caps=("pipeline", "length"))
        rec.port = service.port
        assert (await register(broker.server.port, rec))["status"] == "ack"
        await produce(broker.server.port, "probe", {"m1": b"SECRET-CONTENT"})
        await eventually(lambda: recipient_lost(broker, "probe", "svc"))
        assert b"SECRET-CONTENT" not in service.data
        assert b"push" not in service.data
        assert service.data.replace(b"ping\r\n\r\n", b"") == b""
    assert await stored(broker, "probe") == 1


async def test_a_service_that_never_answers_the_handshake_is_given_up_on(
    make_broker: BrokerFactory, redis: aioredis.Redis, prefix: str
) -> None:
    """HANDSHAKE_TIMEOUT: no `pong` in time, no push; the message stays stored."""
    broker = await make_broker(handshake_timeout=0.3)
    async with Listener(silent=True) as service:
        rec = FakeRecipient("mute-svc", "svc", caps=("pipeline",))
        rec.port = service.port
        assert (await register(broker.server.port, rec))["status"] == "ack"
        await produce(broker.server.port, "mute-svc", {"m1": b"SECRET-CONTENT"})
        await eventually(lambda: recipient_lost(broker, "mute-svc", "svc"))
        assert service.data.replace(b"ping\r\n\r\n", b"") == b""
    assert await stored(broker, "mute-svc") == 1


async def test_an_original_peer_gets_at_most_legacy_window_connections(
    make_broker: BrokerFactory,
) -> None:
    broker = await make_broker(legacy_window=2, ack_timeout=60, legacy_answer_timeout=60)
    rec = FakeRecipient("lw", "go", lambda f: "silent", caps=())
    await rec.start()
    assert (await register(broker.server.port, rec))["status"] == "ack"
    await produce(broker.server.port, "lw", {f"m{i}": b"x" for i in range(10)})
    for _ in range(2):
        await rec.next_push()
    link = broker.engine.links[("lw", "go")]
    await eventually(lambda: _true(len(link.inflight) == 2))
    assert len(rec.received) == 2 and len(link.inflight) <= 2
    await rec.stop()


async def _true(value: bool) -> bool:
    return value


# -- 2. answers are fenced ------------------------------------------------------------


async def test_answers_from_another_address_change_nothing(
    broker: Broker, redis: aioredis.Redis, prefix: str
) -> None:
    """Delayed, pending, in-flight and dead messages: forged acks from another source
    address are refused and change nothing; the recipient's own ack still works."""
    app = "forge"
    holder = FakeRecipient(app, "holder", lambda f: "silent")
    await holder.start()
    assert (await register(broker.server.port, holder))["status"] == "ack"
    await produce(broker.server.port, app, {"late": b"x"}, delay="600000")
    await produce(broker.server.port, app, {"fly": b"x"})
    push = await holder.next_push()
    assert push.fields["msgid"] == "fly"
    for msgid in ("late", "fly", "nope"):
        for kind in ("ack", "reject", "error", "arrived", "extend"):
            resp = await answer_from(broker.server.port, ATTACKER, kind, msgid=msgid, appid=app)
            assert resp["status"] == "reject", (msgid, kind, resp)
    # a guessed or replayed token is refused too, and so is one whose attempt is a digit
    # of another script (`²`: str.isdigit says yes, int() says no)
    for token in ("1.AAAAAAAAAAAAAAAAAAAAAA", "\u00b2.AAAAAAAAAAAAAAAAAAAAAA"):
        resp = await answer_from(
            broker.server.port, ATTACKER, "ack", msgid="fly", appid=app, token=token
        )
        assert (resp["status"], resp.get("msgid")) == ("reject", "fly"), resp
        assert "token does not match" in str(resp["content"])
    assert await in_flight(broker, app, "fly")
    assert (await broker.store.counts([app], now_ms()))[app].delayed == 1  # "late"
    # the delayed one cannot be acked even from the recipient's own host
    resp = await answer_from(broker.server.port, "127.0.0.1", "ack", msgid="late", appid=app)
    assert resp["status"] == "reject"
    # the echoed token settles it from anywhere: whoever holds it received the push
    resp = await answer_from(
        broker.server.port, ATTACKER, "ack", msgid="fly", appid=app, token=push.fields["token"]
    )
    assert resp["status"] == "ack", resp
    assert not await in_flight(broker, app, "fly")
    await holder.stop()


async def test_a_token_from_before_a_replay_does_not_settle_another_recipients_attempt(
    make_broker: BrokerFactory, redis: aioredis.Redis, prefix: str
) -> None:
    """A replay starts the attempts again: attempt 1 of the replayed message goes to r2
    and the token r1 got for its attempt 1 before the replay does not settle it."""
    broker = await make_broker(retry_times=1)
    app = "replayed"
    r1 = FakeRecipient(app, "r1", lambda f: "error")
    await r1.start()
    assert (await register(broker.server.port, r1))["status"] == "ack"
    await produce(broker.server.port, app, {"m": b"x"})
    old = await r1.next_push()
    base = f"{prefix}:{{{app}}}:"

    async def dead() -> bool:
        return await redis.zscore(base + "dead", "m") is not None

    await eventually(dead)
    assert await broker.engine.registry.unregister(app, "r1")
    r2 = FakeRecipient(app, "r2", lambda f: "silent")
    await r2.start()
    assert (await register(broker.server.port, r2))["status"] == "ack"
    assert await broker.store.replay(app, ["m"], now_ms()) == [True]
    new = await r2.next_push()
    assert (old.fields["attempt"], new.fields["attempt"]) == ("1", "1")
    resp = await answer_from(
        broker.server.port, ATTACKER, "ack", msgid="m", appid=app, token=old.fields["token"]
    )
    assert resp["status"] == "reject" and "token does not match" in str(resp["content"]), resp
    assert await in_flight(broker, app, "m")
    resp = await answer_from(
        broker.server.port, ATTACKER, "ack", msgid="m", appid=app, token=new.fields["token"]
    )
    assert resp["status"] == "ack", resp
    await r1.stop()
    await r2.stop()


async def test_an_answer_on_a_push_connection_naming_another_recipient_is_refused(
    broker: Broker, redis: aioredis.Redis, prefix: str
) -> None:
    """PROTOCOL.md 7: `recipient=` narrows an answer to that recipient; on the push
    connection of another it settles nothing."""
    app = "named"
    rec = FakeRecipient(app, "r1", lambda f: "ack-as-other")
    await rec.start()
    assert (await register(broker.server.port, rec))["status"] == "ack"
    await produce(broker.server.port, app, {"m": b"x"})
    await rec.next_push()

    async def answered() -> bool:
        return bool(rec.resps)

    await eventually(answered)
    assert rec.resps[0].fields.get("msgid") == "m"
    assert b"reject" in (rec.resps[0].content or b"") and b"'other'" in (
        rec.resps[0].content or b""
    )
    assert await in_flight(broker, app, "m")
    await rec.stop()


async def test_a_late_ack_from_the_recipients_host_settles_only_its_own_copy(
    broker: Broker, redis: aioredis.Redis, prefix: str
) -> None:
    """Topic copies to recipients on two hosts: an ack with only the msgid, from r1's host,
    settles r1's copy and never r2's; from a third host it settles nothing."""
    app = "copies"
    r1 = FakeRecipient(app, "r1", lambda f: "silent")
    r2 = FakeRecipient(app, "r2", lambda f: "silent", host="127.0.0.3")
    await r1.start()
    await r2.start()
    assert (await register(broker.server.port, r1))["status"] == "ack"
    reader, writer = await asyncio.open_connection(
        "127.0.0.1", broker.server.port, local_addr=("127.0.0.3", 0)
    )
    client = RawClient(reader, writer)
    assert (await client.request("register", r2.registration()))["status"] == "ack"
    await client.close()
    await produce(broker.server.port, app, {"t": b"x"}, topic="1")
    await r1.next_push()
    await r2.next_push()
    resp = await answer_from(broker.server.port, "127.0.0.4", "ack", msgid="t", appid=app)
    assert resp["status"] == "reject"
    resp = await answer_from(broker.server.port, "127.0.0.1", "ack", msgid="t", appid=app)
    assert resp["status"] == "ack", resp
    assert not await in_flight(broker, app, "t", "r1")
    assert await in_flight(broker, app, "t", "r2")
    await r1.stop()
    await r2.stop()


# -- PUSH_WINDOW for topics; content an original peer cannot read ----------------------


async def test_topic_delivery_honours_push_window(make_broker: BrokerFactory) -> None:
    broker = await make_broker(push_window=4, ack_timeout=60)
    app = "tw"
    slow = FakeRecipient(app, "slow", lambda f: "silent")
    fast = FakeRecipient(app, "fast")
    await slow.start()
    await fast.start()
    for rec in (slow, fast):
        assert (await register(broker.server.port, rec))["status"] == "ack"
    await produce(broker.server.port, app, {f"t{i}": b"x" for i in range(40)}, topic="1")
    got = {(await fast.next_push()).fields["msgid"] for _ in range(40)}
    assert len(got) == 40
    assert len(slow.received) <= 4
    link = broker.engine.links[(app, "slow")]
    assert len(link.inflight) <= 4
    await slow.stop()
    await fast.stop()


async def test_cr_lf_content_goes_to_a_capable_recipient_or_the_dead_letter_queue(
    broker: Broker, redis: aioredis.Redis, prefix: str
) -> None:
    app = "crlf"
    legacy = FakeRecipient(app, "legacy", caps=())
    await legacy.start()
    assert (await register(broker.server.port, legacy))["status"] == "ack"
    plain = {f"p{i}": f"plain {i}".encode() for i in range(100)}
    await produce(broker.server.port, app, {f"c{i}": b"two\r\nlines" for i in range(5)} | plain)
    got = {(await legacy.next_push()).fields["msgid"] for _ in range(100)}
    assert got == set(plain)
    base = f"{prefix}:{{{app}}}:"
    await eventually(lambda: dead_count(redis, base, 5))
    dead = await broker.store.dead_letters(app)
    assert {d.msgid for d in dead} == {f"c{i}" for i in range(5)}
    assert all("length capability" in d.last_error for d in dead)
    assert all(b"length=" not in f.content for f in legacy.received if f.content)
    # with a capable recipient there, such content goes to it instead
    capable = FakeRecipient(app, "capable")
    await capable.start()
    assert (await register(broker.server.port, capable))["status"] == "ack"
    await produce(broker.server.port, app, {"c-late": b"two\r\nlines"})
    push = await capable.next_push()
    assert (push.fields["msgid"], push.content) == ("c-late", b"two\r\nlines")
    await legacy.stop()
    await capable.stop()


async def dead_count(redis: aioredis.Redis, base: str, n: int) -> bool:
    return int(await redis.zcard(base + "dead")) == n


async def test_an_original_peer_that_goes_silent_is_cut_off_and_its_push_retried(
    make_broker: BrokerFactory,
) -> None:
    """No caps: one push a connection; a push with no answer at all within
    LEGACY_ANSWER_TIMEOUT closes that connection (never reused) and counts an attempt."""
    broker = await make_broker(legacy_answer_timeout=0.3, ack_timeout=30)
    app = "mute"
    answers = iter(["silent", "ack"])
    rec = FakeRecipient(app, "go", lambda f: next(answers), caps=())
    await rec.start()
    assert (await register(broker.server.port, rec))["status"] == "ack"
    await produce(broker.server.port, app, {"m": b"x"})
    first: Frame = await rec.next_push()
    second: Frame = await rec.next_push(WAIT)
    assert first.fields["msgid"] == second.fields["msgid"] == "m"
    assert rec.connections >= 2  # the silent connection was not reused
    await eventually(lambda: settled(broker, app))
    await rec.stop()


async def settled(broker: Broker, app: str) -> bool:
    counts = await broker.store.counts([app], 0)
    c = counts[app]
    return (c.pending, c.delayed, c.in_flight, c.dead) == (0, 0, 0, 0)


async def test_a_recipient_flooding_answers_it_does_not_read_is_cut_off(
    make_broker: BrokerFactory,
) -> None:
    """A registered recipient streams answers on its push connection and never reads the
    broker's: it is read only while MAX_UNANSWERED_FRAMES of them wait (each unknown msgid
    costs a look in the store), and cut off once MAX_WRITE_BUFFER_BYTES of answers wait
    unread, while producers go on being answered."""
    broker = await make_broker(max_unanswered_frames=16, max_write_buffer_bytes=1024)
    app, rid = "flood", "r1"
    pushed = asyncio.get_running_loop().create_future()
    peak = 0

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        decoder = Decoder()
        while not pushed.done() and (data := await reader.read(65536)):
            for frame in decoder.feed(data):
                if isinstance(frame, Frame) and frame.type == "ping":
                    writer.write(PONG)
                elif isinstance(frame, Frame) and frame.type == "push":
                    pushed.set_result(frame.fields["msgid"])
        flood = b"".join(b"type=ack\r\nmsgid=nx%d\r\n\r\n" % i for i in range(20_000))
        writer.write(flood)  # and never read again
        await writer.drain()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    server.sockets[0].setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    port = server.sockets[0].getsockname()[1]
    try:
        await register_at(broker.server.port, app, rid, port)
        await produce(broker.server.port, app, {"m1": b"x"})
        assert await asyncio.wait_for(pushed, WAIT) == "m1"
        link = broker.engine.pusher.links[(app, rid)]

        async def cut_off() -> bool:
            nonlocal peak
            peak = max([peak, *(c.unanswered for c in link.connections)])
            return not link.connections

        await eventually(cut_off)
        assert peak <= 16  # the connection was read no faster than its answers went out
        await produce(broker.server.port, "other", {"still": b"y"})
    finally:
        server.close()


async def test_answers_on_a_push_connection_are_answered_in_order(
    make_broker: BrokerFactory,
) -> None:
    """docs/PROTOCOL.md 6.1: each answer frame gets its `resp`, in order, although an
    unknown msgid costs a look in the store, an ack its finish, and a refusal nothing."""
    broker = await make_broker()
    app, rid = "order", "r1"
    resps: asyncio.Queue[Frame] = asyncio.Queue()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        decoder = Decoder()
        while data := await reader.read(65536):
            for frame in decoder.feed(data):
                assert isinstance(frame, Frame)
                if frame.type == "ping":
                    writer.write(PONG)
                elif frame.type == "push":
                    writer.write(
                        b"type=ack\r\nmsgid=unknown\r\n\r\n"
                        b"type=ack\r\nmsgid=" + frame.fields["msgid"].encode() + b"\r\n\r\n"
                        b"type=ack\r\nmsgid=named\r\nrecipient=other\r\n\r\n"
                    )
                elif frame.type == "resp":
                    resps.put_nowait(frame)

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        await register_at(broker.server.port, app, rid, port)
        await produce(broker.server.port, app, {"m1": b"x"})
        got = [await asyncio.wait_for(resps.get(), WAIT) for _ in range(3)]
        assert [r.fields.get("msgid") for r in got] == ["unknown", "m1", "named"]
        assert [json.loads(r.content or b"")["status"] for r in got] == ["reject", "ack", "reject"]
    finally:
        server.close()


# -- answers naming no app ---------------------------------------------------------------


async def register_from(port: int, rec: FakeRecipient) -> None:
    """Register rec from its own host (a connection from that source address)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(rec.host, 0))
    client = RawClient(reader, writer)
    try:
        assert (await client.request("register", rec.registration()))["status"] == "ack"
    finally:
        await client.close()


@pytest.mark.parametrize("answered_at", ["pusher", "other broker"])
async def test_an_answer_naming_no_app_settles_the_one_app_it_fits_or_none(
    make_broker: BrokerFactory, redis: aioredis.Redis, prefix: str, answered_at: str
) -> None:
    """One msgid in flight in two apps (their msgids are their own): an answer with only
    the msgid settles the delivery of the app whose recipient is on the sender's host,
    whether the broker it reaches pushed it or must search every app; from a host with
    recipients in both it is ambiguous and settles nothing."""
    broker = await make_broker()
    other = await make_broker() if answered_at == "other broker" else broker
    a1 = FakeRecipient("same-a", "r", lambda f: "silent", host="127.0.0.5")
    a2 = FakeRecipient("same-b", "r", lambda f: "silent", host="127.0.0.6")
    a3 = FakeRecipient("same-c", "r", lambda f: "silent", host="127.0.0.5")
    for rec in (a1, a2, a3):
        await rec.start()
        await register_from(broker.server.port, rec)
        await produce(broker.server.port, rec.app, {"SAME": b"x"})
        await rec.next_push()

    async def known() -> bool:  # the other broker's registry is refreshed from the store
        return all(other.engine.registry.get(r.app, r.rid) for r in (a1, a2, a3))

    await eventually(known)
    resp = await answer_from(other.server.port, "127.0.0.6", "ack", msgid="SAME")
    assert resp["status"] == "ack", resp
    assert not await in_flight(broker, "same-b", "SAME")
    resp = await answer_from(other.server.port, "127.0.0.5", "ack", msgid="SAME")
    assert resp["status"] == "reject" and "ambiguous" in str(resp["content"]), resp
    for app in ("same-a", "same-c"):
        assert await in_flight(broker, app, "SAME")
    for rec in (a1, a2, a3):
        await rec.stop()


async def test_answers_naming_no_app_beyond_max_searches_per_host_are_refused_at_once(
    make_broker: BrokerFactory,
) -> None:
    """Answers that need a search of every app: MAX_SEARCHES_PER_HOST of one host wait
    for it, the rest are refused at once; a host's answers naming their app need none."""
    broker = await make_broker(max_searches_per_host=2)
    await produce(broker.server.port, "searched", {"held": b"x"})
    reader, writer = await asyncio.open_connection(
        "127.0.0.1", broker.server.port, local_addr=(ATTACKER, 0)
    )
    client = RawClient(reader, writer)
    frames = [encode_frame("ack", {"msgid": f"unknown-{i}"}, None) for i in range(5)]
    frames.append(encode_frame("ack", {"msgid": "unknown", "appid": "searched"}, None))
    client.send_raw(b"".join(frames))  # one write: all are handled before a search answers
    resps = [await client.resp() for _ in range(6)]
    await client.close()
    assert [r["status"] for r in resps] == ["reject"] * 6
    contents = [str(r["content"]) for r in resps]
    assert all("is not in flight" in c for c in (*contents[:2], contents[5])), contents
    assert all("MAX_SEARCHES_PER_HOST (2)" in c for c in contents[2:5]), contents
