"""The engine's calls on the apps a broker owns (skmq/queue/owners.py), over the tests'
real Redis: the replies the delivery workers take, from the owners' memory."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from skmq.clock import now_ms
from skmq.lifecycle import State
from skmq.queue.deliveries import Policy
from skmq.queue.journal import AppKeys, acquire
from skmq.queue.owned_store import OwnedStore
from skmq.queue.owners import UNDELIVERABLE, Owners
from skmq.store import AliveRecipient, ClaimResult, Failed, NewMessage
from skmq.store.shards import WriteFailed
from skmq.store.wire import Wire
from skmq.store.wires import Wires
from tests.conftest import eventually

T = 1_700_000_000_000
POLICY = Policy(retry_times=2, backoff_ms=(100,), jitter=0.0, lease_ms=1_000)


async def owners(
    wire: Wire, prefix: str, *apps: str, rids: tuple[str, ...] = ("r1",), policy: Policy = POLICY
) -> Owners:
    o = Owners(Wires.over(wire), prefix, policy, 3_600_000, lambda app: list(rids))
    for app in apps:
        lease = await acquire(wire, AppKeys.of(prefix, app), "A", 60_000)
        assert lease is not None
        await o.gained(app, lease, T)
    return o


def alive(*rids: str, free: int = 10, length: bool = True) -> list[AliveRecipient]:
    return [AliveRecipient(r, free, length) for r in rids]


async def test_store_claim_ack_as_the_engine_calls_them(wire: Wire, prefix: str) -> None:
    o = await owners(wire, prefix, "orders")
    stored = await o.store(
        {"orders": [NewMessage("m1", "queue", b"one"), NewMessage("m1", "queue", b"dup")]}, T
    )
    assert stored == {"orders": [True, False]}
    claimed, _, _ = await o.claim("orders", T, 10, alive("r1"), ["r1"])
    assert [(c.delivery_id, c.content, c.attempt, c.recipient) for c in claimed] == [
        ("m1", b"one", 1, "r1")
    ]
    (done,) = await o.finish("orders", [("m1", 1)], T)
    assert done.ok and done.recipient == "r1"
    (again,) = await o.finish("orders", [("m1", 1)], T)
    assert not again.ok


async def test_failures_and_timeouts_retry_then_die(wire: Wire, prefix: str) -> None:
    o = await owners(wire, prefix, "orders")
    await o.store({"orders": [NewMessage("m1", "queue", b"x"), NewMessage("m2", "queue", b"y")]}, T)
    await o.claim("orders", T, 10, alive("r1"), ["r1", "r1"])
    (f,) = await o.fail("orders", [("m1", "rejected", "no", "r1", 1)], T)
    assert (f.code, f.due) == (Failed.RETRY, T + 100)
    (stale,) = await o.fail("orders", [("m2", "errored", "x", "someone-else", 1)], T)
    assert stale.code == Failed.STALE
    reaped = await o.reap(["orders"], T + 1_000)
    assert [(r.delivery_id, r.result.code) for r in reaped["orders"]] == [("m2", Failed.RETRY)]
    claimed, _, _ = await o.claim("orders", T + 1_100, 10, alive("r1"), ["r1", "r1"])
    assert sorted((c.msgid, c.attempt) for c in claimed) == [("m1", 2), ("m2", 2)]
    (dead,) = await o.fail("orders", [("m1", "errored", "boom", "r1", 2)], T + 1_200)
    assert dead.code == Failed.DEAD


async def test_topic_copies_go_to_recipients_with_room(wire: Wire, prefix: str) -> None:
    o = await owners(wire, prefix, "news", rids=("r1", "r2"))
    await o.store({"news": [NewMessage("t1", "topic", b"x"), NewMessage("t2", "topic", b"y")]}, T)
    claimed, _, _ = await o.claim("news", T, 10, [*alive("r1", free=1), *alive("r2", free=0)], [])
    assert [c.delivery_id for c in claimed] == ["t1\x1fr1"]
    claimed, _, _ = await o.claim("news", T, 10, alive("r1", "r2"), [])
    assert sorted(c.delivery_id for c in claimed) == ["t1\x1fr2", "t2\x1fr1", "t2\x1fr2"]


async def test_content_with_line_breaks_needs_the_length_capability(
    wire: Wire, prefix: str
) -> None:
    o = await owners(wire, prefix, "orders")
    await o.store({"orders": [NewMessage("m1", "queue", b"a\r\nb")]}, T)
    claimed, _, _ = await o.claim("orders", T, 1, alive("old", length=False), ["old"])
    assert [(c.kind, c.content) for c in claimed] == [("dead", UNDELIVERABLE.encode())]


async def test_a_broker_that_does_not_own_the_app_stores_to_its_inbox(
    wire: Wire, prefix: str
) -> None:
    owner = await owners(wire, prefix, "orders")
    other = await owners(wire, prefix)
    assert await other.store({"orders": [NewMessage("m1", "queue", b"x")]}, T) == {"orders": [True]}
    assert await other.claim("orders", T, 10, alive("r1"), ["r1"]) == ([], None, 0.0)
    owner.told("orders")
    claimed, _, _ = await owner.claim("orders", T, 10, alive("r1"), ["r1"])
    assert [c.delivery_id for c in claimed] == ["m1"]


async def test_an_app_just_taken_reads_its_inbox_at_its_first_claim(
    wire: Wire, prefix: str
) -> None:
    """A wake-up that came while the new owner loaded (the app not owned yet) was not
    heard: what another broker appended after the load read the inbox is read at the
    first claim all the same."""
    other = await owners(wire, prefix)
    owner = await owners(wire, prefix, "orders")
    assert await other.store({"orders": [NewMessage("m1", "queue", b"x")]}, T) == {"orders": [True]}
    claimed, _, _ = await owner.claim("orders", T, 10, alive("r1"), ["r1"])
    assert [c.delivery_id for c in claimed] == ["m1"]


async def test_a_msgid_held_as_a_dead_letter_is_a_duplicate_on_either_store_path(
    wire: Wire, prefix: str
) -> None:
    """A producer's store of a msgid the app holds as a dead letter (a queue message's, a
    topic message's copy) is refused, through the owner and through another broker."""
    last_try = Policy(retry_times=1, jitter=0.0, lease_ms=1_000)
    owner = await owners(wire, prefix, "orders", rids=("r1",), policy=last_try)
    other = await owners(wire, prefix, policy=last_try)
    first = [NewMessage("m1", "queue", b"x"), NewMessage("t1", "topic", b"y")]
    assert await owner.store({"orders": first}, T) == {"orders": [True, True]}
    claimed, _, _ = await owner.claim("orders", T, 10, alive("r1"), ["r1"])
    assert sorted(c.delivery_id for c in claimed) == ["m1", "t1\x1fr1"]
    failures = [(c.delivery_id, "errored", "boom", "r1", 1) for c in claimed]
    assert {f.code for f in await owner.fail("orders", failures, T)} == {Failed.DEAD}
    assert owner.holding(["m1", "t1"]) == {"m1": [], "t1": []}  # (out of its memory)

    again = [NewMessage("m1", "queue", b"x2"), NewMessage("t1", "topic", b"y2")]
    fresh = [*again, NewMessage("m2", "queue", b"z")]
    assert await owner.store({"orders": fresh}, T) == {"orders": [False, False, True]}
    assert await other.store({"orders": again}, T) == {"orders": [False, False]}
    assert await wire.call("XLEN", AppKeys.of(prefix, "orders").inbox) == 0


async def test_a_store_carries_its_claim_and_pushes_in_its_write(wire: Wire, prefix: str) -> None:
    """Owners.store with a plan (a dispatcher's carried claim): the new messages come
    back claimed, as `claim` gives them, with nothing left for the dispatcher to wait
    for but their leases."""
    o = await owners(wire, prefix, "orders")
    pushed: dict[str, ClaimResult] = {}
    msgs = [NewMessage("m1", "queue", b"one"), NewMessage("m2", "queue", b"two")]
    stored = await o.store({"orders": msgs}, T, None, {"orders": ["r1"]}, pushed)
    assert stored == {"orders": [True, True]}
    claimed, due, _ = pushed["orders"]
    assert [(c.delivery_id, c.content, c.attempt, c.recipient) for c in claimed] == [
        ("m1", b"one", 1, "r1")
    ]
    assert due == T  # (m2 waits: the dispatcher claims it at once)
    (done,) = await o.finish("orders", [("m1", 1)], T)
    assert done.ok


async def test_pushes_of_a_store_whose_caller_gave_up_are_handed_back(
    wire: Wire, prefix: str
) -> None:
    """A store past its deadline is answered as failed while its write goes on: what it
    would have pushed is handed back (no attempt spent) for the dispatcher, not left in
    flight with nobody pushing it until its lease runs out."""
    o = await owners(wire, prefix, "orders")
    pushed: dict[str, ClaimResult] = {}
    past = asyncio.get_running_loop().time() - 1
    msgs = {"orders": [NewMessage("m1", "queue", b"one")]}
    stored = await o.store(msgs, T, past, {"orders": ["r1"]}, pushed)
    assert isinstance(stored["orders"], WriteFailed)
    owner = o.owned["orders"]

    async def materialised() -> bool:
        return bool(owner.queue.deliveries)

    await eventually(materialised)
    d = owner.queue.deliveries[(b"m1", "")]
    assert (d.state, d.attempt, pushed) == (State.PENDING, 0, {})


async def test_a_claim_returns_once_its_pushes_are_journaled_and_a_stale_owner_pushes_nothing(
    wire: Wire, prefix: str
) -> None:
    """A push leaves only once a new owner would know of it: the claim's records are in
    the journal when it returns; an owner taken over meanwhile (its lease ran out in a
    stall) claims nothing, and is no longer the app's owner."""
    o = await owners(wire, prefix, "orders")
    keys = AppKeys.of(prefix, "orders")
    await o.store({"orders": [NewMessage("m1", "queue", b"one")]}, T)
    journaled = await wire.call("XLEN", keys.journal)
    claimed, _, _ = await o.claim("orders", T, 10, alive("r1"), ["r1"])
    assert [c.delivery_id for c in claimed] == ["m1"]
    assert await wire.call("XLEN", keys.journal) == journaled + 1  # (nothing flushed it else)

    await o.store({"orders": [NewMessage("m2", "queue", b"two")]}, T)
    await wire.call("DEL", keys.owner)  # (A's lease ran out while it stalled)
    assert await acquire(wire, keys, "B", 60_000) is not None
    assert await o.claim("orders", T, 10, alive("r1"), ["r1"]) == ([], None, 0.0)
    assert "orders" not in o.owned


async def test_an_ack_whose_answer_was_lost_is_found_acked(
    wire: Wire, redis: aioredis.Redis, prefix: str
) -> None:
    """OwnedStore.acked_of (the answers' reconcile): acked once its message is settled in
    the dedupe window; one still in flight is not."""
    store = OwnedStore(redis, prefix)
    store.owners = await owners(wire, prefix, "orders")
    await store.store({"orders": [NewMessage(m, "queue", b"x") for m in ("m1", "m2")]}, T)
    await store.claim("orders", T, 10, alive("r1"), ["r1", "r1"])
    (done,) = await store.finish("orders", [("m1", 1)], T)
    assert done.ok
    # (the owner settles by its own clock: the reconcile asks at now_ms(), as here)
    assert await store.acked_of("orders", ["m1", "m2"], now_ms()) == [True, False]
