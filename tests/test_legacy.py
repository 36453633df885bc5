"""Original SKMQ peers (issue 12): our client against a double of the original Go broker,
the original recipient's double itself, `hello`, and (when built binaries are given in
SKMQ_ORIGINAL_BIN_DIR) our client against the original Go broker."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import re
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from skmq.broker import Broker
from skmq.cli import main as cli_main
from skmq.client import Consumer, ExtensionUnsupported, Message, Producer
from skmq.codec import encode_frame
from skmq.embedded import EmbeddedRedis
from skmq.handler import BROKER_CAPS
from tests.conftest import free_port, wait_listening
from tests.peers import (
    LEGACY_END,
    WAIT,
    LegacyBroker,
    LegacyDecoder,
    LegacyRecipient,
    RawClient,
    legacy_encode,
    legacy_send,
)

N = 50


@pytest.fixture
async def legacy_broker() -> AsyncIterator[LegacyBroker]:
    async with LegacyBroker() as broker:
        yield broker


class Received:
    """A consumer handler that records the messages it was given."""

    def __init__(self) -> None:
        self.messages: list[Message] = []

    async def __call__(self, msg: Message) -> None:
        self.messages.append(msg)


def run_cli_quietly(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli_main(argv)
    return code, out.getvalue(), err.getvalue()


def run_cli_sends(port: int, app: str, n: int) -> list[tuple[int, str]]:
    """`skmq send` n times without --msgid (in this process: 50 interpreters cost seconds)."""
    results = []
    for i in range(n):
        code, out, _ = run_cli_quietly(["send", "--app", app, "--port", str(port), f"message {i}"])
        results.append((code, out))
    return results


# ------------------------------------------------------------------- hello


async def test_our_broker_answers_hello(broker: Broker) -> None:
    client = await RawClient.connect(broker.server.port)
    resp = await client.request("hello", msgid="h1")
    await client.close()
    assert resp["status"] == "ack" and resp["msgid"] == "h1"
    body = json.loads(resp["content"])  # a JSON string, as an original client reads content
    assert body["server"] == "skmq" and body["version"]
    assert set(body["caps"]) == set(BROKER_CAPS) >= {"length", "pipeline", "token", "unregister"}
    async with Producer("127.0.0.1", broker.server.port) as producer:
        info = await producer.hello()
    assert info.server == "skmq" and info.supports("unregister") and info.supports("delay")


async def test_hello_to_the_original_broker_means_no_extensions(
    legacy_broker: LegacyBroker,
) -> None:
    async with Producer("127.0.0.1", legacy_broker.port) as producer:
        info = await asyncio.wait_for(producer.hello(), WAIT)
        assert info.server == "original" and not info.caps
        with pytest.raises(ExtensionUnsupported, match=r"original SKMQ broker.*'delay'"):
            await asyncio.wait_for(producer.send("a", b"x", delay_ms=10), WAIT)
        # From then on one frame in flight: the original mangles frames back to back.
        resps = await asyncio.wait_for(producer.send_many("a", [b"p"] * N), WAIT)
    assert all(r.ok for r in resps) and len({r.msgid for r in resps}) == N
    assert legacy_broker.dropped == 0
    # What the original does with it: stores a message of type hello, answered as stored.
    assert legacy_broker.messages["skmq-hello"].type == "hello"
    assert [f.type for f in legacy_broker.frames].count("queue") == N


async def test_unbounded_pipelining_loses_frames_at_the_original_broker(
    legacy_broker: LegacyBroker,
) -> None:
    """Why max_in_flight=1: frames that reach the original in one read are lost."""
    async with Producer("127.0.0.1", legacy_broker.port) as producer:
        sends = asyncio.gather(*(producer.send("a", b"x") for _ in range(N)))
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(sends, 1.0)
    assert legacy_broker.dropped > 0


# ------------------------------------------------------------------- client vs original broker


async def test_cli_send_without_msgid_50_of_50_against_the_original(
    legacy_broker: LegacyBroker,
) -> None:
    results = await asyncio.to_thread(run_cli_sends, legacy_broker.port, "app", N)
    assert [code for code, _ in results] == [0] * N
    outs = [json.loads(out) for _, out in results]
    assert {o["content"] for o in outs} == {"Message enqueue successful"}
    msgids = {o["msgid"] for o in outs}  # named although the original's resps carry none
    assert len(msgids) == N and all(re.fullmatch(r"[0-9a-f]{32}", m) for m in msgids)
    assert set(legacy_broker.messages) == msgids


async def test_cli_send_delay_to_the_original_is_refused_in_one_line(
    legacy_broker: LegacyBroker,
) -> None:
    argv = ["send", "--app", "a", "--port", str(legacy_broker.port), "--delay", "100", "x"]
    code, out, err = await asyncio.to_thread(run_cli_quietly, argv)
    assert (code, out) == (1, "")
    assert err.startswith("skmq send: not sent:") and "'delay'" in err
    assert len(err.strip().splitlines()) == 1
    assert [f.type for f in legacy_broker.frames] == ["hello"]  # the message was not sent


async def test_what_the_original_does_without_msgids(legacy_broker: LegacyBroker) -> None:
    """The double's dedup of empty msgids, and resps without msgid (issue 12)."""
    client = await RawClient.connect(legacy_broker.port)
    first = await client.request("queue", b"one", appid="app")
    second = await client.request("queue", b"two", appid="app")
    await client.close()
    assert first == {"status": "ack", "content": "Message enqueue successful", "msgid": None}
    assert second["status"] == "ack" and second["content"].startswith("message already exists")


async def test_producer_and_consumer_50_of_50_against_the_original(
    legacy_broker: LegacyBroker,
) -> None:
    received = Received()
    consumer = Consumer("app", "c1", received, broker_port=legacy_broker.port)
    await asyncio.wait_for(consumer.start(), WAIT)
    try:
        (reg,) = legacy_broker.recipients.values()
        assert reg["port"] == str(consumer.port)  # the original refuses a number
        async with Producer("127.0.0.1", legacy_broker.port, max_in_flight=1) as producer:
            sends = (producer.send("app", f"body {i}") for i in range(N))
            resps = await asyncio.wait_for(asyncio.gather(*sends), WAIT)
        assert all(r.ok for r in resps)
        acked = await legacy_broker.wait_acked(N)
    finally:
        await consumer.stop()
    assert sorted(acked) == sorted(r.msgid for r in resps)
    assert legacy_broker.dropped == 0  # one frame in flight: nothing lost to its reader
    assert sorted(m.content for m in received.messages) == sorted(
        f"body {i}".encode() for i in range(N)
    )


async def test_consumer_with_arrived_against_the_original(legacy_broker: LegacyBroker) -> None:
    """The original closes the push connection after `arrived`: every final answer goes
    over the consumer's own connection, one at a time (nothing lost to its reader)."""
    consumer = Consumer("app", "c1", Received(), broker_port=legacy_broker.port, send_arrived=True)
    await asyncio.wait_for(consumer.start(), WAIT)
    try:
        async with Producer("127.0.0.1", legacy_broker.port, max_in_flight=1) as producer:
            sends = (producer.send("app", f"body {i}") for i in range(N))
            resps = await asyncio.wait_for(asyncio.gather(*sends), WAIT)
        assert sorted(await legacy_broker.wait_acked(N)) == sorted(r.msgid for r in resps)
    finally:
        await consumer.stop()
    assert legacy_broker.dropped == 0
    assert [f.type for f in legacy_broker.frames].count("arrived") == N


async def test_cli_consume_50_of_50_against_the_original(legacy_broker: LegacyBroker) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "skmq.cli", "consume", "--app", "app", "--id", "c1",
        "--port", "0", "--broker-port", str(legacy_broker.port), "--unregister-on-exit",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stderr is not None
    try:
        line = await asyncio.wait_for(proc.stderr.readline(), 20)
        assert b"listening on" in line, line
        await asyncio.to_thread(run_cli_sends, legacy_broker.port, "app", N)
        lines = [await asyncio.wait_for(proc.stdout.readline(), WAIT) for _ in range(N)]
        await legacy_broker.wait_acked(N)
    finally:
        proc.terminate()
        err = (await asyncio.wait_for(proc.stderr.read(), 20)).decode()
        code = await asyncio.wait_for(proc.wait(), 20)
    assert sorted(int(raw.split()[-1]) for raw in lines) == list(range(N))
    # unregister: a clear error, and never sent (the original would store it as a message)
    assert code == 1
    assert "not unregistered" in err and "original SKMQ broker" in err and "Traceback" not in err
    assert [f.type for f in legacy_broker.frames].count("unregister") == 0


async def test_consumer_handles_a_push_without_msgid(legacy_broker: LegacyBroker) -> None:
    """The original stores a message sent without msgid under the empty id and pushes it
    without one: handled, and acked without msgid on the push connection."""
    received = Received()
    consumer = Consumer("app", "c1", received, broker_port=legacy_broker.port)
    await asyncio.wait_for(consumer.start(), WAIT)
    try:
        client = await RawClient.connect(legacy_broker.port)
        assert (await client.request("queue", b"no id", appid="app"))["status"] == "ack"
        await client.close()
        assert await legacy_broker.wait_acked(1) == [""]
    finally:
        await consumer.stop()
    assert [(m.msgid, m.content) for m in received.messages] == [("", b"no id")]


async def test_consumer_echoes_the_delivery_token(legacy_broker: LegacyBroker) -> None:
    consumer = Consumer("app", "c1", Received(), broker_port=legacy_broker.port)
    await asyncio.wait_for(consumer.start(), WAIT)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", consumer.port)
        fields = {"appid": "app", "msgid": "m1", "token": "tok-1"}
        writer.write(encode_frame("push", fields, b"x") + encode_frame("push", {"msgid": "m2"}))
        client = RawClient(reader, writer)
        answers = {f.get("msgid"): f for f in [await client.recv(), await client.recv()]}
        await client.close()
    finally:
        await consumer.stop()
    assert answers["m1"].type == "ack" and answers["m1"].get("token") == "tok-1"
    assert "token" not in answers["m2"].fields


# ------------------------------------------------------------------- the recipient double


class PushConnection(RawClient):
    """The broker's end of one push connection to a LegacyRecipient."""

    @classmethod
    async def open(cls, port: int) -> PushConnection:
        return cls(*await asyncio.open_connection("127.0.0.1", port))

    async def eof(self) -> bool:
        with contextlib.suppress(ConnectionError):
            await self.recv()
            return False
        return True


async def test_legacy_recipient_registers_as_the_original(legacy_broker: LegacyBroker) -> None:
    async with LegacyRecipient("app", "r1", broker_port=legacy_broker.port) as rec:
        (frame,) = legacy_broker.frames
        assert json.loads(frame.content) == {
            "id": "r1", "app_id": "app", "host": "127.0.0.1", "port": str(rec.port), "weight": 0,
        }  # fmt: skip


async def test_legacy_recipient_one_push_per_connection(legacy_broker: LegacyBroker) -> None:
    """ping/pong, push, ack with only the msgid, the broker's resp, close: it acks."""
    async with LegacyRecipient("app", "r1", broker_port=legacy_broker.port) as rec:
        for i in range(3):
            conn = await PushConnection.open(rec.port)
            conn.send_raw(b"ping" + LEGACY_END)
            assert (await conn.recv()).type == "pong"
            conn.send_raw(legacy_encode("push", appid="app", msgid=f"m{i}", content=b"x"))
            ack = await conn.recv()
            assert (ack.type, ack.fields, ack.content) == ("ack", {"msgid": f"m{i}"}, b"")
            conn.send_raw(LegacyBroker.resp("ack"))
            await conn.close()
        assert await rec.wait_acked(3) == ["m0", "m1", "m2"]
        assert rec.dropped == 0 and rec.wedged == 0


async def test_legacy_recipient_drops_a_second_frame_in_one_read(
    legacy_broker: LegacyBroker,
) -> None:
    async with LegacyRecipient("app", "r1", broker_port=legacy_broker.port) as rec:
        conn = await PushConnection.open(rec.port)
        two = b"".join(legacy_encode("push", appid="app", msgid=m, content=b"x") for m in "ab")
        conn.send_raw(two)  # one write: one read
        assert (await conn.recv()).get("msgid") == "a"
        conn.send_raw(b"ping" + LEGACY_END)  # answered: the connection goes on
        assert (await conn.recv()).type == "pong"
        assert rec.acked == ["a"] and rec.dropped == 1
        await conn.close()


@pytest.mark.parametrize(
    "push",
    [
        encode_frame("push", {"appid": "app", "msgid": "crlf"}, b"two\r\nlines"),  # length=
        legacy_encode("push", appid="app", msgid="big", content=b"x" * 1500),
    ],
    ids=["length", "over-1KiB"],
)
async def test_legacy_recipient_wedges_silently(legacy_broker: LegacyBroker, push: bytes) -> None:
    """Its decoder gives up on `length=` and on frames over 1 KiB: no answer, no close;
    other connections go on."""
    async with LegacyRecipient("app", "r1", broker_port=legacy_broker.port) as rec:
        stuck = await PushConnection.open(rec.port)
        stuck.send_raw(push)
        other = await PushConnection.open(rec.port)
        other.send_raw(b"ping" + LEGACY_END)
        assert (await other.recv()).type == "pong"
        async with asyncio.timeout(WAIT):
            while rec.wedged == 0:
                await asyncio.sleep(0.01)
        with pytest.raises(TimeoutError):  # neither an answer nor a close
            await stuck.recv(timeout=0.3)
        assert rec.acked == []
        await stuck.close()
        await other.close()


async def test_legacy_recipient_arrived_then_late_ack_on_a_new_connection(
    legacy_broker: LegacyBroker,
) -> None:
    async with LegacyRecipient(
        "app", "r1", broker_port=legacy_broker.port, answer="arrived"
    ) as rec:
        conn = await PushConnection.open(rec.port)
        conn.send_raw(legacy_encode("push", appid="app", msgid="m1", content=b"x"))
        arrived = await conn.recv()
        assert (arrived.type, arrived.fields) == ("arrived", {"msgid": "m1"})
        assert await conn.eof()  # it closes the push connection itself
        assert await rec.wait_acked(1) == ["m1"]
    late = legacy_broker.frames[-1]  # on its own connection to the broker port
    assert (late.type, late.msgid, late.appid) == ("ack", "m1", "")
    assert rec.connections == 1


def test_legacy_decoder_reads_the_original_frames() -> None:
    dec = LegacyDecoder()
    done = dec.feed(legacy_send("push", appid="a", msgid="m", content=b"k=v") + b"ping\r\n\r\n")
    assert [(m.type, m.msgid, m.content) for m, _ in done] == [
        ("push", "m", b"k=v"),
        ("ping", "", b""),
    ]
    assert dec.feed(b"appid=a\r\ncontent=x\r\n\r\n") == []  # no type: dropped


# ------------------------------------------------------------------- the Go programs

ORIGINAL_BIN_DIR = os.environ.get("SKMQ_ORIGINAL_BIN_DIR", "")


@pytest.mark.skipif(
    not (ORIGINAL_BIN_DIR and (Path(ORIGINAL_BIN_DIR) / "sikong").is_file()),
    reason="set SKMQ_ORIGINAL_BIN_DIR to a directory holding the original broker `sikong`",
)
async def test_against_the_original_go_broker(tmp_path: Path) -> None:
    """Our `skmq send` (no msgid) and Consumer against the original Go broker: 50 of 50.
    It gets a Redis of its own without a password, which the original cannot send (its
    pprof port 7185 is fixed: if taken, it goes without)."""
    store = EmbeddedRedis(tmp_path / "original-redis", auth=False)
    store.start()
    address = f"{store.host}:{store.port}"
    port = free_port()
    conf = {"retry_times": 5, "ack_timeout": 60000, "rate": 1000,
            "listener_host": "127.0.0.1", "listener_port": str(port), "log_level": 0}  # fmt: skip
    (tmp_path / "conf.json").write_text(json.dumps(conf))
    (tmp_path / "dbconf.json").write_text(json.dumps({"address": address, "db": 15}))
    log = (tmp_path / "sikong.log").open("wb")
    proc = subprocess.Popen(
        [str(Path(ORIGINAL_BIN_DIR) / "sikong"), "--conf", "conf.json", "--dbconf", "dbconf.json"],
        cwd=tmp_path, stdout=log, stderr=log,
    )  # fmt: skip
    received = Received()
    consumer = Consumer("orig-app", "c1", received, broker_port=port)
    try:
        await asyncio.to_thread(wait_listening, port, proc)
        await asyncio.wait_for(consumer.start(), WAIT)
        results = await asyncio.to_thread(run_cli_sends, port, "orig-app", N)
        assert [code for code, _ in results] == [0] * N
        async with asyncio.timeout(60):
            while len(received.messages) < N:
                await asyncio.sleep(0.1)
        assert sorted(m.content for m in received.messages) == sorted(
            f"message {i}".encode() for i in range(N)
        )
    finally:
        await consumer.stop()
        proc.kill()
        proc.wait(10)
        store.stop()
