"""Delivery metadata on pushes, retry jitter and lease extension (issue 17), over real
brokers and a real Redis."""

from __future__ import annotations

import redis.asyncio as aioredis

from skmq.broker import Broker
from skmq.client import Consumer, Message, Resp
from skmq.clock import now_ms
from skmq.queue.deliveries import QUEUE, Policy
from skmq.queue.owners import Owners
from skmq.store import Extended, Failed, NewMessage
from skmq.store.wire import Wire
from tests.conftest import BrokerFactory, eventually
from tests.peers import FakeRecipient, RawClient
from tests.test_delivery import Peer, attempts, logged, produce, registered
from tests.test_queue_owners import alive, owners

# --------------------------------------------------------------------------- metadata


async def test_pushes_carry_attempt_and_stored_at(broker: Broker, redis: aioredis.Redis) -> None:
    app = "meta"
    answers = iter(["reject", "ack"])
    rec = await FakeRecipient(app, "r", lambda f: next(answers)).start()
    await registered(broker.server.port, rec)
    await produce(broker.server.port, app, ["m"])
    (stored,) = await broker.store.stored_of(app, ["m"], now_ms())
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


TRACE = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


async def test_a_traceparent_goes_from_producer_to_push_and_log(broker: Broker) -> None:
    """The W3C trace context of a produced message reaches every push of it (capable
    recipients only) and the delivery log's `stored` and `pushed` lines; a malformed one
    is refused."""
    app = "traced"
    rec = await FakeRecipient(app, "r").start()
    plain = await FakeRecipient(app, "o", caps=()).start()
    await registered(broker.server.port, rec, plain)
    client = await RawClient.connect(broker.server.port)
    for bad in ("00-xyz", "01-" + TRACE[3:], "00-" + "0" * 32 + TRACE[35:]):
        resp = await client.request("queue", b"x", appid=app, msgid="bad", traceparent=bad)
        assert resp["status"] == "error" and "traceparent" in str(resp["content"]), resp
    resp = await client.request("topic", b"x", appid=app, msgid="t1", traceparent=TRACE)
    assert resp["status"] == "ack"
    await client.close()
    push, plain_push = await rec.next_push(), await plain.next_push()
    assert push.fields["traceparent"] == TRACE
    assert "traceparent" not in plain_push.fields  # original peers get no extension field
    for event in ("stored", "pushed"):
        (line, *_) = await logged(broker, event, "t1")
        assert f"traceparent={TRACE}" in (line["detail"] or ""), line


# --------------------------------------------------------------------------- jitter


APP = "semantics"
NOW = 1_700_000_000_000


async def failed_dues(o: Owners, n: int) -> list[int]:
    msgids = [f"j{i}" for i in range(n)]
    await o.store({APP: [NewMessage(m, "queue", b"x") for m in msgids]}, NOW)
    got, _, _ = await o.claim(APP, NOW, n, alive("r1", free=n), ["r1"] * n)
    assert len(got) == n
    results = await o.fail(APP, [(m, "rejected", "", "r1", 1) for m in msgids], NOW)
    assert {r.code for r in results} == {Failed.RETRY}
    return [r.due - NOW for r in results]


async def test_retry_waits_spread_by_the_jitter(wire: Wire, prefix: str) -> None:
    o = await owners(wire, prefix, APP, policy=Policy(backoff_ms=(10_000,), jitter=0.5))
    waits = await failed_dues(o, 40)
    assert all(5_000 <= w <= 15_000 for w in waits), waits
    assert len(set(waits)) > 30  # a burst of failures does not come back in lockstep
    assert min(waits) < 7_500 and max(waits) > 12_500


async def test_no_jitter_waits_exactly_the_backoff(wire: Wire, prefix: str) -> None:
    o = await owners(wire, prefix, APP, policy=Policy(backoff_ms=(10_000,), jitter=0.0))
    assert set(await failed_dues(o, 5)) == {10_000}


async def test_the_broker_applies_retry_jitter(make_broker: BrokerFactory) -> None:
    broker = await make_broker(retry_backoff=[10.0], retry_jitter=1.0)
    assert broker.store.retries.jitter == 1.0


# --------------------------------------------------------------------------- lease extension


async def test_extend_pushes_the_lease_out_up_to_the_limit(wire: Wire, prefix: str) -> None:
    o = await owners(wire, prefix, APP, policy=Policy(lease_ms=10_000, max_extensions=2))
    deliveries = o.owned[APP].queue.deliveries
    await o.store({APP: [NewMessage("m", "queue", b"x")]}, NOW)
    got, _, _ = await o.claim(APP, NOW, 1, alive("r1"), ["r1"])
    assert got[0].attempt == 1
    assert deliveries[(b"m", QUEUE)].due == NOW + 10_000
    (e,) = await o.extend(APP, [("m", 1)], NOW + 6_000)
    assert (e.code, e.extensions, e.deadline) == (Extended.EXTENDED, 1, NOW + 16_000)
    assert deliveries[(b"m", QUEUE)].due == NOW + 16_000
    assert (await o.reap([APP], NOW + 12_000))[APP] == []  # the old deadline passed
    (stale,) = await o.extend(APP, [("m", 2)], NOW + 7_000)  # another attempt's
    assert stale.code == Extended.STALE
    (e,) = await o.extend(APP, [("m", 0)], NOW + 7_000)  # never shortened
    assert (e.code, e.extensions, e.deadline) == (Extended.EXTENDED, 2, NOW + 17_000)
    (refused,) = await o.extend(APP, [("m", 1)], NOW + 8_000)
    assert (refused.code, refused.extensions) == (Extended.LIMIT, 2)
    assert deliveries[(b"m", QUEUE)].due == NOW + 17_000
    # a new attempt starts again from no extension
    (f,) = await o.fail(APP, [("m", "rejected", "", "r1", 1)], NOW + 9_000)
    got, _, _ = await o.claim(APP, f.due, 1, alive("r1"), ["r1"])
    assert got[0].attempt == 2
    (e,) = await o.extend(APP, [("m", 2)], f.due)
    assert (e.code, e.extensions) == (Extended.EXTENDED, 1)
    (done,) = await o.finish(APP, [("m", 2)], f.due)
    assert done.ok
    (gone,) = await o.extend(APP, [("m", 2)], f.due)
    assert gone.code == Extended.STALE
    assert (b"m", QUEUE) not in deliveries


async def test_a_recipient_still_working_keeps_its_lease(
    make_broker: BrokerFactory, redis: aioredis.Redis
) -> None:
    broker = await make_broker(ack_timeout=0.5, max_lease_extensions=3)
    app = "lease"
    peer = await Peer(app, "p").start()
    await registered(broker.server.port, peer)
    await produce(broker.server.port, app, ["m"])
    _, conn = await peer.next_push()
    first = now_ms()  # the lease ends by first + 500
    conn.answer("arrived", "m", app)
    assert (await conn.resp())["content"] == "arrived"  # the first: no extension
    deadline = first + 500
    for kind in ("arrived", "extend", "extend"):  # again, or the extension frame
        await eventually(lambda d=deadline: _past(d - 250))
        conn.answer(kind, "m", app)
        resp = await conn.resp()
        assert resp["status"] == "ack" and "lease extended" in resp["content"], resp
        extended = int(resp["content"].split("until ")[1].split()[0])
        assert extended > deadline
        deadline = extended
    assert now_ms() > first + 250  # well past the first lease's middle, still in flight
    conn.answer("extend", "m", app)
    resp = await conn.resp()
    assert resp["status"] == "reject" and "MAX_LEASE_EXTENSIONS (3)" in resp["content"]
    conn.answer("ack", "m", app)
    assert (await conn.resp())["status"] == "ack"
    await logged(broker, "acked", "m")
    assert attempts(broker, "m", "pushed") == [1]
    assert attempts(broker, "m", "timeout") == []
    assert attempts(broker, "m", "extended") == [1, 1, 1]


async def _past(ms: float) -> bool:
    return now_ms() >= ms


async def test_extend_on_the_broker_port_is_fenced(broker: Broker) -> None:
    app = "fence"
    peer = await Peer(app, "p").start()
    await registered(broker.server.port, peer)
    await produce(broker.server.port, app, ["m"])
    push, _ = await peer.next_push()
    client = await RawClient.connect(broker.server.port)
    try:
        wrong = await client.request("extend", appid=app, msgid="m", token="forged")
        unknown = await client.request("extend", appid=app, msgid="nope")
        right = await client.request("extend", appid=app, msgid="m", token=push.fields["token"])
    finally:
        await client.close()
    assert (wrong["status"], wrong["content"]) == (
        "reject",
        "delivery token does not match a delivery in flight",
    )
    assert unknown["status"] == "reject" and "not in flight" in unknown["content"]
    assert right["status"] == "ack" and "lease extended" in right["content"], right


async def test_consumer_extends_its_lease_while_working(
    make_broker: BrokerFactory, redis: aioredis.Redis
) -> None:
    broker = await make_broker(ack_timeout=0.5)
    app = "slow"
    resps: list[Resp] = []

    async def handler(msg: Message) -> None:
        end = now_ms() + 900  # longer than ACK_TIMEOUT, extending in time
        while now_ms() < end:
            resps.append(await consumer.extend(msg))
            later = now_ms() + 300
            await eventually(lambda later=later: _past(later))

    consumer = Consumer(app, "c", handler, broker_port=broker.server.port)
    async with consumer:
        await consumer.register()
        await produce(broker.server.port, app, ["m"])
        await logged(broker, "acked", "m")
    assert resps and all(r.status == "ack" for r in resps), resps
    assert attempts(broker, "m", "pushed") == [1]
    assert attempts(broker, "m", "timeout") == []
