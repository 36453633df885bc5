"""Consumer groups and pull consumption in the store: one test per pull transition of
skmq/lifecycle.py over a real Redis, refusals (stale receipts) included."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from skmq.clock import now_ms
from skmq.deliverylog import DeliveryLog
from skmq.pull.groups import (
    GroupDeadLetters,
    Groups,
    NoSuchGroup,
    Pulled,
    Receipt,
    Received,
    parse_receipt,
)
from skmq.pull.longpoll import LongPoll
from skmq.pull.position import MAX_MS, BadPosition, FuturePosition, parse_position
from skmq.pull.trimmer import Trimmer
from skmq.pull.wakeups import Wakeups
from skmq.queue.journal import AppKeys
from skmq.queue.owned_store import OwnedStore
from skmq.store import NewMessage, Retries
from skmq.store.wire import Wire
from tests.conftest import eventually
from tests.test_queue_owners import owners

APP = "pull"
NOW = 1_700_000_000_000
VIS = 10_000


@pytest.fixture
async def groups(redis: aioredis.Redis, wire: Wire, prefix: str) -> AsyncIterator[Groups]:
    yield Groups(await pull_store(redis, wire, prefix))


async def pull_store(redis: aioredis.Redis, wire: Wire, prefix: str) -> OwnedStore:
    """A broker's store that owns no app: a store appends to the app's inbox and feeds
    its consumer groups (skmq/queue/lua/feed.lua), as through a broker not its owner."""
    client = aioredis.Redis(connection_pool=redis.connection_pool)
    store = OwnedStore(client, prefix, retries=Retries(2, [1.0]), ack_timeout=10.0)
    store.owners = await owners(wire, prefix)
    return store


async def stored(groups: Groups, *msgids: str, at: int = 0) -> list[bool]:
    batch = {APP: [NewMessage(m, "queue", f"body-{m}".encode(), at) for m in msgids]}
    return (await groups.store.store(batch, NOW))[APP]


async def inbox(groups: Groups) -> list[bytes]:
    """The msgids of APP's inbox: the push queue's, for its owner to read."""
    entries = await groups.store.redis.xrange(AppKeys.of(groups.store.prefix, APP).inbox)
    return [fields[b"m"] for _, fields in entries]


async def received(groups: Groups, group: str, now: int = NOW, n: int = 10) -> list[Pulled]:
    return (await groups.receive(APP, group, now, n, VIS)).messages


def ids(got: list[Pulled]) -> list[str]:
    return [p.msgid for p in got]


def receipt(p: Pulled) -> Receipt:
    parsed = parse_receipt(p.receipt)
    assert parsed is not None
    return parsed


async def test_a_group_gets_what_is_stored_after_it_subscribed_and_each_group_all(
    groups: Groups,
) -> None:
    await stored(groups, "before")
    assert await groups.create(APP, "g1") and await groups.create(APP, "g2")
    assert not await groups.create(APP, "g1")
    assert await stored(groups, "a", "b", "a") == [True, True, False]
    await stored(groups, "a")  # (a duplicate in a later batch: not in the groups again)
    for group in ("g1", "g2"):
        got = await received(groups, group)
        assert ids(got) == ["a", "b"] and got[0].content == b"body-a"
        assert [p.attempt for p in got] == [1, 1]
    # "before" stays in the push queue (the app's inbox, its owner's), as before groups existed
    assert await inbox(groups) == [b"before"]


async def test_pull_only_apps_skip_the_push_queue_push_recipients_keep_theirs(
    groups: Groups,
) -> None:
    await groups.create(APP, "g")
    await stored(groups, "only-pulled")
    assert await inbox(groups) == []
    await groups.store.register(APP, "r1", {"id": "r1"}, NOW, 10)
    await stored(groups, "both")
    assert await inbox(groups) == [b"both"]
    assert ids(await received(groups, "g")) == ["only-pulled", "both"]


async def test_pull_receive_leases_hide_messages_from_the_group_and_no_group_is_refused(
    groups: Groups,
) -> None:
    await groups.create(APP, "g")
    await stored(groups, "a", "b", "c")
    assert ids(await received(groups, "g", n=2)) == ["a", "b"]
    assert ids(await received(groups, "g")) == ["c"]
    result = await groups.receive(APP, "g", NOW, 10, VIS)
    assert result.messages == [] and result.next_due == NOW + VIS + 1
    with pytest.raises(NoSuchGroup):
        await groups.receive(APP, "nope", NOW, 10, VIS)


async def test_pull_ack_settles_only_the_current_attempt_while_its_lease_runs(
    groups: Groups,
) -> None:
    await groups.create(APP, "g")
    await stored(groups, "a", "b")
    a, b = await received(groups, "g")
    assert await groups.ack(APP, "g", [receipt(a)], NOW) == [True]
    assert await groups.ack(APP, "g", [receipt(a)], NOW) == [False]  # settled already
    assert await groups.ack(APP, "g", [receipt(b)], NOW + VIS + 1) == [False]  # ran out
    # the lease that ran out is a failed attempt: redelivered after the backoff (1 s)
    assert await received(groups, "g", NOW + VIS + 1) == []
    again = await received(groups, "g", NOW + VIS + 1_001)
    assert ids(again) == ["b"] and again[0].attempt == 2
    assert await groups.ack(APP, "g", [receipt(b)], NOW + VIS + 1_001) == [False]  # stale
    assert await groups.ack(APP, "g", [receipt(again[0])], NOW + VIS + 1_001) == [2]


async def test_one_batch_acks_each_receipt_once_and_names_its_entries(groups: Groups) -> None:
    """A batch of receipts (pull_ack.lua reads and writes them in one call a key): the
    same receipt twice acks once; the msgids of its entries are found for the delivery
    log whether they are neighbours in the log or far apart (entries(): one XRANGE over
    their span, then one an entry it did not reach)."""
    await groups.create(APP, "g")
    msgids = [f"m{i}" for i in range(40)]
    await stored(groups, *msgids)
    got = await received(groups, "g", n=40)
    first, last = receipt(got[0]), receipt(got[-1])
    assert await groups.ack(APP, "g", [first, first, last], NOW) == [1, 0, 1]
    far = await groups.entries(APP, [last[0], "1-1", first[0]])
    assert far == [("m39", "queue"), ("", "queue"), ("m0", "queue")]
    near = await groups.entries(APP, [receipt(p)[0] for p in got[1:5]])
    assert [m for m, _ in near] == ["m1", "m2", "m3", "m4"]


async def test_a_settle_names_what_this_broker_handed_out_from_memory_and_the_rest_from_the_log(
    groups: Groups,
) -> None:
    """settled_entries: the entries a receive of this Groups handed out are named from
    its memory (their log entries deleted meanwhile, they are still named), once; those
    it forgot (past handed_max, or asked already) and another broker's are read from the
    log."""
    groups.handed_max = 3
    await groups.create(APP, "g")
    await stored(groups, "a", "b", "c", "d")
    got = await received(groups, "g")
    entries = [receipt(p)[0] for p in got]
    await groups.store.redis.xdel(groups.log_key(APP), *entries)
    # "a" was forgotten (the bound): read from the log, which no longer has it
    named = await groups.settled_entries(APP, "g", entries)
    assert named == [("", "queue"), ("b", "queue"), ("c", "queue"), ("d", "queue")]
    assert await groups.settled_entries(APP, "g", entries[1:2]) == [("", "queue")]  # asked
    other = Groups(groups.store)
    await stored(groups, "e")
    (e,) = await received(groups, "g")
    assert await other.settled_entries(APP, "g", [receipt(e)[0]]) == [("e", "queue")]
    assert await groups.settled_entries(APP, "other", [receipt(e)[0]]) == [("e", "queue")]


async def test_a_lease_that_ran_out_waits_its_backoff_from_its_end_not_from_when_noticed(
    groups: Groups,
) -> None:
    await groups.create(APP, "g")
    await stored(groups, "a")
    await received(groups, "g")
    # nobody received for 5 s after the lease's end: its 1 s backoff is over already
    (again,) = await received(groups, "g", NOW + VIS + 5_000)
    assert again.attempt == 2


async def test_pull_nack_waits_then_redelivers_and_dead_letters_after_retry_times(
    groups: Groups,
) -> None:
    await groups.create(APP, "g")
    await stored(groups, "a")
    (first,) = await received(groups, "g")
    assert await groups.nack(APP, "g", [(*receipt(first), 5_000)], NOW) == [(1, NOW + 5_000, 1)]
    assert await groups.nack(APP, "g", [(*receipt(first), 0)], NOW) == [(0, 0, 0)]  # stale
    (waiting,) = await groups.describe(APP, NOW + 4_999)
    assert (waiting.delayed, waiting.backlog) == (1, 0)
    (due,) = await groups.describe(APP, NOW + 5_000)  # (its wait ran out: a receive takes it)
    assert (due.delayed, due.backlog) == (0, 1)
    assert await received(groups, "g", NOW + 4_999) == []
    (second,) = await received(groups, "g", NOW + 5_000)
    assert second.attempt == 2
    assert await groups.nack(APP, "g", [(*receipt(second), -1)], NOW + 5_000) == [
        (2, NOW + 5_000, 2)
    ]
    info = (await groups.describe(APP))[0]
    assert (info.name, info.dead, info.in_flight, info.delayed) == ("g", 1, 0, 0)


async def test_pull_extend_keeps_a_lease_running(groups: Groups) -> None:
    await groups.create(APP, "g")
    await stored(groups, "a")
    (got,) = await received(groups, "g")
    assert await groups.extend(APP, "g", [(*receipt(got), 60_000)], NOW + 5_000) == [True]
    assert await received(groups, "g", NOW + VIS + 1_001) == []  # still leased
    assert await groups.ack(APP, "g", [receipt(got)], NOW + 60_000) == [True]
    assert await groups.extend(APP, "g", [(*receipt(got), 1)], NOW) == [False]


async def test_delayed_messages_reach_groups_when_due(groups: Groups) -> None:
    await groups.create(APP, "g")
    await stored(groups, "later", at=NOW + 30_000)
    result = await groups.receive(APP, "g", NOW, 10, VIS)
    assert result.messages == [] and result.next_due == NOW + 30_000
    assert ids(await received(groups, "g", NOW + 30_000)) == ["later"]


async def test_reset_and_delete_a_group(groups: Groups) -> None:
    await groups.create(APP, "g")
    await stored(groups, "a", "b")
    assert ids(await received(groups, "g", n=1)) == ["a"]
    assert await groups.reset(APP, "g", "earliest")
    assert ids(await received(groups, "g")) == ["a", "b"]
    assert await groups.reset(APP, "g", "latest")
    assert await received(groups, "g") == []
    assert (await groups.describe(APP))[0].backlog == 0
    assert await groups.delete(APP, "g") and not await groups.delete(APP, "g")
    assert not await groups.reset(APP, "g", "latest")
    assert await groups.describe(APP) == []


async def test_a_receipt_from_before_a_reset_or_a_delete_settles_nothing_after(
    groups: Groups,
) -> None:
    await groups.create(APP, "g")
    await groups.create(APP, "other")  # (the log stays while the app has a group)
    await stored(groups, "a")
    (before,) = await received(groups, "g")
    assert await groups.reset(APP, "g", "earliest")
    (after,) = await received(groups, "g")
    # the same entry and attempt, another generation
    assert receipt(after)[:2] == receipt(before)[:2] and after.receipt != before.receipt
    assert await groups.ack(APP, "g", [receipt(before)], NOW) == [False]
    assert await groups.nack(APP, "g", [(*receipt(before), -1)], NOW) == [(0, 0, 0)]
    assert await groups.extend(APP, "g", [(*receipt(before), 1)], NOW) == [False]
    assert await groups.delete(APP, "g") and await groups.create(APP, "g")
    assert await groups.reset(APP, "g", "earliest")
    (again,) = await received(groups, "g")
    assert receipt(again)[:2] == receipt(after)[:2]
    assert await groups.ack(APP, "g", [receipt(after)], NOW) == [False]
    assert await groups.ack(APP, "g", [receipt(again)], NOW) == [True]


async def test_a_message_whose_ttl_ran_out_is_never_handed_to_a_group(groups: Groups) -> None:
    await groups.create(APP, "g")
    batch = [
        NewMessage("short", "queue", b"s", 0, NOW + 1_000),
        NewMessage("delayed", "queue", b"d", NOW + 5_000, NOW + 2_000),  # due after its expiry
        NewMessage("nacked", "queue", b"n", 0, NOW + 3_000),
        NewMessage("forever", "queue", b"f"),
    ]
    await groups.store.store({APP: batch}, NOW)
    (first,) = (await groups.receive(APP, "g", NOW, 1, VIS)).messages
    assert first.msgid == "short"  # still alive at NOW
    assert await groups.nack(APP, "g", [(*receipt(first), 0)], NOW) == [(1, NOW, 1)]
    got = await groups.receive(APP, "g", NOW + 1_000, 10, VIS)
    assert ids(got.messages) == ["nacked", "forever"] and ids(got.expired) == ["short"]
    assert (got.expired[0].content, got.expired[0].attempt, got.expired[0].receipt) == (
        b"dead",
        1,
        "",
    )
    assert got.next_due == NOW + 2_000  # the delayed one falls due at its expiry
    nack = [(*receipt(got.messages[0]), 5_000)]
    assert await groups.nack(APP, "g", nack, NOW + 1_000) == [(1, NOW + 3_000, 1)]  # its expiry
    got = await groups.receive(APP, "g", NOW + 2_000, 10, VIS)
    assert got.messages == [] and ids(got.expired) == ["delayed"]
    got = await groups.receive(APP, "g", NOW + 3_000, 10, VIS)
    assert got.messages == [] and ids(got.expired) == ["nacked"]
    info = (await groups.describe(APP))[0]
    assert (info.dead, info.delayed, info.in_flight) == (3, 0, 1)  # "forever" still leased


async def test_with_expired_drop_an_expired_message_leaves_the_group(groups: Groups) -> None:
    groups.store.expired_drop = True
    await groups.create(APP, "g")
    await groups.store.store({APP: [NewMessage("short", "queue", b"s", 0, NOW + 1)]}, NOW)
    got = await groups.receive(APP, "g", NOW + 1, 10, VIS)
    assert got.messages == [] and [p.content for p in got.expired] == [b"drop"]
    info = (await groups.describe(APP))[0]
    assert (info.dead, info.delayed, info.in_flight) == (0, 0, 0)
    assert await groups.trim(APP) == 1  # no group holds it any more


async def test_a_group_hands_out_one_message_of_an_ordering_key_at_a_time(
    groups: Groups,
) -> None:
    await groups.create(APP, "g")
    keyed = [("a1", "a"), ("b1", "b"), ("a2", "a"), ("a3", "a"), ("b2", "b"), ("free", "")]
    batch = [NewMessage(m, "queue", b"", 0, 0, key) for m, key in keyed]
    await groups.store.store({APP: batch}, NOW)
    a1, b1, free = await received(groups, "g")
    assert ids([a1, b1, free]) == ["a1", "b1", "free"]
    assert await received(groups, "g") == []  # a2, a3, b2 wait for their key
    # a retry holds its key: a2 still waits
    assert await groups.nack(APP, "g", [(*receipt(a1), 0)], NOW) == [(1, NOW, 1)]
    (again,) = await received(groups, "g")
    assert (again.msgid, again.attempt) == ("a1", 2)
    assert await groups.ack(APP, "g", [receipt(again), receipt(b1)], NOW) == [2, 1]
    a2, b2 = await received(groups, "g")
    assert ids([a2, b2]) == ["a2", "b2"]
    # a dead letter ends its turn too (retry_times 2, backoff 1 s)
    assert await groups.nack(APP, "g", [(*receipt(a2), -1)], NOW) == [(1, NOW + 1_000, 1)]
    (a2,) = await received(groups, "g", NOW + 1_000)
    assert await groups.nack(APP, "g", [(*receipt(a2), -1)], NOW + 1_000) == [(2, NOW + 1_000, 2)]
    assert ids(await received(groups, "g", NOW + 1_000)) == ["a3"]
    # a reset starts every key again from the first entry it reads
    assert await groups.reset(APP, "g", "earliest")
    assert ids(await received(groups, "g")) == ["a1", "b1", "free"]


async def test_an_expired_message_ends_its_keys_turn_in_a_group(groups: Groups) -> None:
    await groups.create(APP, "g")
    batch = [
        NewMessage("k1", "queue", b"", 0, NOW + 1_000, "k"),
        NewMessage("k2", "queue", b"", 0, 0, "k"),
    ]
    await groups.store.store({APP: batch}, NOW)
    (k1,) = await received(groups, "g")
    # its retry falls due at its expiry
    assert await groups.nack(APP, "g", [(*receipt(k1), 2_000)], NOW) == [(1, NOW + 1_000, 1)]
    got = await groups.receive(APP, "g", NOW + 1_000, 10, VIS)
    assert ids(got.expired) == ["k1"] and got.messages == []
    assert ids(await received(groups, "g", NOW + 1_000)) == ["k2"]


async def test_a_groups_dead_letters_are_listed_replayed_and_purged(groups: Groups) -> None:
    await groups.create(APP, "g")
    expiring = NewMessage("x", "queue", b"body-x", NOW + 5, NOW + 1)
    await stored(groups, "a", "b")
    await groups.store.store({APP: [expiring]}, NOW)
    for p in await received(groups, "g"):
        assert await groups.nack(APP, "g", [(*receipt(p), -1)], NOW) == [(1, NOW + 1_000, 1)]
    for p in await received(groups, "g", NOW + 1_000):
        due = NOW + 1_000
        assert await groups.nack(APP, "g", [(*receipt(p), -1)], due) == [(2, due, 2)]
    assert (await groups.receive(APP, "g", NOW + 1_000, 10, VIS)).messages == []
    dead = await GroupDeadLetters(groups, "g").dead_letters(APP)
    assert [(d.msgid, d.recipient, d.attempts, d.content) for d in dead] == [
        ("a", "group:g", 2, b"body-a"),
        ("b", "group:g", 2, b"body-b"),
        ("x", "group:g", 0, b"body-x"),  # expired (its TTL ran out before it was received)
    ]
    assert dead[0].last_error == "nack" and dead[2].last_error.startswith("expired")
    assert abs(dead[0].stored_at - time.time() * 1000) < 60_000  # the log entry's (Redis) time
    assert dead[0].died_at == NOW + 1_000
    # replay: due now, attempts reset, TTL lifted; purge: gone, its log entry free
    a, b, x = (d.delivery_id for d in dead)
    assert await groups.replay(APP, "g", [a, x], NOW + 2_000) == [True, True]
    assert await groups.replay(APP, "g", [a], NOW + 2_000) == [False]  # not dead now
    again = await received(groups, "g", NOW + 2_000)
    assert sorted((p.msgid, p.attempt) for p in again) == [("a", 1), ("x", 1)]
    assert await groups.purge(APP, "g", [b]) == [True]
    assert await groups.purge(APP, "g", [b]) == [False]
    assert await GroupDeadLetters(groups, "g").dead_letters(APP) == []
    assert await groups.ack(APP, "g", [receipt(p) for p in again], NOW + 2_000) == [True, True]
    assert await groups.trim(APP) == 3  # nothing of the group held any more


async def test_a_receipt_from_before_a_replay_settles_nothing_after_it(groups: Groups) -> None:
    """A replay renews the attempts (attempt 1 again), not the receipts: the consumer
    still holding attempt 1's receipt from before must not settle the new attempt 1."""
    await groups.create(APP, "g")
    await stored(groups, "a")
    (first,) = await received(groups, "g")
    assert await groups.nack(APP, "g", [(*receipt(first), 0)], NOW) == [(1, NOW, 1)]
    (second,) = await received(groups, "g")
    assert await groups.nack(APP, "g", [(*receipt(second), 0)], NOW) == [(2, NOW, 2)]  # dead
    (dead,) = await GroupDeadLetters(groups, "g").dead_letters(APP)
    assert await groups.replay(APP, "g", [dead.delivery_id], NOW) == [True]
    (replayed,) = await received(groups, "g")
    assert replayed.attempt == 1 and replayed.receipt != first.receipt
    assert await groups.ack(APP, "g", [receipt(first)], NOW) == [0]
    assert await groups.nack(APP, "g", [(*receipt(first), 0)], NOW) == [(0, 0, 0)]
    assert await groups.ack(APP, "g", [receipt(replayed)], NOW) == [1]


async def entry_fields(groups: Groups, group: str) -> list[bytes]:
    """The fields of a group's gstate that belong to entries (not the group's own)."""
    gstate = groups.store.base(APP) + f"g:{group}:gstate"
    return sorted(f for f in await groups.store.redis.hkeys(gstate) if not f.startswith(b"\x1f"))


@pytest.mark.parametrize("made_before_plain", [False, True])
async def test_an_ack_leaves_none_of_an_entrys_fields_plain_group_or_not(
    groups: Groups, made_before_plain: bool
) -> None:
    """A plain group (no entry with a last error, a lifted TTL or replayed attempts:
    pull_lib.lua's \x1fp) acks by an entry's attempts alone; a nack or a replay ends
    that, and a group made before the flag never had it."""
    await groups.create(APP, "g")
    gstate = groups.store.base(APP) + "g:g:gstate"
    if made_before_plain:
        await groups.store.redis.hdel(gstate, "\x1fp")
    await stored(groups, "a", "b")
    got = await received(groups, "g")
    assert await groups.ack(APP, "g", [receipt(got[0])], NOW) == [1]
    assert await groups.nack(APP, "g", [(*receipt(got[1]), 0)], NOW) == [(1, NOW, 1)]
    assert await groups.store.redis.hexists(gstate, "\x1fp") is False
    (again,) = await received(groups, "g")
    assert await groups.nack(APP, "g", [(*receipt(again), 0)], NOW) == [(2, NOW, 2)]  # dead
    (dead,) = await GroupDeadLetters(groups, "g").dead_letters(APP)
    assert await groups.replay(APP, "g", [dead.delivery_id], NOW) == [True]
    (replayed,) = await received(groups, "g")
    assert await entry_fields(groups, "g") != []
    assert await groups.ack(APP, "g", [receipt(replayed)], NOW) == [1]  # since the replay
    assert await entry_fields(groups, "g") == []
    await groups.reset(APP, "g", "latest")  # plain again
    assert await groups.store.redis.hexists(gstate, "\x1fp") is True
    await stored(groups, "c")
    (c,) = await received(groups, "g")
    assert await entry_fields(groups, "g") == [f"{receipt(c)[0]}\x1fn".encode()]
    assert await groups.ack(APP, "g", [receipt(c)], NOW) == [1]
    assert await entry_fields(groups, "g") == []


async def test_a_receive_cancelled_mid_call_lets_what_it_leased_go(
    groups: Groups, redis: aioredis.Redis, prefix: str
) -> None:
    """An HTTP client hanging up cancels its poll while the receive script runs: the
    message it leased to nobody comes back after the retry backoff (1 s), not after its
    lease of 10 minutes."""
    await groups.create(APP, "g")
    await stored(groups, "a")
    poll = LongPoll(groups, Wakeups(redis, prefix), 10)
    gone = asyncio.create_task(poll.receive(APP, "g", 1, 0, 600_000, lambda _: None))
    await asyncio.sleep(0)  # (its receive is under way)
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    got: list[Pulled] = []

    async def back() -> bool:
        got.extend((await groups.receive(APP, "g", now_ms(), 1, VIS)).messages)
        return bool(got)

    await eventually(back)
    assert got[0].msgid == "a" and got[0].attempt == 2


async def test_a_receive_cancelled_mid_call_still_tells_the_leases_it_ended(
    groups: Groups, redis: aioredis.Redis, prefix: str
) -> None:
    """The receive script of a poll cancelled meanwhile (its client gone) ends the leases
    that ran out all the same: they go to on_ended (the delivery log's timeout and retry
    lines), as an answered receive's do; nothing else would tell them."""
    await groups.create(APP, "g")
    await stored(groups, "a")
    (leased,) = (await groups.receive(APP, "g", now_ms() - 60_000, 1, 1)).messages
    ended: list[Received] = []
    poll = LongPoll(groups, Wakeups(redis, prefix), 10)
    gone = asyncio.create_task(poll.receive(APP, "g", 1, 0, 600_000, ended.append))
    await asyncio.sleep(0)  # (its receive is under way)
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone

    async def told() -> bool:
        return bool(ended)

    await eventually(told)
    (got,) = ended
    assert [(p.msgid, p.attempt, p.receipt) for p in got.ran_out] == [("a", 1, leased.receipt)]


def test_receipts_parse_with_and_without_a_generation() -> None:
    assert parse_receipt("17-0.2.1795441220512345") == ("17-0", 2, "1795441220512345")
    assert parse_receipt("17-0.2") == ("17-0", 2, "0")  # a group made before generations
    assert parse_receipt("17-0.2.") is None and parse_receipt("17-0") is None


async def test_group_trim_drops_only_what_no_group_needs(groups: Groups) -> None:
    redis, base = groups.store.redis, groups.store.base(APP)
    await groups.create(APP, "fast")
    await groups.create(APP, "slow")
    await stored(groups, "a", "b", "c")
    fast = await received(groups, "fast")
    assert await groups.ack(APP, "fast", [receipt(fast[0]), receipt(fast[1])], NOW) == [True] * 2
    assert await groups.trim(APP) == 0  # "slow" has read nothing
    slow = await received(groups, "slow", n=2)
    assert await groups.ack(APP, "slow", [receipt(slow[0])], NOW) == [True]
    # a: settled by both; b: leased by "slow"; c: leased by "fast", unread by "slow"
    assert await groups.trim(APP) == 1
    assert [m[1][b"m"] for m in await redis.xrange(base + "glog")] == [b"b", b"c"]
    assert await redis.hkeys(base + "gseen") == [b"b", b"c"]
    assert await stored(groups, "a") == [True]  # its msgid may be used again
    await groups.delete(APP, "fast")
    assert await redis.xlen(base + "glog") == 3
    await groups.delete(APP, "slow")  # the last group: the whole log goes with it
    assert await groups.trim(APP) == 0
    assert await redis.exists(base + "glog", base + "gseen", base + "gadded") == 0


async def test_one_broker_a_round_trims_every_app_with_a_group_log(groups: Groups) -> None:
    await groups.create(APP, "g")
    await stored(groups, "a")
    (got,) = await received(groups, "g")
    await groups.ack(APP, "g", [receipt(got)], NOW)
    first, second = Trimmer(groups, "b1", 5.0), Trimmer(groups, "b2", 5.0)
    assert await first.trim_once() == 1
    await stored(groups, "b")
    (got,) = await received(groups, "g")
    await groups.ack(APP, "g", [receipt(got)], NOW)
    assert await second.trim_once() == 0  # b1's turn holds this round


async def test_an_app_with_only_consumer_groups_is_not_forgotten(groups: Groups) -> None:
    """No recipient and no push message, but a group: the app stays listed (its group
    log is trimmed through the apps listing), until its last group is deleted."""
    store = groups.store
    await groups.create("grouped", "g1")
    assert await store.forget_apps(["grouped"]) == []
    assert "grouped" in await store.apps()
    await groups.delete("grouped", "g1")
    assert await store.forget_apps(["grouped"]) == ["grouped"]


async def log_entries(groups: Groups) -> list[tuple[str, int]]:
    """(msgid, ms of Redis's clock when stored) of each group-log entry."""
    entries = await groups.store.redis.xrange(groups.log_key(APP))
    return [(f[b"m"].decode(), int(eid.split(b"-")[0])) for eid, f in entries]


async def stored_over_two_ms(groups: Groups) -> list[tuple[str, int]]:
    """Messages stored one by one until the log spans two ms of Redis's clock (however
    fast this machine stores them): the log's entries then."""
    await stored(groups, "a", "b")
    n = 0
    while len({ms for _, ms in await log_entries(groups)}) < 2:
        n += 1
        await stored(groups, f"c{n}")
    return await log_entries(groups)


async def backlogs(groups: Groups) -> dict[str, int]:
    return {g.name: g.backlog for g in await groups.describe(APP)}


async def test_a_group_starts_at_latest_earliest_or_a_time(groups: Groups) -> None:
    await groups.create(APP, "first")
    entries = await stored_over_two_ms(groups)
    at = entries[-1][1]  # the last ms: from the entries stored at or after it
    assert await groups.create(APP, "latest")  # (the default)
    assert await groups.create(APP, "earliest", "earliest")
    assert await groups.create(APP, "at", at)
    assert await groups.create(APP, "zero", 0)
    assert not await groups.create(APP, "at", "earliest")  # it exists: left as it is
    since = [m for m, ms in entries if ms >= at]
    assert 0 < len(since) < len(entries)
    everything = [m for m, _ in entries]
    expected = {"first": everything, "latest": [], "earliest": everything, "at": since}
    assert await backlogs(groups) == {
        k: len(v) for k, v in {**expected, "zero": everything}.items()
    }
    for group, msgids in expected.items():
        assert ids(await received(groups, group, n=100)) == msgids
    assert await stored(groups, "z") == [True]
    assert await backlogs(groups) == {
        "first": 1,
        "latest": 1,
        "earliest": 1,
        "at": 1,
        "zero": 1 + len(entries),
    }
    # reset moves a group to a time as well (its backlog counted from there)
    assert await groups.reset(APP, "latest", at)
    assert ids(await received(groups, "latest", n=100)) == [*since, "z"]


async def test_earliest_is_what_the_group_log_still_holds(groups: Groups) -> None:
    await stored(groups, "before")  # no group yet: never in the group log
    await groups.create(APP, "g")
    await stored(groups, "a", "b")
    (a,) = await received(groups, "g", n=1)
    assert await groups.ack(APP, "g", [receipt(a)], NOW) == [True]
    assert await groups.trim(APP) == 1  # "a": read and acked by every group
    assert await groups.create(APP, "late", "earliest")
    assert await backlogs(groups) == {"g": 1, "late": 1}
    for group in ("g", "late"):
        (b,) = await received(groups, group)
        assert b.msgid == "b" and await groups.ack(APP, group, [receipt(b)], NOW) == [True]
    assert await groups.trim(APP) == 1  # the log is empty now: its count goes on
    assert await groups.store.redis.xlen(groups.log_key(APP)) == 0
    await stored(groups, "c")
    assert await groups.create(APP, "later", "earliest")
    assert await backlogs(groups) == {"g": 1, "late": 1, "later": 1}
    assert ids(await received(groups, "later")) == ["c"]
    assert await backlogs(groups) == {"g": 1, "late": 1, "later": 0}


def started(detail: str) -> int:
    """The start a group change's detail logs (`stored from <ms>`)."""
    found = re.search(r"stored from (\d+)", detail)
    assert found is not None, detail
    return int(found[1])


async def test_a_groups_start_is_logged_and_its_last_deletion_drops_the_log(
    groups: Groups, tmp_path: Path
) -> None:
    """A group's making and reset log from when it gets the messages stored (Redis's
    clock, erring later: docs/AUDIT.md), its deletion is logged, and the app's last
    group takes the group log with it: a group made later from `earliest` gets nothing
    stored while the app had no group."""
    dlog = DeliveryLog(tmp_path, "t")
    logged = Groups(groups.store, dlog)
    before = (await groups.store.redis.time())[0] * 1000
    assert await logged.create(APP, "a")
    await stored(groups, "m1", "m2")
    ((first, _), *_) = await groups.store.redis.xrange(logged.log_key(APP))
    assert await logged.create(APP, "e", "earliest")
    assert await logged.reset(APP, "e", 0)
    assert await logged.delete(APP, "a")
    assert await groups.store.redis.xlen(logged.log_key(APP)) == 2  # e needs them
    assert await logged.delete(APP, "e")
    base = groups.store.base(APP)
    assert (
        await groups.store.redis.exists(logged.log_key(APP), base + "gseen", base + "gadded") == 0
    )
    await stored(groups, "gap")  # no group: never in a group log
    assert await logged.create(APP, "late", "earliest")
    assert await received(groups, "late") == []
    dlog.close()
    lines = [
        json.loads(x) for f in sorted(tmp_path.glob("*.jsonl")) for x in f.read_text().splitlines()
    ]
    changes = [(e["event"], e["recipient"], e["detail"]) for e in lines]
    first_ms = int(first.split(b"-")[0])
    (_, _, made_a), *rest = changes
    assert made_a.startswith("consumer group made at latest; stored from ")
    a_from = started(made_a)
    assert before < a_from <= first_ms + 1  # (m1's entry: stored after, perhaps in that ms)
    late = started(rest[-1][2])
    # earliest, nothing trimmed: from the app's first group; each start a new generation
    assert [started(detail) for _, _, detail in rest[:2]] == [a_from, a_from]
    assert [detail.split(";")[0] for _, _, detail in rest[:2]] == [
        "consumer group made at earliest", "consumer group reset at 0"
    ]  # fmt: skip
    gens = [re.search(r"; generation (\d+)$", detail) for _, _, detail in rest[:2]]
    assert all(gens) and len({g[1] for g in gens if g}) == 2
    assert [(event, who) for event, who, _ in rest[:-1]] == [
        ("recipient_registered", "group:e"),
        ("recipient_registered", "group:e"),
        ("recipient_removed", "group:a"),
        ("recipient_removed", "group:e"),
    ]
    assert rest[2][2] == rest[3][2] == "consumer group deleted"
    assert rest[-1][:2] == ("recipient_registered", "group:late") and late > first_ms


async def test_earliest_after_a_trim_is_logged_past_the_last_entry_trimmed(
    groups: Groups, tmp_path: Path
) -> None:
    """Once the log was trimmed, `earliest` starts past the last entry trimmed: the start
    logged is the ms after that entry's (erring later: docs/AUDIT.md)."""
    dlog = DeliveryLog(tmp_path, "t")
    logged = Groups(groups.store, dlog)
    await logged.create(APP, "a")
    await stored(groups, "m1")
    await stored(groups, "m2")
    (m1,) = await received(groups, "a", n=1)
    assert await groups.ack(APP, "a", [receipt(m1)], NOW) == [True]
    (trimmed, _), _ = await groups.store.redis.xrange(logged.log_key(APP))
    assert await groups.trim(APP) == 1
    assert await logged.create(APP, "e", "earliest")
    dlog.close()
    (line,) = [x for f in tmp_path.glob("*.jsonl") for x in f.read_text().splitlines()][-1:]
    assert started(json.loads(line)["detail"]) == int(trimmed.split(b"-")[0]) + 1


async def test_a_time_after_the_stores_clock_is_refused(groups: Groups) -> None:
    later = now_ms() + 3_600_000
    with pytest.raises(FuturePosition, match="after the store's clock"):
        await groups.create(APP, "g", later)
    assert await groups.describe(APP) == []
    await groups.create(APP, "g")
    await stored(groups, "a")
    (a,) = await received(groups, "g")
    with pytest.raises(FuturePosition):
        await groups.reset(APP, "g", later)
    # nothing done: the lease and its receipt hold
    assert await groups.ack(APP, "g", [receipt(a)], NOW) == [True]


@pytest.mark.parametrize(
    ("given", "position"),
    [
        ("latest", "latest"),
        ("earliest", "earliest"),
        (0, 0),
        (1795441224889, 1795441224889),
        ("1795441224889", 1795441224889),
        ("2026-11-28T12:00:00Z", 1795867200000),
        ("2026-11-28T13:00:00.250+01:00", 1795867200250),
        (MAX_MS, MAX_MS),
    ],
)
def test_positions_parse(given: str | int, position: str | int) -> None:
    assert parse_position(given) == position


@pytest.mark.parametrize(
    ("given", "why"),
    [
        ("Latest", "'Latest' is not one of latest"),
        ("", "'' is not one of latest"),
        (-1, "a time in unix ms is 0 to"),
        (MAX_MS + 1, "a time in unix ms is 0 to"),
        ("9" * 16, "a time in unix ms is 0 to"),
        ("2026-11-28T12:00:00", "'2026-11-28T12:00:00': an ISO-8601 time needs its offset"),
        ("1969-12-31T23:59:59Z", "a time in unix ms is 0 to"),
        ("x" * 10_000, "not one of latest"),
        ("١٢٣", "not one of latest"),
        (True, "must be a string or an integer"),
        (1.5, "must be a string or an integer"),
        (None, "must be a string or an integer"),
        (["latest"], "must be a string or an integer"),
    ],
)
def test_bad_positions_are_refused(given: object, why: str) -> None:
    with pytest.raises(BadPosition) as refused:
        parse_position(given)
    assert str(refused.value).startswith(why)


async def test_backlogs_past_10001_are_exact(groups: Groups) -> None:
    await groups.create(APP, "g")
    total = 12_345
    for start in range(0, total, 1000):  # straight into the store, a thousand a call
        batch = [NewMessage(f"m{i}", "queue", b"x") for i in range(start, min(total, start + 1000))]
        assert all((await groups.store.store({APP: batch}, NOW))[APP])
    assert await backlogs(groups) == {"g": total}
    assert len(await received(groups, "g", n=100)) == 100
    await groups.create(APP, "e", "earliest")
    await groups.create(APP, "l")
    assert await backlogs(groups) == {"e": total, "g": total - 100, "l": 0}
    await stored(groups, "one-more")
    assert await backlogs(groups) == {"e": total + 1, "g": total - 99, "l": 1}


async def test_a_group_or_log_from_before_the_count_is_counted_by_reading(
    groups: Groups,
) -> None:
    """A log whose entries have no count `n`, and a group without its `\\x1fr` (both made
    by a version before them): counted by reading the log, until the group reads an
    entry that has its count."""
    redis, base = groups.store.redis, groups.store.base(APP)
    await groups.create(APP, "g")
    for m in ("old1", "old2", "old3"):  # as the store wrote them before
        await redis.xadd(base + "glog", {"m": m, "k": "q", "c": b"x", "d": 0})
    await redis.hdel(base + "g:g:gstate", "\x1fr")
    assert await backlogs(groups) == {"g": 3}
    await stored(groups, "new")  # counted after the log's entries then
    await groups.create(APP, "e", "earliest")
    assert await backlogs(groups) == {"e": 4, "g": 4}
    assert ids(await received(groups, "g", n=1)) == ["old1"]
    assert await backlogs(groups) == {"e": 4, "g": 3}  # (still read)
    assert ids(await received(groups, "g", n=3)) == ["old2", "old3", "new"]
    assert ids(await received(groups, "e", n=2)) == ["old1", "old2"]
    await stored(groups, "newer")
    assert await backlogs(groups) == {"e": 3, "g": 1}


async def test_every_script_touches_only_the_keys_it_declares(groups: Groups) -> None:
    """Redis Cluster routes a script by the keys it declares: MONITOR shows each EVALSHA
    with its KEYS, then every command the script ran. The store's scripts (recipients,
    consumer groups: skmq/store/scripts.py) and the owners' inbox append, once each."""
    store, end = groups.store, f"{groups.store.prefix}:monitor-end"
    touched: list[tuple[list[str], str, str]] = []
    ready, ended = asyncio.Event(), asyncio.Event()

    async def watch() -> None:
        async with store.redis.monitor() as monitor:
            ready.set()
            keys: list[str] = []
            async for entry in monitor.listen():
                args = entry["command"].split(" ")
                if args[0].upper() == "EVALSHA":
                    keys = args[3 : 3 + int(args[2])]
                elif entry.get("client_type") == "lua" and len(args) > 1:
                    touched.append((keys, args[0], args[1]))
                elif end in entry["command"]:
                    ended.set()

    task = asyncio.create_task(watch())
    await ready.wait()
    await store.load_scripts()
    await store.register(APP, "r1", {"id": "r1", "host": "h", "port": 1}, NOW, 10)
    assert await store.register(APP, "r1", {"id": "r1", "host": "h", "port": 2}, NOW, 10) == "h:1"
    await store.set_state(APP, "r1", False, NOW)
    await groups.create(APP, "g")
    keyed = [NewMessage(m, "queue", b"x", 0, 0, "k") for m in ("k1", "k2")]
    expiring = NewMessage("p3", "queue", b"z", NOW + 5, NOW + 1)  # due at its expiry
    await store.store({APP: [NewMessage("p1", "queue", b"y"), *keyed, expiring]}, NOW)
    await store.unregister(APP, "r1")
    got = await received(groups, "g", n=5)
    leased = [receipt(p) for p in got]
    await groups.extend(APP, "g", [(*leased[0], 1000)], NOW)
    await groups.nack(APP, "g", [(*leased[0], 0)], NOW)
    await groups.ack(APP, "g", leased[1:2], NOW)  # k1: k2 may go
    again = await groups.receive(APP, "g", NOW + 1, 5, 1000)
    assert ids(again.expired) == ["p3"] and "k2" in ids(again.messages)
    await groups.reset(APP, "g", "latest")
    await groups.trim(APP)
    await groups.delete(APP, "g")
    await store.redis.set(end, 1)
    async with asyncio.timeout(10):
        await ended.wait()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    assert len(touched) > 30
    assert [(cmd, key) for keys, cmd, key in touched if key not in keys] == []
