"""Raw-TCP peers for tests, written from SPEC: a producer/client connection and a fake
recipient whose answer to each push is chosen by a policy."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Self

from skmq.codec import PONG, Decoder, Frame, InvalidFrame, encode_frame

WAIT = 10.0  # upper bound of every wait in tests


class RawClient:
    """A connection to the broker speaking frames (bytes in, decoded frames out)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.decoder = Decoder()
        self.frames: list[Frame] = []

    @classmethod
    async def connect(cls, port: int, host: str = "127.0.0.1") -> RawClient:
        reader, writer = await asyncio.open_connection(host, port)
        return cls(reader, writer)

    def send_raw(self, data: bytes) -> None:
        self.writer.write(data)

    def send(self, type: str, content: bytes | None = None, **fields: str) -> None:
        self.writer.write(encode_frame(type, fields, content))

    async def recv(self, timeout: float = WAIT) -> Frame:
        async with asyncio.timeout(timeout):
            while not self.frames:
                data = await self.reader.read(65536)
                if not data:
                    raise ConnectionError("closed by broker")
                self.frames.extend(f for f in self.decoder.feed(data) if isinstance(f, Frame))
        return self.frames.pop(0)

    async def resp(self, timeout: float = WAIT) -> dict[str, Any]:
        frame = await self.recv(timeout)
        assert frame.type == "resp", frame
        body: dict[str, Any] = json.loads(frame.content or b"{}")
        body["msgid"] = frame.fields.get("msgid")
        return body

    async def request(
        self, type: str, content: bytes | None = None, **fields: str
    ) -> dict[str, Any]:
        self.send(type, content, **fields)
        return await self.resp()

    async def produce(self, appid: str, msgids: list[str]) -> list[dict[str, Any]]:
        """A queue message (content `x`) for each msgid, pipelined; then their answers."""
        for msgid in msgids:
            self.send("queue", b"x", appid=appid, msgid=msgid)
        return [await self.resp() for _ in msgids]

    async def closed(self, timeout: float = WAIT) -> bool:
        """True once the broker has closed the connection (reads drained)."""
        async with asyncio.timeout(timeout):
            while await self.reader.read(65536):
                pass
        return True

    async def close(self) -> None:
        self.writer.close()
        try:
            await self.writer.wait_closed()
        except (ConnectionError, OSError):
            pass


Policy = Callable[[Frame], str]
# a policy returns: "ack" | "reject" | "error" | "arrived" (then silent) | "arrived+ack"
# | "silent" | "close" (drop the connection without answering)


class FakeRecipient:
    """Listens on a real port; answers each push as `policy` says; answers ping with pong."""

    def __init__(
        self,
        app: str,
        rid: str,
        policy: Policy | None = None,
        weight: int = 0,
        caps: tuple[str, ...] = ("pipeline", "length", "token"),
        host: str = "127.0.0.1",
    ) -> None:
        self.app = app
        self.caps = caps
        self.host = host
        self.rid = rid
        self.weight = weight
        self.policy: Policy = policy or (lambda f: "ack")
        self.pushes: asyncio.Queue[Frame] = asyncio.Queue()
        self.received: list[Frame] = []
        self.pushed_on: list[int] = []  # each received push's connection (its number)
        self.resps: list[Frame] = []  # the broker's answers to our answers
        self.pings = 0
        self.connections = 0
        self.port = 0
        self.answer_pings = True
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> FakeRecipient:
        self._server = await asyncio.start_server(self._serve, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for w in list(self._writers):
            w.close()
        self._server = None

    def registration(self, **extra: Any) -> bytes:
        reg = {"id": self.rid, "app_id": self.app, "host": self.host, "port": self.port,
               "weight": self.weight, "caps": list(self.caps)}  # fmt: skip
        reg.update(extra)
        return json.dumps(reg).encode()

    async def register(self, broker_port: int) -> dict[str, Any]:
        client = await RawClient.connect(broker_port)
        try:
            return await client.request("register", self.registration())
        finally:
            await client.close()

    async def next_push(self, timeout: float = WAIT) -> Frame:
        async with asyncio.timeout(timeout):
            return await self.pushes.get()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        number = self.connections
        self._writers.add(writer)
        decoder = Decoder()
        try:
            while data := await reader.read(65536):
                for frame in decoder.feed(data):
                    if isinstance(frame, InvalidFrame):
                        continue
                    if frame.type == "ping":
                        self.pings += 1
                        if self.answer_pings:
                            writer.write(PONG)
                        continue
                    if frame.type == "resp":
                        self.resps.append(frame)
                    if frame.type != "push":
                        continue
                    self.received.append(frame)
                    self.pushed_on.append(number)
                    self.pushes.put_nowait(frame)
                    self._answer(writer, frame)
        except (ConnectionError, OSError):
            pass
        finally:
            self._writers.discard(writer)
            writer.close()

    def _answer(self, writer: asyncio.StreamWriter, frame: Frame) -> None:
        action = self.policy(frame)
        fields = {"msgid": frame.fields["msgid"], "appid": frame.fields.get("appid", "")}
        if "token" in frame.fields:
            fields["token"] = frame.fields["token"]
        if action == "close":
            writer.close()
            return
        if action == "garbage":  # not a frame at all
            writer.write(b"garbage-line\r\n\r\n")
            return
        if action == "frob":  # a frame, but no answer
            writer.write(encode_frame("frob", fields))
            return
        if action == "no-msgid":
            writer.write(encode_frame("ack", {}))
            return
        if action == "ack-as-other":  # names another recipient than this one
            writer.write(encode_frame("ack", {**fields, "recipient": "other"}))
            return
        if action in ("arrived", "arrived+ack"):
            writer.write(encode_frame("arrived", fields))
        if action in ("ack", "arrived+ack"):
            writer.write(encode_frame("ack", fields))
        elif action == "reject":
            writer.write(encode_frame("reject", fields))
        elif action == "error":
            writer.write(encode_frame("error", fields, b"handler failed"))


# --------------------------------------------------------------------------- original peers
# Doubles of the original Go SKMQ (raomuyang/sikong-mq), written from its source and from
# runs of its programs: its recipient demo (demo/recipient_demo.go) and its broker. Both
# read through process.ReadStream/DecodeMessage, whose reader reuses one 1 KiB buffer while
# the decoder may still be reading it (a data race); the doubles model the outcome seen.

LEGACY_READ = 1024  # the original reader's buffer
LEGACY_END = b"\r\n\r\n"


@dataclass(slots=True)
class LegacyMessage:
    """What the original decoder makes of a frame (base.Message): four known fields."""

    type: str = ""
    msgid: str = ""
    appid: str = ""
    content: bytes = b""


class LegacyPanic(Exception):
    """The original decoder panicked: that connection is read no more, and never closed."""


def legacy_encode(type: str, *, appid: str = "", msgid: str = "", content: bytes = b"") -> bytes:
    """process.EncodeMessage: type, appid and msgid (when not empty), content (always)."""
    head = f"type={type}\r\n"
    head += f"appid={appid}\r\n" if appid else ""
    head += f"msgid={msgid}\r\n" if msgid else ""
    return head.encode() + b"content=" + content + LEGACY_END


def legacy_send(type: str, **fields: Any) -> bytes:
    """process.SendMessage(EncodeMessage(...)): the terminator written twice."""
    return legacy_encode(type, **fields) + LEGACY_END


class LegacyDecoder:
    """process.DecodeMessage, line by line: `key=value`; `content` is the rest of its line;
    other keys ignored; a frame without type dropped; a line without `=` other than `ping`
    panics (so does `length=`: the content's next line has no `=`). `frame_bytes` counts the
    bytes of the frame being read, since a frame over LEGACY_READ spans two reads."""

    def __init__(self) -> None:
        self._line = b""
        self._msg = LegacyMessage()
        self.frame_bytes = 0

    def feed(self, data: bytes) -> list[tuple[LegacyMessage, int]]:
        """(message, its frame's size in bytes) for every frame completed by `data`."""
        out: list[tuple[LegacyMessage, int]] = []
        *lines, self._line = (self._line + data).split(b"\r\n")
        for line in lines:
            self.frame_bytes += len(line) + 2
            if not line:
                if self._msg.type:
                    out.append((self._msg, self.frame_bytes))
                    self._msg = LegacyMessage()
                self.frame_bytes = 0
                continue
            key, sep, value = line.partition(b"=")
            if not sep:
                if line != b"ping":
                    raise LegacyPanic(f"param separator not found: {line[:40]!r}")
                out.append((LegacyMessage(type="ping"), self.frame_bytes))
            elif key == b"length":
                raise LegacyPanic("length= (its content's next line has no separator)")
            elif key == b"content":
                self._msg.content = value
            elif key in (b"type", b"msgid", b"appid"):
                setattr(self._msg, key.decode(), value.decode("utf-8", "replace"))
        return out


class LegacyReader:
    """One connection read as the original does: LEGACY_READ bytes a read. A read that
    completes several frames gives only the first (the race: the next read overwrites the
    buffer before the decoder has copied it) and drops the rest of that read; a frame over
    LEGACY_READ bytes, and anything the decoder panics on, wedges the connection."""

    def __init__(self, reader: asyncio.StreamReader, peer: LegacyPeer | None = None) -> None:
        self._reader = reader
        self._decoder = LegacyDecoder()
        self._peer = peer or LegacyPeer()  # counts frames dropped, connections wedged
        self.wedged = False

    async def messages(self) -> AsyncIterator[LegacyMessage]:
        while data := await self._reader.read(LEGACY_READ):
            try:
                done = self._decoder.feed(data)
                if any(size > LEGACY_READ for _, size in done):
                    raise LegacyPanic("a frame over 1 KiB, read in pieces the race mangles")
            except LegacyPanic:
                self.wedged = True
                self._peer.wedged += 1
                return
            if len(done) > 1:
                self._peer.dropped += len(done) - 1
                self._decoder = LegacyDecoder()
            if done:
                yield done[0][0]


class LegacyPeer:
    """What an original double saw: msgids `acked` (a test can wait for a number of
    them), frames `dropped` by the read race, connections `wedged` (left open, unread
    until the double stops)."""

    def __init__(self) -> None:
        self.acked: list[str] = []
        self.dropped = 0
        self.wedged = 0
        self.stopped = asyncio.Event()
        self._changed = asyncio.Condition()

    async def _note_ack(self, msgid: str) -> None:
        async with self._changed:
            self.acked.append(msgid)
            self._changed.notify_all()

    async def wait_acked(self, n: int, timeout: float = WAIT) -> list[str]:
        async with asyncio.timeout(timeout), self._changed:
            await self._changed.wait_for(lambda: len(self.acked) >= n)
        return self.acked


class LegacyRecipient(LegacyPeer):
    """The original recipient (demo/recipient_demo.go) on a real port.

    It registers with a string port and no `caps`; answers `ping` with `pong`; answers each
    push as `answer` says: "ack" (the demo: `ack` with only the msgid, on the same
    connection), "arrived" (`arrived` on the push connection, closes it, then sends `ack`
    with only the msgid on a new connection to the broker), "reject", "error" or "silent".
    Reads go through LegacyReader (1 KiB reads, the race, no `length=`).

        async with LegacyRecipient("app", "r1", broker_port=port) as rec:
            ...
            await rec.wait_acked(10)   # rec.acked: msgids it acked, in order

    `acked` holds a msgid once its ack is written (arrived mode: once the broker answered
    the late ack); `resps` the broker's resps it read; `pushes`, `wedged` (connections its
    decoder gave up on, left open) and `dropped` (frames lost to the race) the rest.
    """

    def __init__(
        self, app: str, rid: str, *, broker_port: int, answer: str = "ack", weight: int = 0
    ) -> None:
        super().__init__()
        self.app = app
        self.rid = rid
        self.broker_port = broker_port
        self.answer = answer
        self.weight = weight
        self.port = 0
        self.pushes: list[LegacyMessage] = []
        self.resps: list[dict[str, Any]] = []
        self.pings = 0
        self.connections = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> Self:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        resp = await self.register()
        assert resp.get("status") == "ack", resp
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.stopped.set()
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        for writer in list(self._writers):
            writer.close()

    def registration(self) -> bytes:
        """json.Marshal(base.RecipientInfo): the port as a string, nothing else."""
        return json.dumps(
            {"id": self.rid, "app_id": self.app, "host": "127.0.0.1", "port": str(self.port),
             "weight": self.weight}, separators=(",", ":"),
        ).encode()  # fmt: skip

    async def register(self) -> dict[str, Any]:
        return await self._to_broker(legacy_send("register", content=self.registration()))

    async def _to_broker(self, frame: bytes) -> dict[str, Any]:
        """Open a connection to the broker, send one frame, read its resp, close."""
        reader, writer = await asyncio.open_connection("127.0.0.1", self.broker_port)
        try:
            writer.write(frame)
            async with asyncio.timeout(WAIT):
                async for msg in LegacyReader(reader, self).messages():
                    if msg.type == "resp":
                        resp: dict[str, Any] = json.loads(msg.content)
                        self.resps.append(resp)
                        return resp
            raise ConnectionError("the broker closed without a resp")
        finally:
            writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.add(writer)
        legacy = LegacyReader(reader, self)
        try:
            async for msg in legacy.messages():
                if msg.type == "ping":
                    self.pings += 1
                    writer.write(b"pong" + LEGACY_END)
                elif msg.type == "push":
                    self.pushes.append(msg)
                    if not await self._answer(msg, writer):
                        return
                elif msg.type == "resp":
                    self.resps.append(json.loads(msg.content or b"{}"))
            if legacy.wedged:  # the demo's goroutine blocks for good; the socket stays open
                await self.stopped.wait()
        except (ConnectionError, OSError):
            pass
        finally:
            self._writers.discard(writer)
            writer.close()

    async def _answer(self, msg: LegacyMessage, writer: asyncio.StreamWriter) -> bool:
        """Answer one push; False once this connection is done with."""
        if self.answer == "silent":
            return True
        if self.answer == "arrived":
            writer.write(legacy_send("arrived", msgid=msg.msgid))
            await writer.drain()
            writer.close()
            task = asyncio.get_running_loop().create_task(self._late_ack(msg.msgid))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            return False
        writer.write(legacy_send(self.answer, msgid=msg.msgid))
        if self.answer == "ack":
            await self._note_ack(msg.msgid)
        return True

    async def _late_ack(self, msgid: str) -> None:
        resp = await self._to_broker(legacy_send("ack", msgid=msgid))
        if resp.get("status") == "ack":
            await self._note_ack(msgid)


class LegacyBroker(LegacyPeer):
    """The original broker (skmq/postoffice.go, process/msghandler.go) for client tests.

    Every frame it reads (LegacyReader: the same reader and race) is answered `resp` with
    content `{"status","content"}` and no msgid, terminator written twice. Any type but
    register/arrived/ack/reject/error/ping is stored as a message: deduplicated by msgid,
    the empty msgid included ("message already exists"). `register` wants the port as a
    JSON string ("Invalid parameters" otherwise). A queue/topic message with an appid is
    pushed to a registered recipient of the app its way: connect, write the push, answer
    the first answer with a resp, close. `acked`: msgids acked (`ack` answers), `frames`:
    everything it read, `messages`: what it stored, by msgid.
    """

    def __init__(self) -> None:
        super().__init__()
        self.port = 0
        self.frames: list[LegacyMessage] = []
        self.messages: dict[str, LegacyMessage] = {}
        self.recipients: dict[str, dict[str, Any]] = {}
        self._pending: asyncio.Queue[LegacyMessage] = asyncio.Queue()
        self._unassigned: list[LegacyMessage] = []
        self._turn = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> Self:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        self._spawn(self._dispatch())
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.stopped.set()
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    @staticmethod
    def resp(status: str, content: str = "") -> bytes:
        body = json.dumps({"status": status, "content": content}, separators=(",", ":"))
        return legacy_send("resp", content=body.encode())

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        legacy = LegacyReader(reader, self)
        try:
            async for msg in legacy.messages():
                writer.write(await self._handle(msg))
            if legacy.wedged:
                await self.stopped.wait()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    async def _handle(self, msg: LegacyMessage) -> bytes:
        self.frames.append(msg)
        if msg.type == "ping":
            return b"pong" + LEGACY_END
        if msg.type == "register":
            return self._register(msg)
        if msg.type in ("ack", "reject", "error"):
            if msg.type == "ack":
                self.messages.pop(msg.msgid, None)
                await self._note_ack(msg.msgid)
            return self.resp("ack")
        if msg.type == "arrived":
            return self.resp("ack" if msg.msgid in self.messages else "error")
        if msg.msgid in self.messages or msg.msgid in self.acked:
            return self.resp("ack", f"message already exists, ID: {msg.msgid}, Status ")
        self.messages[msg.msgid] = msg
        if msg.appid and msg.type in ("queue", "topic"):
            self._pending.put_nowait(msg)
        return self.resp("ack", "Message enqueue successful")

    def _register(self, msg: LegacyMessage) -> bytes:
        try:
            reg = json.loads(msg.content)
            if not isinstance(reg.get("port", ""), str) or not isinstance(
                reg.get("weight", 0), int
            ):
                raise ValueError
        except ValueError:
            return self.resp("reject", f"Invalid parameters: {msg.content.decode()}")
        self.recipients[reg.get("id", "")] = reg
        return self.resp("ack", "Recipient register successful.")

    async def _dispatch(self) -> None:
        while True:
            msg = await self._pending.get()
            targets = [r for r in self.recipients.values() if r.get("app_id") == msg.appid]
            if not targets:
                self._unassigned.append(msg)  # until a recipient of its app registers
                continue
            self._turn += 1
            self._spawn(self._push(msg, targets[self._turn % len(targets)]))

    async def _push(self, msg: LegacyMessage, rec: dict[str, Any]) -> None:
        """postman.queue: push, then the read that completes the first answer: every
        answer in it is handled, only the first is answered; then close."""
        reader, writer = await asyncio.open_connection(rec.get("host"), int(rec["port"]))
        try:
            writer.write(
                legacy_encode("push", appid=msg.appid, msgid=msg.msgid, content=msg.content)
            )
            decoder = LegacyDecoder()
            done: list[tuple[LegacyMessage, int]] = []
            async with asyncio.timeout(WAIT):
                while not done and (data := await reader.read(LEGACY_READ)):
                    done = decoder.feed(data)
            replies = [await self._handle(answer) for answer, _ in done]
            if replies:
                writer.write(replies[0])
            await writer.drain()
        except (ConnectionError, OSError, TimeoutError, LegacyPanic):
            pass
        finally:
            writer.close()
