"""The store's multiplexed connection (skmq/store/multiplex.py), on the real Redis by
its unix socket and by TCP: callers' pipelines share it and each gets its own replies;
error replies come back in place; a dropped, stalled or refused connection fails the
calls on it, bounded, and the next call connects again."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from redis.exceptions import AuthenticationError, NoScriptError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from skmq.embedded import EmbeddedRedis
from skmq.store import connect_redis
from skmq.store.multiplex import MultiplexedConnection, _Protocol, multiplexed
from tests.conftest import eventually


@pytest.fixture(params=["unix", "tcp"])
def url(request: pytest.FixtureRequest, redis_server: EmbeddedRedis) -> str:
    return redis_server.url if request.param == "unix" else redis_server.tcp_url


def lane_for(url: str, **options: float) -> MultiplexedConnection:
    lane = multiplexed(connect_redis(url))
    assert lane is not None
    lane.timeout = options.get("timeout", lane.timeout)
    return lane


@pytest.fixture
async def admin(url: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(url)
    yield client
    await client.client_unpause()
    await client.aclose()


async def test_concurrent_callers_each_get_their_replies(url: str) -> None:
    lane = lane_for(url)
    calls = [[("ECHO", f"{i}-{j}") for j in range(i % 5 + 1)] for i in range(300)]
    replies = await asyncio.gather(*(lane.pipeline(c) for c in calls))
    assert replies == [[f"{i}-{j}".encode() for j in range(i % 5 + 1)] for i in range(300)]
    lane.close()


async def test_error_replies_come_back_in_place(url: str) -> None:
    lane = lane_for(url)
    ok, missing, wrong, after = await lane.pipeline(
        [("ECHO", "a"), ("EVALSHA", "0" * 40, 0), ("NOSUCHCOMMAND",), ("ECHO", "\udcff")]
    )
    assert ok == b"a" and after == b"\xff"  # a str UTF-8 cannot encode: surrogateescape
    assert isinstance(missing, NoScriptError)
    assert isinstance(wrong, ResponseError) and "unknown command" in str(wrong)
    lane.close()


async def test_a_dropped_connection_fails_its_calls_and_the_next_connects(
    url: str, admin: aioredis.Redis
) -> None:
    lane = lane_for(url)
    [[own_id]] = [await lane.pipeline([("CLIENT", "ID")])]
    waiting = asyncio.ensure_future(lane.pipeline([("BLPOP", "skmq-test:never", 5)]))
    while not any(
        c["id"] == str(own_id) and c["cmd"] == "blpop" for c in await admin.client_list()
    ):
        await asyncio.sleep(0.01)
    await admin.client_kill_filter(_id=own_id)
    with pytest.raises(RedisConnectionError):
        async with asyncio.timeout(2):
            await waiting
    assert await lane.pipeline([("ECHO", "again")]) == [b"again"]
    lane.close()


async def test_a_stalled_redis_fails_every_waiting_call_within_the_timeout(
    url: str, admin: aioredis.Redis
) -> None:
    lane = lane_for(url, timeout=0.3)
    await lane.pipeline([("PING",)])
    await admin.client_pause(3000)
    loop = asyncio.get_running_loop()
    started = loop.time()
    results = await asyncio.gather(
        *(lane.pipeline([("SET", f"skmq-test:stall{i}", i)]) for i in range(5)),
        return_exceptions=True,
    )
    assert loop.time() - started < 2.0
    assert all(isinstance(r, RedisTimeoutError | RedisConnectionError) for r in results)
    assert any(isinstance(r, RedisTimeoutError) for r in results)
    await admin.client_unpause()
    assert await lane.pipeline([("ECHO", "back")]) == [b"back"]
    lane.close()


async def test_a_wrong_password_is_refused_clearly(redis_server: EmbeddedRedis) -> None:
    lane = lane_for(
        redis_server.tcp_url.replace(redis_server.tcp_url.split("@")[0], "redis://:nope")
    )
    with pytest.raises(AuthenticationError, match=r"(?i)invalid|pass"):
        await lane.pipeline([("PING",)])
    lane.close()


def test_only_one_plain_server_gets_one(url: str) -> None:
    assert multiplexed(connect_redis(url)) is not None
    assert multiplexed(connect_redis("rediss://127.0.0.1:1/0")) is None
    assert multiplexed(connect_redis("redis+sentinel://127.0.0.1:1/skmq")) is None
    assert multiplexed(connect_redis("redis+cluster://127.0.0.1:1")) is None


def lane_protocol(lane: MultiplexedConnection) -> _Protocol:
    """The lane's connection, to hand it a call without awaiting (and so without a turn
    of the loop in which its reply could be read)."""
    assert lane._protocol is not None
    return lane._protocol


async def test_a_closed_connection_fails_its_waiting_calls(url: str) -> None:
    lane = lane_for(url)
    await lane.pipeline([("PING",)])
    waiting = lane_protocol(lane).send([("ECHO", "never")], None)
    lane.close()
    with pytest.raises(RedisConnectionError):
        async with asyncio.timeout(5):
            await waiting


async def test_a_stalled_redis_does_not_keep_what_was_not_written(tmp_path: Path) -> None:
    """A Redis that stops reading (SIGSTOP): what waits in the connection's write buffer
    when its calls time out is dropped with the connection, not kept for a Redis that
    may never read it (the broker's memory while its store is stalled)."""
    with EmbeddedRedis(tmp_path / "stalled") as server:
        lane = lane_for(server.url, timeout=0.3)
        await lane.pipeline([("PING",)])
        protocol = lane._protocol
        assert protocol is not None and protocol.transport is not None
        assert server.proc is not None
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            value = b"x" * (8 << 20)
            with pytest.raises(RedisTimeoutError):
                await lane.pipeline([("SET", f"skmq-test:big{i}", value) for i in range(4)])
            transport = protocol.transport

            async def dropped() -> bool:  # (the transport lets go as it closes)
                return transport.get_write_buffer_size() == 0

            await eventually(dropped)
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        assert await lane.pipeline([("ECHO", "back")]) == [b"back"]
        lane.close()
