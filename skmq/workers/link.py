"""The broker's connection to one recipient (SPEC 3): kept open and reused, with up to
PUSH_WINDOW pushes unanswered at once, reconnected on the next push after it breaks.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Protocol, cast

import structlog

from skmq.codec import CodecError, Decoder, Frame, encode_frame, encode_resp

log = structlog.get_logger("skmq.link")


@dataclass(slots=True)
class Delivery:
    app: str
    delivery_id: str
    msgid: str
    kind: str
    content: bytes
    attempt: int
    recipient: str
    pushed_at: float = field(default_factory=time.monotonic)
    arrived_at: float = 0.0


class LinkOwner(Protocol):
    def on_arrived(self, link: RecipientLink, delivery: Delivery) -> None: ...
    def on_answer(
        self, link: RecipientLink, delivery: Delivery, outcome: str, detail: str
    ) -> None: ...
    def on_unknown_answer(self, link: RecipientLink, frame: Frame) -> None: ...
    def on_broken(self, link: RecipientLink, deliveries: list[Delivery], detail: str) -> None: ...
    def on_unreachable(
        self, link: RecipientLink, deliveries: list[Delivery], detail: str
    ) -> None: ...
    def push_fields(self, app: str, msgid: str, content: bytes) -> tuple[tuple[str, str], ...]: ...


ANSWERS = {"ack": "acked", "reject": "rejected", "error": "errored"}
DETAILS = {"ack": "", "reject": "rejected by the recipient", "error": "error at the recipient"}


class RecipientLink(asyncio.Protocol):
    def __init__(
        self,
        owner: LinkOwner,
        app: str,
        rid: str,
        host: str,
        port: int,
        *,
        window: int,
        connect_timeout: float,
        max_frame_bytes: int,
    ) -> None:
        self.owner = owner
        self.app = app
        self.rid = rid
        self.host = host
        self.port = port
        self.window = window
        self.connect_timeout = connect_timeout
        self.max_frame_bytes = max_frame_bytes
        self.inflight: dict[str, Delivery] = {}
        self.last_write = 0.0
        # Until then no new pushes: this recipient let pushes time out (SPEC 3: they go
        # elsewhere). An answer from it lifts the bench.
        self.benched_until = 0.0
        # Pushes given up on, kept (bounded) so that a late answer still names its attempt:
        # that attempt fences it off from a newer one, perhaps another broker's.
        self.expired: OrderedDict[str, Delivery] = OrderedDict()
        self._transport: asyncio.Transport | None = None
        self._decoder = Decoder(max_frame_bytes=max_frame_bytes)
        self._out: list[bytes] = []
        self._flush_scheduled = False
        self._connecting: asyncio.Task[None] | None = None
        self._closed = False

    @property
    def free(self) -> int:
        return self.window - len(self.inflight)

    # -- pushing ----------------------------------------------------------
    def push(self, d: Delivery) -> None:
        self.inflight[d.msgid] = d
        fields: tuple[tuple[str, str], ...] = (("appid", self.app), ("msgid", d.msgid))
        if d.kind == "topic":
            fields += (("recipient", self.rid),)
        fields += self.owner.push_fields(self.app, d.msgid, d.content)
        self._write(encode_frame("push", fields, d.content))

    def send_resp(self, msgid: str, status: str, content: str) -> None:
        if self._transport is not None:
            self._write(encode_resp(status, content, msgid))

    def _write(self, data: bytes) -> None:
        self._out.append(data)
        if self._transport is None:
            if self._connecting is None and not self._closed:
                self._connecting = asyncio.get_running_loop().create_task(self._connect())
            return
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        if self._transport is not None and self._out:
            self._transport.write(b"".join(self._out))
            self._out.clear()
            self.last_write = time.monotonic()

    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout):
                await loop.create_connection(lambda: self, self.host, self.port)
        except (OSError, TimeoutError) as exc:
            self._connecting = None
            self._out.clear()
            lost = list(self.inflight.values())
            self.inflight.clear()
            self.owner.on_unreachable(self, lost, f"connect to {self.host}:{self.port}: {exc!r}")
            return
        self._connecting = None

    # -- asyncio.Protocol -------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not subclass asyncio.Transport: cast, do not assert.
        self._transport = cast(asyncio.Transport, transport)
        self._decoder = Decoder(max_frame_bytes=self.max_frame_bytes)
        if self._closed:
            self._transport.close()
            return
        self._flush()

    def data_received(self, data: bytes) -> None:
        try:
            frames = self._decoder.feed(data)
        except CodecError as exc:
            log.warning(
                "recipient sent an invalid stream", app=self.app, recipient=self.rid, error=str(exc)
            )
            if self._transport is not None:
                self._transport.close()
            return
        for frame in frames:
            if isinstance(frame, Frame):
                self._on_frame(frame)

    def _on_frame(self, frame: Frame) -> None:
        kind = frame.type
        if kind in ("pong", "resp"):
            return
        msgid = frame.fields.get("msgid", "")
        d = self.inflight.get(msgid)
        if d is None:
            late = self.expired.pop(msgid, None) if kind in ANSWERS else None
            if late is None:
                self.owner.on_unknown_answer(self, frame)
            else:
                self.inflight[msgid] = late  # answered below like any other
                self._on_frame(frame)
            return
        if kind == "arrived":
            d.arrived_at = time.monotonic()
            self.owner.on_arrived(self, d)
            self.send_resp(msgid, "ack", "arrived")
            return
        outcome = ANSWERS.get(kind)
        if outcome is None:
            self.send_resp(msgid, "error", f"unexpected frame type {kind!r} from a recipient")
            return
        del self.inflight[msgid]
        self.benched_until = 0.0
        detail = (frame.content or b"").decode("utf-8", "replace") or DETAILS[kind]
        self.owner.on_answer(self, d, outcome, detail)

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        self._out.clear()
        # A push never answered by the time its connection broke is a failed attempt;
        # one that `arrived` keeps waiting for a final answer on another connection.
        broken = [d for d in self.inflight.values() if not d.arrived_at]
        for d in broken:
            del self.inflight[d.msgid]
        if broken:
            self.owner.on_broken(self, broken, "connection to recipient lost")

    # -- housekeeping -----------------------------------------------------
    def close_if_waiting_only(self, ack_wait: float, now: float) -> None:
        """SPEC 3: after `arrived` the broker waits ACK_WAIT for the final answer on this
        connection, then may close it; the recipient sends the answer on its own connection."""
        if self._transport is None or not self.inflight or now - self.last_write < ack_wait:
            return
        if all(d.arrived_at and now - d.arrived_at >= ack_wait for d in self.inflight.values()):
            self._transport.close()

    def drop_expired(self, now: float, ack_timeout: float) -> int:
        """Forget pushes older than ACK_TIMEOUT: by then each was answered elsewhere (on a
        connection of the recipient's own, perhaps to another broker) or reaped as a
        timeout in Redis. Returns how many window slots that freed."""
        expired = [m for m, d in self.inflight.items() if now - d.pushed_at > ack_timeout]
        for msgid in expired:
            self.timed_out(msgid, now, ack_timeout)
        return len(expired)

    def timed_out(self, msgid: str, now: float, bench_for: float) -> None:
        """A push got no final answer in time: bench the recipient; if it also stopped
        reading (our unsent data piles up), drop the connection with that data, so that a
        recipient that stopped reading costs no memory."""
        d = self.inflight.pop(msgid, None)
        if d is None:
            return
        self.expired[msgid] = d
        if len(self.expired) > 4 * self.window:
            self.expired.popitem(last=False)
        if d.arrived_at:
            return
        self.benched_until = now + bench_for
        if self._transport is not None and self._transport.get_write_buffer_size() > 0:
            self._transport.abort()

    def benched(self, now: float) -> bool:
        return now < self.benched_until

    def stalled(self, now: float, after: float) -> bool:
        oldest = next(iter(self.inflight.values()), None)
        return oldest is not None and now - oldest.pushed_at > after

    def take(self, msgid: str) -> Delivery | None:
        return self.inflight.pop(msgid, None)

    def close(self) -> None:
        self._closed = True
        if self._transport is not None:
            self._transport.close()
        if self._connecting is not None:
            self._connecting.cancel()
