"""Message TTL (skmq/lifecycle.py, the expiry rows): an expired message is never pushed,
whatever state its TTL runs out in, over a real Redis; then end to end through a broker."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from skmq.broker import Broker
from skmq.client import Producer
from skmq.clock import now_ms
from skmq.config import Settings, SettingsError
from skmq.lifecycle import State
from skmq.store import Failed, NewMessage, Retries, Store
from tests.conftest import BrokerFactory, eventually
from tests.peers import FakeRecipient, RawClient
from tests.test_delivery import log_events, logged, produce, registered
from tests.test_lifecycle import APP, NOW, alive, claimed, state_of

TTL = 500


def make_store(
    redis: aioredis.Redis, prefix: str, drop: bool = False, retry_times: int = 3
) -> Store:
    client = aioredis.Redis(connection_pool=redis.connection_pool)
    return Store(
        client, prefix, retries=Retries(retry_times, [1.0]), ack_timeout=10.0,
        expired_drop=drop,
    )  # fmt: skip


@pytest.fixture
async def store(redis: aioredis.Redis, prefix: str) -> AsyncIterator[Store]:
    yield make_store(redis, prefix)


@pytest.fixture
async def dropping(redis: aioredis.Redis, prefix: str) -> AsyncIterator[Store]:
    yield make_store(redis, prefix, drop=True)


async def stored(store: Store, msgid: str, kind: str = "queue", at: int = 0) -> None:
    message = NewMessage(msgid, kind, b"body", at, NOW + TTL)
    assert (await store.store({APP: [message]}, NOW))[APP] == [True]


async def claim_all(store: Store, now: int) -> list[tuple[str, str, bytes]]:
    got, _, _ = await store.claim(APP, now, 10, alive("r1", "r2"), ["r1"] * 10)
    return [(c.delivery_id, c.kind, c.content) for c in got]


async def last_error(store: Store, delivery_id: str) -> str:
    (dl,) = [d for d in await store.dead_letters(APP) if d.delivery_id == delivery_id]
    return dl.last_error


async def test_pending_expired_is_dead_lettered_not_pushed(store: Store) -> None:
    await stored(store, "p")
    assert await state_of(store, "p") == State.PENDING
    assert await claim_all(store, NOW + TTL) == [("p", "expired", b"dead")]
    assert await state_of(store, "p") == State.DEAD
    assert await last_error(store, "p") == "expired"


async def test_pending_not_yet_expired_is_pushed(store: Store) -> None:
    await stored(store, "p")
    assert await claim_all(store, NOW + TTL - 1) == [("p", "queue", b"body")]
    (done,) = await store.finish(APP, [("p", 0)], NOW + TTL + 1)
    assert done.ok  # an ack after expiry still counts: the message was delivered


async def test_delayed_past_its_expiry_falls_due_at_the_expiry(store: Store) -> None:
    await stored(store, "d", at=NOW + 60_000)
    assert await state_of(store, "d") == State.DELAYED
    assert await store.redis.zscore(store.base(APP) + "delayed", "d") == NOW + TTL
    assert await claim_all(store, NOW + TTL - 1) == []
    assert await claim_all(store, NOW + TTL) == [("d", "expired", b"dead")]
    assert await state_of(store, "d") == State.DEAD


async def test_retry_wait_ends_at_the_expiry_and_the_claim_expires_it(store: Store) -> None:
    await stored(store, "w")
    assert await claimed(store) == ["w"]
    (f,) = await store.fail(APP, [("w", "rejected", "busy", "r1", 1)], NOW + 10)
    assert (f.code, f.due) == (Failed.RETRY, NOW + TTL)  # not NOW + 10 + 1000
    assert await state_of(store, "w") == State.WAITING_RETRY
    assert await claim_all(store, NOW + TTL) == [("w", "expired", b"dead")]
    assert await state_of(store, "w") == State.DEAD


async def test_in_flight_failure_after_expiry_is_expired_not_retried(store: Store) -> None:
    await stored(store, "f")
    assert await claimed(store) == ["f"]
    (f,) = await store.fail(APP, [("f", "errored", "boom", "r1", 1)], NOW + TTL)
    assert f.code == Failed.EXPIRED
    assert await state_of(store, "f") == State.DEAD
    (dl,) = await store.dead_letters(APP)
    assert dl.last_error == "expired"
    assert "errored: boom; expired" in dl.history[-1]


async def test_in_flight_timeout_after_expiry_is_expired_not_retried(store: Store) -> None:
    await stored(store, "t")
    assert await claimed(store) == ["t"]
    reaped = (await store.reap([APP], NOW + 10_000))[APP]
    assert [(r.delivery_id, r.result.code) for r in reaped] == [("t", Failed.EXPIRED)]
    assert await state_of(store, "t") == State.DEAD


async def test_topic_copies_expire_one_by_one(store: Store) -> None:
    await stored(store, "tp", kind="topic")
    got, _, _ = await store.claim(APP, NOW, 10, [*alive("r1"), *alive("r2", free=0)], [])
    assert [c.delivery_id for c in got] == ["tp\x1fr1"]  # r2's copy waits for a slot
    (f,) = await store.fail(APP, [("tp\x1fr1", "rejected", "no", "r1", 1)], NOW + TTL)
    assert f.code == Failed.EXPIRED
    assert await claim_all(store, NOW + TTL) == [("tp\x1fr2", "expired", b"dead")]
    dead = sorted(d.delivery_id for d in await store.dead_letters(APP))
    assert dead == ["tp\x1fr1", "tp\x1fr2"]
    assert await store.purge(APP, dead) == [True, True]
    assert not await store.redis.hexists(store.base(APP) + "msgs", "tp")


async def test_drop_forgets_expired_messages(dropping: Store) -> None:
    store = dropping
    await stored(store, "p")
    await stored(store, "f")
    await stored(store, "tp", kind="topic")
    got, _, _ = await store.claim(APP, NOW, 1, alive("r1"), ["r1"])
    assert [c.delivery_id for c in got] == ["p"]
    (f,) = await store.fail(APP, [("p", "errored", "x", "r1", 1)], NOW + TTL)
    assert f.code == Failed.EXPIRED_DROPPED
    assert await claim_all(store, NOW + TTL) == [
        ("f", "expired", b"drop"),
        ("tp", "expired", b"drop"),
    ]
    for msgid in ("p", "f", "tp"):
        assert await state_of(store, msgid) == State.GONE
    assert await store.redis.hlen(store.base(APP) + "state") == 0
    assert await store.dead_letters(APP) == []


async def test_dropped_topic_copies_leave_nothing_behind(dropping: Store) -> None:
    store = dropping
    await stored(store, "tp", kind="topic")
    got, _, _ = await store.claim(APP, NOW, 10, alive("r1", "r2"), [])
    assert len(got) == 2
    for c in got:
        (f,) = await store.fail(APP, [(c.delivery_id, "rejected", "no", c.recipient, 1)], NOW + TTL)
        assert f.code == Failed.EXPIRED_DROPPED
    assert await store.redis.hlen(store.base(APP) + "msgs") == 0
    assert await store.redis.hlen(store.base(APP) + "state") == 0


async def test_replay_lifts_the_ttl(store: Store) -> None:
    await stored(store, "r")
    assert await claim_all(store, NOW + TTL) == [("r", "expired", b"dead")]
    assert await store.replay(APP, ["r"], NOW + TTL) == [True]
    assert await claim_all(store, NOW + 10 * TTL) == [("r", "queue", b"body")]


async def test_without_ttl_nothing_expires(store: Store) -> None:
    assert (await store.store({APP: [NewMessage("n", "queue", b"b")]}, NOW))[APP] == [True]
    assert await claim_all(store, NOW + 10**9) == [("n", "queue", b"b")]


# --------------------------------------------------------------------------- end to end


async def test_ttl_field_expires_a_message_nobody_took(
    make_broker: BrokerFactory, redis: aioredis.Redis
) -> None:
    broker = await make_broker()
    app = "ttl"
    await produce(broker.server.port, app, ["gone"], ttl="50")
    await produce(broker.server.port, app, ["kept"])
    rec = await FakeRecipient(app, "r").start()
    await eventually(lambda: _after(redis, broker, app, 60))
    await registered(broker.server.port, rec)
    push = await rec.next_push()
    assert push.fields["msgid"] == "kept"
    await logged(broker, "dead_lettered", "gone")
    (expired,) = log_events(broker, "gone", "expired")
    assert expired["detail"] == "dead-lettered"
    (dl,) = await broker.store.dead_letters(app)
    assert (dl.msgid, dl.last_error) == ("gone", "expired")
    assert [f.fields["msgid"] for f in rec.received] == ["kept"]


async def _after(redis: aioredis.Redis, broker: Broker, app: str, ms: int) -> bool:
    """True once `ms` have passed since the app's message `gone` was stored."""
    (stored,) = await broker.store.stored_of(app, ["gone"], now_ms())
    return stored is not None and now_ms() >= stored + ms


async def test_ttl_by_app_and_drop(make_broker: BrokerFactory, redis: aioredis.Redis) -> None:
    broker = await make_broker(ttl_by_app={"short": 50}, expired="drop")
    await produce(broker.server.port, "short", ["gone"])
    await produce(broker.server.port, "other", ["kept"])
    await eventually(lambda: _after(redis, broker, "short", 60))
    for app in ("short", "other"):
        await registered(broker.server.port, await FakeRecipient(app, "r").start())
    await logged(broker, "expired", "gone")
    await logged(broker, "pushed", "kept")
    assert log_events(broker, "gone", "dead_lettered") == []
    c = (await broker.store.counts(["short"], now_ms()))["short"]
    assert (c.pending, c.delayed, c.in_flight, c.dead) == (0, 0, 0, 0)  # dropped: gone


async def test_in_flight_expiry_ends_a_rejected_message(make_broker: BrokerFactory) -> None:
    broker = await make_broker(retry_backoff=[0.05], retry_times=100)
    app = "flight"
    rec = await FakeRecipient(app, "r", lambda f: "reject").start()
    await registered(broker.server.port, rec)
    await produce(broker.server.port, app, ["m"], ttl="300")
    await logged(broker, "dead_lettered", "m")
    assert 1 < len(rec.received) < 100  # retried until the TTL ran out, then no more
    (dl,) = await broker.store.dead_letters(app)
    assert dl.last_error == "expired"


async def test_bad_ttl_is_refused(broker: Broker) -> None:
    client = await RawClient.connect(broker.server.port)
    try:
        resp = await client.request("queue", b"x", appid="a", msgid="m", ttl="-5")
    finally:
        await client.close()
    assert resp["status"] == "error"
    assert "ttl" in resp["content"]


async def test_client_sends_ttl_to_a_broker_that_supports_it(broker: Broker) -> None:
    async with Producer("127.0.0.1", broker.server.port) as producer:
        resp = await producer.send("cli", b"x", msgid="c1", ttl_ms=1)
    assert resp.status == "ack"
    await registered(broker.server.port, await FakeRecipient("cli", "r").start())
    (expired,) = await logged(broker, "expired", "c1")  # its ttl came with it
    assert expired["detail"] == "dead-lettered"


def test_ttl_settings_parse_and_refuse_garbage() -> None:
    settings = Settings.load(ttl_by_app="a:5000, b:0", default_ttl=7)
    assert (settings.ttl_by_app, settings.default_ttl) == ({"a": 5000, "b": 0}, 7)
    for bad in ({"ttl_by_app": "a:soon"}, {"ttl_by_app": "a"}, {"retry_jitter": 1.5}):
        with pytest.raises(SettingsError):
            Settings.load(**bad)
    with pytest.raises(SettingsError):
        Settings.load(expired="later")
