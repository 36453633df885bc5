"""The channel pipeline of the original SKMQ design, on asyncio:

    connection stage --decode_q--> decode stage --handle_q--> handle stage --reply_q--> reply stage

Each stage is one task and each queue is bounded, so a slow stage slows its readers all
the way back to TCP (backpressure), never drops a frame. Stages pass batches: whatever
is queued is taken at once. Answers leave in frame order per connection: the handle
stage emits one reply a frame, in order, and the reply stage awaits them in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import structlog

from skmq.aio import cancel_and_wait
from skmq.codec import CodecError, Decoder, Frame, InvalidFrame, encode_resp
from skmq.config import Settings
from skmq.handler import Handler, Outcome
from skmq.peer import Peer
from skmq.ratelimit import TokenBucket
from skmq.supervisor import Supervisor

log = structlog.get_logger("skmq.server")

READ_SIZE = 256 * 1024
MAX_BATCH = 4096
# A peer that does not read its answers is cut off past this much unsent data.
MAX_WRITE_BUFFER = 16 << 20


class Connection:
    __slots__ = ("broken", "decoder", "last_active", "peer", "reader", "writer")

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, settings: Settings
    ) -> None:
        self.reader = reader
        self.writer = writer
        peer = writer.get_extra_info("peername")
        self.peer = Peer(peer[0] if isinstance(peer, tuple) else "")
        self.decoder = Decoder(settings.max_frame_bytes, settings.max_line_bytes)
        self.last_active = time.monotonic()
        self.broken = False


Item = Frame | InvalidFrame | CodecError | None


class Server:
    def __init__(self, settings: Settings, handler: Handler, supervisor: Supervisor) -> None:
        self.settings = settings
        self.supervisor = supervisor
        self.handler = handler
        self.decode_q: asyncio.Queue[tuple[Connection, bytes | None]] = asyncio.Queue(1024)
        self.handle_q: asyncio.Queue[list[tuple[Connection, Item]]] = asyncio.Queue(64)
        self.reply_q: asyncio.Queue[list[tuple[Connection, Outcome]]] = asyncio.Queue(64)
        self.connections: set[Connection] = set()
        self.rate = TokenBucket(settings.rate) if settings.rate > 0 else None
        self._server: asyncio.Server | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.port = settings.port

    async def start(self) -> None:
        self._server = await asyncio.start_server(
            self._connection_stage,
            self.settings.host,
            self.settings.port,
            limit=READ_SIZE,
            backlog=1024,
            reuse_address=True,
        )
        self.port = self._server.sockets[0].getsockname()[1]
        start = self.supervisor.start
        self._tasks = [
            start("decode", self._decode_stage),
            start("handle", self._handle_stage),
            start("reply", self._reply_stage),
            start("idle", self._idle_sweep),
        ]

    async def stop_accepting(self) -> None:
        if self._server is not None:
            self._server.close()

    async def stop(self, timeout: float = 2.0) -> None:
        """Stop accepting, answer what was already read (bounded), then close everything."""
        await self.stop_accepting()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                while not (
                    self.decode_q.empty() and self.handle_q.empty() and self.reply_q.empty()
                ):
                    await asyncio.sleep(0.01)
        await cancel_and_wait(self._tasks)
        for conn in list(self.connections):
            conn.writer.close()

    # -- connection stage ---------------------------------------------------
    async def _connection_stage(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        if len(self.connections) >= self.settings.max_connections:
            writer.write(encode_resp("error", "too many connections"))
            writer.close()
            return
        conn = Connection(reader, writer, self.settings)
        self.connections.add(conn)
        try:
            while not conn.broken:
                data = await reader.read(READ_SIZE)
                if not data:
                    break
                conn.last_active = time.monotonic()
                await self.decode_q.put((conn, data))
        except (ConnectionError, OSError):
            pass
        finally:
            if not conn.broken:
                # End of stream: answer what was read, then close (a `printf | nc` peer
                # half-closes and still waits for its answers).
                await self.decode_q.put((conn, None))

    # -- decode stage -------------------------------------------------------
    async def _decode_stage(self) -> None:
        q = self.decode_q
        while True:
            chunks = [await q.get()]
            while not q.empty() and len(chunks) < MAX_BATCH:
                chunks.append(q.get_nowait())
            out: list[tuple[Connection, Item]] = []
            for conn, data in chunks:
                if conn.broken:
                    continue
                if data is None:
                    out.append((conn, None))
                    continue
                try:
                    frames = conn.decoder.feed(data)
                except CodecError as exc:
                    conn.broken = True
                    out.extend((conn, f) for f in exc.frames)
                    out.append((conn, exc))
                    continue
                out.extend((conn, f) for f in frames)
            if not out:
                continue
            if self.rate is not None:
                await self.rate.acquire(len(out))
            await self.handle_q.put(out)

    # -- handle stage -------------------------------------------------------
    async def _handle_stage(self) -> None:
        q = self.handle_q
        while True:
            items = await q.get()
            while not q.empty() and len(items) < MAX_BATCH:
                items.extend(q.get_nowait())
            outcomes = self.handler.handle_batch([(c.peer, item) for c, item in items])
            await self.reply_q.put([(c, o) for (c, _), o in zip(items, outcomes, strict=True)])

    # -- reply stage --------------------------------------------------------
    async def _reply_stage(self) -> None:
        while True:
            replies = await self.reply_q.get()
            out: dict[Connection, list[bytes]] = {}
            closing: list[Connection] = []
            for conn, outcome in replies:
                reply = outcome.reply
                if not isinstance(reply, bytes):
                    try:
                        reply = await reply
                    except Exception:
                        log.exception("handler failed")
                        reply = encode_resp("error", "internal error")
                if reply:
                    out.setdefault(conn, []).append(reply)
                if outcome.close:
                    closing.append(conn)
            now = time.monotonic()
            for conn, chunks in out.items():
                writer = conn.writer
                if writer.is_closing():
                    continue
                writer.write(b"".join(chunks))
                conn.last_active = now
                if writer.transport.get_write_buffer_size() > MAX_WRITE_BUFFER:
                    log.warning("peer does not read its answers, closing", peer=conn.peer.host)
                    self._close(conn)
            for conn in closing:
                self._close(conn)

    def _close(self, conn: Connection) -> None:
        conn.broken = True
        conn.writer.close()
        self.connections.discard(conn)

    async def _idle_sweep(self) -> None:
        timeout = self.settings.idle_timeout
        while True:
            await asyncio.sleep(min(5.0, max(0.05, timeout / 4)))
            cutoff = time.monotonic() - timeout
            for conn in [c for c in self.connections if c.last_active < cutoff]:
                log.info("closing idle connection", peer=conn.peer.host)
                self._close(conn)
