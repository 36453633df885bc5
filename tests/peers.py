"""Raw-TCP peers for tests, written from SPEC: a producer/client connection and a fake
recipient whose answer to each push is chosen by a policy."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

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
                    if frame.type != "push":
                        continue
                    self.received.append(frame)
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
        if action in ("arrived", "arrived+ack"):
            writer.write(encode_frame("arrived", fields))
        if action in ("ack", "arrived+ack"):
            writer.write(encode_frame("ack", fields))
        elif action == "reject":
            writer.write(encode_frame("reject", fields))
        elif action == "error":
            writer.write(encode_frame("error", fields, b"handler failed"))
