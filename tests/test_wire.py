"""The lean Redis connection (skmq/store/wire.py) against the tests' real Redis."""

from __future__ import annotations

import asyncio
import gc
import socket
from pathlib import Path

import pytest

from skmq.embedded import EmbeddedRedis
from skmq.store.wire import ReplyError, Wire, WireClosed


async def test_calls_pipeline_and_match_replies_in_order(
    redis_server: EmbeddedRedis, prefix: str
) -> None:
    wire = await Wire.connect(redis_server.url)
    try:
        key = f"{prefix}:n"
        replies = await asyncio.gather(*(wire.call("INCR", key) for _ in range(200)))
        assert replies == list(range(1, 201))
        many = await wire.call_many([("SET", key, b"\x00\xffbytes"), ("GET", key), ("DEL", key)])
        assert many == [b"OK", b"\x00\xffbytes", 1]
    finally:
        wire.close()


async def test_an_error_reply_is_raised_or_kept_as_a_value(redis_server: EmbeddedRedis) -> None:
    wire = await Wire.connect(redis_server.url)
    try:
        with pytest.raises(ReplyError) as err:
            await wire.call("EVALSHA", "0" * 40, 0)
        assert err.value.code == "NOSCRIPT"
        replies = await wire.call_many([("NOSUCHCOMMAND",), ("PING",)])
        assert isinstance(replies[0], ReplyError) and replies[1] == b"PONG"
    finally:
        wire.close()


async def test_a_caller_that_stops_waiting_does_not_shift_later_replies(
    redis_server: EmbeddedRedis, prefix: str
) -> None:
    wire = await Wire.connect(redis_server.url)
    try:
        slow = asyncio.ensure_future(wire.call("BLPOP", f"{prefix}:none", 0.2))
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(asyncio.shield(slow), 0.01)
        slow.cancel()
        assert await wire.call("ECHO", "after") == b"after"
    finally:
        wire.close()


async def test_a_wrong_password_is_refused(redis_server: EmbeddedRedis) -> None:
    url = redis_server.url
    host_part = url.rpartition("@")[2]
    with pytest.raises(ReplyError):
        await Wire.connect(f"redis://:wrong@{host_part}")


async def test_a_lost_connection_fails_every_waiting_call() -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    wire = await Wire.connect(f"redis://127.0.0.1:{port}")
    conn, _ = await asyncio.get_running_loop().sock_accept(server)
    pending = asyncio.ensure_future(wire.call("PING"))
    await asyncio.sleep(0)
    conn.close()
    server.close()
    with pytest.raises(WireClosed):
        await asyncio.wait_for(pending, 5)
    with pytest.raises(WireClosed):
        await wire.call("PING")


async def test_a_lost_connection_fails_every_reply_of_a_pipeline_read() -> None:
    """A pipeline of three waiting when the connection closes (here, by us): the call
    raises WireClosed, and no reply's failure is left unread (asyncio said "Future
    exception was never retrieved" for the second and third)."""
    loop = asyncio.get_running_loop()
    unread: list[dict[str, object]] = []
    loop.set_exception_handler(lambda _, context: unread.append(context))
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    wire = await Wire.connect(f"redis://127.0.0.1:{server.getsockname()[1]}")
    conn, _ = await loop.sock_accept(server)
    pending = asyncio.ensure_future(wire.call_many([("PING",), ("PING",), ("PING",)]))
    await asyncio.sleep(0)
    wire.close()
    with pytest.raises(WireClosed, match="closed here"):
        await asyncio.wait_for(pending, 5)
    conn.close()
    server.close()
    del pending
    gc.collect()  # (a future's unread failure is reported as it is collected)
    assert unread == []


async def test_a_server_that_breaks_the_protocol_closes_the_connection() -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    wire = await Wire.connect(f"redis://127.0.0.1:{port}")
    loop = asyncio.get_running_loop()
    conn, _ = await loop.sock_accept(server)
    pending = asyncio.ensure_future(wire.call("PING"))
    await loop.sock_sendall(conn, b"?not resp\r\n")
    with pytest.raises(WireClosed, match="protocol"):
        await asyncio.wait_for(pending, 5)
    conn.close()
    server.close()


async def test_a_read_only_reply_closes_the_wire(tmp_path: Path) -> None:
    """A server that became a replica (a Sentinel failover demotes the old master and
    leaves its clients connected) answers writes READONLY: the Wire closes, so that its
    owners let their apps go and the next connection asks the Sentinels for the master."""
    server = EmbeddedRedis(tmp_path / "r", auth=False)
    server.start()
    try:
        admin = await Wire.connect(server.url)
        wire = await Wire.connect(server.url)
        await admin.call("REPLICAOF", "127.0.0.1", 1)  # (a replica of nobody: read-only)
        with pytest.raises(ReplyError) as refused:
            await wire.call("SET", "k", "v")
        assert refused.value.code == "READONLY"
        assert wire.closed
        admin.close()
    finally:
        server.stop()
