"""The reliable producer (seed 004's QMQ outbox): a message is written to a table of the
caller's own SQLite database, in the caller's transaction, and a background sender
delivers it once that transaction has committed.

    outbox = Outbox(db, producer)          # db: the caller's sqlite3.Connection (a file)
    with db:                               # the caller's transaction
        db.execute("INSERT INTO orders ...")
        outbox.send("billing", b"order 42 placed")
    outbox.wake()                          # or wait for the next poll
    await outbox.run()                     # the sender (a task of the caller's)

A row is deleted only once the broker answered `ack` (stored, or already stored: a
duplicate). A producer that crashes leaves its unsent rows in the table; the next
`run()` sends them again with the same msgids, and the broker's dedup stores each
message once. Rows the broker refuses (`reject`: not allowed, invalid) stay in the table
with the reason, skipped by the sender (`rejected()` lists them); nothing is dropped.

The sender reads and deletes through a connection of its own, in a worker thread: it
sees committed rows only, and SQLite never blocks the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
import time
from dataclasses import dataclass

from skmq.client import ExtensionUnsupported, Producer, Resp, new_msgid

log = logging.getLogger("skmq.outbox")

TABLE = "skmq_outbox"
SCHEMA = f"""CREATE TABLE IF NOT EXISTS {TABLE} (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    msgid TEXT NOT NULL UNIQUE,
    app TEXT NOT NULL,
    topic INTEGER NOT NULL,
    content BLOB NOT NULL,
    deliver_at INTEGER,
    expires_at INTEGER,
    rejected TEXT
)"""


class OutboxError(Exception):
    """The outbox cannot work with this database (in memory, or not writable)."""


@dataclass(frozen=True, slots=True)
class Row:
    id: int
    msgid: str
    app: str
    topic: bool
    content: bytes
    deliver_at: int | None
    expires_at: int | None


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def _path_of(db: sqlite3.Connection) -> str:
    for _, name, path in db.execute("PRAGMA database_list"):
        if name == "main":
            if not path:
                raise OutboxError("the outbox needs a database file, not one in memory")
            return str(path)
    raise OutboxError("no main database")


class Outbox:
    def __init__(
        self,
        db: sqlite3.Connection,
        producer: Producer,
        *,
        batch: int = 256,
        poll: float = 1.0,
        retry: float = 1.0,
    ) -> None:
        """`batch`: rows sent at once (pipelined); `poll`: how often committed rows are
        looked for without a `wake()`; `retry`: the first wait after the broker could not
        be reached or answered `error` (doubling up to 30 s)."""
        if batch < 1 or poll <= 0 or retry <= 0:
            raise ValueError("batch must be at least 1, poll and retry positive")
        self.db = db
        self.producer = producer
        self.batch = batch
        self.poll = poll
        self.retry = retry
        self._own = sqlite3.connect(_path_of(db), check_same_thread=False, timeout=30.0)
        with self._own:
            self._own.execute(SCHEMA)
        self._wake = asyncio.Event()
        self.sent = 0  # rows delivered (and deleted) by this outbox
        self._task: asyncio.Task[None] | None = None

    # -- the caller's side: in its transaction ------------------------------
    def send(
        self,
        app: str,
        content: bytes | str,
        msgid: str | None = None,
        *,
        topic: bool = False,
        delay_ms: int | None = None,
        deliver_at_ms: int | None = None,
        ttl_ms: int | None = None,
    ) -> str:
        """Write one message to the outbox through the caller's connection, within its
        transaction (the caller commits); returns its msgid. The same msgid again is a
        no-op, like the broker's dedup. A delay and a TTL count from now, not from when
        the sender gets to the row."""
        msgid = msgid or new_msgid()
        now = _now_ms()
        due = deliver_at_ms
        if delay_ms is not None:
            due = max(due or 0, now + delay_ms)
        expires = now + ttl_ms if ttl_ms else None
        data = content.encode() if isinstance(content, str) else content
        self.db.execute(
            f"INSERT OR IGNORE INTO {TABLE} (msgid, app, topic, content, deliver_at, expires_at)"
            " VALUES (?, ?, ?, ?, ?, ?)",
            (msgid, app, int(topic), data, due, expires),
        )
        return msgid

    def wake(self) -> None:
        """Look for committed rows now (call it after the commit), not at the next poll."""
        self._wake.set()

    # -- the sender ---------------------------------------------------------
    def start(self) -> asyncio.Task[None]:
        """Run the sender as a task (stop it with `stop()`)."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self.run(), name="outbox")
        return self._task

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def run(self) -> None:
        """Send committed rows until cancelled; never raises for the broker's failures."""
        wait = self.retry
        while True:
            try:
                more = await self.send_pending()
                wait = self.retry
            except (OSError, TimeoutError, _Retry) as exc:
                log.warning("outbox: broker unavailable (%s), retrying in %.1fs", exc, wait)
                await self.producer.close()
                await asyncio.sleep(wait)
                wait = min(30.0, wait * 2)
                continue
            if not more:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.poll):
                        await self._wake.wait()
                self._wake.clear()

    async def send_pending(self) -> bool:
        """Send one batch of committed rows; True when there may be more."""
        rows = await asyncio.to_thread(self._read)
        if not rows:
            return False
        await self.producer.connect()
        resps = await asyncio.gather(*(self._send_row(r) for r in rows))
        done = [r.id for r, resp in zip(rows, resps, strict=True) if resp.ok]
        refused = [
            (resp.content, r.id)
            for r, resp in zip(rows, resps, strict=True)
            if resp.status == "reject"
        ]
        await asyncio.to_thread(self._settle, done, refused)
        self.sent += len(done)
        for reason, _ in refused:
            log.warning("outbox: the broker refused a message, kept as rejected: %s", reason)
        if len(done) + len(refused) < len(rows):
            raise _Retry("the broker answered error")
        return len(rows) == self.batch

    async def _send_row(self, r: Row) -> Resp:
        ttl = None if r.expires_at is None else max(1, r.expires_at - _now_ms())
        try:
            return await self.producer.send(
                r.app, r.content, topic=r.topic, msgid=r.msgid, deliver_at_ms=r.deliver_at,
                ttl_ms=ttl,
            )  # fmt: skip
        except ExtensionUnsupported as exc:  # will never be sent to this broker as it is
            return Resp("reject", str(exc), r.msgid)

    def _read(self) -> list[Row]:
        cur = self._own.execute(
            f"SELECT id, msgid, app, topic, content, deliver_at, expires_at FROM {TABLE}"
            " WHERE rejected IS NULL ORDER BY id LIMIT ?",
            (self.batch,),
        )
        return [Row(i, m, a, bool(t), bytes(c), d, x) for i, m, a, t, c, d, x in cur.fetchall()]

    def _settle(self, done: list[int], refused: list[tuple[str, int]]) -> None:
        with self._own:
            self._own.executemany(f"DELETE FROM {TABLE} WHERE id = ?", [(i,) for i in done])
            self._own.executemany(f"UPDATE {TABLE} SET rejected = ? WHERE id = ?", refused)

    def pending(self) -> int:
        """Committed rows not yet delivered (the rejected ones aside)."""
        (n,) = self._own.execute(f"SELECT count(*) FROM {TABLE} WHERE rejected IS NULL").fetchone()
        return int(n)

    def rejected(self) -> list[tuple[str, str, str]]:
        """(msgid, app, reason) of the rows the broker refused."""
        rows = self._own.execute(
            f"SELECT msgid, app, rejected FROM {TABLE} WHERE rejected IS NOT NULL ORDER BY id"
        ).fetchall()
        return [(str(m), str(a), str(r)) for m, a, r in rows]

    def close(self) -> None:
        self._own.close()


class _Retry(Exception):
    """Some rows got `error` (the broker could not store them now): try again later."""
