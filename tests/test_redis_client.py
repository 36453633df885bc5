"""The store's Redis connections pack commands with hiredis (issue 19): byte for byte what
redis-py's own packer sends, raw-byte app ids included, and its refusals."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from redis.asyncio.connection import Connection
from redis.exceptions import DataError, NoScriptError, ResponseError

from skmq.store import connect_redis
from skmq.store.client import _HiredisPacking, hiredis_packing
from skmq.store.multiplex import multiplexed

ARGS: list[tuple[Any, ...]] = [
    ("EVALSHA", b"abc", 2, "k1", "k2", 1.5, -3, b"\x00\r\n"),
    ("CONFIG GET", "maxmemory"),
    (b"CLIENT SETINFO", b"LIB-NAME", "x"),
    ("HSET", "skmq:{caf\udcc3}:msgs", "m1", "é" * 3),  # an app id of raw bytes
    ("SET", "big", b"x" * 70_000),
]


@pytest.mark.parametrize("args", ARGS)
def test_packed_as_redis_py_packs_it(args: tuple[Any, ...]) -> None:
    plain = Connection(encoding_errors="surrogateescape")
    fast = hiredis_packing(Connection)(encoding_errors="surrogateescape")
    assert b"".join(fast.pack_command(*args)) == b"".join(plain.pack_command(*args))


def test_what_redis_py_refuses_is_refused() -> None:
    fast = hiredis_packing(Connection)()
    with pytest.raises(DataError):
        fast.pack_command("SET", "k", None)


async def test_the_store_talks_through_it(redis_url: str) -> None:
    client = connect_redis(redis_url)
    assert issubclass(client.connection_pool.connection_class, _HiredisPacking)
    await client.set("skmq-test:{\udcff}", b"v")
    assert await client.get("skmq-test:{\udcff}") == b"v"
    assert await client.execute_command("CONFIG GET", "maxmemory-policy")
    await client.aclose()


async def test_the_pool_under_contention_and_after_redis_closed_its_connections(
    redis_url: str,
) -> None:
    """More callers than connections all get theirs (waiting for one), and connections
    Redis closed meanwhile are made again (redis-py's BlockingConnectionPool: its public
    API only, no private attributes of redis-py's)."""
    client = connect_redis(redis_url, pool_size=2)
    results = await asyncio.gather(*(client.echo(f"m{i}") for i in range(50)))
    assert results == [f"m{i}".encode() for i in range(50)]
    ids = set(await asyncio.gather(*(client.client_id() for _ in range(4))))
    assert len(ids) == 2  # (both connections made)
    killer = connect_redis(redis_url, pool_size=1)
    for client_id in ids:  # (Redis closes them: a restart, a timeout, an operator)
        assert await killer.client_kill_filter(_id=client_id) == 1
    await killer.aclose()
    assert await asyncio.gather(client.echo("a"), client.echo("b")) == [b"a", b"b"]
    await client.aclose()


async def test_an_error_reply_is_redis_pys_exception_for_it(redis_url: str) -> None:
    """The store's multiplexed connection gives an error reply the class redis-py's parser
    would (a script to load again: NoScriptError), the message after its code."""
    client = connect_redis(redis_url)
    lane = multiplexed(client)
    assert lane is not None
    replies = await lane.pipeline([("EVALSHA", "0" * 40, 0), ("INCR", "skmq-test:{x}:no", "a")])
    assert isinstance(replies[0], NoScriptError) and str(replies[0]).startswith("No matching")
    assert type(replies[1]) is ResponseError and str(replies[1]).startswith("wrong number")
    lane.close()
    await client.aclose()
