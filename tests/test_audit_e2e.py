"""The audit of a real broker's delivery log: every message acked, none unresolved;
pushed and pulled."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from skmq.audit_job.audit import run_audit

from skmq.pull.consumer import PullConsumer, PulledMessage
from tests.conftest import BrokerFactory, eventually
from tests.peers import FakeRecipient, RawClient


async def test_audit_of_a_real_broker_log(
    make_broker: BrokerFactory, spark: Any, tmp_path: Path
) -> None:
    broker = await make_broker(data_dir=tmp_path / "data")
    flaky_seen: set[str] = set()

    def reject_first_time(frame: Any) -> str:
        msgid = frame.fields["msgid"]
        if msgid.startswith("retry") and msgid not in flaky_seen:
            flaky_seen.add(msgid)
            return "reject"
        return "ack"

    r1 = await FakeRecipient("shop", "r1", reject_first_time).start()
    r2 = await FakeRecipient("shop", "r2", reject_first_time, weight=1).start()
    for r in (r1, r2):
        assert (await r.register(broker.server.port))["status"] == "ack"
    client = await RawClient.connect(broker.server.port)
    for i in range(60):
        client.send("queue", b"order %d" % i, appid="shop", msgid=f"q{i}")
    for i in range(5):
        client.send("queue", b"flaky", appid="shop", msgid=f"retry{i}")
    for i in range(4):
        client.send("topic", b"news", appid="shop", msgid=f"t{i}")
    client.send("queue", b"again", appid="shop", msgid="q0")  # a duplicate
    answers = [await client.resp() for _ in range(70)]
    assert all(a["status"] == "ack" for a in answers)
    # 60 + 5 first pushes, 5 retried pushes, 4 topic messages x 2 recipients
    async with asyncio.timeout(15):
        while len(r1.received) + len(r2.received) < 78:
            await asyncio.wait_for(asyncio.shield(_any_push(r1, r2)), 15)
    await client.close()
    broker.stopping.set()
    await broker.stop()  # flushes the delivery log

    report = run_audit(str(broker.settings.delivery_log_dir), str(tmp_path / "out"),
                       spark=spark, progress=False)  # fmt: skip
    totals = report["totals"]
    assert totals["messages"] == 69
    assert totals["acked"] == 69
    assert totals["unresolved"] == 0
    assert totals["dead_lettered"] == 0
    assert totals["duplicates"] == 1
    assert totals["pushes"] == 78
    assert report["attempts"] == {"1": 68, "2": 5}  # per delivery: 4 topic messages x 2
    assert report["anomalies"]["acked_more_than_once"] == 0
    by_recipient = {r["recipient"]: r for r in report["by_recipient"]}
    assert by_recipient["r1"]["acked"] + by_recipient["r2"]["acked"] == 73
    assert (tmp_path / "out" / "report.html").exists()


async def _any_push(*recipients: FakeRecipient) -> None:
    waits = [asyncio.ensure_future(r.next_push()) for r in recipients]
    done, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for p in pending:
        p.cancel()
    for d in done:
        d.result()


async def test_audit_of_deliveries_pulled_by_two_groups(
    make_broker: BrokerFactory, spark: Any, tmp_path: Path
) -> None:
    """Two consumer groups pull an app's messages over TCP; one fails some attempts. The
    log has every pull, ack and retry (recipient `group:<name>`), and the audit counts
    each group's copy as a delivery."""
    broker = await make_broker(data_dir=tmp_path / "data")
    where = f"tcp://127.0.0.1:{broker.server.port}"
    async with (
        PullConsumer(where, "pulls", "g1", wait=2, batch=10) as g1,
        PullConsumer(where, "pulls", "g2", wait=2, batch=10) as g2,
    ):
        client = await RawClient.connect(broker.server.port)
        for i in range(10):
            assert (await client.request("queue", b"x", appid="pulls", msgid=f"p{i}"))[
                "status"
            ] == "ack"
        await client.close()
        for consumer, failing in ((g1, 0), (g2, 3)):
            got: list[PulledMessage] = []
            while len(got) < 10:
                got += await consumer.receive()
            for msg in got[:failing]:
                assert await msg.nack(delay_ms=0) == "retry"
            for msg in got[failing:]:
                assert await msg.ack()
            again: list[PulledMessage] = []
            while len(again) < failing:
                again += await consumer.receive()
            assert [m.attempt for m in again] == [2] * failing
            for msg in again:
                assert await msg.ack()
    broker.stopping.set()
    await broker.stop()  # flushes the delivery log

    report = run_audit(str(broker.settings.delivery_log_dir), str(tmp_path / "out"),
                       spark=spark, progress=False)  # fmt: skip
    totals = report["totals"]
    assert (totals["messages"], totals["acked"], totals["unresolved"]) == (10, 10, 0)
    assert (totals["deliveries"], totals["pushes"]) == (20, 23)
    assert report["attempts"] == {"1": 17, "2": 3}
    assert report["anomalies"]["acked_more_than_once"] == 0
    by_recipient = {r["recipient"]: r for r in report["by_recipient"]}
    assert by_recipient["group:g1"]["acked"] == by_recipient["group:g2"]["acked"] == 10


async def test_audit_of_a_rotated_compressed_log(
    make_broker: BrokerFactory, spark: Any, tmp_path: Path
) -> None:
    """Issue 19: with small files (LOG_ROTATE_BYTES) the broker compresses each closed
    file while it runs, and its last one when it stops; the audit reads the .gz files."""
    broker = await make_broker(data_dir=tmp_path / "data", log_rotate_bytes=4096)
    log_dir = broker.settings.delivery_log_dir
    rec = await FakeRecipient("zip", "r1").start()
    assert (await rec.register(broker.server.port))["status"] == "ack"
    client = await RawClient.connect(broker.server.port)
    answers = await client.produce("zip", [f"z{i}" for i in range(200)])
    assert {a["status"] for a in answers} == {"ack"}
    async with asyncio.timeout(15):
        for _ in range(200):
            await rec.next_push()

    async def compressed_while_running() -> bool:
        return len(list(log_dir.glob("*.jsonl.gz"))) >= 5

    await eventually(compressed_while_running, 10)
    await client.close()
    await rec.stop()
    broker.stopping.set()
    await broker.stop()
    assert all(p.name.endswith(".jsonl.gz") for p in log_dir.iterdir())

    report = run_audit(str(log_dir), str(tmp_path / "out"), spark=spark, progress=False)
    totals = report["totals"]
    assert (totals["messages"], totals["acked"], totals["unresolved"]) == (200, 200, 0)
    assert report["input"]["bad_lines"]["total"] == 0
    assert report["input"]["files"] == len(list(log_dir.iterdir())) > 5
