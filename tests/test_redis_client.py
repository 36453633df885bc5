"""The store's Redis connections pack commands with hiredis (issue 19): byte for byte what
redis-py's own packer sends, raw-byte app ids included, and its refusals."""

from __future__ import annotations

from typing import Any

import pytest
from redis.asyncio.connection import Connection
from redis.exceptions import DataError

from skmq.store import connect_redis
from skmq.store.client import hiredis_packing

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
    assert client.connection_pool.connection_class is hiredis_packing(Connection)
    await client.set("skmq-test:{\udcff}", b"v")
    assert await client.get("skmq-test:{\udcff}") == b"v"
    assert await client.execute_command("CONFIG GET", "maxmemory-policy")
    await client.aclose()
