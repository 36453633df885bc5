"""One app's owner (skmq/queue/owner.py) over the tests' real Redis: stores, flushes,
the inbox, checkpoints, and a takeover that rebuilds the state and fences the old
owner."""

from __future__ import annotations

import asyncio
import time

import pytest

from skmq.lifecycle import State
from skmq.queue.deliveries import QUEUE, Policy
from skmq.queue.entries import Meta
from skmq.queue.journal import Appended, AppKeys, Fenced, Journal, Lease, acquire, append
from skmq.queue.operator import Request, answer_request
from skmq.queue.owner import AppOwner, NewMessage
from skmq.store.wire import Wire

T = 1_700_000_000_000
LEASE = 60_000
DEDUPE = 3_600_000
POLICY = Policy(retry_times=3, backoff_ms=(100,), jitter=0.0, lease_ms=1_000)


@pytest.fixture
def keys(prefix: str) -> AppKeys:
    return AppKeys.of(prefix, "orders")


async def owner(wire: Wire, keys: AppKeys, broker: str, recipients: list[str]) -> AppOwner:
    lease = await acquire(wire, keys, broker, LEASE)
    assert lease is not None
    return AppOwner(Journal(wire, keys, lease, DEDUPE), POLICY, lambda: recipients, lambda: T)


def msgs(*names: str, **meta: object) -> list[NewMessage]:
    return [NewMessage(n.encode(), b"body " + n.encode(), Meta(**meta)) for n in names]  # type: ignore[arg-type]


def states(o: AppOwner) -> dict[tuple[bytes, str], tuple[State, int]]:
    return {k: (d.state, d.attempt) for k, d in o.queue.deliveries.items()}


async def test_stored_pushed_acked_in_one_write_a_turn(wire: Wire, keys: AppKeys) -> None:
    a = await owner(wire, keys, "A", ["r1"])
    assert await a.store(msgs("m1", "m2"), T) == [True, True]
    assert await wire.call("XLEN", keys.log) == 2
    for d in list(a.queue.take(10, T)):
        a.queue.push(d, "r1", T)
    a.queue.ack(b"m1", QUEUE, 1, T)
    # the records ride with the next store
    assert await a.store(msgs("m3"), T) == [True]
    assert await wire.call("XLEN", keys.journal) == 1
    assert await wire.call("SMEMBERS", keys.done(T // DEDUPE)) == [b"m1"]
    assert await a.store(msgs("m1", "m2", "m4", "m4"), T) == [False, False, True, False]


async def test_a_key_stored_through_another_broker_first_is_pushed_first(
    wire: Wire, keys: AppKeys
) -> None:
    # k-1 acked by another broker (in the inbox, its owner not told yet), then k-2 here
    a = await owner(wire, keys, "A", ["r1"])
    await append(wire, keys, T, DEDUPE, [Appended(b"k-1", b"one", b"q\x1f0\x1f0\x1fk\x1f")])
    assert await a.store(msgs("k-2", key="k"), T) == [True]
    assert [d.msgid for d in a.queue.take(10, T)] == [b"k-1"]  # k-2 waits for it
    assert states(a)[(b"k-2", QUEUE)] == (State.WAITING_KEY, 0)


async def test_a_store_on_another_broker_reaches_the_owner_through_the_inbox(
    wire: Wire, keys: AppKeys
) -> None:
    a = await owner(wire, keys, "A", ["r1"])
    await a.store(msgs("m1"), T)
    await append(wire, keys, T, DEDUPE, [Appended(b"m2", b"x"), Appended(b"m1", b"dup")])
    assert await a.read_inbox(T) == 2
    assert [d.msgid for d in a.queue.take(10, T)] == [b"m1", b"m2"]
    assert await a.read_inbox(T) == 0


@pytest.mark.parametrize("read", ["read_inbox", "store", "takeover"])
async def test_an_inbox_copy_of_a_message_acked_since_is_dropped(
    wire: Wire, keys: AppKeys, read: str
) -> None:
    """Stored again through another broker while live here (only the owner knows its live
    msgids, so the inbox takes it), then acked before the owner reads its inbox (alone,
    or first in a store's flush), or before a new owner rebuilds the state: the copy is
    a duplicate, not a message to deliver again."""
    a = await owner(wire, keys, "A", ["r1"])
    await a.store(msgs("m1"), T)
    await append(wire, keys, T, DEDUPE, [Appended(b"m1", b"again"), Appended(b"m2", b"x")])
    for d in list(a.queue.take(10, T)):
        a.queue.push(d, "r1", T)
    a.queue.ack(b"m1", QUEUE, 1, T)
    await a.flush(T)
    assert b"m1" not in a.live
    if read == "takeover":  # (m1's own entry before the checkpoint: not read again)
        await a.checkpoint(T)
        await wire.call("DEL", keys.owner)
        a = await owner(wire, keys, "B", ["r1"])
        await a.load(T + 1)
    elif read == "read_inbox":
        assert await a.read_inbox(T) == 2
    else:
        assert await a.store(msgs("m3"), T) == [True]
    assert sorted(m for m, _ in a.queue.deliveries) == sorted(
        [b"m2", *([b"m3"] * (read == "store"))]
    )


async def test_a_topic_message_is_copied_to_each_recipient(wire: Wire, keys: AppKeys) -> None:
    a = await owner(wire, keys, "A", ["r1", "r2"])
    await a.store(msgs("t1", topic=True), T)
    assert set(a.queue.deliveries) == {(b"t1", "r1"), (b"t1", "r2")}


async def test_a_topic_message_waiting_for_a_first_recipient_survives_a_takeover(
    wire: Wire, keys: AppKeys
) -> None:
    recipients: list[str] = []
    a = AppOwner(
        Journal(wire, keys, await acquire(wire, keys, "A", LEASE) or _never(), DEDUPE),
        POLICY,
        lambda: recipients,
        lambda: T,
    )
    await a.store(msgs("t1", topic=True), T)
    await a.store(msgs("m1"), T)  # the log's cursor goes past t1
    await a.checkpoint(T)
    await wire.call("DEL", keys.owner)
    recipients.append("r1")
    b = AppOwner(
        Journal(wire, keys, await acquire(wire, keys, "B", LEASE) or _never(), DEDUPE),
        POLICY,
        lambda: recipients,
        lambda: T,
    )
    await b.load(T + 1)
    b.fan_out(T + 1)
    assert [d.content for d in b.queue.take(10, T + 1, "r1")] == [b"body t1"]


async def test_a_message_stored_through_another_broker_keeps_its_content_after_a_takeover(
    wire: Wire, keys: AppKeys
) -> None:
    """Its content is in the inbox, not the log: a checkpoint says so to the next owner."""
    await append(wire, keys, T, DEDUPE, [Appended(b"m1", b"body m1")])
    a = await owner(wire, keys, "A", ["r1"])
    await a.load(T)
    await a.checkpoint(T)
    await wire.call("DEL", keys.owner)
    b = await owner(wire, keys, "B", ["r1"])
    await b.load(T)
    taken = list(b.queue.take(10, T))
    await b.contents(taken)
    assert [(d.msgid, d.content) for d in taken] == [(b"m1", b"body m1")]


def _never() -> Lease:
    raise AssertionError("the lease was taken")


async def test_a_takeover_rebuilds_the_state_and_fences_the_old_owner(
    wire: Wire, keys: AppKeys
) -> None:
    a = await owner(wire, keys, "A", ["r1", "r2"])
    await a.store(msgs("m1", "m2", "m3", "m4"), T)
    await a.store(msgs("k1", "k2", key="k"), T)
    await a.store(msgs("t1", topic=True), T)
    await a.store(msgs("later", deliver_at=T + 60_000), T)
    for d in list(a.queue.take(5, T)):  # m1..m4, k1
        a.queue.push(d, "r1", T)
    a.queue.ack(b"m1", QUEUE, 1, T)
    a.queue.fail(b"m2", QUEUE, 1, "error: x", T)
    await a.checkpoint(T)
    a.queue.ack(b"k1", QUEUE, 1, T + 1)  # after the checkpoint: from the journal's tail
    for line in a.queue.lines():  # k2, t1's copies
        for d in list(a.queue.take(10, T + 1, line)):
            a.queue.push(d, d.copy or "r2", T + 1)
    a.queue.ack(b"t1", "r1", 1, T + 1)
    await a.flush(T + 1)
    before = states(a)

    await wire.call("DEL", keys.owner)  # A stalls past its lease
    b = await owner(wire, keys, "B", ["r1", "r2"])
    await b.load(T + 2)
    after = states(b)
    # what A had in flight is pushed again (attempt kept); everything else as A had it
    for key, (state, attempt) in before.items():
        if state is State.IN_FLIGHT:
            assert after[key] == (State.PENDING, attempt), key
        else:
            assert after[key] == (state, attempt), key
    assert set(after) == set(before)
    await b.contents(list(b.queue.deliveries.values()))
    assert b.queue.deliveries[(b"m3", QUEUE)].content == b"body m3"

    # A wakes and writes: nothing of it lands
    log, journal = await wire.call("XLEN", keys.log), await wire.call("XLEN", keys.journal)
    landed = 0
    for attempt in (a.store(msgs("late"), T + 3), a.checkpoint(T + 3)):
        try:
            await attempt
            landed += 1
        except Fenced:
            pass
    a.queue.ack(b"m3", QUEUE, 1, T + 3)
    with pytest.raises(Fenced):
        await a.flush(T + 3)
    assert landed == 0
    assert (await wire.call("XLEN", keys.log), await wire.call("XLEN", keys.journal)) == (
        log,
        journal,
    )

    # B goes on: a second takeover from B's own writes rebuilds the same again
    assert await b.store(msgs("m5"), T + 4) == [True]
    await wire.call("DEL", keys.owner)
    c = await owner(wire, keys, "C", ["r1", "r2"])
    await c.load(T + 5)
    assert set(c.queue.deliveries) == set(b.queue.deliveries)


async def test_a_new_owner_names_the_acks_of_the_journals_tail_to_log_again(
    wire: Wire, keys: AppKeys
) -> None:
    """An owner killed after its write of an ack and before its `acked` line: the new
    owner finds the ack in the journal's tail (AppOwner.recovered, logged again by the
    reaper), and not one the checkpoint covers."""
    a = await owner(wire, keys, "A", ["r1", "r2"])
    await a.store(msgs("m1", "m2", "m3"), T)
    for d, rid in zip(list(a.queue.take(3, T)), ("r1", "r2", "r1"), strict=True):
        a.queue.push(d, rid, T)
    a.queue.ack(b"m1", QUEUE, 1, T)
    await a.checkpoint(T)  # (m1's ack is the checkpoint's: its line was written long since)
    a.queue.ack(b"m2", QUEUE, 1, T + 1)
    a.queue.fail(b"m3", QUEUE, 1, "error: x", T + 1)
    await a.flush(T + 1)

    await wire.call("DEL", keys.owner)  # A dies
    b = await owner(wire, keys, "B", ["r1", "r2"])
    await b.load(T + 2)
    assert [(c.delivery.msgid, c.attempt, c.recipient) for c in b.recovered] == [(b"m2", 1, "r2")]


async def test_pushes_made_while_a_checkpoint_is_written_are_replayed_once(
    wire: Wire, keys: AppKeys
) -> None:
    """A checkpoint's state stands for exactly the journal up to the entry it names:
    what the owner does while the checkpoint is on its way (pushes, here) is replayed
    by a new owner from the journal after it, once (not on top of a state that already
    has it: a push of a delivery in flight is refused by the table)."""
    a = await owner(wire, keys, "A", ["r1"])
    await a.store(msgs("m1", "m2", "m3"), T)
    writing = asyncio.ensure_future(a.checkpoint(T))
    await asyncio.sleep(0)  # (the checkpoint is under way: its first write sent)
    for d in list(a.queue.take(10, T)):
        a.queue.push(d, "r1", T)
    await writing
    await a.flush(T)
    before = states(a)

    await wire.call("DEL", keys.owner)
    b = await owner(wire, keys, "B", ["r1"])
    await b.load(T + 1)
    assert before == {k: (State.IN_FLIGHT, 1) for k in before} and len(before) == 3
    assert states(b) == {k: (State.PENDING, 1) for k in before}  # pushed again


async def test_a_checkpoint_waits_for_a_store_whose_flush_carries_first_pushes(
    wire: Wire, keys: AppKeys
) -> None:
    """A store's first pushes are held once its flush returns: a checkpoint taken while
    that flush is on its way must not name a journal entry past their records without
    holding them (a new owner would find the message pending, a record of its ack
    refused, the app not loaded: a broker killed so could not start again). It waits
    for the store, and a store that comes meanwhile waits for it."""
    a = await owner(wire, keys, "A", ["r1"])
    storing = asyncio.ensure_future(a.store_and_push(msgs("m1"), T, ["r1"]))
    await asyncio.sleep(0)  # (the store's flush sent, its reply not read)
    checkpoint = asyncio.ensure_future(a.checkpoint(T))
    await asyncio.sleep(0)  # (the checkpoint waits for the store)
    later = asyncio.ensure_future(a.store_and_push(msgs("m2"), T, ["r1"]))
    (stored, pushed), _ = await asyncio.gather(storing, checkpoint)
    assert stored == [True] and [d.msgid for d in pushed] == [b"m1"]
    assert (await later)[0] == [True]
    state = await wire.call("GET", keys.checkpoint)
    assert b"m1" in state and b"m2" not in state  # (m2 stored after the checkpoint)
    a.queue.ack(b"m1", QUEUE, 1, T)
    await a.flush(T)

    await wire.call("DEL", keys.owner)
    b = await owner(wire, keys, "B", ["r1"])
    await b.load(T + 1)
    assert (b"m1", QUEUE) not in b.queue.deliveries  # acked
    assert states(b)[(b"m2", QUEUE)] == (State.PENDING, 1)  # pushed again


async def test_a_journal_record_its_delivery_cannot_take_is_skipped_not_fatal(
    wire: Wire, keys: AppKeys
) -> None:
    """A new owner that meets a record the table refuses (here an ack whose push record
    is missing) leaves that delivery as it stands and loads the app: redelivered, never
    an app (or a broker) that cannot start."""
    a = await owner(wire, keys, "A", ["r1"])
    await a.store(msgs("m1", "m2"), T)
    (d,) = a.queue.take(1, T)
    a.queue.push(d, "r1", T)
    await a.flush(T)
    ((pushed, _),) = await wire.call("XREVRANGE", keys.journal, "+", "-", "COUNT", 1)
    a.queue.ack(b"m1", QUEUE, 1, T)
    await a.flush(T)
    await wire.call("XDEL", keys.journal, pushed)

    await wire.call("DEL", keys.owner)
    b = await owner(wire, keys, "B", ["r1"])
    await b.load(T + 1)
    assert states(b) == {(b"m1", QUEUE): (State.PENDING, 0), (b"m2", QUEUE): (State.PENDING, 0)}


async def test_the_answers_of_one_loop_turn_share_one_write(wire: Wire, keys: AppKeys) -> None:
    a = await owner(wire, keys, "A", ["r1"])
    await a.store(msgs(*(f"m{n}" for n in range(20))), T)
    for d in list(a.queue.take(20, T)):
        a.queue.push(d, "r1", T)
    waits = []
    for n in range(20):
        a.queue.ack(f"m{n}".encode(), QUEUE, 1, T)
        waits.append(a.durable())
    assert len({id(w) for w in waits}) == 1
    await asyncio.gather(*waits)
    assert await wire.call("XLEN", keys.journal) == 1
    assert await wire.call("SCARD", keys.done(T // DEDUPE)) == 20


async def test_a_fenced_write_fails_every_caller_waiting_for_it(wire: Wire, keys: AppKeys) -> None:
    a = await owner(wire, keys, "A", ["r1"])
    await a.store(msgs("m1"), T)
    await wire.call("DEL", keys.owner)
    assert await acquire(wire, keys, "B", LEASE) is not None
    for d in list(a.queue.take(1, T)):
        a.queue.push(d, "r1", T)
    with pytest.raises(Fenced):
        await a.durable()


async def test_new_messages_are_stored_and_pushed_in_one_write(wire: Wire, keys: AppKeys) -> None:
    """A store that carries its dispatcher's free slots pushes the new messages in the
    same flush (their push records beside them): in flight at once, one journal entry;
    a new owner rebuilds exactly that (pushed again, the attempt counted)."""
    a = await owner(wire, keys, "A", ["r1", "r2"])
    stored, pushed = await a.store_and_push(msgs("m1", "m2", "m3"), T, ["r1", "r2"])
    assert stored == [True, True, True]
    assert [(d.msgid, d.recipient, d.attempt) for d in pushed] == [
        (b"m1", "r1", 1),
        (b"m2", "r2", 1),
    ]
    assert states(a) == {
        (b"m1", QUEUE): (State.IN_FLIGHT, 1),
        (b"m2", QUEUE): (State.IN_FLIGHT, 1),
        (b"m3", QUEUE): (State.PENDING, 0),  # (no slot left: the dispatcher's)
    }
    assert await wire.call("XLEN", keys.journal) == 1
    assert pushed[0].due == T + POLICY.lease_ms
    a.queue.ack(b"m1", QUEUE, 1, T)
    await a.flush(T)
    before = states(a)

    await wire.call("DEL", keys.owner)
    b = await owner(wire, keys, "B", ["r1", "r2"])
    await b.load(T + 1)
    assert set(states(b)) == set(before) == {(b"m2", QUEUE), (b"m3", QUEUE)}
    assert states(b)[(b"m2", QUEUE)] == (State.PENDING, 1)  # its attempt counted


@pytest.mark.parametrize(
    ("meta", "why"),
    [({"key": "k"}, "a key"), ({"topic": True}, "a topic"), ({"deliver_at": T + 1}, "a delay")],
)
async def test_a_store_pushes_nothing_past_a_message_the_dispatcher_must_take(
    wire: Wire, keys: AppKeys, meta: dict[str, object], why: str
) -> None:
    a = await owner(wire, keys, "A", ["r1"])
    first = msgs("odd", **meta)
    _, pushed = await a.store_and_push([*first, *msgs("plain")], T, ["r1", "r1"])
    assert pushed == [], why  # (in order: nothing jumps the odd one)


async def test_a_store_pushes_nothing_while_older_messages_wait(wire: Wire, keys: AppKeys) -> None:
    a = await owner(wire, keys, "A", ["r1"])
    await a.store(msgs("old"), T)
    _, pushed = await a.store_and_push(msgs("new"), T, ["r1", "r1"])
    assert pushed == []
    assert [d.msgid for d in a.queue.take(10, T)] == [b"old", b"new"]


async def test_a_duplicate_is_not_pushed_and_its_record_is_harmless(
    wire: Wire, keys: AppKeys
) -> None:
    """A msgid settled within the dedupe window is refused by the flush's script: not
    pushed; the push record written beside it names no delivery, and a new owner
    ignores it."""
    a = await owner(wire, keys, "A", ["r1"])
    _, pushed = await a.store_and_push(msgs("m1"), T, ["r1"])
    a.queue.ack(b"m1", QUEUE, pushed[0].attempt, T)
    await a.flush(T)
    stored, again = await a.store_and_push(msgs("m1"), T, ["r1"])
    assert (stored, again, states(a)) == ([False], [], {})
    await wire.call("DEL", keys.owner)
    b = await owner(wire, keys, "B", ["r1"])
    await b.load(T + 1)
    assert states(b) == {}


async def test_answers_wait_for_the_next_stores_write_within_the_linger(
    wire: Wire, keys: AppKeys
) -> None:
    """ACK_LINGER: an answer's record waits for a flush to carry it; a store's that
    starts meanwhile does, and its waiters are done when that write is."""
    a = await owner(wire, keys, "A", ["r1"])
    await a.store_and_push(msgs("m1"), T, ["r1"])
    a.queue.ack(b"m1", QUEUE, 1, T)
    waiting = a.durable(linger=60.0)  # (far longer than the test: only a store ends it)
    await asyncio.sleep(0)
    assert not waiting.done()
    await a.store(msgs("m2"), T)
    assert waiting.done() and waiting.exception() is None
    assert await wire.call("XLEN", keys.journal) == 2  # the first store's, the second's
    assert await wire.call("SMEMBERS", keys.done(T // DEDUPE)) == [b"m1"]


async def test_a_checkpoint_is_due_once_the_tail_is_as_long_as_the_state(
    wire: Wire, keys: AppKeys
) -> None:
    a = await owner(wire, keys, "A", ["r1"])
    assert not a.checkpoint_due(T)  # nothing written
    await a.store(msgs(*(f"m{n}" for n in range(10))), T)
    assert a.checkpoint_due(T)  # (10 entries for 10 deliveries)
    await a.checkpoint(T)
    assert not a.checkpoint_due(T)
    await a.store(msgs("m10"), T)
    assert not a.checkpoint_due(T)  # (1 entry, 11 deliveries held)
    assert a.checkpoint_due(T + 60_000)  # (a minute since the last)


async def test_two_stores_of_one_msgid_at_once_store_it_once(wire: Wire, keys: AppKeys) -> None:
    """The second store of a msgid made while the first's write is on its way (two
    batches of one producer, or two producers) waits for it, and is a duplicate."""
    a = await owner(wire, keys, "A", ["r1"])
    first, second = await asyncio.gather(a.store(msgs("m1"), T), a.store(msgs("m1", "m2"), T))
    assert (first, second) == ([True], [False, True])
    assert await wire.call("XLEN", keys.log) == 2


async def drain(o: AppOwner, now: int, batch: int = 2) -> list[bytes]:
    """Every queue message the owner has, pushed and acked `batch` at a time, as a
    dispatcher takes them (a refill first); the msgids in the order pushed."""
    pushed: list[bytes] = []
    while True:
        o.queue.tick(now)
        await o.refill(now, batch)
        taken = list(o.queue.take(batch, now))
        if not taken:
            return pushed
        for d in taken:
            o.queue.push(d, "r1", now)
            o.queue.ack(d.msgid, QUEUE, d.attempt, now)
            pushed.append(d.msgid)
        assert len(o.queue.deliveries) <= o.held + batch
        await o.flush(now)


async def test_a_backlog_past_what_is_held_stays_in_the_log_until_its_turn(
    wire: Wire, keys: AppKeys
) -> None:
    a = await owner(wire, keys, "A", ["r1"])
    a.held = 4
    names = [f"m{i}" for i in range(10)]
    assert await a.store(msgs(*names), T) == [True] * 10
    assert len(a.queue.deliveries) == 4 and a.backlog == 6
    assert a.counts(T) == (10, 0, 0)
    # a msgid the log holds is a duplicate; a keyed or delayed one is held at once
    assert await a.store(msgs("m7", "m4"), T) == [False, False]
    await a.store(msgs("k1", key="k"), T)
    await a.store(msgs("later", deliver_at=T + 1), T)
    assert len(a.queue.deliveries) == 6 and a.backlog == 6
    pushed = await drain(a, T + 1)
    assert [m for m in pushed if m.startswith(b"m")] == [n.encode() for n in names]
    assert sorted(pushed) == sorted([*[n.encode() for n in names], b"k1", b"later"])
    assert a.backlog == 0 and not a.live and a.counts(T + 1) == (0, 0, 0)
    # the backlog over, a store is held at once again
    await a.store(msgs("m10"), T + 1)
    assert a.backlog == 0 and list(a.queue.deliveries) == [(b"m10", QUEUE)]


async def test_a_new_owner_leaves_the_backlog_in_the_log_and_delivers_each_message_once(
    wire: Wire, keys: AppKeys
) -> None:
    """A takeover with a backlog in the log: what the old owner held and settled (a
    keyed message read as it was stored, behind the backlog, acked before the
    checkpoint; backlog messages read back and acked after it) is not delivered again;
    what it had in flight is pushed again; the rest waits in the log, each once."""
    a = await owner(wire, keys, "A", ["r1"])
    a.held = 4
    await a.store(msgs(*[f"m{i}" for i in range(10)]), T)
    await a.store(msgs("k1", key="k"), T)
    for d in list(a.queue.take(5, T)):  # m0..m3, k1
        a.queue.push(d, "r1", T)
        if d.msgid != b"m3":
            a.queue.ack(d.msgid, QUEUE, 1, T)
    await a.flush(T)
    await a.checkpoint(T)
    await a.refill(T, 2)  # m4..m9: read back after the checkpoint
    for d in list(a.queue.take(2, T)):  # m4, m5
        a.queue.push(d, "r1", T)
    a.queue.ack(b"m4", QUEUE, 1, T)
    await a.store(msgs("m10"), T)
    await a.flush(T)
    assert a.backlog == 1  # (m10)

    await wire.call("DEL", keys.owner)
    b = await owner(wire, keys, "B", ["r1"])
    b.held = 4
    await b.load(T + 1)
    assert states(b)[(b"m3", QUEUE)] == (State.PENDING, 1)  # pushed again
    assert states(b)[(b"m5", QUEUE)] == (State.PENDING, 1)
    assert len(b.queue.deliveries) <= 4 + 2  # (the rest in the log)
    assert b.counts(T + 1)[0] == 7  # m3, m5..m10
    assert sorted(await drain(b, T + 1)) == sorted(
        [b"m3", b"m5", b"m6", b"m7", b"m8", b"m9", b"m10"]
    )
    await b.store(msgs("m11"), T + 1)
    await b.checkpoint(T + 1)
    # and a third owner, from B's checkpoint: only m11
    await wire.call("DEL", keys.owner)
    c = await owner(wire, keys, "C", ["r1"])
    await c.load(T + 2)
    assert await drain(c, T + 2) == [b"m11"]


async def test_stores_are_taken_in_in_the_order_written_while_a_new_app_is_listed(
    wire: Wire, keys: AppKeys
) -> None:
    """The first store of an app lists it in the apps directory, a wait after its write:
    a second store written meanwhile is taken in after it all the same, so that what
    each leaves in the log is behind the cursor's next read, none passed over."""
    second_done = asyncio.Event()

    async def lister(app: str) -> None:
        await second_done.wait()

    lease = await acquire(wire, keys, "A", LEASE)
    assert lease is not None
    a = AppOwner(Journal(wire, keys, lease, DEDUPE, lister), POLICY, lambda: ["r1"], lambda: T)
    a.held = 4
    first = asyncio.create_task(a.store(msgs(*[f"m{i}" for i in range(6)]), T))
    second = asyncio.create_task(a.store(msgs(*[f"n{i}" for i in range(6)]), T))
    assert await second == [True] * 6
    second_done.set()
    assert await first == [True] * 6
    assert await drain(a, T) == [f"{p}{i}".encode() for p in "mn" for i in range(6)]


async def test_peek_and_purge_reach_the_backlog_the_log_holds(wire: Wire, keys: AppKeys) -> None:
    a = await owner(wire, keys, "A", ["r1"])
    a.held = 4
    names = [f"m{i}".encode() for i in range(10)]
    await a.store(msgs(*(n.decode() for n in names)), T)
    peeked = await answer_request(a, Request("peek", 2), T)
    assert [row[0].encode() for row in peeked] == names[:2]
    assert a.backlog == 6  # (what is held shows them: nothing read back)
    purged = await answer_request(a, Request("purge", None), T)  # (a read at a time)
    assert [row[0].encode() for row in purged] == names
    assert a.backlog == 0 and not a.live and a.counts(T) == (0, 0, 0)
    more = [f"n{i}".encode() for i in range(10)]
    await a.store(msgs(*(n.decode() for n in more)), T)
    dry = await answer_request(a, Request("purge", None, dry_run=True), T)
    assert [row[0].encode() for row in dry] == more
    assert a.counts(T) == (10, 0, 0)  # (a dry run purges nothing)
    await wire.call("DEL", keys.owner)
    b = await owner(wire, keys, "B", ["r1"])
    await b.load(T)
    assert b.counts(T) == (10, 0, 0)  # (the purge is journaled: only the n's come back)
    assert sorted(await drain(b, T)) == more


async def test_a_checkpoint_bounds_its_writes_not_the_taking_of_its_state(
    wire: Wire, keys: AppKeys
) -> None:
    """A state that takes longer to snapshot than the bound (a large one on a slow
    machine) is still written: before, such a checkpoint ran out of time before its
    first write, every round."""
    a = await owner(wire, keys, "A", ["r1"])
    await a.store(msgs("m1", "m2"), T)
    snapshot = a.queue.snapshot

    def slow_snapshot() -> bytes:
        time.sleep(0.2)  # (the CPU a large state costs: the loop is held meanwhile)
        return snapshot()

    a.queue.snapshot = slow_snapshot  # type: ignore[method-assign]
    assert await wire.call("GET", keys.checkpoint) is None
    await a.checkpoint(T, bound=0.1)
    saved = await wire.call("GET", keys.checkpoint)
    assert saved is not None and b'"m1"' in saved and b'"m2"' in saved
