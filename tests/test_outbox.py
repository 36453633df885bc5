"""The reliable producer (skmq/outbox.py) against a real broker and Redis: rows go out
only once committed, are deleted only on `ack`, and a producer killed mid-send loses
nothing and duplicates nothing in the store."""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from skmq.broker import Broker
from skmq.client import Producer
from skmq.clock import now_ms
from skmq.outbox import Outbox, OutboxError
from tests.conftest import BrokerFactory, eventually, free_port
from tests.peers import FakeRecipient
from tests.test_delivery import logged, registered

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def db(tmp_path: Path) -> Iterator[sqlite3.Connection]:
    conn = sqlite3.connect(tmp_path / "app.db")
    conn.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY, what TEXT)")
    conn.commit()
    yield conn
    conn.close()


@pytest.fixture
async def producer(broker: Broker) -> AsyncIterator[Producer]:
    p = Producer("127.0.0.1", broker.server.port)
    yield p
    await p.close()


async def stored(broker: Broker, app: str, limit: int = 100) -> list[str]:
    """The msgids waiting in app, oldest first (at most `limit`)."""
    return [w.msgid for w in await broker.store.peek(app, limit, now_ms())]


async def test_send_belongs_to_the_callers_transaction(
    db: sqlite3.Connection, producer: Producer, broker: Broker
) -> None:
    outbox = Outbox(db, producer)
    db.execute("INSERT INTO orders (what) VALUES ('lost')")
    outbox.send("tx", b"rolled back", msgid="r1")
    assert await outbox.send_pending() is False  # not committed: not seen
    db.rollback()
    with db:
        db.execute("INSERT INTO orders (what) VALUES ('kept')")
        outbox.send("tx", b"committed", msgid="c1")
        outbox.send("tx", b"committed again", msgid="c1")  # the same msgid: a no-op
    assert outbox.pending() == 1
    assert await outbox.send_pending() is False
    assert await stored(broker, "tx") == ["c1"]
    assert outbox.pending() == 0 and outbox.sent == 1
    outbox.close()


async def test_the_sender_delivers_after_the_commit(
    db: sqlite3.Connection, producer: Producer, broker: Broker
) -> None:
    outbox = Outbox(db, producer, batch=7, poll=30.0)
    outbox.start()
    try:
        with db:
            ids = [outbox.send("bg", f"{i}", ttl_ms=60_000) for i in range(20)]
            outbox.send("bg-ttl", b"short-lived", msgid="short", ttl_ms=1)
        outbox.wake()
        await eventually(lambda: _true(outbox.pending() == 0))  # deleted once acked
    finally:
        await outbox.stop()
    assert await stored(broker, "bg") == ids  # in order
    await registered(broker.server.port, await FakeRecipient("bg-ttl", "r").start())
    (expired,) = await logged(broker, "expired", "short")  # its TTL came with it
    assert expired["detail"] == "dead-lettered"


async def _count(broker: Broker, app: str, n: int) -> bool:
    return (await broker.store.counts([app], now_ms()))[app].pending >= n


async def test_rows_wait_while_the_broker_is_down(
    db: sqlite3.Connection, make_broker: BrokerFactory
) -> None:
    port = free_port()
    producer = Producer("127.0.0.1", port)
    outbox = Outbox(db, producer, poll=0.05, retry=0.05)
    with db:
        outbox.send("down", b"x", msgid="d1")
    outbox.start()
    try:
        with pytest.raises(OSError):
            await outbox.send_pending()  # nobody listens: the row stays
        assert outbox.pending() == 1
        broker = await make_broker(port=port)
        await eventually(lambda: _count(broker, "down", 1))
        await eventually(lambda: _true(outbox.pending() == 0))
    finally:
        await outbox.stop()
        await producer.close()


async def _true(value: bool) -> bool:
    return value


def test_an_in_memory_database_is_refused() -> None:
    with pytest.raises(OutboxError):
        Outbox(sqlite3.connect(":memory:"), Producer("127.0.0.1", 1))


async def test_a_producer_killed_mid_send_loses_and_duplicates_nothing(
    tmp_path: Path, broker: Broker
) -> None:
    n = 20_000
    path = tmp_path / "crash.db"
    args = [sys.executable, "-m", "tests.outbox_child", str(path), str(broker.server.port), str(n)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    try:
        await eventually(lambda: _count(broker, "crash", 2_000), timeout=60)
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=10) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    with sqlite3.connect(path) as check:
        left = check.execute("SELECT count(*) FROM skmq_outbox").fetchone()[0]
    assert 0 < left < n  # killed in the middle of sending
    again = await asyncio.to_thread(
        subprocess.run, args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert again.returncode == 0, again.stderr
    ids = await stored(broker, "crash", limit=n + 1)
    assert len(ids) == n  # nothing duplicated ...
    assert set(ids) == {f"m{i}" for i in range(n)}  # ... and nothing lost
    assert (await broker.store.counts(["crash"], now_ms()))["crash"].pending == n
