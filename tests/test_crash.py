"""kill -9 of a broker with its embedded Redis: nothing acknowledged is lost, and what
was in flight goes out again at once on restart (not after ACK_TIMEOUT)."""

from __future__ import annotations

import asyncio

from tests.conftest import BrokerProcess
from tests.peers import FakeRecipient, RawClient


async def test_in_flight_messages_return_at_once_after_kill_9(
    broker_process: BrokerProcess,
) -> None:
    broker_process.env["SKMQ_ACK_TIMEOUT"] = "30"
    broker_process.env["SKMQ_HEARTBEAT_INTERVAL"] = "30"
    broker_process.start()
    answer = {"ack": False}
    rec = FakeRecipient("crash", "r1", lambda f: "ack" if answer["ack"] else "silent")
    await rec.start()
    assert (await rec.register(broker_process.port))["status"] == "ack"
    client = await RawClient.connect(broker_process.port)
    for i in range(5):
        resp = await client.request("queue", b"x", appid="crash", msgid=f"c{i}")
        assert resp["status"] == "ack"
    first = {(await rec.next_push()).fields["msgid"] for _ in range(5)}
    assert first == {f"c{i}" for i in range(5)}
    await client.close()

    broker_process.kill()
    answer["ack"] = True
    loop = asyncio.get_running_loop()
    restarted = loop.time()
    await loop.run_in_executor(None, broker_process.start)
    again = {(await rec.next_push(timeout=10)).fields["msgid"] for _ in range(5)}
    assert again == first
    # Well inside the 30 s lease: the restart handed the orphans back.
    assert loop.time() - restarted < 15
    assert broker_process.terminate() == 0
    await rec.stop()
