"""Per-key ordered delivery (`key=`, seed 001's orderly consumption): one message of an
app and key at a time, in stored order; a retry blocks its key, not the app; across two
brokers on one store and a kill -9 of one of them."""

from __future__ import annotations

import asyncio
import collections
import contextlib
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from skmq.aio import cancel_and_wait
from skmq.broker import Broker
from skmq.client import Producer
from skmq.clock import now_ms
from skmq.codec import Frame
from skmq.deliverylog import DeliveryLog
from skmq.events import Event
from skmq.lifecycle import State
from skmq.queue.deliveries import Policy
from skmq.queue.owned_store import OwnedStore
from skmq.store import AliveRecipient, Claimed, Failed, NewMessage
from skmq.store.wire import Wire
from skmq.workers.answers import Answer, AnswerBatcher
from skmq.workers.dispatch import POLL, Dispatcher
from tests.conftest import BrokerFactory, BrokerProcess, eventually
from tests.peers import FakeRecipient, RawClient
from tests.test_delivery import base, log_events, produce, registered, settle
from tests.test_queue_owners import owners

APP = "order"


NOW = 1_700_000_000_000
POLICY = Policy(retry_times=2, backoff_ms=(1_000,), jitter=0.0, lease_ms=10_000)


@pytest.fixture
async def store(wire: Wire, redis: aioredis.Redis, prefix: str) -> OwnedStore:
    """The store of a broker that owns APP (its owner in this process)."""
    store = OwnedStore(aioredis.Redis(connection_pool=redis.connection_pool), prefix)
    store.owners = await owners(wire, prefix, APP, rids=("r",), policy=POLICY)
    return store


def keyed(msgid: str, key: str, at: int = 0, content: bytes = b"x") -> NewMessage:
    return NewMessage(msgid, "queue", content, at, 0, key)


async def claim(store: OwnedStore, now: int = NOW, length: bool = True) -> list[str]:
    got, _, _ = await store.claim(APP, now, 10, [AliveRecipient("r", 10, length)], ["r"] * 10)
    return [c.msgid for c in got if c.kind == "queue"]


def waiting(store: OwnedStore, state: State = State.PENDING) -> list[str]:
    """The msgids of APP's deliveries in `state`, as its owner holds them."""
    assert store.owners is not None
    found = store.owners.owned[APP].queue.deliveries.values()
    return sorted(d.msgid.decode() for d in found if d.state is state)


async def test_an_ack_that_lets_the_next_of_its_key_go_wakes_the_dispatcher(
    store: OwnedStore, tmp_path: Path
) -> None:
    """The next message of a key goes when the one before is acked: the ack must wake
    the app's dispatcher, which would otherwise sleep until its next poll."""
    await store.store(
        {APP: [keyed("a1", "A"), keyed("a2", "A"), NewMessage("u", "queue", b"x")]}, NOW
    )
    assert await claim(store) == ["a1", "u"]
    woken: list[tuple[str, bool]] = []
    answers = AnswerBatcher(store, DeliveryLog(tmp_path, "b1"), lambda *a: woken.append(a))
    for msgid in ("a1", "u"):  # a2 waits behind a1; u has no key
        answers.submit(APP, msgid, Event.ACKED, recipient="r", attempt=1)
        await answers.drain()
    assert woken == [(APP, True), (APP, False)]
    assert await claim(store, NOW + 1) == ["a2"]


async def test_an_uncertain_ack_acked_since_leaves_nothing_to_look_up(
    store: OwnedStore, tmp_path: Path
) -> None:
    """An ack whose finish's answer was lost is remembered for a lookup; acked anew since
    (a redelivery's ack), nothing is left to look up. It left an app with no ids, whose
    lookup Redis refused (SMISMEMBER with no member) and that was put back for the next
    flush: a warning every ack batch until a restart."""
    await store.store({APP: [NewMessage("m1", "queue", b"x")]}, NOW)
    assert await claim(store) == ["m1"]
    answers = AnswerBatcher(store, DeliveryLog(tmp_path, "b1"), lambda *a: None)
    answers._remember(APP, [Answer("m1", Event.ACKED, "", "r", 1, lambda verdict: None)])
    answers.submit(APP, "m1", Event.ACKED, recipient="r", attempt=1)
    await answers.drain()
    assert (answers._uncertain, answers._reconciling) == ({}, None)
    assert await store.acked_of(APP, [], now_ms()) == []


async def test_a_claim_that_buried_one_claims_again_at_once(store: OwnedStore) -> None:
    """A claim that dead-letters or expires a message may let the next of its key go:
    the dispatcher claims again now, not at its next poll."""
    pushed: list[Claimed] = []
    d = Dispatcher(APP, store, lambda app: [], lambda app, rs: {}, lambda a, c: pushed.extend(c))
    for kind, wait in (("expired", 0.0), ("dead", 0.0), ("queue", POLL)):
        c = Claimed("m", "m", kind, b"", 1, "r")
        assert d._claimed(4, ([c], None, 0.0)) == wait


async def test_one_message_of_a_key_at_a_time_in_stored_order(store: OwnedStore) -> None:
    batch = [keyed("a1", "A"), keyed("a2", "A"), keyed("b1", "B"), keyed("a3", "A")]
    await store.store({APP: [*batch, NewMessage("u", "queue", b"x")]}, NOW)
    assert waiting(store, State.WAITING_KEY) == ["a2", "a3"]  # behind a1, their key's head
    assert await claim(store) == ["a1", "b1", "u"]
    assert await claim(store) == []
    assert (await store.finish(APP, [("a1", 1)], NOW))[0].ok
    assert await claim(store) == ["a2"]
    # a retry blocks its key, not the app: B's next message goes meanwhile
    (f,) = await store.fail(APP, [("a2", "rejected", "", "r", 1)], NOW)
    assert f.code == Failed.RETRY
    await store.store({APP: [keyed("b2", "B")]}, NOW)
    assert await claim(store) == []  # b1 still in flight
    assert (await store.finish(APP, [("b1", 1)], NOW))[0].ok
    assert await claim(store) == ["b2"]
    assert await claim(store, NOW + 1000) == ["a2"]  # its retry, before a3
    (f,) = await store.fail(APP, [("a2", "rejected", "", "r", 2)], NOW + 1000)
    assert f.code == Failed.DEAD  # dead: the key goes on
    assert await claim(store, NOW + 1000) == ["a3"]
    done = await store.finish(APP, [("a3", 1), ("b2", 1)], NOW + 1000)
    assert [f.ok for f in done] == [True, True]
    assert store.owners is not None and not store.owners.owned[APP].queue.keys


async def test_a_delayed_message_waiting_for_its_key_keeps_its_time(store: OwnedStore) -> None:
    await store.store({APP: [keyed("d1", "D"), keyed("d2", "D", at=NOW + 5000)]}, NOW)
    assert await claim(store) == ["d1"]
    assert (await store.finish(APP, [("d1", 1)], NOW + 10))[0].ok
    assert await claim(store, NOW + 4999) == []
    assert waiting(store, State.DELAYED) == ["d2"]
    assert await claim(store, NOW + 5000) == ["d2"]


async def test_a_key_goes_on_after_its_head_expires_or_is_undeliverable(
    store: OwnedStore,
) -> None:
    head = NewMessage("e1", "queue", b"x", 0, NOW + 100, "E")
    crlf = keyed("c1", "C", content=b"a\r\nb")
    await store.store({APP: [head, keyed("e2", "E"), crlf, keyed("c2", "C")]}, NOW)
    got, _, _ = await store.claim(APP, NOW + 100, 10, [AliveRecipient("r", 10, False)], ["r"])
    assert {(c.msgid, c.kind) for c in got} == {("e1", "expired"), ("c1", "dead")}
    assert waiting(store) == ["c2", "e2"]


async def test_a_key_on_a_topic_message_is_refused(broker: Broker) -> None:
    client = await RawClient.connect(broker.server.port)
    try:
        topic = await client.request("topic", b"x", appid=APP, msgid="t", key="K")
        bad = await client.request("queue", b"x", appid=APP, msgid="q", key="a\x01b")
    finally:
        await client.close()
    assert topic["status"] == "error" and "queue messages only" in topic["content"]
    assert bad["status"] == "error" and "key holds a control character" in bad["content"]


# --------------------------------------------------------------------------- end to end

KEYS = 100
PER_KEY = 100


class OrderWatch:
    """What the recipient saw, per key; and, sampled from Redis, what was in flight."""

    def __init__(self) -> None:
        self.seen: dict[str, list[int]] = collections.defaultdict(list)
        self.total = 0
        self.overlaps: list[list[str]] = []
        self.hold = False  # answer nothing: pushes stay in flight
        self.held: set[str] = set()
        self.sampling = True  # (a cancel alone: once seen swallowed, the wait for the
        # sampler's end took 330 s; Python 3.11, skmq/aio.py's cancel_and_wait)

    def on_push(self, frame: Frame) -> str:
        key, _, n = (frame.fields.get("msgid") or "").partition("-")
        self.seen[key].append(int(n))
        self.total += 1
        if self.hold:
            self.held.add(frame.fields.get("msgid") or "")
            return "silent"
        return "ack"

    async def sample(self, redis: aioredis.Redis, inflight: str) -> None:
        while self.sampling:
            members = [m.decode() for m in await redis.zrange(inflight, 0, -1)]
            keys = collections.Counter(m.partition("-")[0] for m in members)
            if any(c > 1 for c in keys.values()):
                self.overlaps.append(members)
            await asyncio.sleep(0.005)


# (above the sum of its bounded waits, 360 s: a wait that runs out says which it was)
@pytest.mark.timeout(420)
async def test_order_per_key_across_two_brokers_and_a_kill_9(
    broker_process: BrokerProcess,
    make_broker: BrokerFactory,
    redis: aioredis.Redis,
    redis_url: str,
    prefix: str,
) -> None:
    env = broker_process.env
    env.update(SKMQ_REDIS_URL=redis_url, SKMQ_KEY_PREFIX=prefix, SKMQ_RETRY_TIMES="20")
    env.update(SKMQ_ACK_TIMEOUT="1.5", SKMQ_RETRY_BACKOFF="0.1")
    env["SKMQ_LOG_DIR"] = env["SKMQ_DATA_DIR"] + "-killed-log"  # its log only
    await asyncio.to_thread(broker_process.start)
    # the first messages through the broker to kill, before the other starts: it owns
    # the app then (and pushes), as the test needs
    await _produce_keyed(broker_process.port, [f"k{k}-0" for k in range(KEYS)])
    other = await make_broker(ack_timeout=1.5, retry_times=20, retry_backoff=[0.1])
    watch = OrderWatch()
    rec = await FakeRecipient(APP, "r", watch.on_push).start()
    await registered(broker_process.port, rec)
    await registered(other.server.port, rec)
    sampler = asyncio.create_task(watch.sample(redis, base(other, APP) + "inflight"))
    try:
        # stored in order per key: k<key>-<n>, n = 0..PER_KEY-1, keys interleaved
        for n in range(1, PER_KEY):
            if n == 2 * PER_KEY // 3:  # mid-way: pushes held from now (then the kill)
                await eventually(lambda: _at_least(watch, KEYS * PER_KEY // 3), timeout=120)
                watch.hold = True
            ids = [f"k{k}-{n}" for k in range(KEYS)]
            port = broker_process.port if n % 2 else other.server.port
            await _produce_keyed(port, ids)
        pushed_there = Path(env["SKMQ_LOG_DIR"])
        caught: set[str] = set()

        def unanswered_there() -> set[str]:
            pushed = {e["msgid"] for e in log_events(pushed_there, event="pushed")}
            return pushed - {e["msgid"] for e in log_events(pushed_there, event="acked")}

        async def in_flight_there() -> bool:
            caught.update(watch.held & unanswered_there())  # never to be answered
            return bool(caught)

        await eventually(in_flight_there, timeout=60)
        await asyncio.to_thread(broker_process.kill)
        watch.hold = False
        if other.owned is not None:  # (the counts are the owner's; until
            # `other` takes the app over, they are as the killed one last said)
            owned = other.owned.owners.owned

            async def taken_over() -> bool:
                return APP in owned

            await eventually(taken_over, timeout=60)
        await settle(redis, other, APP, timeout=180)
    finally:
        watch.sampling = False
        await cancel_and_wait([sampler])
        await rec.stop()
    assert watch.overlaps == []  # no key ever had two messages in flight
    for k in range(KEYS):
        got = watch.seen[f"k{k}"]
        firsts = [n for i, n in enumerate(got) if i == 0 or n != got[i - 1]]
        assert firsts == list(range(PER_KEY)), (k, got)  # in order; a repeat only of
        # the message just pushed (its ack lost with the killed broker)
    assert watch.total >= KEYS * PER_KEY

    # the killed broker's pushes in flight: their leases ran out and went on here (logged
    # by the reaper's next round, which may come after the app settled)
    def missed_now() -> set[str]:
        return caught - {e["msgid"] for e in log_events(other, event="timeout")}

    async def none_missed() -> bool:
        return not missed_now()

    with contextlib.suppress(TimeoutError):
        await eventually(none_missed, timeout=10)
    missed = missed_now()
    assert not missed, [
        (e["event"], e["msgid"], e["attempt"], e["ts"], where)
        for where in (other, Path(env["SKMQ_LOG_DIR"]))
        for e in log_events(where)
        if e["msgid"] in missed
    ]


async def _at_least(watch: OrderWatch, n: int) -> bool:
    return watch.total >= n


async def _produce_keyed(port: int, msgids: list[str]) -> None:
    client = await RawClient.connect(port)
    try:
        for m in msgids:
            client.send("queue", m.encode(), appid=APP, msgid=m, key=m.partition("-")[0])
        for m in msgids:
            resp = await client.resp()
            assert (resp["status"], resp["msgid"]) == ("ack", m), resp
    finally:
        await client.close()


async def test_keyed_and_unkeyed_messages_all_arrive(
    make_broker: BrokerFactory, redis: aioredis.Redis
) -> None:
    broker = await make_broker()
    watch = OrderWatch()
    rec = await FakeRecipient(APP, "r", watch.on_push).start()
    await registered(broker.server.port, rec)
    await _produce_keyed(broker.server.port, [f"k{i % 3}-{i // 3}" for i in range(30)])
    await produce(broker.server.port, APP, ["plain-0"])
    await settle(redis, broker, APP)
    assert {k: v for k, v in watch.seen.items()} == {
        "k0": list(range(10)),
        "k1": list(range(10)),
        "k2": list(range(10)),
        "plain": [0],
    }


async def test_the_client_sends_a_key(broker: Broker, redis: aioredis.Redis) -> None:
    async with Producer("127.0.0.1", broker.server.port) as producer:
        assert (await producer.send(APP, b"1", msgid="c1", key="K")).ok
        assert (await producer.send(APP, b"2", msgid="c2", key="K")).ok
    counts = (await broker.store.counts([APP], now_ms()))[APP]
    assert counts.pending == 1  # c2 waits for c1
