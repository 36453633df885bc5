"""Client library: a pipelined `Producer` and a push-receiving `Consumer`.

Both speak the SKMQ wire protocol (docs/PROTOCOL.md) over plain asyncio
protocols rather than streams: one `data_received` call decodes every frame a
read holds, and writes are coalesced so that everything produced in one loop
iteration leaves in a single `transport.write`.

They work with the original Go broker too: every message carries a msgid
(generated here when the caller gives none), the registration's port is a
string, and an extension frame is sent only after a `hello` exchange showed
that the broker supports it.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import os
import socket
import uuid
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import KW_ONLY, InitVar, dataclass, field, replace
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self, cast

from skmq import tracing
from skmq.coalesce import Coalescer, transport_sink
from skmq.codec import PONG, CodecError, Frame, FrameProtocol, InvalidFrame, encode_frame
from skmq.signing import DEFAULT_TOLERANCE, PushVerifier

if TYPE_CHECKING:
    from opentelemetry.trace import Span

__all__ = [
    "AuthenticationError",
    "BrokerInfo",
    "CannotListen",
    "Consumer",
    "ExtensionUnsupported",
    "Handler",
    "Message",
    "Producer",
    "RegistrationError",
    "Reject",
    "Resp",
]

log = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 1734
DEFAULT_MAX_FRAME_BYTES = 1 << 20
#: How long the consumer waits for the broker to answer register/unregister.
BROKER_TIMEOUT = 10.0
_WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::"})
#: What our Consumer handles on a push connection (declared in its registration).
CONSUMER_CAPS = ("pipeline", "length", "token", "identity")
#: How a broker's `error` answer to a message starts when the message may be stored all
#: the same (docs/PROTOCOL.md, section 3): sent again with the same msgid, it is stored
#: once (a duplicate is answered `ack`).
OUTCOME_UNKNOWN = "outcome unknown"
#: The msgid of the `hello` frame. An original broker stores an unknown frame type as a
#: message; one fixed msgid makes its duplicate check drop every hello after the first.
HELLO_MSGID = "skmq-hello"


def new_msgid() -> str:
    """A fresh msgid (uuid4 hex), as the original client makes one for every message."""
    return uuid.uuid4().hex


@dataclass(frozen=True, slots=True)
class Resp:
    """The broker's answer (`type=resp`) to one frame."""

    status: str
    content: str
    msgid: str | None
    # (extension) On a `register`'s ack: the address the id was alive at, whose place
    # this registration took (another consumer was running with the same id).
    took_over: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ack"

    @property
    def outcome_unknown(self) -> bool:
        """An `error` for a message that may be stored all the same (OUTCOME_UNKNOWN)."""
        return self.status == "error" and self.content.startswith(OUTCOME_UNKNOWN)

    @classmethod
    def from_frame(cls, frame: Frame) -> Resp:
        """Parse a resp frame; JSON keys are matched case-insensitively.

        Content that is not a JSON object becomes an `error` resp carrying the
        raw text, so a confused broker never looks like an ack.
        """
        raw = (frame.content or b"").decode("utf-8", "replace")
        msgid = frame.get("msgid")
        try:
            body: Any = json.loads(raw)
        except ValueError:
            return cls("error", raw, msgid)
        if not isinstance(body, dict):
            return cls("error", raw, msgid)
        lowered = {str(k).lower(): v for k, v in body.items()}
        content = lowered.get("content", "")
        if not isinstance(content, str):
            content = "" if content is None else json.dumps(content)
        return cls(str(lowered.get("status", "error")), content, msgid, frame.get("took_over"))

    def to_dict(self) -> dict[str, str | None]:
        return {"status": self.status, "content": self.content, "msgid": self.msgid}


class RegistrationError(Exception):
    """The broker did not accept a `register` (or `unregister`) frame."""

    def __init__(self, resp: Resp) -> None:
        super().__init__(f"broker answered {resp.status}: {resp.content}")
        self.resp = resp


class AuthenticationError(Exception):
    """The broker did not accept our `auth` frame (its token)."""

    def __init__(self, resp: Resp) -> None:
        super().__init__(f"broker answered {resp.status} to auth: {resp.content}")
        self.resp = resp


class CannotListen(OSError):
    """The consumer could not listen on its own host and port (taken, not this
    machine's): an OSError with the cause's errno and strerror."""


@dataclass(frozen=True, slots=True)
class BrokerInfo:
    """What a broker said in answer to `hello`: an SKMQ broker names its extensions;
    any other answer (an original broker stores the frame and answers "Message
    enqueue successful") means a broker without extensions."""

    server: str
    version: str
    caps: frozenset[str]

    def supports(self, cap: str) -> bool:
        return cap in self.caps

    @classmethod
    def from_resp(cls, resp: Resp) -> BrokerInfo:
        body: Any = None
        if resp.ok:
            try:
                body = json.loads(resp.content)
            except ValueError:
                body = None
        if not isinstance(body, dict) or body.get("server") != "skmq":
            return ORIGINAL_BROKER
        caps = body.get("caps")
        names = [c for c in caps if isinstance(c, str)] if isinstance(caps, list) else []
        return cls("skmq", str(body.get("version", "")), frozenset(names))


ORIGINAL_BROKER = BrokerInfo("original", "", frozenset())


class ExtensionUnsupported(Exception):
    """The broker has no such extension (it is an original SKMQ broker, or older)."""

    def __init__(self, address: str, cap: str, info: BrokerInfo) -> None:
        who = "an original SKMQ broker" if info.server != "skmq" else "an SKMQ broker"
        super().__init__(f"the broker at {address} is {who} without the {cap!r} extension")
        self.cap = cap
        self.info = info


class Reject(Exception):
    """Raise from a consumer handler to answer `reject` (redeliver later)."""


@dataclass(frozen=True, slots=True)
class Message:
    """One pushed message, as given to a consumer handler."""

    appid: str
    msgid: str
    content: bytes
    fields: dict[str, str]

    @property
    def attempt(self) -> int | None:
        """Which attempt this push is (1 the first), when the broker said (extension)."""
        return _int_or_none(self.fields.get("attempt"))

    @property
    def stored_at(self) -> int | None:
        """When the broker first stored the message (unix ms), when it said (extension)."""
        return _int_or_none(self.fields.get("stored_at"))


def _int_or_none(value: str | None) -> int | None:
    return int(value) if value is not None and value.isascii() and value.isdigit() else None


Handler = Callable[[Message], Awaitable[None]]


class _Scoped:
    """`async with x:` opens x (its `_open`) and shuts it (its `_shut`) at the end."""

    async def _open(self) -> None:
        raise NotImplementedError

    async def _shut(self) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        await self._open()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._shut()


# --------------------------------------------------------------------------- producer


class _RespProtocol(FrameProtocol):
    """Client side of a broker connection: resps are matched FIFO to futures."""

    def __init__(self, loop: asyncio.AbstractEventLoop, peer: str, max_frame_bytes: int) -> None:
        super().__init__(max_frame_bytes)
        self.loop = loop
        self._peer = peer
        self.pending: collections.deque[asyncio.Future[Resp]] = collections.deque()
        self.transport: asyncio.Transport | None = None
        self.writer: Coalescer[bytes] | None = None
        self.closed: asyncio.Future[None] = loop.create_future()
        self._writable = asyncio.Event()
        self._writable.set()
        self._gave_up = ""  # why this side gave up on the connection (what it read)

    @property
    def is_open(self) -> bool:
        return self.transport is not None and not self.closed.done()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)
        self.writer = Coalescer(transport_sink(self.transport))

    def connection_lost(self, exc: Exception | None) -> None:
        reason = f": {self._gave_up or exc}" if self._gave_up or exc else ""
        while self.pending:
            fut = self.pending.popleft()
            if not fut.done():
                fut.set_exception(ConnectionError(f"connection to {self._peer} lost{reason}"))
        self._writable.set()  # wake senders blocked on flow control; they see closed
        if not self.closed.done():
            self.closed.set_result(None)

    def pause_writing(self) -> None:
        self._writable.clear()

    def resume_writing(self) -> None:
        self._writable.set()

    async def wait_writable(self) -> None:
        if not self._writable.is_set():
            await self._writable.wait()

    def stream_broken(self, exc: CodecError) -> None:
        self._fatal(f"undecodable data from broker: {exc}")

    def frames_received(self, frames: list[Frame | InvalidFrame]) -> None:
        for frame in frames:
            if isinstance(frame, InvalidFrame):
                # A mangled resp would shift every later answer onto the wrong
                # send: give up on the connection rather than mis-attribute acks.
                self._fatal(f"invalid frame from broker: {frame.reason}")
                return
            if frame.type == "resp":
                self._on_resp(frame)
            elif frame.type == "ping":
                assert self.writer is not None
                self.writer.add(PONG)
            else:
                log.debug("ignoring %r frame from broker %s", frame.type, self._peer)

    def _on_resp(self, frame: Frame) -> None:
        if not self.pending:
            log.warning("unexpected resp from broker %s: %r", self._peer, frame.content)
            return
        fut = self.pending.popleft()
        if not fut.done():  # the caller may have given up (cancelled) meanwhile
            fut.set_result(Resp.from_frame(frame))

    def _fatal(self, reason: str) -> None:
        """Give up on the connection; whoever waits for a resp hears why."""
        log.debug("%s; closing connection", reason)
        self._gave_up = reason
        if self.transport is not None:
            self.transport.abort()


def _named(resp: Resp, msgid: str) -> Resp:
    """`resp` naming the msgid it answers; the original broker's resps carry none, but
    they come in the order of the frames, so the sender knows which it is."""
    return resp if resp.msgid is not None else replace(resp, msgid=msgid)


class Producer(_Scoped):
    """A connection to the broker for sending frames, pipelined.

    Any number of `send` calls may be in flight at once: each frame is written
    right away and the broker's resps, which come back in order, are matched to
    the senders first-in first-out.

    A message answered `error` with an unknown outcome (`Resp.outcome_unknown`: the
    broker could not tell whether it is stored) is sent again with the same msgid, at
    most `unknown_retries` times, `unknown_wait` seconds apart (the broker deduplicates
    by msgid: one message); the last answer is returned.

    `max_in_flight` bounds the frames written and not yet answered (None: no
    bound). The original Go broker needs 1: its reader reuses one 1 KiB buffer
    while its decoder may still be reading it, so frames arriving back to back are
    mangled and the connection goes silent. A `hello` answered by an original
    broker sets 1 by itself.
    """

    def __init__(
        self,
        host: str = DEFAULT_HOST,
        port: int = DEFAULT_PORT,
        *,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        token: str | None = None,
        max_in_flight: int | None = None,
        unknown_retries: int = 3,
        unknown_wait: float = 0.5,
    ) -> None:
        if max_in_flight is not None and max_in_flight < 1:
            raise ValueError("max_in_flight must be at least 1")
        if unknown_retries < 0 or unknown_wait < 0:
            raise ValueError("unknown_retries and unknown_wait must not be negative")
        self.unknown_retries = unknown_retries
        self.unknown_wait = unknown_wait
        self.host = host
        self.port = port
        self._max_frame_bytes = max_frame_bytes
        self._token = token  # sent in an `auth` frame first when given
        self._window = asyncio.Semaphore(max_in_flight) if max_in_flight else None
        self._proto: _RespProtocol | None = None
        self._info: BrokerInfo | None = None  # from `hello`, per connection

    @property
    def connected(self) -> bool:
        return self._proto is not None and self._proto.is_open

    @property
    def local_address(self) -> tuple[str, int] | None:
        """The (host, port) of our end of the connection, if connected."""
        if self._proto is None or self._proto.transport is None:
            return None
        name = self._proto.transport.get_extra_info("sockname")
        return (str(name[0]), int(name[1])) if name else None

    async def connect(self) -> None:
        """Open the connection (a no-op if already connected)."""
        if self.connected:
            return
        loop = asyncio.get_running_loop()
        peer = f"{self.host}:{self.port}"
        _, proto = await loop.create_connection(
            lambda: _RespProtocol(loop, peer, self._max_frame_bytes), self.host, self.port
        )
        self._proto = proto
        self._info = None
        if self._token is not None:
            resp = await self.request("auth", (), self._token.encode())
            if not resp.ok:
                await self.close()
                raise AuthenticationError(resp)

    async def close(self) -> None:
        """Close the connection; sends still waiting fail with ConnectionError."""
        proto, self._proto = self._proto, None
        if proto is None or proto.transport is None:
            return
        if proto.writer is not None:
            proto.writer.flush()
        proto.transport.close()
        try:
            await asyncio.wait_for(asyncio.shield(proto.closed), 5.0)
        except TimeoutError:
            proto.transport.abort()

    async def _open(self) -> None:
        await self.connect()

    async def _shut(self) -> None:
        await self.close()

    async def _writable_proto(self) -> _RespProtocol:
        proto = self._proto
        if proto is None or not proto.is_open:
            raise ConnectionError(f"not connected to {self.host}:{self.port}")
        await proto.wait_writable()
        if not proto.is_open:
            raise ConnectionError(f"connection to {self.host}:{self.port} lost")
        return proto

    async def request(
        self,
        frame_type: str,
        fields: Mapping[str, str] | Iterable[tuple[str, str]] = (),
        content: bytes | None = None,
    ) -> Resp:
        """Send any frame and wait for the broker's resp to it."""
        data = encode_frame(frame_type, fields, content)  # may raise: before queueing
        if self._window is None:
            return await self._exchange(data)
        async with self._window:
            return await self._exchange(data)

    async def _exchange(self, data: bytes) -> Resp:
        proto = await self._writable_proto()
        fut: asyncio.Future[Resp] = proto.loop.create_future()
        proto.pending.append(fut)
        assert proto.writer is not None
        proto.writer.add(data)
        return await fut

    async def hello(self) -> BrokerInfo:
        """Ask the broker what it supports (once per connection; cached)."""
        if self._info is None:
            resp = await self.request("hello", (("msgid", HELLO_MSGID),))
            self._info = BrokerInfo.from_resp(resp)
            if not self._info.supports("pipeline") and self._window is None:
                self._window = asyncio.Semaphore(1)
        return self._info

    async def require(self, cap: str) -> None:
        """Raise ExtensionUnsupported unless the broker said (in `hello`) it has `cap`."""
        info = await self.hello()
        if not info.supports(cap):
            raise ExtensionUnsupported(f"{self.host}:{self.port}", cap, info)

    async def send(
        self,
        app: str,
        content: bytes | str,
        *,
        topic: bool = False,
        msgid: str | None = None,
        delay_ms: int | None = None,
        deliver_at_ms: int | None = None,
        ttl_ms: int | None = None,
        key: str | None = None,
        traceparent: str | None = None,
        mandatory: bool = False,
    ) -> Resp:
        """Send one `queue` (or `topic`) message; returns the broker's resp.

        Without `msgid` one is generated here (the original broker would take every
        message without one for a duplicate of the first); `resp.msgid` names it even
        when the broker's answer carries none (the original's do not). A delay needs
        the broker's `delay` extension, a TTL (not pushed once `ttl_ms` have passed,
        0: none, overriding the broker's default) its `ttl` extension
        (ExtensionUnsupported otherwise). A `key` (queue messages only, the `key`
        extension) orders delivery: one message of the app and key at a time, in stored
        order. A W3C `traceparent` (the `trace` extension) goes with the message to its
        pushes (`Message.fields["traceparent"]`) and into the delivery log; while tracing
        is on (skmq/tracing.py), the message carries instead the traceparent of this
        send's span, a child of the one given (or of the current span). `mandatory`
        (the `mandatory` extension): answered `reject`, not stored, when the app has no
        recipient and no consumer group (else it is stored to wait for one).
        """
        msgid = msgid or new_msgid()
        fields = [("appid", app), ("msgid", msgid)]
        if delay_ms is not None or deliver_at_ms is not None:
            await self.require("delay")
        if delay_ms is not None:
            fields.append(("delay", str(int(delay_ms))))
        if deliver_at_ms is not None:
            fields.append(("deliver_at", str(int(deliver_at_ms))))
        if ttl_ms is not None:
            await self.require("ttl")
            fields.append(("ttl", str(int(ttl_ms))))
        if key is not None:
            await self.require("key")
            fields.append(("key", key))
        if traceparent is not None:
            await self.require("trace")
        if mandatory:
            await self.require("mandatory")
            fields.append(("mandatory", "1"))
        data = content.encode() if isinstance(content, str) else content
        frame_type = "topic" if topic else "queue"
        if tracing.tracer is not None:
            span = tracing.start("send", traceparent, app, msgid)
            return await self._traced_send(span, frame_type, fields, data, msgid)
        if traceparent is not None:
            fields.append(("traceparent", traceparent))
        return await self._sent(frame_type, fields, data, msgid)

    async def _traced_send(
        self, span: Span, frame_type: str, fields: list[tuple[str, str]], data: bytes, msgid: str
    ) -> Resp:
        """Send within `span` (`skmq send`), its traceparent the message's when the broker
        takes one."""
        with tracing.current(span):
            if (await self.hello()).supports("trace"):
                fields.append(("traceparent", tracing.traceparent(span)))
            resp = await self._sent(frame_type, fields, data, msgid)
            if not resp.ok:
                tracing.failed(span, f"{resp.status}: {resp.content}")
            return resp

    async def _sent(
        self, frame_type: str, fields: list[tuple[str, str]], data: bytes, msgid: str
    ) -> Resp:
        resp = _named(await self.request(frame_type, fields, data), msgid)
        return await self._until_known(resp, frame_type, fields, data)

    async def _until_known(
        self, resp: Resp, frame_type: str, fields: list[tuple[str, str]], data: bytes
    ) -> Resp:
        """`resp`, or while it is an unknown outcome, the answer to the same frame sent
        again (at most `unknown_retries` times)."""
        for _ in range(self.unknown_retries):
            if not resp.outcome_unknown:
                break
            await asyncio.sleep(self.unknown_wait)
            resp = _named(await self.request(frame_type, fields, data), resp.msgid or "")
        return resp

    async def send_many(
        self, app: str, contents: Iterable[bytes], topic: bool = False
    ) -> list[Resp]:
        """Send many messages (each with a new msgid) in one write; their resps in order.
        Those answered with an unknown outcome are sent again as `send` does, each alone.

        With `max_in_flight` set, they go as separate `send` calls within that bound.
        """
        if self._window is not None:
            return list(await asyncio.gather(*(self.send(app, c, topic=topic) for c in contents)))
        frame_type = "topic" if topic else "queue"
        msgids: list[str] = []
        frames: list[bytes] = []
        sent = list(contents)
        for content in sent:
            msgid = new_msgid()
            msgids.append(msgid)
            frames.append(encode_frame(frame_type, (("appid", app), ("msgid", msgid)), content))
        if not frames:
            return []
        proto = await self._writable_proto()
        loop = proto.loop
        futs: list[asyncio.Future[Resp]] = [loop.create_future() for _ in frames]
        proto.pending.extend(futs)
        assert proto.writer is not None
        proto.writer.add(b"".join(frames))
        resps = [_named(r, m) for r, m in zip(await asyncio.gather(*futs), msgids, strict=True)]
        again = [i for i, r in enumerate(resps) if r.outcome_unknown]
        redone = await asyncio.gather(
            *(
                self._until_known(resps[i], frame_type, [("appid", app), ("msgid", msgids[i])],
                                  sent[i])
                for i in again
            )
        )  # fmt: skip
        for i, resp in zip(again, redone, strict=True):
            resps[i] = resp
        return resps


# --------------------------------------------------------------------------- consumer


def _error_reason(exc: BaseException) -> str:
    reason = str(exc) or type(exc).__name__
    return reason.replace("\r", " ").replace("\n", " ")


class _PushProtocol(FrameProtocol):
    """One connection the broker opened to a consumer: pushes in, answers out.

    Up to `concurrency` handlers run at once; further pushes wait in a backlog.
    Reading is paused only once the backlog is as long again, so that
    heartbeat pings on a busy connection are still answered in time.
    """

    def __init__(self, consumer: Consumer) -> None:
        super().__init__(consumer.max_frame_bytes)
        self._consumer = consumer
        self._transport: asyncio.Transport | None = None
        self._writer: Coalescer[bytes] | None = None
        self._active = 0
        self._backlog: collections.deque[Message] = collections.deque()
        self._reading_paused = False
        self._lost = False
        # Answers written here that the broker has not answered with a resp yet (resps
        # come in the order of the answers); kept in send_arrived mode only.
        self._unanswered: collections.deque[_Answer] = collections.deque()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)
        self._writer = Coalescer(transport_sink(self._transport))
        self._consumer._connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        # An original broker closes the push connection right after its resp to
        # `arrived`: a final answer written meanwhile may be lost with the connection,
        # so each one it did not answer goes again over our own connection.
        if not self._consumer._stopping:
            for answer in self._unanswered:
                if answer.kind != "arrived":
                    self._consumer._answer_late(answer.kind, answer.fields, answer.content)
        self._unanswered.clear()
        # Never started: the broker counts a broken connection as a failed
        # delivery and retries them, so running them now would only duplicate.
        self._backlog.clear()
        self._consumer._connections.discard(self)

    def stream_broken(self, exc: CodecError) -> None:
        log.warning("closing push connection: %s", exc)
        self.close()

    def frames_received(self, frames: list[Frame | InvalidFrame]) -> None:
        for frame in frames:
            if isinstance(frame, InvalidFrame):
                log.debug("ignoring invalid frame: %s", frame.reason)
            elif frame.type == "push":
                self._on_push(frame)
            elif frame.type == "ping":
                if self._consumer.is_named(frame):
                    self._write(PONG)
                else:  # (another registration's address, this port's before us)
                    log.warning("ping for %s of app %s, not this consumer: not answered",
                                frame.get("recipient"), frame.get("appid"))  # fmt: skip
                    self.close()
            elif frame.type == "resp":
                if self._unanswered:
                    self._unanswered.popleft()
                log.debug("broker resp %s: %r", frame.get("msgid"), frame.content)
            else:
                log.debug("ignoring %r frame", frame.type)

    def stop_reading(self) -> None:
        """Take no more pushes from this connection (consumer stopping)."""
        self._backlog.clear()
        if self._transport is not None and not self._lost:
            self._transport.pause_reading()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.flush()
        if self._transport is not None:
            self._transport.close()

    def _write(self, data: bytes) -> None:
        assert self._writer is not None
        self._writer.add(data)

    def _on_push(self, frame: Frame) -> None:
        consumer = self._consumer
        # An original broker pushes a message stored without msgid (under the empty
        # id) without one: handled, and answered without msgid on this connection.
        msgid = frame.get("msgid") or ""
        appid = frame.get("appid") or consumer.app
        msg = Message(appid, msgid, frame.content or b"", frame.fields)
        if appid != consumer.app:  # (another registration's address, this port's before us)
            log.warning("refusing push %s: for app %s, not this consumer's", msgid, appid)
            consumer.stats["errored"] += 1
            self._answer(msg, "error", f"not a recipient of app {appid}")
            return
        verifier = consumer.verifier
        if verifier is not None and (why := verifier.refusal(frame.fields, msg.content)):
            log.warning("refusing push %s: %s", msgid, why)
            consumer.stats["rejected"] += 1
            self._answer(msg, "reject", why)
            return
        consumer.stats["received"] += 1
        if consumer.send_arrived:
            self._answer(msg, "arrived")
        if self._active < consumer.concurrency:
            self._start(msg)
            return
        self._backlog.append(msg)
        if len(self._backlog) >= consumer.concurrency and not self._reading_paused:
            assert self._transport is not None
            self._transport.pause_reading()
            self._reading_paused = True

    def _start(self, msg: Message) -> None:
        self._active += 1
        self._consumer._track(asyncio.get_running_loop().create_task(self._handle(msg)))

    async def _handle(self, msg: Message) -> None:
        try:
            if tracing.tracer is not None and (parent := msg.fields.get("traceparent")):
                span = tracing.start("receive", parent, msg.appid, msg.msgid)
                with tracing.current(span):  # (the handler's spans are its children)
                    if (why := await self._run(msg)) is not None:
                        tracing.failed(span, why)
            else:
                await self._run(msg)
        finally:
            self._active -= 1
            self._start_next()

    async def _run(self, msg: Message) -> str | None:
        """Run the handler on msg and answer; None, or why it was not acked."""
        consumer = self._consumer
        try:
            await consumer.handler(msg)
        except Reject:
            consumer.stats["rejected"] += 1
            self._answer(msg, "reject")
            return "rejected"
        except Exception as exc:
            consumer.stats["errored"] += 1
            reason = _error_reason(exc)
            log.warning(
                "handler failed for %s: %s",
                msg.msgid,
                reason,
                exc_info=log.isEnabledFor(logging.DEBUG),
            )
            self._answer(msg, "error", reason)
            return reason
        consumer.stats["acked"] += 1
        self._answer(msg, "ack")
        return None

    def _start_next(self) -> None:
        if self._lost or self._consumer._stopping:
            return
        while self._backlog and self._active < self._consumer.concurrency:
            self._start(self._backlog.popleft())
        if self._reading_paused and len(self._backlog) < self._consumer.concurrency:
            assert self._transport is not None
            self._transport.resume_reading()
            self._reading_paused = False

    def _answer(self, msg: Message, kind: str, reason: str | None = None) -> None:
        fields = _answer_fields(msg, self._consumer.id)
        content = reason.encode() if reason is not None else None
        assert self._transport is not None
        if not self._lost and not self._transport.is_closing():
            self._write(encode_frame(kind, fields, content))
            if self._consumer.send_arrived and msg.msgid:
                self._unanswered.append(_Answer(kind, fields, content))
        elif not msg.msgid:
            log.warning("connection gone, %s for a push without msgid not sent", kind)
        elif kind != "arrived" and self._consumer.send_arrived:
            # After `arrived` the broker may close the push connection; the
            # final answer then goes over our own connection to the broker.
            self._consumer._answer_late(kind, fields, content)
        else:
            log.debug("connection gone, %s for %s not sent", kind, msg.msgid)


@dataclass(frozen=True, slots=True)
class _Answer:
    kind: str
    fields: list[tuple[str, str]]
    content: bytes | None


def _answer_fields(msg: Message, consumer_id: str) -> list[tuple[str, str]]:
    """msgid (if the push had one), appid, and two extensions an original broker ignores:
    `recipient` names us, so that a late answer reaching any broker can only end a push
    made to us; `token` echoes the push's delivery token, which names that delivery."""
    fields = [("msgid", msg.msgid)] if msg.msgid else []
    fields.append(("appid", msg.appid))
    fields.append(("recipient", msg.fields.get("recipient") or consumer_id))
    if token := msg.fields.get("token"):
        fields.append(("token", token))
    return fields


CONSUMER_STATS = ("received", "acked", "rejected", "errored")


@dataclass(eq=False, repr=False)  # a repr would show the token
class Consumer(_Scoped):
    """A recipient: listens for the broker's pushes and calls `handler` on each.

    `handler` returning normally answers `ack`; raising `Reject` answers
    `reject`; any other exception answers `error` with its text as reason.
    """

    app: str
    id: str
    handler: Handler
    _: KW_ONLY
    host: str = DEFAULT_HOST
    port: int = 0
    weight: int = 0
    broker_host: str = DEFAULT_HOST
    broker_port: int = DEFAULT_PORT
    send_arrived: bool = False
    concurrency: int = 64
    #: The host put in the registration; default `host`, or for a wildcard
    #: `host` our address as seen on the connection to the broker.
    advertise_host: str | None = None
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    #: Sent in an `auth` frame on our own connection to the broker.
    token: str | None = None
    signing_secret: InitVar[str | None] = None
    signing_tolerance: InitVar[float] = DEFAULT_TOLERANCE
    #: With the broker's SIGNING_SECRET: a push not signed by it, or stale, is rejected.
    verifier: PushVerifier | None = field(init=False)
    # Pushes received, and how they were answered (`skmq consume` prints them).
    stats: collections.Counter[str] = field(
        init=False, default_factory=lambda: collections.Counter(dict.fromkeys(CONSUMER_STATS, 0))
    )
    _server: asyncio.Server | None = field(init=False, default=None)
    _connections: set[_PushProtocol] = field(init=False, default_factory=set)
    _tasks: set[asyncio.Task[None]] = field(init=False, default_factory=set)
    _broker_conn: Producer | None = field(init=False, default=None)
    _broker_conn_lock: asyncio.Lock = field(init=False, default_factory=asyncio.Lock)
    _stopping: bool = field(init=False, default=False)

    def __post_init__(self, signing_secret: str | None, signing_tolerance: float) -> None:
        if self.concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        self.verifier = (
            PushVerifier(signing_secret, signing_tolerance) if signing_secret is not None else None
        )

    def is_named(self, ping: Frame) -> bool:
        """Whether a `ping` is for this consumer: one that names a registration
        (capability `identity`) names this one's app and id."""
        app, rid = ping.get("appid"), ping.get("recipient")
        return (app is None or app == self.app) and (rid is None or rid == self.id)

    #: After `register`: the address the broker said this registration took the id over
    #: from (another consumer was running with it), else None.
    took_over: str | None = None

    async def start(self) -> None:
        """Listen on host:port (port 0: any free port), then register."""
        self._stopping = False
        loop = asyncio.get_running_loop()
        try:
            self._server = await loop.create_server(
                lambda: _PushProtocol(self), self.host, self.port
            )
        except OSError as exc:  # asyncio's strerror repeats the address: the cause alone
            why = (
                os.strerror(exc.errno) if exc.errno and exc.errno > 0 else exc.strerror or str(exc)
            )
            raise CannotListen(exc.errno, why[:1].lower() + why[1:]) from exc
        self.port = int(self._server.sockets[0].getsockname()[1])
        try:
            await self.register()
        except BaseException:
            await self.stop(grace=0)
            raise

    async def register(self) -> Resp:
        """Send `register`; raises RegistrationError unless the broker acks."""
        broker = await self._broker()
        host = self.advertise_host or self.host
        if host in _WILDCARD_HOSTS:
            local = broker.local_address
            host = local[0] if local else socket.gethostname()
        # The port as a string: the original broker refuses a number ("Invalid
        # parameters"). `caps` (an extension it ignores) says we take pipelined pushes,
        # `length=` content and delivery tokens.
        body: dict[str, Any] = {
            "id": self.id,
            "app_id": self.app,
            "host": host,
            "port": str(self.port),
            "weight": self.weight,
            "caps": list(CONSUMER_CAPS),
        }
        resp = await self._request(broker, "register", body)
        if not resp.ok:
            raise RegistrationError(resp)
        self.took_over = resp.took_over
        return resp

    async def extend(self, msg: Message) -> Resp:
        """Ask for another ACK_TIMEOUT to work on `msg` (the broker's `extend` extension,
        ExtensionUnsupported otherwise; at most MAX_LEASE_EXTENSIONS times an attempt, then
        `reject`). Sent on our own connection to the broker."""
        link = await self._broker()
        await link.require("extend")
        fields = _answer_fields(msg, self.id)
        return await asyncio.wait_for(link.request("extend", fields), BROKER_TIMEOUT)

    async def unregister(self) -> Resp:
        """Send `unregister`; returns the broker's resp (not raising on refusal).

        `unregister` is an extension: ExtensionUnsupported (and nothing sent but
        `hello`) when the broker does not have it.
        """
        broker = await self._broker()
        await asyncio.wait_for(broker.require("unregister"), BROKER_TIMEOUT)
        return await self._request(broker, "unregister", {"id": self.id, "app_id": self.app})

    async def stop(self, grace: float = 5.0) -> None:
        """Stop listening, give running handlers `grace` seconds, then cancel them.

        Pushes not yet started get no answer: the broker redelivers them.
        """
        self._stopping = True
        if self._server is not None:
            self._server.close()
        for conn in list(self._connections):
            conn.stop_reading()
        await self._drain_tasks(grace)
        for conn in list(self._connections):
            conn.close()
        if self._server is not None:
            server, self._server = self._server, None
            try:
                await asyncio.wait_for(server.wait_closed(), 1.0)
            except TimeoutError:
                log.debug("server did not close in time")
        if self._broker_conn is not None:
            broker, self._broker_conn = self._broker_conn, None
            await broker.close()

    async def _open(self) -> None:
        await self.start()

    async def _shut(self) -> None:
        await self.stop()

    async def _drain_tasks(self, grace: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        # Loop: a handler finishing after its connection closed spawns a late answer.
        while self._tasks and (remaining := deadline - loop.time()) > 0:
            await asyncio.wait(set(self._tasks), timeout=remaining)
        tasks = set(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=1.0)

    def _track(self, task: asyncio.Task[None]) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _broker(self) -> Producer:
        """Our own connection to the broker, (re)opened on demand."""
        async with self._broker_conn_lock:
            if self._broker_conn is None or not self._broker_conn.connected:
                # One frame in flight: late answers can come in bursts, and an original
                # broker mangles frames that reach it back to back.
                broker = Producer(
                    self.broker_host, self.broker_port, max_in_flight=1, token=self.token
                )
                await asyncio.wait_for(broker.connect(), BROKER_TIMEOUT)
                self._broker_conn = broker
            return self._broker_conn

    @staticmethod
    async def _request(broker: Producer, frame_type: str, body: dict[str, Any]) -> Resp:
        content = json.dumps(body, separators=(",", ":")).encode()
        return await asyncio.wait_for(broker.request(frame_type, (), content), BROKER_TIMEOUT)

    def _answer_late(self, kind: str, fields: list[tuple[str, str]], content: bytes | None) -> None:
        self._track(asyncio.get_running_loop().create_task(self._send_late(kind, fields, content)))

    async def _send_late(
        self, kind: str, fields: list[tuple[str, str]], content: bytes | None
    ) -> None:
        try:
            broker = await self._broker()
            resp = await asyncio.wait_for(broker.request(kind, fields, content), BROKER_TIMEOUT)
        except (OSError, TimeoutError) as exc:
            log.warning("could not send %s for %s to the broker: %s", kind, fields[0][1], exc)
            return
        log.debug("broker resp to late %s for %s: %s", kind, fields[0][1], resp)
