"""The owner's writes in Redis (skmq/queue/journal.py): leases, epochs and fencing, the
log, the journal, dedupe and checkpoints, against the tests' real Redis."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from skmq.embedded import EmbeddedRedis
from skmq.lifecycle import State
from skmq.queue.dead import flush_args
from skmq.queue.deliveries import QUEUE, Delivery
from skmq.queue.journal import (
    Appended,
    AppKeys,
    Fenced,
    Journal,
    acquire,
    append,
    release,
    renew,
    run_script,
)
from skmq.store.wire import Wire

NOW = 1_700_000_000_000
LEASE = 60_000
DEDUPE = 3_600_000


@pytest.fixture
def keys(prefix: str) -> AppKeys:
    return AppKeys.of(prefix, "orders{x}:1")


async def lengths(wire: Wire, keys: AppKeys) -> tuple[int, int]:
    return await wire.call("XLEN", keys.log), await wire.call("XLEN", keys.journal)


async def test_one_owner_at_a_time_and_a_takeover_fences_the_old_one(
    wire: Wire, keys: AppKeys
) -> None:
    a = await acquire(wire, keys, "A", LEASE)
    assert a is not None and a.epoch == 1
    assert await acquire(wire, keys, "B", LEASE) is None  # A's lease holds
    old = Journal(wire, keys, a, DEDUPE)
    await old.flush(NOW, [Appended(b"m1", b"one")], b"rec1")
    assert await lengths(wire, keys) == (1, 1)

    await wire.call("DEL", keys.owner)  # A's lease runs out (a pause, SIGSTOP)
    b = await acquire(wire, keys, "B", LEASE)
    assert b is not None and b.epoch == 2

    # A wakes: none of its writes lands
    with pytest.raises(Fenced) as fenced:
        await old.flush(NOW, [Appended(b"m2", b"two")], b"rec2", [b"m1"])
    assert (fenced.value.mine, fenced.value.current) == (1, 2)
    with pytest.raises(Fenced):
        await old.checkpoint(b"state", b"0-1", b"0-1", b"0-1")
    assert not await renew(wire, keys, a, LEASE)
    assert await lengths(wire, keys) == (1, 1)
    assert await wire.call("SCARD", keys.done(NOW // DEDUPE)) == 0

    new = Journal(wire, keys, b, DEDUPE)
    await new.flush(NOW, [Appended(b"m2", b"two")], b"rec2")
    assert await lengths(wire, keys) == (2, 2)


async def test_a_lease_run_out_that_nobody_took_is_renewed(wire: Wire, keys: AppKeys) -> None:
    a = await acquire(wire, keys, "A", LEASE)
    assert a is not None
    await wire.call("DEL", keys.owner)
    assert await renew(wire, keys, a, LEASE)
    assert await wire.call("GET", keys.owner) == b"A:1"
    assert await acquire(wire, keys, "B", LEASE) is None


async def test_release_lets_the_next_owner_in_with_a_new_epoch(wire: Wire, keys: AppKeys) -> None:
    a = await acquire(wire, keys, "A", LEASE)
    assert a is not None
    await release(wire, keys, a)
    b = await acquire(wire, keys, "B", LEASE)
    assert b is not None and b.epoch == a.epoch + 1
    with pytest.raises(Fenced):
        await Journal(wire, keys, a, DEDUPE).flush(NOW, records=b"late")


async def test_the_log_keeps_messages_and_refuses_msgids_settled_lately(
    wire: Wire, keys: AppKeys
) -> None:
    lease = await acquire(wire, keys, "A", LEASE)
    assert lease is not None
    journal = Journal(wire, keys, lease, DEDUPE)
    flushed = await journal.flush(
        NOW, [Appended(b"m1", b"plain"), Appended(b"m2", b"\r\nbinary\x00", b"t")]
    )
    ids = flushed.ids
    assert all(ids)
    entries = await wire.call("XRANGE", keys.log, "-", "+")
    assert [e[1] for e in entries] == [
        [b"m", b"m1", b"c", b"plain"],
        [b"m", b"m2", b"c", b"\r\nbinary\x00", b"h", b"t"],
    ]
    await journal.flush(NOW, settled=[b"m1"])
    again = await journal.flush(NOW + DEDUPE, [Appended(b"m1", b"again")])  # next bucket
    assert again.ids == [None]
    later = await journal.flush(NOW + 2 * DEDUPE, [Appended(b"m1", b"again")])
    assert later.ids[0] is not None  # two windows on: the msgid may be used again


async def test_a_store_on_another_broker_appends_to_the_inbox_and_tells_the_owner(
    wire: Wire, keys: AppKeys, redis_server: EmbeddedRedis
) -> None:
    client = aioredis.from_url(redis_server.url)
    pubsub = client.pubsub()
    try:
        await pubsub.subscribe(keys.wakeup)
        lease = await acquire(wire, keys, "A", LEASE)
        assert lease is not None
        await Journal(wire, keys, lease, DEDUPE).flush(NOW, settled=[b"gone"])
        stores = [Appended(b"new", b"x"), Appended(b"gone", b"y")]
        ids = await append(wire, keys, NOW, DEDUPE, stores)
        assert ids[0] is not None and ids[1] is None
        assert await wire.call("XLEN", keys.inbox) == 1
        assert await wire.call("XLEN", keys.log) == 0
        async with asyncio.timeout(5):
            told = None
            while told is None:  # (get_message answers None for the subscribe reply)
                told = await pubsub.get_message(ignore_subscribe_messages=True, timeout=5)
        assert told["channel"] == keys.wakeup.encode()
    finally:
        await pubsub.aclose()
        await client.aclose()


async def bury(journal: Journal, msgid: bytes, *rids: str) -> None:
    """`msgid` stored, then dead: a queue message, or a topic message's copies for `rids`."""
    (entry,) = (await journal.flush(NOW, [Appended(msgid, b"x", b"t" if rids else b"")])).ids
    assert entry is not None
    dead = [Delivery(entry, msgid, rid, State.DEAD, topic=True) for rid in rids]
    dead = dead or [Delivery(entry, msgid, QUEUE, State.DEAD)]
    await journal.flush(NOW, dead=flush_args(dead, NOW))


async def test_a_msgid_held_as_a_dead_letter_is_a_duplicate_until_its_letters_are_gone(
    wire: Wire, keys: AppKeys, prefix: str
) -> None:
    """A queue message's letter, and a topic message's while any copy of it is one: the
    owner's flush, another broker's append and a move into the app refuse the msgid; a
    purge or a move out frees it."""
    journals = []
    for app in (keys, other := AppKeys.of(prefix, "other")):
        lease = await acquire(wire, app, "A", LEASE)
        assert lease is not None
        journals.append(Journal(wire, app, lease, DEDUPE))
    journal, elsewhere = journals
    await bury(journal, b"q")
    await bury(journal, b"t", "r1", "r2")
    await bury(elsewhere, b"t", "r9")

    async def refused(msgid: bytes) -> tuple[bool, bool]:
        """Whether the owner's flush and another broker's append refuse it (else store it)."""
        stored = await journal.flush(NOW, [Appended(msgid, b"again")])
        appended = await append(wire, keys, NOW, DEDUPE, [Appended(msgid, b"again")])
        return stored.ids[0] is None, appended[0] is None

    async def purge(app: AppKeys, *ids: bytes) -> list[int]:
        dead = [app.dead, app.dead_order, app.dead_copies]
        return list(await run_script(wire, "dead_purge", dead, ids))

    assert await refused(b"q") == await refused(b"t") == (True, True)
    # (a move is a store into the target: OwnedStore.move)
    assert await append(wire, other, NOW, DEDUPE, [Appended(b"t", b"moved")]) == [None]

    assert await purge(keys, b"q", b"t\x1fr1") == [1, 1]
    assert await refused(b"q") == (False, False)
    assert await refused(b"t") == (True, True)  # its copy for r2 is still a dead letter
    assert await purge(other, b"t\x1fr9") == [1]
    assert await purge(keys, b"t\x1fr2") == [1]  # (moved out)
    assert await refused(b"t") == (False, False)
    assert await wire.call("EXISTS", keys.dead_copies, other.dead_copies) == 0


async def test_a_checkpoint_trims_the_journal_and_the_log(wire: Wire, keys: AppKeys) -> None:
    lease = await acquire(wire, keys, "A", LEASE)
    assert lease is not None
    journal = Journal(wire, keys, lease, DEDUPE)
    logged = (await journal.flush(NOW, [Appended(b"a", b"1"), Appended(b"b", b"2")], b"r1")).ids
    await journal.flush(NOW, records=b"r2")
    first, second = await wire.call("XRANGE", keys.journal, "-", "+")
    assert logged[1] is not None
    await journal.checkpoint(b"state@r1", first[0], logged[1], b"0-1")
    assert await wire.call("GET", keys.checkpoint) == b"state@r1"
    assert [e[0] for e in await wire.call("XRANGE", keys.journal, "-", "+")] == [second[0]]
    assert [e[1][1] for e in await wire.call("XRANGE", keys.log, "-", "+")] == [b"b"]


async def test_a_store_through_another_broker_lists_an_app_no_broker_owns(
    wire: Wire, keys: AppKeys
) -> None:
    """A broker that died between a first store's write and the app's listing left the
    app unlisted, so no ownership round would take it: a store sent again lists it,
    while no broker owns it (an owned app is listed: once its mark is set, not again)."""
    listed: list[str] = []

    async def lister(app: str) -> None:
        listed.append(app)

    await append(wire, keys, NOW, DEDUPE, [Appended(b"m1", b"x")], lister)
    await append(wire, keys, NOW, DEDUPE, [Appended(b"m1", b"x")], lister)  # sent again
    assert listed == [keys.app, keys.app]
    assert await acquire(wire, keys, "A", LEASE) is not None
    await append(wire, keys, NOW, DEDUPE, [Appended(b"m2", b"y")], lister)
    assert listed == [keys.app, keys.app]
