"""A producer process for tests/test_outbox.py: `python -m tests.outbox_child DB PORT N`.

The first run writes N messages (msgids m0..m<N-1>) to the outbox of DB, in one
transaction with a marker row; every run then sends what is left, and exits 0 once the
outbox is empty. A test kills it (SIGKILL) in the middle and runs it again."""

from __future__ import annotations

import asyncio
import sqlite3
import sys

from skmq.client import Producer
from skmq.outbox import Outbox

BATCH = 100


async def main(path: str, port: int, n: int) -> None:
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE IF NOT EXISTS marker (done INTEGER)")
    db.commit()
    producer = Producer("127.0.0.1", port)
    outbox = Outbox(db, producer, batch=BATCH, poll=0.05, retry=0.05)
    if db.execute("SELECT count(*) FROM marker").fetchone()[0] == 0:
        with db:  # the caller's transaction: its own write and the messages, or nothing
            db.execute("INSERT INTO marker VALUES (1)")
            for i in range(n):
                outbox.send("crash", f"body {i}".encode(), msgid=f"m{i}")
    print("written", flush=True)
    outbox.start()
    while outbox.pending():
        await asyncio.sleep(0.02)
    await outbox.stop()
    await producer.close()
    print("sent", outbox.sent, flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
