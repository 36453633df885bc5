"""The operator's console (issue 39): `skmq apps`, `peek` and `purge`, and their HTTP
routes, against a real Redis and a real broker with traffic."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from skmq.store import AliveRecipient, NewMessage, Retries, Store

T0 = 1_700_000_000_000


@pytest.fixture
async def store(redis: aioredis.Redis, prefix: str) -> AsyncIterator[Store]:
    client = aioredis.Redis(connection_pool=redis.connection_pool)
    yield Store(client, prefix, retries=Retries(times=1))


async def test_scratch(store: Store) -> None:
    now = T0
    s = store
    await s.store({"a": [NewMessage(f"m{i}", "queue", b"hi\x00\n" + bytes([i])*100, key="k" if i%2 else "") for i in range(6)]}, now)
    await s.store({"a": [NewMessage("late", "queue", b"later", deliver_at=now+10_000)]}, now+5)
    await s.store({"a": [NewMessage("t1", "topic", b"topic")]}, now+6)
    for w in await s.peek("a", 100, now + 10):
        print(w)
    print(await s.oldest_pending(["a", "none"], now+10))
    print(await s.purge_waiting("a", None, 3, True, now+10))
    print(await s.purge_waiting("a", None, 3, False, now+10))
    for w in await s.peek("a", 100, now + 10):
        print(w)
    print(await s.counts(["a"], now+10))
    print(await s.purge_waiting("a", 5, None, False, now+10))
    print([w.msgid for w in await s.peek("a", 100, now + 10)])
    print(await s.purge_waiting("a", None, None, False, now+10))
    print(await s.counts(["a"], now+10), await s.redis.keys(s.prefix + "*"))
