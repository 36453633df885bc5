"""The broker core over raw TCP, as SPEC sections 1-2 describe it."""

from __future__ import annotations

import asyncio
import json
import socket

import redis.asyncio as aioredis

from skmq.broker import Broker
from skmq.clock import now_ms
from skmq.store import Waiting
from tests.conftest import BrokerFactory
from tests.peers import RawClient


async def waiting(broker: Broker, app: str) -> dict[str, Waiting]:
    """The app's messages waiting, by msgid, as an operator's peek shows them."""
    return {w.msgid: w for w in await broker.store.peek(app, 100, now_ms())}


async def test_queue_and_topic_are_stored_and_acked(broker: Broker) -> None:
    client = await RawClient.connect(broker.server.port)
    q = await client.request("queue", b"hello", appid="app1", msgid="m1")
    t = await client.request("topic", b"news", appid="app1", msgid="m2")
    assert (q["status"], q["content"], q["msgid"]) == ("ack", "stored", "m1")
    assert (t["status"], t["msgid"]) == ("ack", "m2")
    stored = await waiting(broker, "app1")
    assert {msgid: w.preview for msgid, w in stored.items()} == {"m1": b"hello", "m2": b"news"}
    await client.close()


async def test_duplicate_msgid_is_recognised(broker: Broker) -> None:
    client = await RawClient.connect(broker.server.port)
    first = await client.request("queue", b"x", appid="a", msgid="dup")
    second = await client.request("queue", b"y", appid="a", msgid="dup")
    assert first["content"] == "stored"
    assert second["status"] == "ack" and "duplicate" in second["content"]
    await client.close()


async def test_broker_generates_a_msgid_when_none_is_given(broker: Broker) -> None:
    client = await RawClient.connect(broker.server.port)
    a = await client.request("queue", b"x", appid="a")
    b = await client.request("queue", b"x", appid="a")
    assert a["status"] == b["status"] == "ack"
    assert a["msgid"] and b["msgid"] and a["msgid"] != b["msgid"]
    await client.close()


async def test_msgid_cannot_collide_with_broker_keys(broker: Broker) -> None:
    client = await RawClient.connect(broker.server.port)
    # the app's keys (log, inbox ...; and those an earlier SKMQ's store held: ready ...)
    evils = ["ready", "inflight", "dead", "delayed", "recipients", "m:x", "{a}", "done:1"]
    evils += ["log", "inbox", "jr", "ckpt", "dl", "dlt", "epoch", "owner", "stats"]
    for evil in evils:
        resp = await client.request("queue", evil.encode(), appid="a", msgid=evil)
        assert resp["content"] == "stored", evil
    stored = await waiting(broker, "a")
    assert {msgid: w.preview for msgid, w in stored.items()} == {e: e.encode() for e in evils}
    assert (await broker.store.counts(["a"], now_ms()))["a"].pending == len(evils)
    await client.close()


async def test_original_doubled_terminator_and_arbitrary_chunks(broker: Broker) -> None:
    client = await RawClient.connect(broker.server.port)
    stream = b"".join(
        f"appid=a\r\nmsgid=c{i}\r\ntype=queue\r\ncontent=body {i}\r\n\r\n\r\n\r\n".encode()
        for i in range(20)
    )
    for i in range(0, len(stream), 7):
        client.send_raw(stream[i : i + 7])
        await client.writer.drain()
    answers = [await client.resp() for _ in range(20)]
    assert [a["msgid"] for a in answers] == [f"c{i}" for i in range(20)]
    assert all(a["status"] == "ack" for a in answers)
    await client.close()


async def test_answers_come_in_frame_order(broker: Broker) -> None:
    client = await RawClient.connect(broker.server.port)
    frames = []
    for i in range(300):
        if i % 3 == 0:
            frames.append(b"ping\r\n\r\n")
        elif i % 3 == 1:
            frames.append(f"appid=a\r\nmsgid=o{i}\r\ntype=queue\r\ncontent=x\r\n\r\n".encode())
        else:
            frames.append(f"msgid=o{i}\r\ntype=queue\r\ncontent=no app\r\n\r\n".encode())
    client.send_raw(b"".join(frames))
    for i in range(300):
        frame = await client.recv()
        if i % 3 == 0:
            assert frame.type == "pong"
        else:
            body = json.loads(frame.content or b"")
            assert frame.fields["msgid"] == f"o{i}"
            assert body["status"] == ("ack" if i % 3 == 1 else "error")
    await client.close()


async def test_ping_is_answered_pong(broker: Broker) -> None:
    client = await RawClient.connect(broker.server.port)
    client.send_raw(b"ping\r\n\r\n")
    assert (await client.recv()).type == "pong"
    await client.close()


async def test_malformed_inputs_get_error_and_connection_goes_on(broker: Broker) -> None:
    client = await RawClient.connect(broker.server.port)
    bad = [
        b"garbage line\r\n\r\n",  # a line without '='
        b"=novalue\r\n\r\n",  # empty key
        b"msgid=x\r\ncontent=no type\r\n\r\n",  # no type
        b"type=bogus\r\nmsgid=x\r\n\r\n",  # unknown type
        b"type=queue\r\nmsgid=x\r\ncontent=no app\r\n\r\n",  # appid missing
        b"type=queue\r\nappid=a\r\nmsgid=x\r\n\r\n",  # content missing
        b"type=queue\r\nappid=a\r\ndelay=soon\r\ncontent=x\r\n\r\n",  # delay not a number
        "type=queue\r\nappid=a\r\ndelay=\u0661\u0662\r\ncontent=x\r\n\r\n".encode(),  # not ASCII
        b"type=queue\r\nappid=a\r\nttl=1_000\r\ncontent=x\r\n\r\n",
        b'type=register\r\ncontent={"id":"r","app_id":"a","host":"127.0.0.1","port":"'
        + "\uff15\uff16\uff11".encode()  # fullwidth digits
        + b'"}\r\n\r\n',
        b"type=queue\r\nappid=a\r\nmsgid=\x01bad\r\ncontent=x\r\n\r\n",  # control char in msgid
        "type=queue\r\nappid=a\r\nmsgid=m\u0085x\r\ncontent=x\r\n\r\n".encode(),  # C1 control
        "type=queue\r\nappid=a\u2028b\r\nmsgid=m\r\ncontent=x\r\n\r\n".encode(),  # line sep.
        b"type=queue\r\nappid=a\r\nmsgid=" + b"l" * 300 + b"\r\ncontent=x\r\n\r\n",  # too long
        b"type=register\r\ncontent=not json\r\n\r\n",
        b"type=ack\r\n\r\n",  # ack without msgid
        b"type=pull\r\ngroup=g\r\nop=receive\r\ncontent={}\r\n\r\n",  # appid missing
        b"type=ack\r\nmsgid=never-seen\r\n\r\n",
    ]
    for frame in bad:
        client.send_raw(frame)
        resp = await client.resp()
        assert resp["status"] in ("error", "reject"), (frame, resp)
        assert resp["content"], frame
    for kind in ("ack", "reject", "error", "arrived", "extend"):  # docs/PROTOCOL.md 7
        resp = await client.request(kind)
        assert (resp["status"], resp["content"]) == ("error", "msgid required"), kind
    ok = await client.request("queue", b"still fine", appid="a", msgid="after")
    assert ok["status"] == "ack"
    await client.close()


async def test_unknown_keys_are_ignored(broker: Broker) -> None:
    client = await RawClient.connect(broker.server.port)
    resp = await client.request("queue", b"x", appid="a", msgid="u1", colour="blue")
    assert resp["status"] == "ack"
    await client.close()


async def test_binary_content_with_length(broker: Broker) -> None:
    client = await RawClient.connect(broker.server.port)
    body = b"line1\r\n\r\nline2\nend\r"
    resp = await client.request("queue", body, appid="a", msgid="bin")
    assert resp["status"] == "ack"
    (stored,) = (await waiting(broker, "a")).values()
    assert (stored.msgid, stored.size, stored.preview) == ("bin", len(body), body)
    await client.close()


async def test_oversized_frame_gets_error_then_close(broker: Broker) -> None:
    client = await RawClient.connect(broker.server.port)
    client.send_raw(b"type=queue\r\nappid=a\r\ncontent=" + b"x" * 70_000 + b"\r\n\r\n")
    resp = await client.resp()
    assert resp["status"] == "error" and "refused" in resp["content"]
    assert await client.closed()


async def test_a_peer_that_sends_all_before_it_reads_gets_the_error_not_a_reset(
    broker: Broker,
) -> None:
    """Closing with the rest of a 4 MB frame unread would reset the connection, and the
    reset would take the answer with it: the broker drops what follows, then closes."""
    loop = asyncio.get_running_loop()
    with socket.create_connection(("127.0.0.1", broker.server.port)) as sock:
        sock.setblocking(False)
        frame = b"type=queue\r\nappid=a\r\ncontent=" + b"x" * (4 << 20) + b"\r\n\r\n"
        await asyncio.wait_for(loop.sock_sendall(sock, frame), 30)
        sock.shutdown(socket.SHUT_WR)
        got = b""
        while chunk := await asyncio.wait_for(loop.sock_recv(sock, 65536), 30):
            got += chunk
    assert got.startswith(b"type=resp\r\n") and b'"status":"error"' in got, got


async def test_overlong_header_line_gets_error_then_close(make_broker: BrokerFactory) -> None:
    broker = await make_broker(max_line_bytes=128)
    client = await RawClient.connect(broker.server.port)
    client.send_raw(b"type=queue\r\nappid=" + b"a" * 200)
    resp = await client.resp()
    assert resp["status"] == "error"
    assert await client.closed()


async def test_a_frame_with_bare_lf_line_endings_gets_an_error_naming_crlf_then_close(
    make_broker: BrokerFactory,
) -> None:
    """`queue\\nappid=...\\n\\n` never ends a frame: refused as soon as its first line
    ends (not at FRAME_TIMEOUT), after the frames before it, and the connection closed as
    for a frame over a limit (docs/PROTOCOL.md, section 1)."""
    broker = await make_broker(frame_timeout=60.0)
    client = await RawClient.connect(broker.server.port)
    client.send_raw(
        b"type=queue\r\nappid=lf\r\nmsgid=before\r\ncontent=x\r\n\r\n"
        b"type=queue\nappid=lf\nmsgid=bare\ncontent=y\n\n"
    )
    first = await client.resp(timeout=10)
    assert (first["status"], first["msgid"]) == ("ack", "before")
    refused = await client.resp(timeout=10)
    assert refused["status"] == "error"
    assert refused["content"] == (
        "frame refused, closing: bare LF in a header line: lines end with CRLF, "
        "a frame with CRLF CRLF"
    )
    assert await client.closed(timeout=10)
    await client.close()
    assert list(await waiting(broker, "lf")) == ["before"]


async def test_frames_before_an_oversized_one_are_answered(broker: Broker) -> None:
    client = await RawClient.connect(broker.server.port)
    client.send_raw(
        b"type=queue\r\nappid=a\r\nmsgid=before\r\ncontent=x\r\n\r\n"
        b"type=queue\r\nappid=a\r\ncontent=" + b"x" * 70_000 + b"\r\n\r\n"
    )
    first = await client.resp()
    assert (first["status"], first["msgid"]) == ("ack", "before")
    assert (await client.resp())["status"] == "error"
    assert await client.closed()


async def test_half_closed_peer_still_gets_its_answers(broker: Broker) -> None:
    client = await RawClient.connect(broker.server.port)
    client.send_raw(b"type=queue\r\nappid=a\r\nmsgid=hc\r\ncontent=x\r\n\r\n")
    client.writer.write_eof()
    resp = await client.resp()
    assert resp["status"] == "ack"
    assert await client.closed()


async def test_delayed_message_is_stored_delayed(broker: Broker) -> None:
    client = await RawClient.connect(broker.server.port)
    sent = now_ms()
    assert (await client.request("queue", b"x", appid="a", msgid="d1", delay="60000"))[
        "status"
    ] == "ack"
    (stored,) = (await waiting(broker, "a")).values()
    assert stored.msgid == "d1"
    assert sent + 60_000 <= stored.due_ms <= now_ms() + 60_000
    c = (await broker.store.counts(["a"], now_ms()))["a"]
    assert (c.pending, c.delayed) == (0, 1)
    await client.close()


async def test_register_and_unregister(broker: Broker, redis: aioredis.Redis) -> None:
    client = await RawClient.connect(broker.server.port)
    reg = {"id": "r1", "app_id": "a", "host": "127.0.0.1", "port": "9001", "weight": 2}
    resp = await client.request("register", json.dumps(reg).encode())
    assert resp["status"] == "ack"
    stored = json.loads(await redis.hget(f"{broker.store.base('a')}recipients", "r1"))
    assert (stored["port"], stored["weight"]) == (9001, 2)
    resp = await client.request("unregister", json.dumps({"id": "r1", "app_id": "a"}).encode())
    assert resp["status"] == "ack"
    assert await redis.hget(f"{broker.store.base('a')}recipients", "r1") is None
    await client.close()


async def test_register_refuses_addresses_outside_the_allowlist(make_broker: BrokerFactory) -> None:
    broker = await make_broker(recipient_networks=["10.9.0.0/16"])
    client = await RawClient.connect(broker.server.port)
    for host, status in (("8.8.8.8", "reject"), ("example.com", "reject"),
                         ("10.9.1.2", "ack"), ("127.0.0.2", "ack"), ("", "ack")):  # fmt: skip
        reg = {"id": f"r-{host}", "app_id": "a", "host": host, "port": 9001}
        resp = await client.request("register", json.dumps(reg).encode())
        assert resp["status"] == status, (host, resp)
    await client.close()


async def test_too_many_connections(make_broker: BrokerFactory) -> None:
    broker = await make_broker(max_connections=2)
    first = await RawClient.connect(broker.server.port)
    second = await RawClient.connect(broker.server.port)
    assert (await first.request("queue", b"x", appid="a"))["status"] == "ack"
    assert (await second.request("queue", b"x", appid="a"))["status"] == "ack"
    third = await RawClient.connect(broker.server.port)
    resp = await third.resp()
    assert resp["status"] == "error" and "too many" in resp["content"]
    assert await third.closed()
    await first.close()
    await second.close()


async def test_idle_connection_is_closed(make_broker: BrokerFactory) -> None:
    broker = await make_broker(idle_timeout=0.3)
    client = await RawClient.connect(broker.server.port)
    assert await client.closed(timeout=5)


async def test_a_long_poll_longer_than_idle_timeout_is_answered_not_closed(
    make_broker: BrokerFactory,
) -> None:
    """A connection waiting for the broker's answer (a `pull` receive's wait) is not
    silent: the receive is answered at its wait's end, then the connection is idle."""
    broker = await make_broker(idle_timeout=0.3)
    client = await RawClient.connect(broker.server.port)
    group = {"appid": "idle", "group": "g"}
    assert (await client.request("pull", b"", op="create", **group))["status"] == "ack"
    got = await client.request("pull", b'{"wait": 1.5}', op="receive", **group)
    assert (got["status"], json.loads(got["content"])) == ("ack", {"messages": []})
    assert await client.closed(timeout=5)


async def test_ingest_rate_limit_slows_without_dropping(make_broker: BrokerFactory) -> None:
    broker = await make_broker(rate=200)
    client = await RawClient.connect(broker.server.port)
    n = 400
    loop = asyncio.get_running_loop()
    start = loop.time()
    client.send_raw(
        b"".join(
            f"appid=a\r\nmsgid=r{i}\r\ntype=queue\r\ncontent=x\r\n\r\n".encode() for i in range(n)
        )
    )
    answers = [await client.resp() for _ in range(n)]
    elapsed = loop.time() - start
    assert all(a["status"] == "ack" for a in answers)
    # 400 frames at 200/s with a burst of 200: at least ~1 s of backpressure.
    assert elapsed >= 0.8
    await client.close()
