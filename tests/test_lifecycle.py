"""One test per transition of skmq/lifecycle.py, over a real Redis, refusals included,
and a check that every script touches only the keys it declares (Redis Cluster routes
a script by its declared keys)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as aioredis

from skmq.lifecycle import TRANSITIONS, State
from skmq.pull.groups import Groups, Pulled, parse_receipt
from skmq.store import AliveRecipient, ClaimArgs, NewMessage, Retries, Store, scripts

APP = "life"
NOW = 1_700_000_000_000


@pytest.fixture
async def store(redis: aioredis.Redis, prefix: str) -> AsyncIterator[Store]:
    client = aioredis.Redis(connection_pool=redis.connection_pool)
    yield Store(client, prefix, retries=Retries(2, [1.0]), ack_timeout=10.0)


def alive(*rids: str, free: int = 10, length: bool = True) -> list[AliveRecipient]:
    return [AliveRecipient(r, free, length) for r in rids]


async def state_of(store: Store, msgid: str) -> State:
    """Where msgid stands, read straight from the keys."""
    r, base = store.redis, store.base(APP)
    if await r.zscore(base + "inflight", msgid) is not None:
        return State.IN_FLIGHT
    if await r.zscore(base + "dead", msgid) is not None:
        return State.DEAD
    if await r.zscore(base + "delayed", msgid) is not None:
        attempts = await r.hget(base + "state", f"{msgid}\x1fn")
        return State.WAITING_RETRY if int(attempts or 0) > 0 else State.DELAYED
    if msgid.encode() in await r.lrange(base + "ready", 0, -1):
        return State.PENDING
    if await r.hexists(base + "msgs", msgid):
        return State.RECEIVED  # stored but in no list: must never happen
    return State.GONE


async def stored(store: Store, *msgids: str, at: int = 0) -> None:
    res = await store.store({APP: [NewMessage(m, "queue", b"body", at) for m in msgids]}, NOW)
    assert res[APP] == [True] * len(msgids)


async def claimed(store: Store, n: int = 10, now: int = NOW) -> list[str]:
    got, _, _ = await store.claim(APP, now, n, alive("r1"), ["r1"] * n)
    return [c.delivery_id for c in got]


def test_the_table_names_a_lua_file_for_every_transition() -> None:
    for t in TRANSITIONS:
        assert t.script in scripts.KEYS
        assert scripts.source(t.script)


async def test_store_then_pending_or_delayed_and_duplicates_refused(store: Store) -> None:
    await stored(store, "now")
    await stored(store, "later", at=NOW + 60_000)
    assert await state_of(store, "now") == State.PENDING
    assert await state_of(store, "later") == State.DELAYED
    again = await store.store({APP: [NewMessage("now", "queue", b"x")]}, NOW)
    assert again[APP] == [False]


async def test_claim_takes_due_messages_only(store: Store) -> None:
    await stored(store, "a")
    await stored(store, "b", at=NOW + 60_000)
    assert await claimed(store) == ["a"]
    assert await state_of(store, "a") == State.IN_FLIGHT
    assert await state_of(store, "b") == State.DELAYED
    assert await claimed(store, now=NOW + 60_000) == ["b"]


async def test_claim_dead_letters_content_no_recipient_can_take(store: Store) -> None:
    await store.store({APP: [NewMessage("crlf", "queue", b"a\r\nb")]}, NOW)
    got, _, _ = await store.claim(APP, NOW, 1, alive("r1", length=False), ["r1"])
    assert [(c.kind, c.delivery_id) for c in got] == [("dead", "crlf")]
    assert await state_of(store, "crlf") == State.DEAD


async def test_finish_settles_only_the_attempt_in_flight(store: Store) -> None:
    await stored(store, "p", "f")
    assert await claimed(store, 1) == ["p"]
    # refused: a pending message, another attempt, an unknown one
    refused = await store.finish(APP, [("f", 0), ("p", 2), ("nope", 0)], NOW)
    assert [r.ok for r in refused] == [False, False, False]
    assert await state_of(store, "f") == State.PENDING
    assert await state_of(store, "p") == State.IN_FLIGHT
    done = await store.finish(APP, [("p", 1)], NOW)
    assert done[0].ok and done[0].attempt == 1
    assert await state_of(store, "p") == State.GONE
    assert (await store.store({APP: [NewMessage("p", "queue", b"x")]}, NOW))[APP] == [False]


async def test_fail_waits_then_dead_after_retry_times(store: Store) -> None:
    await stored(store, "m")
    await claimed(store)
    stale = await store.fail(APP, [("m", "errored", "x", "r1", 2)], NOW)
    assert stale[0].code == stale[0].STALE
    first = await store.fail(APP, [("m", "errored", "x", "r1", 1)], NOW)
    assert (first[0].code, first[0].due) == (first[0].RETRY, NOW + 1000)
    assert await state_of(store, "m") == State.WAITING_RETRY
    assert await claimed(store, now=NOW + 1000) == ["m"]
    second = await store.fail(APP, [("m", "rejected", "no", "r1", 0)], NOW + 1000)
    assert second[0].code == second[0].DEAD
    assert await state_of(store, "m") == State.DEAD
    (letter,) = await store.dead_letters(APP)
    assert (letter.attempts, letter.recipient, len(letter.history)) == (2, "r1", 2)


async def test_reap_counts_a_lease_run_out(store: Store) -> None:
    await stored(store, "m")
    await claimed(store)
    assert (await store.reap([APP], NOW + 5_000))[APP] == []  # lease not run out
    (reaped,) = (await store.reap([APP], NOW + 10_001))[APP]
    assert (reaped.delivery_id, reaped.result.code) == ("m", reaped.result.RETRY)
    assert await state_of(store, "m") == State.WAITING_RETRY


async def test_release_spends_no_attempt(store: Store) -> None:
    await stored(store, "m")
    await claimed(store)
    assert await store.release(APP, [("m", 1), ("other", 0)]) == [True, False]
    assert await state_of(store, "m") == State.PENDING
    got, _, _ = await store.claim(APP, NOW, 1, alive("r1"), ["r1"])
    assert got[0].attempt == 1


async def test_a_stale_attempt_is_not_released(store: Store) -> None:
    """A broker that stalled past its lease hands back its attempt on SIGTERM: the
    message, pushed again since (attempt 2, perhaps by another broker), stays in flight."""
    await stored(store, "m")
    await claimed(store)
    await store.reap([APP], NOW + 10_001)
    got, _, _ = await store.claim(APP, NOW + 90_000, 1, alive("r1"), ["r1"])
    assert [(g.delivery_id, g.attempt) for g in got] == [("m", 2)]
    assert await store.release(APP, [("m", 1)]) == [False]
    assert await state_of(store, "m") == State.IN_FLIGHT
    assert await store.release(APP, [("m", 2)]) == [True]


async def test_replay_and_purge_take_dead_letters_only(store: Store) -> None:
    await stored(store, "d", "p", "alive")
    await claimed(store)
    for attempt in (1, 2):
        await store.fail(APP, [("d", "errored", "x", "r1", attempt), ("p", "errored", "x",
                               "r1", attempt)], NOW + attempt * 1000)  # fmt: skip
        if attempt == 1:
            assert await claimed(store, now=NOW + 2000) == ["d", "p"]
    assert await store.replay(APP, ["alive", "d"], NOW) == [False, True]
    assert await state_of(store, "d") == State.DELAYED
    assert await store.purge(APP, ["alive", "p"]) == [False, True]
    assert await state_of(store, "p") == State.GONE
    assert await state_of(store, "alive") == State.IN_FLIGHT


def ids_of(pulled: list[Pulled]) -> list[str]:
    return [p.msgid for p in pulled]


async def pull_transitions(store: Store) -> None:
    """Every group and pull script once (tests/test_pull_store.py tests what they do)."""
    groups = Groups(store)
    await groups.create(APP, "g")
    keyed = [NewMessage(m, "queue", b"x", 0, 0, "k") for m in ("k1", "k2")]
    expiring = NewMessage("p3", "queue", b"z", NOW + 5, NOW + 1)  # due at its expiry
    await store.store({APP: [NewMessage("p1", "queue", b"y"), *keyed, expiring]}, NOW)
    got = (await groups.receive(APP, "g", NOW, 5, 1000)).messages
    receipts = [r for p in got if (r := parse_receipt(p.receipt)) is not None]
    await groups.extend(APP, "g", [(*receipts[0], 1000)], NOW)
    await groups.nack(APP, "g", [(*receipts[0], 0)], NOW)
    await groups.ack(APP, "g", receipts[1:2], NOW)  # k1: k2 may go
    got = await groups.receive(APP, "g", NOW + 1, 5, 1000)
    assert ids_of(got.expired) == ["p3"] and "k2" in ids_of(got.messages)
    await groups.reset(APP, "g", "latest")
    await groups.trim(APP)
    await groups.delete(APP, "g")


async def test_every_script_touches_only_the_keys_it_declares(store: Store) -> None:
    """MONITOR shows each EVALSHA with its KEYS and then every command the script ran."""
    touched: list[tuple[list[str], str, str]] = []
    ready = asyncio.Event()

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

    task = asyncio.create_task(watch())
    await ready.wait()
    await store.load_scripts()
    ttl = NewMessage("x", "queue", b"z", 0, NOW + 1)  # expires: reaped as `expired`
    messages = [NewMessage("t", "topic", b"x"), NewMessage("q", "queue", b"y"), ttl]
    await store.store({APP: messages}, NOW)
    got, _, _ = await store.claim(APP, NOW, 5, alive("r1", "r2"), ["r1"] * 5)
    ids = [c.delivery_id for c in got]
    await store.in_flight_of(APP, "t")
    await store.extend(APP, [(ids[0], 0), (ids[1], 1)], NOW)
    await store.finish(APP, [(ids[0], 0)], NOW)
    await store.fail(APP, [(ids[1], "errored", "x", "", 0)], NOW)
    await store.reap([APP], NOW + 20_000)
    await store.release(APP, [(i, 0) for i in ids])
    for _ in range(3):
        await store.claim(APP, NOW + 90_000_000, 5, alive("r1", "r2"), ["r1"] * 5)
        await store.reap([APP], NOW + 100_000_000)
    dead = [d.delivery_id for d in await store.dead_letters(APP)]
    await store.replay(APP, dead[:1], NOW)
    assert await store.move(APP, "life2", dead[1:2], NOW) == [1]
    await store.purge(APP, dead[2:])
    ordered = [NewMessage(m, "queue", b"o", key="o") for m in ("o1", "o2")]  # o2 waits
    await store.store({APP: ordered}, NOW)
    await store.peek(APP, 10, NOW)
    await store.oldest_pending([APP], NOW)
    purged = await store.purge_waiting(APP, None, None, False, NOW)
    assert {"o1", "o2"} <= {p.msgid for p in purged}
    await store.register(APP, "r1", {"id": "r1", "host": "h", "port": 1}, NOW, 10)
    assert await store.register(APP, "r1", {"id": "r1", "host": "h", "port": 2}, NOW, 10) == "h:1"
    await store.set_state(APP, "r1", False, NOW)
    await store.unregister(APP, "r1")
    await pull_transitions(store)
    await store.redis.ping()
    async with asyncio.timeout(10):
        while not any(cmd.strip('"').upper() == "HDEL" for _, cmd, _ in touched[-3:]):
            await asyncio.sleep(0.01)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    assert len(touched) > 50
    wrong = [(cmd, key) for keys, cmd, key in touched if key not in keys]
    assert wrong == []


async def test_a_claim_carried_by_a_store_sees_its_messages(store: Store) -> None:
    """Store.store(claims=...): the claim runs after the store, in the same round trip,
    and hears its result after the store's `stored` callback."""
    heard: list[Any] = []
    args = store.claim_args(NOW, 4, alive("r1"), ["r1"] * 4)
    claim = ClaimArgs(APP, args, heard.append)
    messages = {APP: [NewMessage("c1", "queue", b"x"), NewMessage("c2", "queue", b"y")]}
    res = await store.store(messages, NOW, lambda out: heard.append(out), [claim])
    assert res == {APP: [True, True]}
    assert heard[0] == {APP: [True, True]}
    got, next_due, rate_wait = heard[1]
    assert [(c.msgid, c.recipient, c.attempt) for c in got] == [("c1", "r1", 1), ("c2", "r1", 1)]
    assert next_due is None and rate_wait == 0


async def test_a_failing_carried_claim_never_fails_the_store(store: Store) -> None:
    heard: list[object] = []
    claim = ClaimArgs(APP, ["not a number"], heard.append)
    res = await store.store({APP: [NewMessage("c3", "queue", b"x")]}, NOW, None, [claim])
    assert res == {APP: [True]}
    assert len(heard) == 1 and isinstance(heard[0], Exception)
    got, _, _ = await store.claim(APP, NOW, 4, alive("r1"), ["r1"] * 4)
    assert [c.msgid for c in got] == ["c3"]


async def test_an_acked_topic_message_leaves_no_state(store: Store) -> None:
    """in flight -> acked for every copy of a topic message: the message and every field
    of its state (its copies' too) are gone."""
    await stored(store, "q0")  # another message's state stays
    await store.store({APP: [NewMessage("t1", "topic", b"x")]}, NOW)
    got, _, _ = await store.claim(APP, NOW, 5, alive("r1", "r2"), ["r1"] * 5)
    copies = [c.delivery_id for c in got if c.msgid == "t1"]
    assert len(copies) == 2
    for copy in copies:
        [done] = await store.finish(APP, [(copy, 0)], NOW)
        assert done.ok
    fields = await store.redis.hkeys(store.base(APP) + "state")
    assert [f for f in fields if f.startswith(b"t1")] == []
    assert not await store.redis.hexists(store.base(APP) + "msgs", "t1")
    assert any(f.startswith(b"q0") for f in fields)


async def store_carrying_a_claim(store: Store, msgid: str) -> list[str]:
    """Store msgid with a claim riding in the same round trip; the msgids it claimed."""
    heard: list[Any] = []
    claim = ClaimArgs(APP, store.claim_args(NOW, 4, alive("r1"), ["r1"] * 4), heard.append)
    res = await store.store({APP: [NewMessage(msgid, "queue", b"x")]}, NOW, None, [claim])
    assert res == {APP: [True]}
    got, _, _ = heard[0]
    return [c.msgid for c in got]


async def test_a_carried_claim_survives_a_script_flush(store: Store) -> None:
    """NOSCRIPT (a Redis restarted without its scripts): the store and the claim it
    carries are both loaded again and sent again, once."""
    await store.redis.script_flush()
    assert await store_carrying_a_claim(store, "f1") == ["f1"]


async def test_batches_larger_than_a_script_call_chunk_keep_each_message_apart(
    store: Store,
) -> None:
    """The scripts read and write a whole batch in chunked calls (lib.lua: call_all):
    2,500 messages in one store, claim and finish, a msgid twice in each batch (the
    second is a duplicate, a second ack is refused), and nothing left after the acks."""
    ids = [f"b{i}" for i in range(2500)]
    res = await store.store({APP: [NewMessage(m, "queue", b"x") for m in [*ids, "b7"]]}, NOW)
    assert res[APP] == [True] * 2500 + [False]
    got, _, _ = await store.claim(APP, NOW, 3000, alive("r1", free=3000), ["r1"] * 3000)
    assert [c.delivery_id for c in got] == ids
    assert {c.attempt for c in got} == {1}
    assert await state_of(store, "b2499") == State.IN_FLIGHT
    done = await store.finish(APP, [(m, 1) for m in [*ids, "b7"]], NOW)
    assert [d.ok for d in done] == [True] * 2500 + [False]
    assert done[-1].attempt == 0
    assert await store.redis.hlen(store.base(APP) + "state") == 0
    assert await store.redis.hlen(store.base(APP) + "msgs") == 0
    assert await store.redis.zcard(store.base(APP) + "inflight") == 0


async def test_copies_of_a_topic_message_acked_in_one_call_leave_no_state(store: Store) -> None:
    await store.store({APP: [NewMessage("t2", "topic", b"x")]}, NOW)
    got, _, _ = await store.claim(APP, NOW, 5, alive("r1", "r2", "r3"), ["r1"] * 5)
    copies = [c.delivery_id for c in got]
    assert len(copies) == 3
    done = await store.finish(APP, [(c, 1) for c in copies], NOW)
    assert [d.ok for d in done] == [True, True, True]
    assert await store.redis.hlen(store.base(APP) + "state") == 0
    assert not await store.redis.hexists(store.base(APP) + "msgs", "t2")


async def test_after_noscript_only_the_refused_calls_run_again(store: Store) -> None:
    """A Redis holding the store script but not the claim script: the store runs once
    (its message is stored, not refused as its own duplicate) and the carried claim,
    refused, is sent again and takes it."""
    await store.redis.script_flush()
    await store.redis.script_load(scripts.source("store"))
    assert await store_carrying_a_claim(store, "n1") == ["n1"]
