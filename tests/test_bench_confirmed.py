"""The confirming producer of the benchmark's RabbitMQ and NATS loads (bench/confirmed.py,
bench/nats_load.py): a message counts as acked only once its confirmation arrives, at
most `--window` outstanding; NATS's `publish_async` against a nats-server of the test's
own (a free port, JetStream in a temporary directory; never the machine's 4222)."""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.js import JetStreamContext
from nats.js.api import StorageType

from bench.childio import msgid
from bench.cli import amain
from bench.cli import parse_args as bench_args
from bench.confirmed import Body, in_tasks, send_confirmed
from bench.nats_load import PubAckDeadlines, publisher
from bench.systems import free_port, port_open
from tests.conftest import eventually


def load_args(count: int, window: int, prefix: str = "t") -> argparse.Namespace:
    return argparse.Namespace(
        count=count, window=window, rate=0.0, size=100, send_time=30.0, ack_wait=10.0,
        prefix=prefix,
    )  # fmt: skip


@pytest.fixture
async def nats_url(tmp_path: Path) -> AsyncIterator[str]:
    binary = shutil.which("nats-server")
    if binary is None:
        pytest.skip("no nats-server on this machine")
    port = free_port()
    cmd = [binary, "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", str(tmp_path / "js")]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        await eventually(lambda: port_open("127.0.0.1", port, 0.5))
        yield f"nats://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


async def stream_messages(js: JetStreamContext, stream: str) -> int:
    return (await js.stream_info(stream)).state.messages


async def test_publish_async_acks_each_on_its_puback_window_bounded_deduped(
    nats_url: str,
) -> None:
    nc = await nats.connect(nats_url)
    try:
        # nats-py's own limit far above the window: only send_confirmed's bounds it here.
        js = nc.jetstream(publish_async_max_pending=10_000)
        await js.add_stream(name="T", subjects=["t.msgs"], storage=StorageType.FILE)
        start = publisher(js, "t.msgs", PubAckDeadlines(30.0))
        most = 0

        async def counting(msgid: str, body: Body) -> asyncio.Future[Any]:
            nonlocal most
            future = await start(msgid, body)
            most = max(most, js.publish_async_pending())
            return future

        result = await send_confirmed(load_args(300, 20), counting)
        answered = (result["sent"], result["acked"], result["failed"], result["unanswered"])
        assert answered == (300, 300, [], [])
        assert most == 20
        assert await stream_messages(js, "T") == 300

        # The same msgids again: JetStream drops them (Nats-Msg-Id), the PubAcks still ack.
        again = await send_confirmed(load_args(300, 20), start)
        assert (again["acked"], again["failed"]) == (300, [])
        assert await stream_messages(js, "T") == 300

        # No stream on the subject: every PubAck is an error, none counts as acked.
        lost = await send_confirmed(load_args(5, 20), publisher(js, "none", PubAckDeadlines(30)))
        assert (lost["acked"], lost["responses"], len(lost["failed"])) == (0, 5, 5)
        assert "NoStreamResponse" in lost["failed_samples"][0]
    finally:
        await nc.close()


async def test_a_puback_not_come_by_its_deadline_fails() -> None:
    loop = asyncio.get_running_loop()
    deadlines = PubAckDeadlines(0.0)
    answered, waiting = loop.create_future(), loop.create_future()
    answered.set_result("ack")
    deadlines.add(answered)
    deadlines.add(waiting)
    deadlines.sweep()
    assert answered.result() == "ack"
    with pytest.raises(TimeoutError):
        waiting.result()
    assert not deadlines.waiting


async def test_in_tasks_counts_raised_publishes_as_failed() -> None:
    bodies: list[bytes] = []

    async def publish(msgid: str, body: bytes) -> None:
        bodies.append(body)
        if msgid.endswith("3"):
            raise RuntimeError("nacked")

    result = await send_confirmed(load_args(20, 4), in_tasks(publish))
    assert (result["sent"], result["acked"], result["responses"]) == (20, 18, 20)
    assert sorted(result["failed"]) == [msgid("t", 0x3), msgid("t", 0x13)]
    assert result["unanswered"] == []
    assert all(len(b) == 100 and int(b.split(b"|")[0]) > 0 for b in bodies)


async def test_bench_e2e_against_nats_delivers_every_acked_message_once(
    nats_url: str, tmp_path: Path
) -> None:
    out = tmp_path / "bench.json"
    argv = ["--systems", "nats", "--scenarios", "e2e", "--messages", "2000", "--no-backlog"]
    argv += ["--nats-url", nats_url, "--time-limit", "120", "--json", str(out)]
    assert await amain(bench_args(argv), argv) == 0
    (row,) = json.loads(out.read_text())["results"]
    figures = (row["error"], row["sent"], row["acked"], row["failed"], row["unique"])
    assert figures == (None, 2000, 2000, 0, 2000)
    assert (row["lost"], row["duplicates"]) == (0, 0)
