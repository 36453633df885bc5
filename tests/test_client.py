"""Producer and Consumer against small fake peers over real TCP sockets.

The fake broker answers every frame with a resp (the ingest side); the fake
pusher connects to a consumer's port like the broker's delivery side does.
Every wait is bounded; nothing synchronises by sleeping.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import shlex
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import pytest
import uvloop

from skmq import client
from skmq.client import Consumer, Message, Producer, RegistrationError, Reject, Resp
from skmq.codec import PING, PONG, Decoder, Frame, InvalidFrame, encode_frame, encode_resp
from skmq.handler import HELLO_BODY

T = 5.0  # upper bound for any single wait


R = TypeVar("R")


async def within(aw: Awaitable[R]) -> R:
    return await asyncio.wait_for(aw, T)


class FakeBroker:
    """Answers each frame with a resp; can hold answers or drop the connection.

    `hold=N`: answer nothing until N frames arrived, then everything at once
    (proves the client had N frames in flight). `drop_after=N`: close the
    connection after N frames, answering none of them.
    """

    def __init__(
        self,
        *,
        hold: int = 0,
        drop_after: int = 0,
        answer: Callable[[Frame], bytes] | None = None,
    ) -> None:
        self.hold = hold
        self.drop_after = drop_after
        self.answer = answer or self.echo
        self.frames: list[Frame] = []
        self.arrived = asyncio.Condition()
        self.reads = 0
        self.port = 0
        self._server: asyncio.Server | None = None

    @staticmethod
    def echo(frame: Frame) -> bytes:
        """ack with the frame's own content, and its msgid (or a generated one); `hello`
        answered as our broker does."""
        msgid = frame.get("msgid") or "generated-1"
        if frame.type == "hello":
            return encode_resp("ack", HELLO_BODY, msgid)
        return encode_resp("ack", (frame.content or b"").decode(), msgid)

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()

    async def wait_for_frames(self, n: int) -> list[Frame]:
        async with self.arrived:
            await within(self.arrived.wait_for(lambda: len(self.frames) >= n))
        return self.frames

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        decoder = Decoder()
        held: list[bytes] = []
        seen = 0
        while data := await reader.read(1 << 16):
            self.reads += 1
            for frame in decoder.feed(data):
                assert isinstance(frame, Frame), frame
                seen += 1
                async with self.arrived:
                    self.frames.append(frame)
                    self.arrived.notify_all()
                if self.drop_after:
                    if seen >= self.drop_after:
                        writer.close()
                        return
                    continue
                held.append(self.answer(frame))
                if seen >= self.hold:
                    writer.write(b"".join(held))
                    held.clear()
        writer.close()


@pytest.fixture
async def fake_broker() -> AsyncIterator[FakeBroker]:
    b = FakeBroker()
    await b.start()
    yield b
    await b.stop()


class Pusher:
    """The broker's side of a push connection to a consumer."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.decoder = Decoder()
        self.pending: list[Frame | InvalidFrame] = []

    @classmethod
    async def connect(cls, port: int) -> Pusher:
        reader, writer = await within(asyncio.open_connection("127.0.0.1", port))
        return cls(reader, writer)

    def push(self, msgid: str, content: bytes, **extra: str) -> None:
        fields = {"appid": "app", "msgid": msgid, **extra}
        self.writer.write(encode_frame("push", fields, content))

    async def read(self, n: int) -> list[Frame]:
        while len(self.pending) < n:
            data = await within(self.reader.read(1 << 16))
            assert data, "consumer closed the connection"
            self.pending.extend(self.decoder.feed(data))
        got, self.pending = self.pending[:n], self.pending[n:]
        assert all(isinstance(f, Frame) for f in got), got
        return [f for f in got if isinstance(f, Frame)]

    async def ping(self) -> None:
        """Ping and expect the very next answer to be pong: everything sent
        before it has been seen by the consumer, and answered nothing else."""
        self.writer.write(PING)
        (frame,) = await self.read(1)
        assert frame.type == "pong", frame

    def close(self) -> None:
        self.writer.close()


async def start_consumer(
    broker: FakeBroker, handler: Callable[[Message], Awaitable[None]], **kw: object
) -> Consumer:
    consumer = Consumer("app", "c1", handler, broker_port=broker.port, **kw)  # type: ignore[arg-type]
    await within(consumer.start())
    return consumer


async def ack_all(msg: Message) -> None:
    return None


# ------------------------------------------------------------------- Resp


def resp_frame(content: bytes, msgid: str | None = "m1") -> Frame:
    decoded = Decoder().feed(encode_frame("resp", {"msgid": msgid} if msgid else {}, content))
    assert isinstance(decoded[0], Frame)
    return decoded[0]


def test_resp_parses_lowercase_and_capitalised_keys() -> None:
    assert Resp.from_frame(resp_frame(b'{"status":"ack","content":"stored"}')) == Resp(
        "ack", "stored", "m1"
    )
    resp = Resp.from_frame(resp_frame(b'{"Status":"reject","Content":"nope"}', msgid=None))
    assert resp == Resp("reject", "nope", None)
    assert not resp.ok


def test_resp_from_garbage_is_an_error() -> None:
    assert Resp.from_frame(resp_frame(b"not json")) == Resp("error", "not json", "m1")
    assert Resp.from_frame(resp_frame(b"[1]")).status == "error"


# ------------------------------------------------------------------- Producer


async def test_send_writes_the_fields(fake_broker: FakeBroker) -> None:
    async with Producer("127.0.0.1", fake_broker.port) as producer:
        resp = await within(
            producer.send("a", "hello", msgid="m1", delay_ms=1500, deliver_at_ms=1700000000000)
        )
        assert resp == Resp("ack", "hello", "m1") and resp.ok
        await within(producer.send("a", b"x", topic=True, msgid="m2"))
    hello, queue, topic = fake_broker.frames  # hello: a delay needs the broker's extension
    assert hello.type == "hello"
    assert queue.type == "queue"
    assert queue.fields == {
        "appid": "a",
        "msgid": "m1",
        "delay": "1500",
        "deliver_at": "1700000000000",
    }
    assert queue.content == b"hello"
    assert topic.type == "topic" and topic.fields == {"appid": "a", "msgid": "m2"}


async def test_a_sender_hears_why_the_connection_was_given_up(fake_broker: FakeBroker) -> None:
    """Something that is not the protocol (an HTTP server on the port): the send fails
    with the reason, nothing logged beside it (a CLI prints one line)."""
    fake_broker.answer = lambda frame: b"HTTP/1.1 400 Bad Request\r\n\r\n"
    async with Producer("127.0.0.1", fake_broker.port) as producer:
        with pytest.raises(ConnectionError, match="invalid frame from broker: line without"):
            await within(producer.send("a", "x", msgid="m1"))


async def test_msgid_generated_by_the_client_is_returned(fake_broker: FakeBroker) -> None:
    async with Producer("127.0.0.1", fake_broker.port) as producer:
        resp = await within(producer.send("a", b"x"))
    assert resp.msgid is not None and re.fullmatch(r"[0-9a-f]{32}", resp.msgid)
    assert fake_broker.frames[0].fields["msgid"] == resp.msgid


async def test_an_unknown_outcome_is_sent_again_with_the_same_msgid(
    fake_broker: FakeBroker,
) -> None:
    """An `error` whose outcome is unknown (the message may be stored) is sent again with
    the same msgid until answered otherwise, at most unknown_retries times; `not stored`
    and any other error are the caller's. (The broker's side: tests/test_cluster.py.)"""
    tries: dict[str, int] = {}

    def answer(frame: Frame) -> bytes:
        msgid = frame.fields["msgid"]
        tries[msgid] = tries.get(msgid, 0) + 1
        if frame.content == b"not stored":
            return encode_resp("error", "not stored: store unavailable: send it again", msgid)
        if tries[msgid] <= int(frame.content or b"0"):
            return encode_resp("error", "outcome unknown: store unavailable", msgid)
        return encode_resp("ack", "duplicate: a message with this msgid is already stored", msgid)

    fake_broker.answer = answer
    async with Producer("127.0.0.1", fake_broker.port, unknown_retries=2, unknown_wait=0) as p:
        assert (await within(p.send("a", b"2", msgid="m1"))).ok
        resp = await within(p.send("a", b"3", msgid="m2"))
        assert resp.outcome_unknown and resp.msgid == "m2"
        resp = await within(p.send("a", b"not stored", msgid="m3"))
        assert resp.status == "error" and not resp.outcome_unknown
        many = await within(p.send_many("a", [b"0", b"1", b"5"]))
        assert [r.ok for r in many] == [True, True, False] and many[2].outcome_unknown
    assert tries["m1"] == 3 and tries["m2"] == 3 and tries["m3"] == 1
    assert [tries[r.msgid or ""] for r in many] == [1, 2, 3]
    with pytest.raises(ValueError, match="unknown_retries"):
        Producer(unknown_retries=-1)


async def test_binary_content_round_trips(fake_broker: FakeBroker) -> None:
    content = b"line one\r\nline two\n\r\n"
    async with Producer("127.0.0.1", fake_broker.port) as producer:
        await within(producer.send("a", content))
    assert fake_broker.frames[0].content == content


async def test_a_thousand_sends_in_flight_matched_in_order() -> None:
    broker = FakeBroker(hold=1000)  # answers only once all 1000 are in
    await broker.start()
    async with Producer("127.0.0.1", broker.port) as producer:
        resps = await within(asyncio.gather(*(producer.send("a", f"m{i}") for i in range(1000))))
    assert [r.content for r in resps] == [f"m{i}" for i in range(1000)]
    assert len(broker.frames) == 1000
    # Coalesced: far fewer socket reads on the broker side than frames.
    assert broker.reads < 100
    await broker.stop()


async def test_send_many_in_one_write(fake_broker: FakeBroker) -> None:
    contents = [f"c{i}".encode() for i in range(500)]
    async with Producer("127.0.0.1", fake_broker.port) as producer:
        resps = await within(producer.send_many("a", iter(contents), topic=True))
        assert await within(producer.send_many("a", [])) == []
    assert [r.content.encode() for r in resps] == contents
    assert {f.type for f in fake_broker.frames} == {"topic"}


async def test_broken_connection_fails_every_pending_send() -> None:
    broker = FakeBroker(drop_after=3)
    await broker.start()
    async with Producer("127.0.0.1", broker.port) as producer:
        sends = [asyncio.ensure_future(producer.send("a", b"x")) for _ in range(3)]
        results = await within(asyncio.gather(*sends, return_exceptions=True))
        assert all(isinstance(r, ConnectionError) for r in results), results
        assert not producer.connected
        with pytest.raises(ConnectionError):
            await within(producer.send("a", b"y"))
    await broker.stop()


async def test_send_without_connect_raises() -> None:
    with pytest.raises(ConnectionError):
        await Producer("127.0.0.1", 1).send("a", b"x")


async def test_cancelled_send_does_not_shift_later_resps() -> None:
    broker = FakeBroker(hold=2)
    await broker.start()
    async with Producer("127.0.0.1", broker.port) as producer:
        first = asyncio.ensure_future(producer.send("a", b"first"))
        await broker.wait_for_frames(1)
        first.cancel()
        resp = await within(producer.send("a", b"second"))
        assert resp.content == "second"
        assert first.cancelled()
    await broker.stop()


# ------------------------------------------------------------------- Consumer


async def test_register_sends_where_we_listen(fake_broker: FakeBroker) -> None:
    consumer = await start_consumer(fake_broker, ack_all, weight=3)
    (frame,) = fake_broker.frames
    assert frame.type == "register"
    assert json.loads(frame.content or b"") == {
        "id": "c1",
        "app_id": "app",
        "host": "127.0.0.1",
        "port": str(consumer.port),
        "weight": 3,
        "caps": ["pipeline", "length", "token", "identity"],
    }
    assert consumer.port != 0
    resp = await within(consumer.unregister())
    assert resp.ok
    assert [f.type for f in fake_broker.frames[1:]] == ["hello", "unregister"]
    assert json.loads(fake_broker.frames[2].content or b"") == {"id": "c1", "app_id": "app"}
    await within(consumer.stop())
    with pytest.raises(OSError):
        await within(asyncio.open_connection("127.0.0.1", consumer.port))


async def test_refused_registration_raises_and_stops_listening() -> None:
    broker = FakeBroker(answer=lambda f: encode_resp("reject", "address not allowed"))
    await broker.start()
    consumer = Consumer("app", "c1", ack_all, broker_port=broker.port)
    with pytest.raises(RegistrationError) as info:
        await within(consumer.start())
    assert info.value.resp.status == "reject"
    assert info.value.resp.content == "address not allowed"
    with pytest.raises(OSError):
        await within(asyncio.open_connection("127.0.0.1", consumer.port))
    await broker.stop()


async def test_ack_reject_and_error_answers(fake_broker: FakeBroker) -> None:
    async def handler(msg: Message) -> None:
        if msg.content == b"no":
            raise Reject
        if msg.content == b"bad":
            raise ValueError("broken\r\nbadly")

    consumer = await start_consumer(fake_broker, handler)
    pusher = await Pusher.connect(consumer.port)
    pusher.push("m1", b"ok", recipient="c1")
    pusher.push("m2", b"no")
    pusher.push("m3", b"bad", recipient="c1")
    answers = {f.get("msgid"): f for f in await pusher.read(3)}
    assert answers["m1"].type == "ack"
    assert answers["m1"].fields == {"msgid": "m1", "appid": "app", "recipient": "c1"}
    assert answers["m2"].type == "reject"
    assert answers["m2"].fields == {"msgid": "m2", "appid": "app", "recipient": "c1"}
    assert answers["m3"].type == "error"
    assert answers["m3"].content == b"broken  badly"
    assert answers["m3"].get("recipient") == "c1"
    # The broker's resps to those answers are read and ignored.
    pusher.writer.write(b"".join(encode_resp("ack", "done", m) for m in ("m1", "m2", "m3")))
    await pusher.ping()
    assert consumer.stats == {"received": 3, "acked": 1, "rejected": 1, "errored": 1}
    pusher.close()
    await within(consumer.stop())


async def test_many_unanswered_pushes_on_one_connection(fake_broker: FakeBroker) -> None:
    gate = asyncio.Event()
    seen: list[Message] = []

    async def handler(msg: Message) -> None:
        seen.append(msg)
        await gate.wait()

    consumer = await start_consumer(fake_broker, handler)
    pusher = await Pusher.connect(consumer.port)
    for i in range(10):
        pusher.push(f"m{i}", f"c{i}".encode())
    await pusher.ping()  # answered while all ten are still being handled
    assert len(seen) == 10
    gate.set()
    answers = await pusher.read(10)
    assert sorted(f.get("msgid") or "" for f in answers) == sorted(f"m{i}" for i in range(10))
    assert {f.type for f in answers} == {"ack"}
    assert seen[3].content == b"c3" and seen[3].appid == "app"
    pusher.close()
    await within(consumer.stop())


async def test_concurrency_is_bounded_per_connection(fake_broker: FakeBroker) -> None:
    gate = asyncio.Event()
    running = 0
    most = 0

    async def handler(msg: Message) -> None:
        nonlocal running, most
        running += 1
        most = max(most, running)
        await gate.wait()
        running -= 1

    consumer = await start_consumer(fake_broker, handler, concurrency=2)
    pusher = await Pusher.connect(consumer.port)
    for i in range(6):
        pusher.push(f"m{i}", b"x")
    await pusher.ping()
    assert consumer.stats["received"] == 6 and running == 2
    gate.set()
    assert {f.type for f in await pusher.read(6)} == {"ack"}
    assert most == 2
    pusher.close()
    await within(consumer.stop())


async def test_arrived_then_ack(fake_broker: FakeBroker) -> None:
    gate = asyncio.Event()

    async def handler(msg: Message) -> None:
        await gate.wait()

    consumer = await start_consumer(fake_broker, handler, send_arrived=True)
    pusher = await Pusher.connect(consumer.port)
    pusher.push("m1", b"x")
    (arrived,) = await pusher.read(1)
    assert arrived.type == "arrived"
    assert arrived.fields == {"msgid": "m1", "appid": "app", "recipient": "c1"}
    gate.set()
    (ack,) = await pusher.read(1)
    assert ack.type == "ack" and ack.get("msgid") == "m1"
    pusher.close()
    await within(consumer.stop())


async def test_final_answer_after_arrived_goes_to_the_broker_if_push_connection_closed(
    fake_broker: FakeBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = asyncio.Event()
    lost = asyncio.Event()
    original = client._PushProtocol.connection_lost

    def connection_lost(self: client._PushProtocol, exc: Exception | None) -> None:
        original(self, exc)
        lost.set()

    monkeypatch.setattr(client._PushProtocol, "connection_lost", connection_lost)

    async def handler(msg: Message) -> None:
        await gate.wait()

    consumer = await start_consumer(fake_broker, handler, send_arrived=True)
    pusher = await Pusher.connect(consumer.port)
    pusher.push("m1", b"x", recipient="c1")
    (arrived,) = await pusher.read(1)
    assert arrived.type == "arrived"
    pusher.close()  # the broker gives up waiting on this connection
    await within(lost.wait())
    gate.set()
    frames = await fake_broker.wait_for_frames(2)  # register, then the late ack
    assert frames[1].type == "ack"
    assert frames[1].fields == {"msgid": "m1", "appid": "app", "recipient": "c1"}
    await within(consumer.stop())


async def test_heartbeat_on_its_own_connection(fake_broker: FakeBroker) -> None:
    consumer = await start_consumer(fake_broker, ack_all)
    for _ in range(3):
        pusher = await Pusher.connect(consumer.port)
        await pusher.ping()
        pusher.close()
    await within(consumer.stop())


async def test_double_terminator_and_odd_frames_get_no_extra_answer(
    fake_broker: FakeBroker,
) -> None:
    received: list[bytes] = []

    async def handler(msg: Message) -> None:
        received.append(msg.content)

    consumer = await start_consumer(fake_broker, handler)
    pusher = await Pusher.connect(consumer.port)
    # As the original sender writes it: terminator twice.
    pusher.writer.write(b"appid=app\r\nmsgid=m1\r\ntype=push\r\ncontent=hello\r\n\r\n\r\n\r\n")
    (ack,) = await pusher.read(1)
    assert ack.type == "ack" and ack.get("msgid") == "m1"
    # Invalid frame, unknown type, stray pong: no answer at all.
    pusher.writer.write(b"garbage line\r\n\r\n" + encode_frame("bogus", {"x": "1"}) + PONG)
    await pusher.ping()
    # Binary content, with the length= extension.
    pusher.push("m2", b"a\r\nb")
    (ack,) = await pusher.read(1)
    assert ack.get("msgid") == "m2"
    assert received == [b"hello", b"a\r\nb"]
    pusher.close()
    await within(consumer.stop())


async def test_push_split_into_single_bytes(fake_broker: FakeBroker) -> None:
    consumer = await start_consumer(fake_broker, ack_all)
    pusher = await Pusher.connect(consumer.port)
    for byte in encode_frame("push", {"appid": "app", "msgid": "m1"}, b"x"):
        pusher.writer.write(bytes([byte]))
        await within(pusher.writer.drain())
    (ack,) = await pusher.read(1)
    assert ack.type == "ack"
    pusher.close()
    await within(consumer.stop())


# ------------------------------------------------------------------- CLI


def _cli_importable() -> bool:
    try:
        import skmq.cli  # noqa: F401
    except ImportError:
        return False
    return True


cli = pytest.mark.skipif(not _cli_importable(), reason="skmq.cli is not complete yet")
RUN_CLI = "import sys; from skmq.cli import main; sys.exit(main())"


async def run_cli(*args: str, stdin: bytes = b"") -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        RUN_CLI,
        *args,
        stdin=asyncio.subprocess.PIPE if stdin else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(stdin or None), 20)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


@cli
async def test_cli_send(fake_broker: FakeBroker) -> None:
    port = str(fake_broker.port)
    code, out, err = await run_cli("send", "--app", "a", "--port", port, "--msgid", "m1", "hi")
    assert code == 0, err
    assert json.loads(out) == {"status": "ack", "content": "hi", "msgid": "m1"}
    code, out, _ = await run_cli("send", "--app", "a", "--port", port, "--topic", stdin=b"in\n")
    assert code == 0
    assert fake_broker.frames[1].type == "topic" and fake_broker.frames[1].content == b"in\n"


@cli
async def test_cli_send_exit_codes() -> None:
    broker = FakeBroker(answer=lambda f: encode_resp("reject", "invalid"))
    await broker.start()
    code, out, _ = await run_cli("send", "--app", "a", "--port", str(broker.port), "x")
    assert code == 1 and json.loads(out)["status"] == "reject"
    await broker.stop()
    code, out, err = await run_cli("send", "--app", "a", "--port", str(broker.port), "x")
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and "connection refused" in err


async def _start_consume(broker: FakeBroker, *args: str) -> tuple[asyncio.subprocess.Process, int]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        RUN_CLI,
        "consume",
        "--app",
        "app",
        "--id",
        "c1",
        "--port",
        "0",
        "--broker-port",
        str(broker.port),
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    assert proc.stderr is not None
    line = (await asyncio.wait_for(proc.stderr.readline(), 20)).decode()
    found = re.search(r"listening on [\d.]+:(\d+)", line)
    assert found, line
    return proc, int(found.group(1))


async def _stop(proc: asyncio.subprocess.Process) -> int:
    proc.send_signal(signal.SIGTERM)
    return await asyncio.wait_for(proc.wait(), 20)


@cli
async def test_cli_consume_prints_and_acks(fake_broker: FakeBroker) -> None:
    proc, port = await _start_consume(fake_broker)
    pusher = await Pusher.connect(port)
    pusher.push("m1", b"hello\nworld")
    (ack,) = await pusher.read(1)
    assert ack.type == "ack"
    assert proc.stdout is not None
    assert await within(proc.stdout.readline()) == b"app m1 hello\\nworld\n"
    pusher.close()
    assert await _stop(proc) == 0
    assert [f.type for f in fake_broker.frames] == ["register"]  # no unregister by default


@cli
async def test_cli_consume_exec(fake_broker: FakeBroker, tmp_path: Path) -> None:
    out = shlex.quote(str(tmp_path))
    script = (
        f'cat > {out}/"$SKMQ_MSGID"; case "$SKMQ_MSGID" in m1) exit 0;; m2) exit 3;; esac; exit 1'
    )
    proc, port = await _start_consume(
        fake_broker, "--exec", script, "--reject-exit-code", "3", "--unregister-on-exit"
    )
    pusher = await Pusher.connect(port)
    for i in (1, 2, 3):
        pusher.push(f"m{i}", f"body{i}".encode())
    answers = {f.get("msgid"): f for f in await pusher.read(3)}
    assert answers["m1"].type == "ack"
    assert answers["m2"].type == "reject"
    assert answers["m3"].type == "error" and answers["m3"].content == b"exit status 1"
    assert (tmp_path / "m2").read_bytes() == b"body2"
    pusher.close()
    assert await _stop(proc) == 0
    assert [f.type for f in fake_broker.frames] == ["register", "hello", "unregister"]


# ------------------------------------------------------------------- uvloop

# pytest-asyncio runs the tests above on the default loop; the CLI and the
# broker run on uvloop, whose transports differ (not asyncio.Transport
# subclasses, other write/flow-control paths), so run the core ones there too.
UVLOOP_SCENARIOS: list[Callable[..., Awaitable[None]]] = [
    test_send_writes_the_fields,
    test_a_thousand_sends_in_flight_matched_in_order,
    test_send_many_in_one_write,
    test_broken_connection_fails_every_pending_send,
    test_cancelled_send_does_not_shift_later_resps,
    test_register_sends_where_we_listen,
    test_ack_reject_and_error_answers,
    test_many_unanswered_pushes_on_one_connection,
    test_concurrency_is_bounded_per_connection,
    test_arrived_then_ack,
    test_double_terminator_and_odd_frames_get_no_extra_answer,
]


@pytest.mark.parametrize("scenario", UVLOOP_SCENARIOS, ids=lambda f: f.__name__)
def test_under_uvloop(scenario: Callable[..., Awaitable[None]]) -> None:
    async def main() -> None:
        if "fake_broker" not in inspect.signature(scenario).parameters:
            await scenario()
            return
        broker = FakeBroker()
        await broker.start()
        try:
            await scenario(broker)
        finally:
            await broker.stop()

    uvloop.run(main())
