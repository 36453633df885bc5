"""Delivery metadata on pushes, retry jitter and lease extension (issue 17), over real
brokers and a real Redis."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from skmq.broker import Broker
from skmq.store import Failed, NewMessage, Store
from tests.conftest import BrokerFactory
from tests.peers import FakeRecipient
from tests.test_delivery import base, produce, registered
from tests.test_lifecycle import APP, NOW, alive

# --------------------------------------------------------------------------- metadata


async def test_pushes_carry_attempt_and_stored_at(broker: Broker, redis: aioredis.Redis) -> None:
    app = "meta"
    answers = iter(["reject", "ack"])
    rec = await FakeRecipient(app, "r", lambda f: next(answers)).start()
    await registered(broker.server.port, rec)
    await produce(broker.server.port, app, ["m"])
    stored = int((await redis.hget(base(broker, app) + "msgs", "m"))[1:14])
    first, second = await rec.next_push(), await rec.next_push()
    assert (first.fields["attempt"], second.fields["attempt"]) == ("1", "2")
    assert first.fields["stored_at"] == second.fields["stored_at"] == str(stored)


async def test_original_peers_get_no_metadata(broker: Broker) -> None:
    app = "plain"
    rec = await FakeRecipient(app, "r", caps=()).start()
    await registered(broker.server.port, rec)
    await produce(broker.server.port, app, ["m"])
    push = await rec.next_push()
    assert set(push.fields) == {"appid", "msgid"}


# --------------------------------------------------------------------------- jitter


@pytest.fixture
async def client(redis: aioredis.Redis) -> AsyncIterator[aioredis.Redis]:
    yield aioredis.Redis(connection_pool=redis.connection_pool)


async def failed_dues(store: Store, n: int) -> list[int]:
    msgids = [f"j{i}" for i in range(n)]
    await store.store({APP: [NewMessage(m, "queue", b"x") for m in msgids]}, NOW)
    got, _, _ = await store.claim(APP, NOW, n, alive("r1", free=n), ["r1"] * n)
    assert len(got) == n
    results = await store.fail(APP, [(m, "rejected", "", "r1", 1) for m in msgids], NOW)
    assert {r.code for r in results} == {Failed.RETRY}
    return [r.due - NOW for r in results]


async def test_retry_waits_spread_by_the_jitter(client: aioredis.Redis, prefix: str) -> None:
    store = Store(client, prefix, backoff=[10.0], retry_jitter=0.5)
    waits = await failed_dues(store, 40)
    assert all(5_000 <= w <= 15_000 for w in waits), waits
    assert len(set(waits)) == 40  # a burst of failures does not come back in lockstep
    assert min(waits) < 7_500 and max(waits) > 12_500


async def test_no_jitter_waits_exactly_the_backoff(client: aioredis.Redis, prefix: str) -> None:
    store = Store(client, prefix, backoff=[10.0], retry_jitter=0.0)
    assert set(await failed_dues(store, 5)) == {10_000}


async def test_the_broker_applies_retry_jitter(make_broker: BrokerFactory) -> None:
    broker = await make_broker(retry_backoff=[10.0], retry_jitter=1.0)
    assert broker.store.retry_jitter == 1.0
