"""Messages as Redis holds them (skmq/store/messages.py): a new store writes 5-byte
headers, a store of the version before keeps writing text ones, and Python and the
scripts read both forms back alike."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from hypothesis import given
from hypothesis import strategies as st

from skmq.store import AliveRecipient, NewMessage, Retries, Store
from skmq.store.messages import DAY_MS, WRAP, header, read
from skmq.store.msgids import pack

APP = "heads"
NOW = 1_764_000_000_000  # 2025-11-24
KINDS = st.sampled_from(["queue", "topic"])


@given(KINDS, st.integers(0, 10**13 - 1), st.binary(max_size=64))
def test_a_text_header_reads_back(kind: str, ms: int, content: bytes) -> None:
    value = header(kind, ms, compact=False) + content
    assert value[:1] in (b"q", b"t") and len(value) == 14 + len(content)
    assert read(value, NOW) == (kind, ms, content)


@given(KINDS, st.integers(NOW - WRAP + DAY_MS + 1, NOW + DAY_MS), st.binary(max_size=64))
def test_a_compact_header_reads_back_within_its_span(kind: str, ms: int, content: bytes) -> None:
    value = header(kind, ms, compact=True) + content
    assert value[0] >= 128 and len(value) == 5 + len(content)
    assert read(value, NOW) == (kind, ms, content)


def test_a_compact_header_wraps_after_its_span() -> None:
    # 8.7 years: a message older than that reads as stored a span later
    old = NOW - WRAP + DAY_MS
    assert read(header("queue", old, compact=True), NOW)[1] == old + WRAP
    # a clock a day ahead of ours is still read right
    assert read(header("topic", NOW + DAY_MS, compact=True), NOW)[1:] == (NOW + DAY_MS, b"")


@pytest.fixture
async def client(redis: aioredis.Redis) -> AsyncIterator[aioredis.Redis]:
    yield aioredis.Redis(connection_pool=redis.connection_pool)


def new_store(client: aioredis.Redis, prefix: str) -> Store:
    return Store(client, prefix, retries=Retries(1, [0.0]), ack_timeout=10.0)


@pytest.mark.parametrize("form", ["compact", "packed"])
async def test_each_form_goes_through_a_message_s_life(
    client: aioredis.Redis, prefix: str, form: str
) -> None:
    if form == "packed":  # as the broker of the version before left a store
        await client.set(f"{prefix}:msgids", "packed")
    store = new_store(client, prefix)
    assert await store.store_format() == form.encode()
    q, t, d = "a" * 32, "b" * 32, "c" * 32
    content = b"x" * 100
    batch = [NewMessage(q, "queue", content), NewMessage(t, "topic", content)]
    batch.append(NewMessage(d, "queue", b"dies"))
    assert (await store.store({APP: batch}, NOW))[APP] == [True, True, True]
    value = await client.hget(store.base(APP) + "msgs", pack(q))
    assert value is not None
    if form == "compact":
        assert len(value) == 105 and value[0] >= 128
    else:
        assert value == b"q" + str(NOW).encode() + content

    await store.register(APP, "r1", {"id": "r1"}, NOW, 10)
    alive = [AliveRecipient("r1", 10, True)]
    # (claimed by a broker whose clock is a second behind the one that stored)
    got, _, _ = await store.claim(APP, NOW - 1_000, 3, alive, ["r1", "r1"])
    assert [(g.delivery_id, g.kind, g.content, g.stored_at) for g in got] == [
        (q, "queue", content, NOW),
        (f"{t}\x1fr1", "topic", content, NOW),
        (d, "queue", b"dies", NOW),
    ]
    assert await store.in_flight_of(APP, q) == [(q, "r1", 1)]
    assert await store.in_flight_of(APP, t) == [(f"{t}\x1fr1", "r1", 1)]
    finished = await store.finish(APP, [(q, 1), (f"{t}\x1fr1", 1)], NOW + 9)
    assert [(f.ok, f.stored_ts) for f in finished] == [(True, NOW), (True, NOW)]

    # dead, listed with its kind and stored time, then moved to another app: stored anew
    assert (await store.fail(APP, [(d, "errored", "boom", "r1", 1)], NOW + 10))[0].code == 2
    [dead] = await store.dead_letters(APP)
    assert (dead.kind, dead.content, dead.stored_at) == ("queue", b"dies", NOW)
    assert await store.move(APP, "other", [d], NOW + 20) == [1]
    moved = await client.hget(store.base("other") + "msgs", pack(d))
    assert moved is not None and read(moved, NOW) == ("queue", NOW + 20, b"dies")
    assert (moved[0] >= 128) == (form == "compact")
