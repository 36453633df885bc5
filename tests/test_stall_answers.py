"""A broker woken from a stall (SIGSTOP, a long GC pause) reads the answers that wait in
its sockets before it acts on the leases that ran out meanwhile (skmq/stall.py): an ack
sent while it was stopped settles its message, which is not delivered again, and the
connection it came on is not dropped as timed out. Pushed or pulled alike."""

from __future__ import annotations

import asyncio
import signal
from collections import Counter
from pathlib import Path

from skmq.pull.consumer import PullConsumer
from tests.conftest import BrokerProcess
from tests.peers import RawClient
from tests.test_reliability import Holder, log_events

SENT = 20
STOPPED = 3.0  # s: twice the suite's ACK_TIMEOUT (1.5 s)


async def test_acks_sent_while_the_broker_was_stopped_settle_their_messages(
    broker_process: BrokerProcess,
) -> None:
    broker_process.start()
    assert broker_process.proc is not None
    rec = Holder("stall", "r1", "hold")
    await rec.start()
    assert (await rec.register(broker_process.port))["status"] == "ack"
    client = await RawClient.connect(broker_process.port)
    replies = await client.produce("stall", [f"m{i}" for i in range(SENT)])
    assert [r["status"] for r in replies] == ["ack"] * SENT
    pushed = {(await rec.next_push()).fields["msgid"] for _ in range(SENT)}
    assert len(pushed) == SENT
    broker_process.proc.send_signal(signal.SIGSTOP)
    try:
        assert rec.answer_held("ack") == SENT  # (they wait in the broker's socket)
        await asyncio.sleep(STOPPED)  # (what is tested: the broker's stall, not a sync)
    finally:
        broker_process.proc.send_signal(signal.SIGCONT)
    # A message sent after it woke is pushed on the same connection (not dropped as
    # timed out, nor its recipient benched)...
    assert (await client.request("queue", b"x", appid="stall", msgid="after"))["status"] == "ack"
    assert (await rec.next_push()).fields["msgid"] == "after"
    assert len(set(rec.pushed_on)) == 1  # (all on one connection)
    await client.close()
    assert broker_process.terminate() == 0
    await rec.stop()
    # ... and each held message was acked once and pushed once: no lease ran out.
    events = log_events(Path(broker_process.env["SKMQ_DATA_DIR"]) / "delivery-log")
    held = [e for e in events if e["msgid"] in pushed]
    assert Counter(e["event"] for e in held if e["event"] not in ("stored", "received")) == {
        "pushed": SENT,
        "acked": SENT,
    }
    assert Counter(f.fields["msgid"] for f in rec.received) == Counter([*pushed, "after"])


async def test_pull_acks_sent_while_the_broker_was_stopped_settle_their_messages(
    broker_process: BrokerProcess,
) -> None:
    """The same over pull: a consumer's ack sent while the broker was stopped past the
    messages' visibility settles them (not `stale`), and another consumer's long poll,
    woken with it, does not take them again."""
    broker_process.start()
    assert broker_process.proc is not None
    url = f"tcp://127.0.0.1:{broker_process.port}"
    async with (
        PullConsumer(url, "stallp", "g", batch=SENT, visibility=1.0, wait=0) as first,
        PullConsumer(url, "stallp", "g", wait=STOPPED + 2) as other,
    ):
        client = await RawClient.connect(broker_process.port)
        replies = await client.produce("stallp", [f"p{i}" for i in range(SENT)])
        assert [r["status"] for r in replies] == ["ack"] * SENT
        msgs = await first.receive()
        assert len(msgs) == SENT
        polling = asyncio.ensure_future(other.receive())  # (waits: nothing is free)
        broker_process.proc.send_signal(signal.SIGSTOP)
        try:
            acking = asyncio.ensure_future(first.ack_all(msgs))
            await asyncio.sleep(STOPPED)  # (the broker's stall, past the 1 s visibility)
        finally:
            broker_process.proc.send_signal(signal.SIGCONT)
        assert await acking == [True] * SENT
        assert await polling == []
        await client.close()
    assert broker_process.terminate() == 0
