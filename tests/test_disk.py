"""A nearly full disk under the embedded Redis (skmq/store/disk.py): nothing is stored or
acknowledged there. Redis answers a write before its AOF append; an append that fails
on a full disk leaves the write in Redis's memory only, and a kill -9 of the broker takes
the embedded Redis, and that write, with it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import redis.asyncio as aioredis

from skmq.codec import encode_resp
from skmq.deliverylog import DeliveryLog
from skmq.queue.journal import AppKeys
from skmq.queue.owned_store import OwnedStore
from skmq.store import NewMessage
from skmq.store.disk import DiskSpace
from skmq.store.wire import Wire
from skmq.workers.enqueue import DISK_LOW, EnqueueBatch, Enqueuer
from tests.conftest import BrokerProcess
from tests.disks import fill, small_disk
from tests.peers import FakeRecipient, RawClient
from tests.test_queue_owners import owners


async def test_a_full_disk_acknowledges_nothing_and_loses_nothing_acknowledged(
    broker_process: BrokerProcess, tmp_path: Path
) -> None:
    with small_disk(tmp_path / "disk", "64m") as disk:
        env = broker_process.env
        env["SKMQ_DATA_DIR"] = str(disk / "data")
        env["SKMQ_LOG_DIR"] = str(tmp_path / "log")
        env["SKMQ_DISK_FREE_LIMIT"] = str(8 << 20)
        broker_process.start()
        client = await RawClient.connect(broker_process.port)
        acked = [f"m{i}" for i in range(20)]
        assert all(r["content"] == "stored" for r in await client.produce("disk", acked))

        filler = fill(disk, leave=1 << 20)  # under the limit, room for Redis's appends
        refused = [f"low{i}" for i in range(10)]
        answers = await client.produce("disk", refused)
        assert all(r["status"] == "error" and r["content"] == DISK_LOW for r in answers)
        fill(disk)  # no room at all: Redis's appends fail
        refused += [f"full{i}" for i in range(10)]
        answers = await client.produce("disk", refused[10:])
        assert all(r["status"] == "error" and r["content"] == DISK_LOW for r in answers)
        await client.close()

        broker_process.kill()  # its embedded Redis goes with it
        filler.unlink()
        await asyncio.get_running_loop().run_in_executor(None, broker_process.start)
        rec = await FakeRecipient("disk", "r1").start()
        try:
            assert (await rec.register(broker_process.port))["status"] == "ack"
            got = {(await rec.next_push(timeout=10)).fields["msgid"] for _ in acked}
            assert got == set(acked)
            # The refused ones were never stored: sent again, each is stored, no duplicate.
            client = await RawClient.connect(broker_process.port)
            again = await client.produce("disk", refused)
            assert [r["content"] for r in again] == ["stored"] * len(refused)
            await client.close()
        finally:
            await rec.stop()
        assert broker_process.terminate() == 0


class FillsDuringTheStore(DiskSpace):
    """A disk that is low from its second reading on: it filled while Redis stored."""

    def __init__(self) -> None:
        super().__init__(Path("/"), 1)
        self.readings = 0

    def low(self) -> bool:
        self.readings += 1
        return self.readings > 1


async def test_a_store_that_finds_the_disk_low_once_redis_answered_is_not_acknowledged(
    redis: aioredis.Redis, wire: Wire, prefix: str, tmp_path: Path
) -> None:
    """Redis may have failed to append what it just stored: the producer hears `error`
    (it sends again; a stored message is then acked as a duplicate), and the next batch
    is refused before anything is stored."""
    store = OwnedStore(aioredis.Redis(connection_pool=redis.connection_pool), prefix)
    store.owners = await owners(wire, prefix, "app")

    async def note_apps(apps: set[str]) -> None:
        pass

    enqueuer = Enqueuer(
        store, DeliveryLog(tmp_path, "b1"), lambda apps: None, note_apps,
        disk=FillsDuringTheStore(),
    )  # fmt: skip
    replies = []
    for msgid in ("a", "b"):
        batch = EnqueueBatch()
        replies.append(batch.add("app", NewMessage(msgid, "queue", b"x", 0)))
        enqueuer.submit(batch)
        await batch.future
    for reply in replies:
        assert reply.result() == encode_resp("error", DISK_LOW, reply.msgid)
    # `a` was stored before the disk was found low; `b` never was.
    logged = await redis.xrange(AppKeys.of(prefix, "app").log)
    assert [fields[b"m"] for _, fields in logged] == [b"a"]
    assert enqueuer.disk_low
