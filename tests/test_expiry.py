"""Message TTL (skmq/lifecycle.py, the expiry rows): an expired message is never pushed,
whatever state its TTL runs out in, through an app's owner over a real Redis; then end
to end through a broker."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import redis.asyncio as aioredis

from skmq.broker import Broker
from skmq.client import Producer
from skmq.clock import now_ms
from skmq.config import Settings, SettingsError
from skmq.lifecycle import State
from skmq.queue.deliveries import QUEUE, Policy
from skmq.queue.owned_store import OwnedStore
from skmq.queue.owners import SWEEP_MS, Owners
from skmq.store import Failed, NewMessage
from skmq.store.wire import Wire
from tests.conftest import BrokerFactory, eventually
from tests.peers import FakeRecipient, RawClient
from tests.test_delivery import log_events, logged, produce, registered
from tests.test_queue_owners import alive, owners

TTL = 500
APP = "ttl"
NOW = 1_700_000_000_000


@dataclass
class Engine:
    """An app's owner in this process (skmq/queue/owners.py, as a broker's), and the
    store operators read its dead letters through."""

    owners: Owners
    store: OwnedStore

    async def state_of(self, msgid: str) -> State | None:
        """Where msgid's queue delivery stands: in its owner's memory, else dead (among
        the app's dead letters), else None (over: acked or dropped)."""
        d = self.owners.owned[APP].queue.deliveries.get((msgid.encode(), QUEUE))
        if d is not None:
            return d.state
        dead = {x.delivery_id for x in await self.store.dead_letters(APP)}
        return State.DEAD if msgid in dead else None


def policy(drop: bool = False, retry_times: int = 3) -> Policy:
    return Policy(retry_times, (1_000,), 0.0, 10_000, drop_expired=drop)


async def engine_of(wire: Wire, redis: aioredis.Redis, prefix: str, drop: bool) -> Engine:
    client = aioredis.Redis(connection_pool=redis.connection_pool)
    o = await owners(wire, prefix, APP, rids=("r1", "r2"), policy=policy(drop))
    return Engine(o, OwnedStore(client, prefix))


@pytest.fixture
async def engine(wire: Wire, redis: aioredis.Redis, prefix: str) -> Engine:
    return await engine_of(wire, redis, prefix, drop=False)


@pytest.fixture
async def dropping(wire: Wire, redis: aioredis.Redis, prefix: str) -> Engine:
    return await engine_of(wire, redis, prefix, drop=True)


async def stored(e: Engine, msgid: str, kind: str = "queue", at: int = 0) -> None:
    message = NewMessage(msgid, kind, b"body", at, NOW + TTL)
    assert (await e.owners.store({APP: [message]}, NOW))[APP] == [True]


async def claim_all(e: Engine, now: int) -> list[tuple[str, str, bytes]]:
    got, _, _ = await e.owners.claim(APP, now, 10, alive("r1", "r2"), ["r1"] * 10)
    return [(c.delivery_id, c.kind, c.content) for c in got]


async def claimed(e: Engine) -> list[str]:
    got, _, _ = await e.owners.claim(APP, NOW, 10, alive("r1"), ["r1"] * 10)
    return [c.delivery_id for c in got]


async def last_error(e: Engine, delivery_id: str) -> str:
    (dl,) = [d for d in await e.store.dead_letters(APP) if d.delivery_id == delivery_id]
    return dl.last_error


async def test_pending_expired_is_dead_lettered_not_pushed(engine: Engine) -> None:
    await stored(engine, "p")
    assert await engine.state_of("p") == State.PENDING
    assert await claim_all(engine, NOW + TTL) == [("p", "expired", b"dead")]
    assert await engine.state_of("p") == State.DEAD
    assert (await last_error(engine, "p")).startswith("expired")


async def test_pending_not_yet_expired_is_pushed(engine: Engine) -> None:
    await stored(engine, "p")
    assert await claim_all(engine, NOW + TTL - 1) == [("p", "queue", b"body")]
    (done,) = await engine.owners.finish(APP, [("p", 0)], NOW + TTL + 1)
    assert done.ok  # an ack after expiry still counts: the message was delivered


async def test_delayed_past_its_expiry_falls_due_at_the_expiry(engine: Engine) -> None:
    await stored(engine, "d", at=NOW + 60_000)
    assert await engine.state_of("d") == State.DELAYED
    assert await claim_all(engine, NOW + TTL - 1) == []
    assert await claim_all(engine, NOW + TTL) == [("d", "expired", b"dead")]
    assert await engine.state_of("d") == State.DEAD


async def test_retry_wait_ends_at_the_expiry_and_the_claim_expires_it(engine: Engine) -> None:
    await stored(engine, "w")
    assert await claimed(engine) == ["w"]
    (f,) = await engine.owners.fail(APP, [("w", "rejected", "busy", "r1", 1)], NOW + 10)
    assert (f.code, f.due) == (Failed.RETRY, NOW + TTL)  # not NOW + 10 + 1000
    assert await engine.state_of("w") == State.WAITING_RETRY
    assert await claim_all(engine, NOW + TTL) == [("w", "expired", b"dead")]
    assert await engine.state_of("w") == State.DEAD


async def test_in_flight_failure_after_expiry_is_expired_not_retried(engine: Engine) -> None:
    await stored(engine, "f")
    assert await claimed(engine) == ["f"]
    (f,) = await engine.owners.fail(APP, [("f", "errored", "boom", "r1", 1)], NOW + TTL)
    assert f.code == Failed.EXPIRED
    assert await engine.state_of("f") == State.DEAD
    assert (await last_error(engine, "f")).startswith("expired")


async def test_in_flight_timeout_after_expiry_is_expired_not_retried(engine: Engine) -> None:
    await stored(engine, "t")
    assert await claimed(engine) == ["t"]
    reaped = (await engine.owners.reap([APP], NOW + 10_000))[APP]
    assert [(r.delivery_id, r.result.code) for r in reaped] == [("t", Failed.EXPIRED)]
    assert await engine.state_of("t") == State.DEAD


async def test_topic_copies_expire_one_by_one(engine: Engine) -> None:
    await stored(engine, "tp", kind="topic")
    got, _, _ = await engine.owners.claim(APP, NOW, 10, [*alive("r1"), *alive("r2", free=0)], [])
    assert [c.delivery_id for c in got] == ["tp\x1fr1"]  # r2's copy waits for a slot
    (f,) = await engine.owners.fail(APP, [("tp\x1fr1", "rejected", "no", "r1", 1)], NOW + TTL)
    assert f.code == Failed.EXPIRED
    assert await claim_all(engine, NOW + TTL) == [("tp\x1fr2", "expired", b"dead")]
    dead = sorted(d.delivery_id for d in await engine.store.dead_letters(APP))
    assert dead == ["tp\x1fr1", "tp\x1fr2"]
    assert await engine.store.purge(APP, dead) == [True, True]
    assert await engine.store.dead_letters(APP) == []


async def test_drop_forgets_expired_messages(dropping: Engine) -> None:
    e = dropping
    await stored(e, "p")
    assert await claimed(e) == ["p"]
    await stored(e, "f")
    await stored(e, "tp", kind="topic")
    (f,) = await e.owners.fail(APP, [("p", "errored", "x", "r1", 1)], NOW + TTL)
    assert f.code == Failed.EXPIRED_DROPPED
    expired = await claim_all(e, NOW + TTL)
    assert sorted(expired) == [
        ("f", "expired", b"drop"),
        ("tp\x1fr1", "expired", b"drop"),
        ("tp\x1fr2", "expired", b"drop"),
    ]
    assert e.owners.owned[APP].queue.deliveries == {}
    assert await e.store.dead_letters(APP) == []


async def test_replay_lifts_the_ttl(engine: Engine) -> None:
    await stored(engine, "r")
    assert await claim_all(engine, NOW + TTL) == [("r", "expired", b"dead")]
    assert await engine.store.replay(APP, ["r"], NOW + TTL) == [True]
    await engine.owners.read_inbox(APP, NOW + TTL)
    assert await claim_all(engine, NOW + 10 * TTL) == [("r", "queue", b"body")]


async def test_without_ttl_nothing_expires(engine: Engine) -> None:
    assert (await engine.owners.store({APP: [NewMessage("n", "queue", b"b")]}, NOW))[APP] == [True]
    assert await claim_all(engine, NOW + 10**9) == [("n", "queue", b"b")]


async def test_a_claim_of_none_expires_what_waits_for_no_recipient(engine: Engine) -> None:
    await stored(engine, "p")
    got, due, _ = await engine.owners.claim(APP, NOW + 100, 0, [], [], lost=["r1", "r2"])
    assert got == [] and due == NOW + 100 + SWEEP_MS  # (its TTL: the sweep after it)
    got, _, _ = await engine.owners.claim(APP, NOW + 100 + SWEEP_MS, 0, [], [], lost=["r1"])
    assert [(c.delivery_id, c.kind, c.content) for c in got] == [("p", "expired", b"dead")]
    assert await engine.state_of("p") == State.DEAD


async def test_a_lost_recipients_copy_expires_while_another_takes_its_own(engine: Engine) -> None:
    await stored(engine, "tp", kind="topic")
    got, _, _ = await engine.owners.claim(APP, NOW, 10, alive("r1"), [], lost=["r2"])
    assert [c.delivery_id for c in got] == ["tp\x1fr1"]
    got, _, _ = await engine.owners.claim(APP, NOW + SWEEP_MS, 10, alive("r1"), [], lost=["r2"])
    assert [(c.delivery_id, c.kind) for c in got] == [("tp\x1fr2", "expired")]
    assert [d.delivery_id for d in await engine.store.dead_letters(APP)] == ["tp\x1fr2"]


async def test_one_behind_its_key_expires_and_the_head_is_acked(engine: Engine) -> None:
    for msgid in ("k1", "k2"):
        m = NewMessage(msgid, "queue", b"body", 0, NOW + TTL, key="K")
        assert (await engine.owners.store({APP: [m]}, NOW))[APP] == [True]
    assert await claimed(engine) == ["k1"]
    assert await engine.state_of("k2") == State.WAITING_KEY
    got, _, _ = await engine.owners.claim(APP, NOW + SWEEP_MS, 0, [], [], lost=["r1"])
    assert [c.delivery_id for c in got] == ["k2"]
    (done,) = await engine.owners.finish(APP, [("k1", 1)], NOW + SWEEP_MS)
    assert done.ok and await engine.state_of("k1") is None


# --------------------------------------------------------------------------- end to end


@pytest.mark.parametrize("expired", ["dead", "drop"])
async def test_a_message_for_an_app_without_recipients_expires_on_time(
    make_broker: BrokerFactory, expired: str
) -> None:
    broker = await make_broker(expired=expired)
    await produce(broker.server.port, "nobody", ["gone"], ttl="100")
    await produce(broker.server.port, "nobody", ["kept"])
    (line,) = await logged(broker, "expired", "gone")
    (stored_line,) = log_events(broker, "gone", "stored")
    assert line["ts"] - stored_line["ts"] < 100 + 3 * SWEEP_MS  # (no recipient ever came)
    c = (await broker.store.counts(["nobody"], now_ms()))["nobody"]
    if expired == "dead":
        (dl,) = await broker.store.dead_letters("nobody")
        assert (dl.msgid, dl.last_error) == ("gone", "expired")
        await logged(broker, "dead_lettered", "gone")
        assert (c.pending, c.dead) == (1, 1)
    else:
        assert line["detail"] == "dropped (EXPIRED=drop)"
        assert (c.pending, c.dead) == (1, 0)
        assert await broker.store.dead_letters("nobody") == []


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
