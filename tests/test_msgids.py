"""Msgids as Redis holds them (skmq/store/msgids.py): a uuid4 in hex is packed to 17
bytes in a new store, read back as the text it was, through every transition; a store
that already held apps keeps its msgids as text."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from hypothesis import given
from hypothesis import strategies as st

from skmq.pull.groups import Groups
from skmq.store import AliveRecipient, NewMessage, Retries, Store
from skmq.store.msgids import pack, pack_delivery, split_held, unpack

APP = "ids"
NOW = 1_700_000_000_000


@pytest.mark.parametrize(
    "msgid", ["0123456789abcdef0123456789abcdef", "1f" * 16, "1f1f1f1f1f1f1f1f1f1f1f1f1f1f1f00"]
)
def test_a_hex_uuid_packs_to_17_bytes_and_back(msgid: str) -> None:
    held = pack(msgid)
    assert held == b"\x00" + bytes.fromhex(msgid)
    assert unpack(held) == msgid
    assert split_held(held) == (held, b"")
    copy = pack_delivery(msgid + "\x1fr1")
    assert unpack(copy) == msgid + "\x1fr1"
    assert split_held(copy) == (held, b"\x1fr1")
    assert split_held(b"m1\x1fr1") == (b"m1", b"\x1fr1")


@pytest.mark.parametrize(
    "msgid",
    [
        "0123456789ABCDEF0123456789ABCDEF",  # upper case: would come back lower
        "0123456789abcdef 123456789abcdef",  # fromhex skips spaces
        "0123456789abcdef0123456789abcdeg",
        "0123456789abcdef0123456789abcde",
        "m1",
        "",
    ],
)
def test_any_other_msgid_stays_text(msgid: str) -> None:
    assert pack(msgid) == msgid.encode()
    assert pack_delivery(msgid + "\x1fr1") == (msgid + "\x1fr1").encode()
    assert unpack(msgid.encode()) == msgid


# what the broker takes as an id: no control character, valid UTF-8
IDS = st.characters(min_codepoint=0x20, exclude_characters="\x7f", exclude_categories=("Cs",))


@given(st.text(IDS, max_size=40))
def test_every_msgid_reads_back(msgid: str) -> None:
    assert unpack(pack(msgid)) == msgid


@given(st.uuids(version=4), st.text(IDS, max_size=8))
def test_every_uuid_delivery_id_reads_back(u: uuid.UUID, rid: str) -> None:
    assert unpack(pack_delivery(f"{u.hex}\x1f{rid}")) == f"{u.hex}\x1f{rid}"


@pytest.fixture
async def store(redis: aioredis.Redis, prefix: str) -> AsyncIterator[Store]:
    client = aioredis.Redis(connection_pool=redis.connection_pool)
    yield Store(client, prefix, retries=Retries(1, [0.0]), ack_timeout=10.0)


def uuids(n: int) -> list[str]:
    """n hex uuids, the first made of bytes \\x1f (the separator of a topic copy's
    recipient in a delivery id)."""
    return ["1f" * 16, *(uuid.uuid4().hex for _ in range(n - 1))]


async def test_a_new_store_holds_hex_msgids_packed_through_their_life(store: Store) -> None:
    c, a, b = uuids(3)  # (c, made of bytes \x1f, goes through the dead-letter queue)
    res = await store.store({APP: [NewMessage(m, "queue", b"body", 0) for m in (a, b, c)]}, NOW)
    assert res[APP] == [True, True, True]
    base, r = store.base(APP), store.redis
    assert await r.hkeys(base + "msgs") != []
    assert {len(f) for f in await r.hkeys(base + "msgs")} == {17}
    assert await r.lrange(base + "ready", 0, -1) == [pack(m) for m in (a, b, c)]
    # a duplicate is still one
    again = await store.store({APP: [NewMessage(a, "queue", b"body", 0)]}, NOW)
    assert again[APP] == [False]

    got, _, _ = await store.claim(APP, NOW, 3, [AliveRecipient("r1", 10, True)], ["r1"] * 3)
    assert [g.msgid for g in got] == [a, b, c]
    assert set(await store.in_flight(APP)) == {a, b, c}
    assert await store.in_flight_of(APP, b) == [(b, "r1", 1)]
    assert await store.find_apps([c, "nowhere"]) == {c: [APP], "nowhere": []}

    finished = await store.finish(APP, [(a, 1)], NOW)
    assert [f.ok for f in finished] == [True]
    ext = await store.extend(APP, [(b, 1)], NOW)
    assert ext[0].code == 1
    # c fails its one attempt: dead, listed as its text, replayed
    failed = await store.fail(APP, [(c, "errored", "boom", "r1", 1)], NOW)
    assert failed[0].code == 2
    dead = await store.dead_letters(APP)
    assert [(d.msgid, d.attempts, d.last_error) for d in dead] == [(c, 1, "errored: boom")]
    assert await store.replay(APP, [c], NOW) == [True]
    got, _, _ = await store.claim(APP, NOW, 1, [AliveRecipient("r1", 10, True)], ["r1"])
    assert [g.msgid for g in got] == [c]
    assert await store.release(APP, [(b, 0), (c, 0)]) == [True, True]
    # a completed msgid is a duplicate for the dedupe window
    late = await store.store({APP: [NewMessage(a, "queue", b"body", 0)]}, NOW)
    assert late[APP] == [False]


@pytest.mark.parametrize("before", ["an app listed", "a broker ran, its apps forgotten"])
async def test_a_store_written_before_keeps_text_msgids(
    store: Store, prefix: str, before: str
) -> None:
    # (by a broker before this version: its dedupe sets may hold text msgids still)
    if before == "an app listed":
        await store.add_apps(["older"])
    else:
        await store.delivery_secret()
    a = uuid.uuid4().hex
    await store.store({APP: [NewMessage(a, "queue", b"body", 0)]}, NOW)
    assert await store.redis.hkeys(store.base(APP) + "msgs") == [a.encode()]
    assert await store.redis.get(f"{prefix}:msgids") == b"text"
    # and every broker on it reads the same choice
    other = Store(store.redis, prefix)
    await other.store({APP: [NewMessage(uuid.uuid4().hex, "queue", b"x", 0)]}, NOW)
    assert {len(f) for f in await other.redis.hkeys(store.base(APP) + "msgs")} == {32}


async def test_topic_copies_and_group_logs_read_back_as_text(store: Store) -> None:
    assert await store.packs_msgids()  # as a broker reads it at start (load_scripts)
    groups = Groups(store)
    assert await groups.create(APP, "g1")
    t = "1f" * 16
    await store.register(APP, "r1", {"id": "r1"}, NOW, 10)
    await store.register(APP, "r2", {"id": "r2"}, NOW, 10)
    res = await store.store({APP: [NewMessage(t, "topic", b"fan", 0)]}, NOW)
    assert res[APP] == [True]
    alive = [AliveRecipient("r1", 10, True), AliveRecipient("r2", 10, True)]
    got, _, _ = await store.claim(APP, NOW, 1, alive, [])
    assert sorted(g.delivery_id for g in got) == [f"{t}\x1fr1", f"{t}\x1fr2"]
    assert {g.msgid for g in got} == {t}
    finished = await store.finish(APP, [(f"{t}\x1fr1", 1), (f"{t}\x1fr2", 1)], NOW)
    assert [f.ok for f in finished] == [True, True]
    received = await groups.receive(APP, "g1", NOW, 10, 1000)
    assert [m.msgid for m in received.messages] == [t]
