"""kill -9 of a broker with its embedded Redis: nothing acknowledged is lost, and what
was in flight goes out again at once on restart (not after ACK_TIMEOUT)."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import os
import signal
import subprocess
from pathlib import Path

from skmq.embedded import read_info
from skmq.events import RECOVERED_ACK
from skmq.queue.ownership import rank
from tests.conftest import BrokerProcess, eventually
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


async def test_a_broker_starts_again_after_kill_9_while_its_redis_was_stopped(
    broker_process: BrokerProcess,
) -> None:
    """kill -9 of a broker whose embedded Redis was stalled (SIGSTOP): the stopped server
    ignored its death signal; the next start continues it, stops it, and runs, with
    every acknowledged message still there."""
    broker_process.start()
    client = await RawClient.connect(broker_process.port)
    assert (await client.request("queue", b"x", appid="stall", msgid="kept"))["status"] == "ack"
    await client.close()
    info = read_info(Path(broker_process.env["SKMQ_DATA_DIR"]))
    assert info is not None
    os.kill(int(info["pid"]), signal.SIGSTOP)
    try:
        broker_process.kill()
        await asyncio.get_running_loop().run_in_executor(None, broker_process.start)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(info["pid"]), signal.SIGCONT)
    rec = FakeRecipient("stall", "r1")
    await rec.start()
    assert (await rec.register(broker_process.port))["status"] == "ack"
    assert (await rec.next_push(timeout=10)).fields["msgid"] == "kept"
    assert broker_process.terminate() == 0
    await rec.stop()


async def test_a_restart_never_signals_a_process_that_took_the_dead_servers_pid(
    broker_process: BrokerProcess,
) -> None:
    """After kill -9 the embedded Redis dies too, and the kernel can give its pid (still
    in redis.json) to any process: the next start must leave that process alone."""
    broker_process.start()
    data = Path(broker_process.env["SKMQ_DATA_DIR"])
    info = read_info(data)
    assert info is not None
    broker_process.kill()
    await eventually(lambda: dead(int(info["pid"])))
    bystander = subprocess.Popen(["sleep", "60"])
    try:
        (data / "redis.json").write_text(json.dumps({**info, "pid": bystander.pid}))
        await asyncio.get_running_loop().run_in_executor(None, broker_process.start)
        client = await RawClient.connect(broker_process.port)
        assert (await client.request("queue", b"x", appid="pid", msgid="m"))["status"] == "ack"
        await client.close()
        assert bystander.poll() is None
        assert broker_process.terminate() == 0
    finally:
        bystander.kill()
        bystander.wait()


async def dead(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _acked_lines(data_dir: Path) -> list[dict[str, object]]:
    """The `acked` lines of the delivery log, the files compressed since included."""
    lines = [
        json.loads(line)
        for path in sorted(data_dir.rglob("delivery-*.jsonl*"))
        for line in (
            gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
        ).splitlines()
    ]
    return [e for e in lines if e["event"] == "acked"]


async def test_a_restart_after_kill_9_takes_the_apps_at_once_and_logs_the_tails_acks(
    broker_process: BrokerProcess,
) -> None:
    """The embedded Redis is the broker's alone: the lease and the live-broker entry of
    the killed process are a dead one's, so the restarted broker takes its apps at once,
    not a lease later, even where rendezvous ranks the dead one first for the app (its
    BROKER_ID chosen so here). A broker killed between its write of an ack and its
    `acked` line would leave the audit a message in flight for ever: the new owner logs
    again the acks it replays from the journal's tail, marked RECOVERED_ACK (the audit
    counts them once)."""
    dead, restarted = (
        "first",
        next(
            b
            for b in (f"second-{i}" for i in range(100))
            if rank("tail", b) < rank("tail", "first")
        ),
    )
    broker_process.env["SKMQ_OWNER_LEASE"] = "60"  # (no checkpoint round before the kill)
    broker_process.env["SKMQ_BROKER_ID"] = dead
    broker_process.start()
    data = Path(broker_process.env["SKMQ_DATA_DIR"])
    rec = FakeRecipient("tail", "r1", lambda f: "ack")
    await rec.start()
    assert (await rec.register(broker_process.port))["status"] == "ack"
    client = await RawClient.connect(broker_process.port)
    for i in range(3):
        assert (await client.request("queue", b"x", appid="tail", msgid=f"t{i}"))["status"] == "ack"
    await client.close()

    async def acked(n: int) -> bool:
        return len(_acked_lines(data)) >= n

    await eventually(lambda: acked(3))
    broker_process.kill()
    broker_process.env["SKMQ_BROKER_ID"] = restarted
    await asyncio.get_running_loop().run_in_executor(None, broker_process.start)
    await eventually(lambda: acked(6))  # (a lease later: 60 s)
    again = [e for e in _acked_lines(data) if e["detail"] == RECOVERED_ACK]
    assert sorted((e["msgid"], e["recipient"], e["attempt"]) for e in again) == [
        (f"t{i}", "r1", 1) for i in range(3)
    ]
    assert broker_process.terminate() == 0
    await rec.stop()
