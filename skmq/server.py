"""The channel pipeline of the original SKMQ design, on asyncio protocol callbacks:

    connection (read, decode) --> handle (the loop turn's batch) --> replies

Each connection is an asyncio.Protocol: what it reads is decoded in its `data_received`,
at once, and its frames join the batch of the loop's turn; one callback a turn hands the
batch of every connection to the handler (the producer frames of a batch are stored in
one round trip). No task, queue or stream reader stands between a frame's bytes and its
handling (each was a loop turn and a task switch more a frame). While the store has too
much content pending or RATE holds frames back, the handle task hands the batches on
instead, once they may go; connections are read on only until their shares of
unanswered frames are full (backpressure down to TCP, never a dropped frame). The handle stage
emits one reply a frame, in frame order, into its connection's reply queue, and writes
the replies at its head that are ready; a pending reply (a store batch, a task) writes
the next ones from its done callback when it is done. Answers thus leave in frame order
per connection, no connection waits behind another connection's replies, and no task a
connection waits for them.

Limits, each a setting: a connection is not read while it has its share of unanswered
frames: MAX_UNANSWERED_FRAMES, or less when MAX_UNANSWERED_TOTAL shared by every
connection is smaller (never under MIN_SHARE). Every frame decoded may cost memory until
it is answered, so a connection decodes no more bytes than could hold the frames its
share has room for (one frame is at least MIN_FRAME_BYTES), and what it read beyond them
waits undecoded, its reading paused: the frames held in memory stay bounded however
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
from collections.abc import Iterator, Sequence
from typing import cast

import structlog

from skmq.admission import LINGER, LINGER_BYTES, Admission
from skmq.aio import cancel_and_wait
from skmq.codec import CodecError, Decoder, Frame, InvalidFrame, encode_resp
from skmq.config import Settings
from skmq.connections import peer_address
from skmq.handler import FrameHandler, Outcome, PendingReply
from skmq.peer import Peer
from skmq.ratelimit import TokenBucket
from skmq.supervisor import Supervisor

log = structlog.get_logger("skmq.server")

# The fewest bytes a frame that is answered later can take ("a\r\n\r\n" is 5; an answer
# or a registration, which waits for the store, "type=ack\r\n\r\n", 13).
MIN_FRAME_BYTES = 8
# A connection's share of MAX_UNANSWERED_TOTAL is never below this many frames.
MIN_SHARE = 16
# Decoding near the share decodes at least this much (a large frame still makes progress).
MIN_READ = 256


class LimitExceeded(CodecError):
    """A connection broke a server limit (not a codec rule): answered `error`, closed."""


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


def peer_host(transport: asyncio.BaseTransport) -> str:
    peer = transport.get_extra_info("peername")
    return str(peer[0]) if isinstance(peer, tuple) else ""


class Connection(asyncio.Protocol):
    """One client connection: reads, decodes, and holds its replies in frame order."""

    __slots__ = (
        "admitted",
        "broken",
        "closing",
        "decode_due",
        "decoder",
        "draining",
        "dropped",
        "ended",
        "frame_started",
        "last_active",
        "linger_timer",
        "partial",
        "paused",
        "peer",
        "refused",
        "replies",
        "replying",
        "server",
        "transport",
        "unanswered",
        "undecoded",
    )

    def __init__(self, server: Server) -> None:
        self.server = server
        settings = server.settings
        self.transport: asyncio.Transport | None = None
        self.peer = Peer("", store_calls=asyncio.Semaphore(settings.max_store_calls_per_connection))
        self.decoder = Decoder(settings.max_frame_bytes, settings.max_line_bytes)
        self.last_active = time.monotonic()
        self.admitted = False  # counted by Admission until its reading ends
        self.refused = False  # over a connection limit: answered, then closed
        # Nothing after a fatal error (or the end of stream) is decoded.
        self.broken = False
        # The peer's end of stream (or the connection lost): once what it sent before is
        # decoded, the end joins the batch (its answers go out, then the connection closes).
        self.ended = False
        # A fatal error ended its stream: what the peer still sends is read and dropped
        # (draining) until our answers are out (closing) and the peer closes, or LINGER
        # or LINGER_BYTES runs out: closing with its bytes unread would reset the
        # connection, and a peer that sends all before it reads (an oversized frame, a
        # pipelined flood) would lose our last answer, the error saying why, to the reset.
        self.draining = False
        self.closing = False
        self.dropped = 0
        self.linger_timer: asyncio.TimerHandle | None = None
        # When the incomplete frame at the head of the decoder began (None: no partial
        # frame), and its size as counted in Server.partial_bytes.
        self.frame_started: float | None = None
        self.partial = 0
        # Frames decoded and not answered yet; reading pauses while there are too many.
        self.unanswered = 0
        # Bytes read and not decoded yet: beyond what the share has room for.
        self.undecoded = b""
        self.decode_due = False  # a decode of what is left is due next turn
        # Reading paused: while it is, the broker waits, not the peer (FRAME_TIMEOUT).
        self.paused = False
        self.replies: deque[Outcome] = deque()
        self.replying = False

    # -- asyncio.Protocol ---------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # (uvloop's is not a subclass)
        server = self.server
        host = peer_host(transport)
        self.peer.host = host
        self.peer.address = peer_address(transport)
        refusal = server.admission.refusal(host)
        if refusal is None:
            server.connections.add(self)
            server.admission.admit(host)
            self.admitted = True
            return
        self.refused = self.broken = True
        self.transport.write(encode_resp("error", refusal))
        if not server.admission.linger():  # at most MAX_LINGERING refused ones linger
            self.transport.close()
            return
        with contextlib.suppress(OSError, RuntimeError):
            self.transport.write_eof()
        self.drain()

    def data_received(self, data: bytes) -> None:
        if self.draining:
            self.dropped += len(data)
            if self.dropped >= LINGER_BYTES:  # (reading costs CPU)
                self.end_drain()
            return
        if self.broken:
            return
        self.last_active = time.monotonic()
        self.undecoded = self.undecoded + data if self.undecoded else data
        self.decode()

    def eof_received(self) -> bool:
        """The peer half-closed: answer what it sent (a `printf | nc` peer still waits for
        its answers), then close. True: the transport stays open for them."""
        if self.draining:
            self.end_drain()
        else:
            self.stream_ended()
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        if self.draining:
            self.end_drain()
        self.stream_ended()  # (the answers to what was read go nowhere)
        self.server.connections.discard(self)

    def stream_ended(self) -> None:
        """Nothing more comes: once what was read is decoded, the end joins the batch."""
        if not self.broken:
            self.ended = True
            self.decode()
        self.reading_ended()

    # -- reading ------------------------------------------------------------
    def decode(self) -> None:
        """Decode what was read as far as the share has room, one chunk a loop turn (the
        share shrinks as connections arrive: a flood of them must not each take the share
        of the first); pause reading while the share is full or bytes wait undecoded,
        resume once neither."""
        self.decode_due = False
        server = self.server
        if self.undecoded and not self.broken:
            room = (server.share() - self.unanswered) * MIN_FRAME_BYTES
            if room > 0:
                size = max(room, MIN_READ)
                chunk = self.undecoded
                if len(chunk) > size:
                    chunk, self.undecoded = chunk[:size], chunk[size:]
                else:
                    self.undecoded = b""
                try:
                    frames = self.decoder.feed(chunk)
                except CodecError as exc:
                    server.add(self, exc.frames)
                    self.end(exc)
                    return
                server.add(self, frames)
                server.track_partial(self, completed=bool(frames))
                if self.undecoded and not self.broken and not self.decode_due:
                    self.decode_due = True  # the rest next turn, if the share has room
                    asyncio.get_running_loop().call_soon(self.decode)
        if self.ended and not self.broken and not self.undecoded:
            self.end(None)
        self.pace()

    def pace(self) -> None:
        transport = self.transport
        if transport is None or self.broken or transport.is_closing():
            return
        full = bool(self.undecoded) or self.unanswered >= self.server.share()
        if full and not self.paused:
            self.paused = True
            transport.pause_reading()
        elif self.paused and not full:
            self.paused = False
            transport.resume_reading()
            if self.frame_started is not None:  # the pause was the broker's
                self.frame_started = time.monotonic()

    def end(self, item: CodecError | None) -> None:
        """The end of the stream (None), or a fatal error: nothing after it is decoded;
        after an error, what the peer still sends is dropped (drain)."""
        self.broken = True
        self.undecoded = b""
        self.server.release_partial(self)
        self.server.add(self, [item])
        if item is not None:
            self.drain()

    def reading_ended(self) -> None:
        """Nothing more is read from the peer (its end, or its drain's): it leaves the
        connection limits, and a long poll of its waits no longer."""
        self.peer.gone.set()
        if self.admitted:
            self.admitted = False
            self.server.admission.release(self.peer.host)

    # -- lingering ----------------------------------------------------------
    def drain(self) -> None:
        """Read and drop what the peer sends until it closes, or LINGER or LINGER_BYTES
        runs out (see `draining`)."""
        if self.draining:
            return
        if self.transport is None or self.transport.is_closing():
            self.reading_ended()
            return
        self.draining = True
        self.dropped = 0
        if self.paused:
            self.paused = False
            self.transport.resume_reading()
        self.linger_timer = asyncio.get_running_loop().call_later(LINGER, self.end_drain)

    def end_drain(self) -> None:
        if not self.draining:
            return
        self.draining = False
        if self.linger_timer is not None:
            self.linger_timer.cancel()
        if self.refused:
            self.server.admission.lingered()
        if self.refused or self.closing:
            self.close_transport()
        elif self.transport is not None and not self.transport.is_closing():
            self.paused = True  # read no more; the answers close it
            self.transport.pause_reading()
        self.reading_ended()

    def close_transport(self) -> None:
        if self.transport is not None:
            self.transport.close()


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
        self.connections: set[Connection] = set()
        self.partial_bytes = 0
        self.rate = TokenBucket(settings.rate) if settings.rate > 0 else None
        # The frames decoded this loop turn, of every connection, in order (each one an
        # unanswered frame of its connection: bounded by the shares).
        self.batch: list[tuple[Connection, Item]] = []
        self._flush_due = False
        # The handle task has the batches while they must wait (store room, RATE).
        self._held_back = False
        self._wake_handle = asyncio.Event()
        self._server: asyncio.Server | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.port = settings.port

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: Connection(self),
            self.settings.host,
            self.settings.port,
            backlog=1024,
            reuse_address=True,
        )
        self.port = self._server.sockets[0].getsockname()[1]
        start = self.supervisor.start
        self._tasks = [start("handle", self._handle_stage), start("sweep", self._sweep)]

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
            conn.close_transport()

    def _idle(self) -> bool:
        """Nothing read is left to answer."""
        replying = any(conn.replying for conn in self.connections)
        return not self.batch and not self._held_back and not replying

    def share(self) -> int:
        """The unanswered frames one connection may have now."""
        fair = self.settings.max_unanswered_total // max(1, len(self.connections))
        return min(self.settings.max_unanswered_frames, max(MIN_SHARE, fair))

    # -- the batch ------------------------------------------------------------
    def add(self, conn: Connection, items: Sequence[Item]) -> None:
        """Items of `conn` join the loop turn's batch (each one unanswered until its reply
        is written)."""
        if not items:
            return
        conn.unanswered += len(items)
        self.batch.extend((conn, item) for item in items)
        if not self._flush_due:
            self._flush_due = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        """Once a loop turn: the batch to the handler now, unless it must wait."""
        self._flush_due = False
        if not self.batch:
            return
        if self._held_back or self.rate is not None:
            self._wake_handle.set()
            return
        items, self.batch = self.batch, []
        parts = list(_by_content_size(items, self.settings.max_store_pending_bytes))
        for i, part in enumerate(parts):
            if not self.handler.has_store_room():  # the rest waits for it (the task)
                self.batch = [item for rest in parts[i:] for item in rest] + self.batch
                self._wake_handle.set()
                return
            self._handle(part)

    async def _handle_stage(self) -> None:
        """The batches that must wait: for store room (MAX_STORE_PENDING_BYTES), for RATE."""
        while True:
            await self._wake_handle.wait()
            self._wake_handle.clear()
            self._held_back = True
            try:
                while self.batch:
                    items, self.batch = self.batch, []
                    if self.rate is not None:
                        await self.rate.acquire(len(items))
                    for part in _by_content_size(items, self.settings.max_store_pending_bytes):
                        await self.handler.store_room()
                        self._handle(part)
            finally:
                self._held_back = False

    def _handle(self, part: list[tuple[Connection, Item]]) -> None:
        outcomes = self.handler.handle_batch([(c.peer, item) for c, item in part])
        answered: dict[Connection, None] = {}  # in order, once each
        for (conn, _), outcome in zip(part, outcomes, strict=True):
            conn.replies.append(outcome)
            answered[conn] = None
        for conn in answered:
            if not conn.replying:
                self._send_replies(conn)

    # -- partial frames -------------------------------------------------------
    def track_partial(self, conn: Connection, completed: bool) -> None:
        buffered = conn.decoder.buffered
        self.partial_bytes += buffered - conn.partial
        conn.partial = buffered
        if not buffered:
            conn.frame_started = None
        elif completed or conn.frame_started is None:
            conn.frame_started = time.monotonic()  # the partial frame began in this chunk
        if self.partial_bytes > self.settings.max_partial_bytes:
            self._shed_partial()

    def release_partial(self, conn: Connection) -> None:
        self.partial_bytes -= conn.partial
        conn.partial = 0
        conn.frame_started = None

    def _shed_partial(self) -> None:
        """Over MAX_PARTIAL_BYTES: refuse the connections holding the most until under."""
        cap = self.settings.max_partial_bytes
        while self.partial_bytes > cap and self.connections:
            conn = max(self.connections, key=lambda c: c.partial)
            if not conn.partial:
                break
            log.warning("partial frames over MAX_PARTIAL_BYTES, closing the largest",
                        peer=conn.peer.host, held=conn.partial)  # fmt: skip
            conn.end(LimitExceeded("incomplete frames over MAX_PARTIAL_BYTES"))

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
            closing = outcome.close
        conn.replying = False
        self._write(conn, ready)
        if closing:
            conn.replies.clear()
            self._close(conn)
        elif conn.paused:
            conn.decode()  # room again: what waited undecoded, then reading

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
        transport = conn.transport
        if not replies or transport is None or transport.is_closing():
            return
        transport.write(b"".join(replies))
        conn.last_active = time.monotonic()
        if transport.get_write_buffer_size() > self.settings.max_write_buffer_bytes:
            log.warning("peer does not read its answers, closing", peer=conn.peer.host)
            self._close(conn)

    def _close(self, conn: Connection) -> None:
        conn.broken = True
        conn.undecoded = b""
        conn.peer.gone.set()
        if not conn.draining:
            conn.reading_ended()
        self.release_partial(conn)
        if conn.draining:  # our answers, then the end of our side: end_drain closes
            conn.closing = True
            if conn.transport is not None:
                with contextlib.suppress(OSError, RuntimeError):
                    conn.transport.write_eof()
        else:
            conn.close_transport()
        self.connections.discard(conn)

    # -- timeouts -------------------------------------------------------------
    async def _sweep(self) -> None:
        """Close connections silent for IDLE_TIMEOUT; refuse frames older than FRAME_TIMEOUT.
        A connection waiting for an answer of ours (a long poll's) is not silent: it is
        timed from the answer's write."""
        s = self.settings
        period = min(5.0, max(0.05, min(s.idle_timeout, s.frame_timeout) / 4))
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for conn in list(self.connections):
                if conn.broken:
                    continue
                if not conn.replying and conn.last_active < now - s.idle_timeout:
                    log.info("closing idle connection", peer=conn.peer.host)
                    self._close(conn)
                elif (
                    not conn.paused
                    and conn.frame_started is not None
                    and (conn.frame_started < now - s.frame_timeout)
                ):
                    log.info("frame not complete within FRAME_TIMEOUT", peer=conn.peer.host)
                    reason = f"frame not complete within FRAME_TIMEOUT ({s.frame_timeout:g} s)"
                    conn.end(LimitExceeded(reason))
