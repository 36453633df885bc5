"""The store's Redis connections pack commands with hiredis (issue 19): byte for byte what
redis-py's own packer sends, raw-byte app ids included, and its refusals."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from redis.asyncio.connection import Connection
from redis.exceptions import DataError

from skmq.store import connect_redis
from skmq.store.client import QuickPool, _HiredisPacking, hiredis_packing

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


async def test_the_pool_under_contention_and_after_a_disconnect(redis_url: str) -> None:
    """QuickPool: more callers than connections all get theirs (the waiters through
    redis-py's way), and an idle connection that was closed is not lent as it is."""
    client = connect_redis(redis_url, pool_size=2)
    pool = client.connection_pool
    assert isinstance(pool, QuickPool)
    results = await asyncio.gather(*(client.echo(f"m{i}") for i in range(50)))
    assert results == [f"m{i}".encode() for i in range(50)]
    assert not pool._in_use_connections and len(pool._available_connections) == 2
    for conn in pool._available_connections:
        await conn.disconnect()
    assert await asyncio.gather(client.echo("a"), client.echo("b")) == [b"a", b"b"]
    await client.aclose()
