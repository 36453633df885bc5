"""A store an earlier SKMQ wrote (the per-transition scripts engine) converted by a broker
of this version when it starts (skmq/queue/migrate.py): every waiting message pushed,
in key order, every dead letter kept with its history, nothing left in the old layout.

The stores in tests/data/legacy_store_{packed,text}.json were written by that engine
(main at eba59f9, through its Store's calls; a 32-hex msgid held packed in the first,
as text in the second), with the clock at NOW:

- app `shop`: acked1 acked; H2 dead after 2 failed attempts (r1, then r2), with a
  traceparent; topic t3 fanned out to r1 and r2, both copies dead; topic t1 fanned out,
  r1's copy acked, r2's in flight; a1, a2, a3 of key k1 (a1 in flight, a2 and a3
  behind it); retry1 waiting for its retry; inflight1 in flight; p1 and H1 pending;
  far delayed to 2100; ttl pending with a TTL run out since; topic t2 not fanned out
  yet; b1 of key k2 delayed to 2100 and b2 behind it;
- app `other`: o1 dead.
"""

from __future__ import annotations

import asyncio
import base64
import json
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from skmq.clock import now_ms
from skmq.embedded_cluster import LocalCluster
from skmq.errors import Misconfigured
from skmq.queue import migrate
from skmq.queue.journal import AppKeys
from skmq.queue.migrate import OLD_KEYS, migrate_store
from skmq.store.engine_mark import mark_key
from skmq.store.msgids import pack
from skmq.store.store import Store
from tests.conftest import BrokerFactory, eventually
from tests.peers import WAIT, FakeRecipient
from tests.test_cluster import cluster, cluster_redis
from tests.test_delivery import log_events, registered, started

__all__ = ["cluster", "cluster_redis"]  # the fixtures, shared with tests/test_cluster.py

DATA = Path(__file__).parent / "data"
NOW = 1_700_000_000_000
H1 = "0123456789abcdef0123456789abcdef"
H2 = "fedcba9876543210fedcba9876543210"
FAR = 4_102_444_800_000
LIVE = 13  # deliveries waiting or in flight in `shop`: each an inbox entry


async def load(redis: aioredis.Redis | RedisCluster, prefix: str, layout: str) -> None:
    """The stored keys, under `prefix`."""
    data = json.loads((DATA / f"legacy_store_{layout}.json").read_text())
    old = data["prefix"].encode() + b":"
    pipe = redis.pipeline(transaction=False)
    for raw_key, (kind, value) in data["keys"].items():
        key = prefix.encode() + b":" + base64.b64decode(raw_key)[len(old) :]
        b = base64.b64decode
        if kind == "string":
            pipe.set(key, b(value))
        elif kind == "hash":
            pipe.hset(key, mapping={b(f): b(v) for f, v in value})
        elif kind == "list":
            pipe.rpush(key, *(b(v) for v in value))
        elif kind == "set":
            pipe.sadd(key, *(b(v) for v in value))
        else:
            assert kind == "zset", kind
            pipe.zadd(key, {b(m): score for m, score in value})
    await pipe.execute()


@pytest.fixture(params=["packed", "text"])
async def legacy(request: pytest.FixtureRequest, redis: aioredis.Redis, prefix: str) -> str:
    await load(redis, prefix, request.param)
    return str(request.param)


async def test_a_broker_converts_a_store_of_an_earlier_version_and_delivers_what_it_held(
    legacy: str, make_broker: BrokerFactory, redis: aioredis.Redis, prefix: str
) -> None:
    recs = [FakeRecipient("shop", rid) for rid in ("r1", "r2")]
    await started(*recs)
    broker = await make_broker()
    assert await redis.get(mark_key(prefix)) == b"owner"
    assert not await redis.exists(f"{prefix}:msgids")
    for app in ("shop", "other"):
        base = AppKeys.of(prefix, app).base
        assert not await redis.exists(*(base + name for name in OLD_KEYS))
    await registered(broker.server.port, *recs)

    # every waiting message pushed, each key's in order, each topic copy to its recipient
    # (t2, not fanned out yet: to the recipients registered when it is pushed; r1 first)
    queue_ones = {"p1", H1, "inflight1", "retry1", "a1", "a2", "a3"}
    got: dict[str, list[str]] = {}

    async def delivered() -> bool:
        got.update((r.rid, [f.fields["msgid"] for f in r.received]) for r in recs)
        return queue_ones | {"t1"} <= {*got["r1"], *got["r2"]} and "t2" in got["r1"]

    await eventually(delivered, WAIT)
    assert sorted(m for m in got["r1"] + got["r2"] if m in queue_ones) == sorted(queue_ones)
    assert "t1" in got["r2"] and "t1" not in got["r1"]
    for rid in ("r1", "r2"):  # a1 before a2 before a3, whoever got them
        keyed = [m for m in got[rid] if m.startswith("a")]
        assert keyed == sorted(keyed)
    pushed_a = [e["msgid"] for m in ("a1", "a2", "a3") for e in log_events(broker, m, "pushed")]
    assert pushed_a == ["a1", "a2", "a3"]
    contents = {f.fields["msgid"]: f.content for r in recs for f in r.received}
    assert contents[H1] == b"pending packed" and contents["t1"] == b"topic one"

    # the delayed ones still wait, b2 behind b1
    waiting = {w.msgid: w for w in await broker.store.peek("shop", 10, NOW)}
    assert set(waiting) == {"far", "b1", "b2"}
    assert (waiting["far"].due_ms, waiting["far"].stored_ms) == (FAR, NOW + 18000)
    assert (waiting["b2"].key, waiting["b1"].preview) == ("k2", b"b1")

    # the dead letters kept: attempts, last error, history, recipient, content, died
    dead = {d.delivery_id: d for d in await broker.store.dead_letters("shop")}
    assert set(dead) == {H2, "t3\x1fr1", "t3\x1fr2", "ttl"}
    h2 = dead[H2]
    assert (h2.attempts, h2.last_error, h2.recipient) == (2, "reject: boom 2", "r2")
    assert (h2.content, h2.died_at, h2.stored_at) == (b"dead body", NOW + 5000, NOW)
    assert len(h2.history) == 2 and "recipient=r1" in h2.history[0]
    assert (dead["t3\x1fr2"].recipient, dead["t3\x1fr2"].attempts) == ("r2", 2)
    assert dead["ttl"].last_error == "expired"
    assert [d.msgid for d in await broker.store.dead_letters("other")] == ["o1"]

    # a dead letter replayed after the conversion is delivered with its traceparent
    assert await broker.store.replay("shop", [H2], NOW) == [True]

    async def replayed_pushed() -> bool:
        return any(f.fields["msgid"] == H2 for r in recs for f in r.received)

    await eventually(replayed_pushed, WAIT)
    replayed = [f for r in recs for f in r.received if f.fields["msgid"] == H2]
    assert replayed[0].fields.get("traceparent", "").startswith("00-0af7651916cd43dd")


@pytest.mark.parametrize("page", [migrate.CHUNK, 2])
async def test_two_brokers_starting_together_convert_each_message_once(
    legacy: str, redis: aioredis.Redis, prefix: str, page: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """(Pages of 2 messages: an ordering key's messages read in several pages.)"""
    monkeypatch.setattr(migrate, "CHUNK", page)
    await asyncio.gather(
        migrate_store(Store(redis, prefix, dedupe_window=3600.0), NOW + 30_000),
        migrate_store(Store(redis, prefix, dedupe_window=3600.0), NOW + 30_000),
    )
    keys = AppKeys.of(prefix, "shop")
    assert await redis.xlen(keys.inbox) == LIVE
    assert await redis.hlen(keys.dead) == 3
    assert await redis.hget(keys.dead_copies, "t3") == b"2"
    entries = [fields[b"m"] for _, fields in await redis.xrange(keys.inbox)]
    assert entries.index(b"a1") < entries.index(b"a2") < entries.index(b"a3")
    assert entries.index(b"b1") < entries.index(b"b2")
    assert entries[:4] == [b"p1", H1.encode(), b"ttl", b"t2"]  # (`ready`, in its order)
    assert H1.encode() in entries  # as text, not packed


async def test_the_dedupe_sets_hold_msgids_as_text(
    legacy: str, redis: aioredis.Redis, prefix: str
) -> None:
    keys = AppKeys.of(prefix, "shop")
    now = NOW + 30_000
    current, _ = keys.dedupe(now, 3_600_000)
    await redis.sadd(current, pack(H2), "acked2")
    await migrate_store(Store(redis, prefix, dedupe_window=3600.0), now)
    assert await redis.smembers(current) == {H2.encode(), b"acked1", b"acked2"}


async def test_a_store_an_earlier_broker_still_serves_is_not_converted(
    legacy: str, make_broker: BrokerFactory, redis: aioredis.Redis, prefix: str
) -> None:
    seen = {"last_seen": now_ms(), "host": "10.0.0.7", "port": 13000}
    await redis.hset(f"{prefix}:brokers", "old-broker", json.dumps(seen))
    with pytest.raises(Misconfigured, match=r"10\.0\.0\.7:13000\): stop them"):
        await make_broker()
    assert await redis.exists(AppKeys.of(prefix, "shop").base + "msgs")
    assert await redis.get(mark_key(prefix)) is None


async def test_a_store_on_a_redis_cluster_is_converted(
    make_broker: BrokerFactory, cluster: LocalCluster, cluster_redis: RedisCluster, prefix: str
) -> None:
    """Each app's old keys on its own master (the apps `shop` and `other` on two)."""
    await load(cluster_redis, prefix, "packed")
    shop, other = (AppKeys.of(prefix, app) for app in ("shop", "other"))
    assert cluster_redis.keyslot(shop.inbox) != cluster_redis.keyslot(other.inbox)
    broker = await make_broker(redis_url=cluster.url)
    assert await cluster_redis.get(mark_key(prefix)) == b"owner"
    assert not await cluster_redis.exists(*(shop.base + name for name in OLD_KEYS))

    dead = {d.delivery_id for d in await broker.store.dead_letters("shop")}
    waiting = {w.msgid for w in await broker.store.peek("shop", 20, NOW)}
    # (`ttl`, its TTL run out: dead-lettered once its owner would push it, none here)
    assert dead - {"ttl"} == {H2, "t3\x1fr1", "t3\x1fr2"}
    queued = {"p1", H1, "inflight1", "retry1", "a1", "a2", "a3", "t1", "t2", "far", "b1", "b2"}
    assert waiting - {"ttl"} == queued and "ttl" in dead | waiting
    assert [d.msgid for d in await broker.store.dead_letters("other")] == ["o1"]
