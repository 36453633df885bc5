"""The audit of a real broker's delivery log: every message acked, none unresolved."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from skmq.audit_job.audit import run_audit

from tests.conftest import BrokerFactory
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
