"""The channel pipeline of the original SKMQ design, on asyncio:

    connection stage --decode_q--> decode stage --handle_q--> handle stage --> replies

Each stage is one task and each queue is bounded, so a slow stage slows its readers all
the way back to TCP (backpressure), never drops a frame. Stages pass batches: whatever
is queued is taken at once. The handle stage emits one reply a frame, in frame order,
into its connection's reply queue, and writes the replies at its head that are ready;
a pending reply (a store batch, a task) writes the next ones from its done callback
when it is done. Answers thus leave in frame order per connection, no connection waits
behind another connection's replies, and no task a connection waits for them.

Limits, each a setting: a connection is not read while it has its share of unanswered
frames: MAX_UNANSWERED_FRAMES, or less when MAX_UNANSWERED_TOTAL shared by every
connection is smaller (never under MIN_SHARE). Every frame read may cost memory until
it is answered, so a connection reads no more bytes than could hold the frames its
share has room for (one frame is at least MIN_FRAME_BYTES), counting what it read and
the decode stage has not decoded yet: the frames held in memory stay bounded however
small the frames of a flood are. A frame that has started must end within FRAME_TIMEOUT;
incomplete frames of all connections hold at most MAX_PARTIAL_BYTES; MAX_CONNECTIONS
and MAX_CONNECTIONS_PER_HOST bound connections. A connection over a limit is answered
`error` (after the answers to its earlier frames) and closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Iterator

import structlog

from skmq.admission import LINGER, LINGER_BYTES, Admission
from skmq.aio import cancel_and_wait
from skmq.codec import CodecError, Decoder, Frame, InvalidFrame, encode_resp
from skmq.config import Settings
from skmq.handler import FrameHandler, Outcome, PendingReply
from skmq.peer import Peer
from skmq.ratelimit import TokenBucket
from skmq.supervisor import Supervisor

log = structlog.get_logger("skmq.server")

READ_SIZE = 256 * 1024
# The fewest bytes a frame that is answered later can take ("a\r\n\r\n" is 5; an answer
# or a registration, which waits for the store, "type=ack\r\n\r\n", 13).
MIN_FRAME_BYTES = 8
# A connection's share of MAX_UNANSWERED_TOTAL is never below this many frames.
MIN_SHARE = 16
# Reading near the share reads at least this much (a large frame still makes progress).
MIN_READ = 256
MAX_BATCH = 4096


class LimitExceeded(CodecError):
    """A connection broke a server limit (not a codec rule): answered `error`, closed."""


async def _drop_input(reader: asyncio.StreamReader) -> None:
    """Read and drop what a peer sends until it closes, or LINGER or LINGER_BYTES runs
    out."""
    dropped = 0
    with contextlib.suppress(TimeoutError, ConnectionError, OSError):
        async with asyncio.timeout(LINGER):
            while dropped < LINGER_BYTES and (data := await reader.read(READ_SIZE)):
                dropped += len(data)


class Connection:
    __slots__ = (
        "broken",
        "closing",
        "decoded",
        "decoder",
        "draining",
        "frame_started",
        "last_active",
        "partial",
        "peer",
        "queued",
        "readable",
        "reader",
        "reading",
        "replies",
        "replying",
        "unanswered",
        "writer",
    )

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, settings: Settings
    ) -> None:
        self.reader = reader
        self.writer = writer
        self.peer = Peer(
            peer_host(writer),
            store_calls=asyncio.Semaphore(settings.max_store_calls_per_connection),
        )
        self.decoder = Decoder(settings.max_frame_bytes, settings.max_line_bytes)
        self.last_active = time.monotonic()
        self.broken = False
        # A fatal error ended its stream: what the peer still sends is read and dropped
        # (draining) until our answers are out (closing) and the peer closes, or LINGER.
        self.draining = False
        self.closing = False
        # When the incomplete frame at the head of the decoder began (None: no partial
        # frame), and its size as counted in Server.partial_bytes.
        self.frame_started: float | None = None
        self.partial = 0
        # Frames decoded and not answered yet; reading pauses while there are too many.
        self.unanswered = 0
        self.readable = asyncio.Event()
        self.readable.set()
        # Bytes read and not decoded yet; `decoded` is set each time the decode stage
        # took a chunk of this connection's.
        self.queued = 0
        self.decoded = asyncio.Event()
        # True while the broker waits for the peer's bytes: only that time counts
        # against FRAME_TIMEOUT (not the time the broker itself is behind).
        self.reading = False
        self.replies: deque[Outcome] = deque()
        self.replying = False


def peer_host(writer: asyncio.StreamWriter) -> str:
    peer = writer.get_extra_info("peername")
    return str(peer[0]) if isinstance(peer, tuple) else ""


# What the connection stage passes on: bytes read, None at end of stream, or a limit
# broken (from the sweep).
Chunk = bytes | LimitExceeded | None
Item = Frame | InvalidFrame | CodecError | None


def _by_content_size(
    items: list[tuple[Connection, Item]], budget: int
) -> Iterator[list[tuple[Connection, Item]]]:
    """The items in runs of at most `budget` content bytes (at least one item a run), so
    that content waiting for the store stays within MAX_STORE_PENDING_BYTES and one run."""
    start, size = 0, 0
    for i, (_, item) in enumerate(items):
        if isinstance(item, Frame) and item.content:
            if size and size + len(item.content) > budget:
                yield items[start:i]
                start, size = i, 0
            size += len(item.content)
    yield items[start:]


class Server:
    def __init__(
        self,
        settings: Settings,
        handler: FrameHandler,
        supervisor: Supervisor,
        admission: Admission | None = None,
    ) -> None:
        self.settings = settings
        #: Shared with the HTTP gateway: both count against the same connection limits.
        self.admission = admission if admission is not None else Admission(settings)
        self.supervisor = supervisor
        self.handler = handler
        self.decode_q: asyncio.Queue[tuple[Connection, Chunk]] = asyncio.Queue(256)
        self.handle_q: asyncio.Queue[list[tuple[Connection, Item]]] = asyncio.Queue(64)
        self.connections: set[Connection] = set()
        self.partial_bytes = 0
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
            start("sweep", self._sweep),
        ]

    async def stop_accepting(self) -> None:
        if self._server is not None:
            self._server.close()

    async def stop(self, timeout: float = 2.0) -> None:
        """Stop accepting, answer what was already read (bounded), then close everything."""
        await self.stop_accepting()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                while not self._idle():
                    await asyncio.sleep(0.01)
        await cancel_and_wait(self._tasks)
        for conn in list(self.connections):
            conn.writer.close()

    def _idle(self) -> bool:
        """Nothing read is left to answer."""
        queued = not (self.decode_q.empty() and self.handle_q.empty())
        return not queued and not any(conn.replying for conn in self.connections)

    # -- connection stage ---------------------------------------------------
    async def _connection_stage(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        host = peer_host(writer)
        refusal = self.admission.refusal(host)
        if refusal is not None:
            writer.write(encode_resp("error", refusal))
            await self._refuse(reader, writer)
            return
        conn = Connection(reader, writer, self.settings)
        self.connections.add(conn)
        self.admission.admit(host)
        try:
            while not conn.broken:
                await conn.readable.wait()
                room = self._read_room(conn)
                if room <= 0:
                    if conn.queued:  # the decode stage is behind: wait for it
                        conn.decoded.clear()
                        await conn.decoded.wait()
                    else:  # at its share: its replies resume reading
                        conn.readable.clear()
                    continue
                conn.reading = True
                data = await reader.read(max(room, MIN_READ))
                conn.reading = False
                if not data:
                    break
                conn.last_active = time.monotonic()
                conn.queued += len(data)
                await self.decode_q.put((conn, data))
            if conn.broken:
                await self._drain(conn)
        except (ConnectionError, OSError):
            pass
        finally:
            self.admission.release(host)
            conn.peer.gone.set()
            if not conn.broken:
                # End of stream: answer what was read, then close (a `printf | nc` peer
                # half-closes and still waits for its answers).
                await self.decode_q.put((conn, None))

    async def _drain(self, conn: Connection) -> None:
        """Read and drop what the peer still sends (_drop_input): closing with its bytes
        unread would reset the connection, and a peer that sends all before it reads (an
        oversized frame, a pipelined flood) would lose our last answer, the error saying
        why, to the reset."""
        conn.draining = True
        await _drop_input(conn.reader)
        conn.draining = False
        if conn.closing:
            conn.writer.close()

    async def _refuse(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """End a refused connection after its answer (written), lingering as _drain does
        while at most MAX_LINGERING refused connections linger."""
        if not self.admission.linger():
            writer.close()
            return
        try:
            with contextlib.suppress(OSError, RuntimeError):
                writer.write_eof()
            await _drop_input(reader)
        finally:
            self.admission.lingered()
            writer.close()

    def share(self) -> int:
        """The unanswered frames one connection may have now."""
        fair = self.settings.max_unanswered_total // max(1, len(self.connections))
        return min(self.settings.max_unanswered_frames, max(MIN_SHARE, fair))

    def _read_room(self, conn: Connection) -> int:
        """Bytes the connection may read now: no more than frames its share has room for."""
        room = (self.share() - conn.unanswered) * MIN_FRAME_BYTES - conn.queued
        return min(READ_SIZE, room)

    # -- decode stage -------------------------------------------------------
    async def _decode_stage(self) -> None:
        q = self.decode_q
        while True:
            chunks = [await q.get()]
            while not q.empty() and len(chunks) < MAX_BATCH:
                chunks.append(q.get_nowait())
            out: list[tuple[Connection, Item]] = []
            for conn, data in chunks:
                if isinstance(data, bytes):
                    conn.queued -= len(data)
                    conn.decoded.set()
                if conn.broken:
                    continue
                if not isinstance(data, bytes):
                    self._last_item(conn, data, out)
                    continue
                try:
                    frames = conn.decoder.feed(data)
                except CodecError as exc:
                    out.extend((conn, f) for f in exc.frames)
                    self._last_item(conn, exc, out)
                    continue
                out.extend((conn, f) for f in frames)
                self._track_partial(conn, completed=bool(frames))
            if self.partial_bytes > self.settings.max_partial_bytes:
                self._shed_partial(out)
            if not out:
                continue
            share = self.share()
            for conn, _ in out:
                conn.unanswered += 1
                if conn.unanswered >= share:
                    conn.readable.clear()
            if self.rate is not None:
                await self.rate.acquire(len(out))
            await self.handle_q.put(out)

    def _last_item(
        self, conn: Connection, item: CodecError | None, out: list[tuple[Connection, Item]]
    ) -> None:
        """The end of a connection's stream, or a fatal error: nothing after it is decoded."""
        conn.broken = item is not None
        self._release_partial(conn)
        out.append((conn, item))

    def _track_partial(self, conn: Connection, completed: bool) -> None:
        buffered = conn.decoder.buffered
        self.partial_bytes += buffered - conn.partial
        conn.partial = buffered
        if not buffered:
            conn.frame_started = None
        elif completed or conn.frame_started is None:
            conn.frame_started = time.monotonic()  # the partial frame began in this chunk

    def _release_partial(self, conn: Connection) -> None:
        self.partial_bytes -= conn.partial
        conn.partial = 0
        conn.frame_started = None

    def _shed_partial(self, out: list[tuple[Connection, Item]]) -> None:
        """Over MAX_PARTIAL_BYTES: refuse the connections holding the most until under."""
        cap = self.settings.max_partial_bytes
        while self.partial_bytes > cap and self.connections:
            conn = max(self.connections, key=lambda c: c.partial)
            if not conn.partial:
                break
            log.warning("partial frames over MAX_PARTIAL_BYTES, closing the largest",
                        peer=conn.peer.host, held=conn.partial)  # fmt: skip
            self._last_item(conn, LimitExceeded("incomplete frames over MAX_PARTIAL_BYTES"), out)

    # -- handle stage -------------------------------------------------------
    async def _handle_stage(self) -> None:
        q = self.handle_q
        while True:
            items = await q.get()
            while not q.empty() and len(items) < MAX_BATCH:
                items.extend(q.get_nowait())
            for part in _by_content_size(items, self.settings.max_store_pending_bytes):
                await self.handler.store_room()
                outcomes = self.handler.handle_batch([(c.peer, item) for c, item in part])
                answered: dict[Connection, None] = {}  # in order, once each
                for (conn, _), outcome in zip(part, outcomes, strict=True):
                    conn.replies.append(outcome)
                    answered[conn] = None
                for conn in answered:
                    if not conn.replying:
                        self._send_replies(conn)

    # -- replies -------------------------------------------------------------
    def _send_replies(self, conn: Connection) -> None:
        """Write the connection's replies in frame order, as far as they are ready; at the
        first pending one, write what is ready and go on from that reply's done callback.
        Called by the handle stage and by those callbacks: no task waits on a reply."""
        ready: list[bytes] = []
        closing = False
        while conn.replies and not closing:
            outcome = conn.replies[0]
            reply = outcome.reply
            if not isinstance(reply, bytes):
                if not reply.done():
                    conn.replying = True
                    self._write(conn, ready)
                    reply.add_done_callback(lambda _: self._send_replies(conn))
                    return
                reply = self._result(reply)
            conn.replies.popleft()
            if reply:
                ready.append(reply)
            conn.unanswered -= 1
            if not conn.readable.is_set() and conn.unanswered < self.share():
                conn.readable.set()
                if conn.frame_started is not None:  # the pause was the broker's
                    conn.frame_started = time.monotonic()
            closing = outcome.close
        conn.replying = False
        self._write(conn, ready)
        if closing:
            conn.replies.clear()
            self._close(conn)

    @staticmethod
    def _result(reply: PendingReply) -> bytes:
        try:
            return reply.result()
        except asyncio.CancelledError:  # the broker is stopping
            return encode_resp("error", "broker stopping")
        except Exception:
            log.exception("handler failed")
            return encode_resp("error", "internal error")

    def _write(self, conn: Connection, replies: list[bytes]) -> None:
        writer = conn.writer
        if not replies or writer.is_closing():
            return
        writer.write(b"".join(replies))
        conn.last_active = time.monotonic()
        if writer.transport.get_write_buffer_size() > self.settings.max_write_buffer_bytes:
            log.warning("peer does not read its answers, closing", peer=conn.peer.host)
            self._close(conn)

    def _close(self, conn: Connection) -> None:
        conn.broken = True
        conn.peer.gone.set()
        self._release_partial(conn)
        conn.readable.set()  # let its connection stage see the end
        conn.decoded.set()
        if conn.draining:  # our answers, then the end of our side: _drain closes
            conn.closing = True
            with contextlib.suppress(OSError, RuntimeError):
                conn.writer.write_eof()
        else:
            conn.writer.close()
        self.connections.discard(conn)

    # -- timeouts -------------------------------------------------------------
    async def _sweep(self) -> None:
        """Close connections silent for IDLE_TIMEOUT; refuse frames older than FRAME_TIMEOUT."""
        s = self.settings
        period = min(5.0, max(0.05, min(s.idle_timeout, s.frame_timeout) / 4))
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for conn in list(self.connections):
                if conn.broken:
                    continue
                if conn.last_active < now - s.idle_timeout:
                    log.info("closing idle connection", peer=conn.peer.host)
                    self._close(conn)
                elif (
                    conn.reading
                    and conn.frame_started is not None
                    and (conn.frame_started < now - s.frame_timeout)
                ):
                    log.info("frame not complete within FRAME_TIMEOUT", peer=conn.peer.host)
                    conn.frame_started = None
                    reason = f"frame not complete within FRAME_TIMEOUT ({s.frame_timeout:g} s)"
                    await self.decode_q.put((conn, LimitExceeded(reason)))
