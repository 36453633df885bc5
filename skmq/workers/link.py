"""The broker's connections to one recipient (SPEC 3; docs/PROTOCOL.md, "Push delivery").

Every connection starts with `ping`, and no push goes out on it before the recipient
answered `pong`: a service that does not speak SKMQ (a Redis, an admin port) never
receives a message. Then, by what the recipient declared when it registered:

- `pipeline`: one kept-open connection, up to PUSH_WINDOW pushes unanswered on it;
- none (an original SKMQ peer): the original broker's discipline, one push a connection
  (connect, ping, push, read its answers, reply, close), up to LEGACY_WINDOW such
  connections at once, and a short LEGACY_ANSWER_TIMEOUT for a push nobody answers
  (an original recipient that wedged never closes its connection).

A connection that breaks, times out or sends garbage is closed and never reused. Pushes
that were never written on it go back without spending an attempt; written ones that got
no answer count a failed attempt; ones that `arrived` wait for their final answer on
another connection.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field
from typing import Protocol, cast

import structlog

from skmq import tracing
from skmq.clock import now_ms
from skmq.coalesce import Coalescer
from skmq.codec import (
    PING,
    CodecError,
    Frame,
    FrameProtocol,
    InvalidFrame,
    Status,
    encode_frame,
    encode_resp,
)
from skmq.events import Event
from skmq.store import Claimed

log = structlog.get_logger("skmq.link")

Verdict = tuple[str, str]


@dataclass(slots=True, eq=False)
class Delivery(Claimed):
    """A claimed delivery of app, as pushed (or about to be) by this broker."""

    app: str = ""
    token: str = ""
    pushed_at: float = field(default_factory=time.monotonic)
    arrived_at: float = 0.0
    conn: PushConnection | None = None
    pushed_as: str = ""  # the traceparent of its `skmq push` span (tracing on)


class LinkOwner(Protocol):
    def on_arrived(self, link: RecipientLink, delivery: Delivery) -> None: ...
    def on_extend(
        self, link: RecipientLink, delivery: Delivery, reply: Callable[[Verdict], None]
    ) -> None: ...
    def on_answer(
        self,
        link: RecipientLink,
        delivery: Delivery,
        outcome: Event,
        detail: str,
        reply: Callable[[Verdict], None],
    ) -> None: ...
    def on_unknown_answer(
        self, link: RecipientLink, frame: Frame, reply: Callable[[Verdict], None]
    ) -> None: ...
    def on_broken(self, link: RecipientLink, deliveries: list[Delivery], detail: str) -> None: ...
    def on_unreachable(
        self, link: RecipientLink, deliveries: list[Delivery], detail: str
    ) -> None: ...
    def push_fields(self, app: str, msgid: str, content: bytes) -> tuple[tuple[str, str], ...]: ...


OUTCOMES = {"ack": Event.ACKED, "reject": Event.REJECTED, "error": Event.ERRORED}
DETAILS = {"ack": "", "reject": "rejected by the recipient", "error": "error at the recipient"}
# What a recipient may send on a push connection, besides `pong`; anything else closes it.
ANSWERS = frozenset({*OUTCOMES, "arrived", "extend"})


@dataclass(frozen=True, slots=True)
class LinkTimeouts:
    connect: float
    handshake: float  # for the `pong` that must come before any push
    legacy_answer: float  # an original peer's push with no answer at all


@dataclass(frozen=True, slots=True)
class LinkLimits:
    """What a recipient may make a push connection hold, as a producer's connection on the
    broker's port (the same settings): a recipient is a peer like any other."""

    max_frame_bytes: int
    max_unanswered: int  # its frames read and not answered yet: past it, not read
    max_write_buffer: int  # our answers it has not read: past it, cut off


class PushConnection(FrameProtocol):
    """One TCP connection to the recipient: handshake, then pushes and their answers."""

    def __init__(self, link: RecipientLink, single_use: bool) -> None:
        super().__init__(link.limits.max_frame_bytes)
        self.link = link
        self.single_use = single_use
        self.transport: asyncio.Transport | None = None
        self.ready = False  # the recipient answered the handshake's `ping` with `pong`
        self.closed = False
        self.queued: list[Delivery] = []  # waiting for the handshake: never written
        self.pushed: dict[str, Delivery] = {}  # written, not finally answered
        # The `resp`s to the recipient's answers, in their order: [] until ready; those
        # not written yet are its unanswered frames (MAX_UNANSWERED_FRAMES).
        self.replies: deque[list[bytes]] = deque()
        self.held: list[Frame | InvalidFrame] = []  # read past that limit: taken as it drops
        self.last_write = 0.0
        self._failure = "connection to recipient lost"
        self._timer: asyncio.TimerHandle | None = None
        self._out: Coalescer[bytes] = Coalescer(self._write_out)
        self._task = asyncio.get_running_loop().create_task(self._connect())

    async def _connect(self) -> None:
        link = self.link
        try:
            async with asyncio.timeout(link.timeouts.connect):
                await asyncio.get_running_loop().create_connection(
                    lambda: self, link.host, link.port
                )
        except (OSError, TimeoutError) as exc:
            self._failure = f"connect to {link.host}:{link.port}: {exc!r}"
            self._lost()

    def send(self, d: Delivery) -> None:
        d.conn = self
        if self.ready:
            self._push(d)
        else:
            self.queued.append(d)

    def _push(self, d: Delivery) -> None:
        self.pushed[d.msgid] = d
        d.pushed_at = time.monotonic()
        self._out.add(self.link.encode_push(d))
        if self.single_use:
            self._arm(self.link.timeouts.legacy_answer, "no answer within legacy_answer_timeout")

    @property
    def unanswered(self) -> int:
        """The recipient's frames read and not answered yet."""
        return len(self.replies)

    def replier(self, msgid: str) -> Callable[[Verdict], None]:
        """How to answer the recipient's frame just read: its `resp` goes out after those
        of the frames before it (docs/PROTOCOL.md 6.1), whichever is ready first."""
        slot: list[bytes] = []
        self.replies.append(slot)

        def reply(resp: Verdict) -> None:
            slot.append(encode_resp(resp[0], resp[1], msgid or None))
            self._reply_ready()

        return reply

    def _reply_ready(self) -> None:
        """Write the answers at the head that are ready; an original peer's connection
        closes once its push has its final answer. (After `arrived` it stays open for
        ACK_WAIT, for a final answer on it; the original recipient may instead close it
        and answer on a connection of its own.)"""
        replies = self.replies
        while replies and replies[0]:
            resp = replies.popleft()[0]
            if self.transport is not None and not self.closed:
                self._out.add(resp)
        if self.transport is None or self.closed:
            return
        if self.single_use and not self.pushed and not replies:
            self._out.flush()
            self.close()
        elif self.held:
            held, self.held = self.held, []
            self.frames_received(held)
            if not self.held and self.transport is not None:
                self.transport.resume_reading()

    def _write_out(self, chunks: list[bytes]) -> None:
        if self.transport is not None:
            self.transport.write(b"".join(chunks))
            self.last_write = time.monotonic()
            if self.transport.get_write_buffer_size() > self.link.limits.max_write_buffer:
                self.abort("recipient does not read the broker's answers")

    def _arm(self, delay: float, why: str) -> None:
        self._disarm()
        self._timer = asyncio.get_running_loop().call_later(delay, self.abort, why)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def refuse(self, why: str) -> None:
        """Something that is not a valid answer: answered `error`, then the connection is
        closed for good (its unanswered pushes fail: docs/PROTOCOL.md 6.1)."""
        if self.transport is not None and not self.closed:
            self._out.add(encode_resp(Status.ERROR, why))
            self._out.flush()
        self._failure = why
        self.close()

    def abort(self, why: str) -> None:
        """Drop the connection for good (garbage, a timeout): it is never reused."""
        self._failure = why
        if self.transport is not None:
            self.transport.abort()
        else:
            self.close()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._task.cancel()
        if self.transport is not None:
            self.transport.close()
        else:
            self._lost()

    def waiting_only(self, ack_wait: float, now: float) -> bool:
        """Every push on it `arrived` ACK_WAIT ago, and nothing was written since."""
        return (
            bool(self.pushed)
            and now - self.last_write >= ack_wait
            and all(d.arrived_at and now - d.arrived_at >= ack_wait for d in self.pushed.values())
        )

    # -- asyncio.Protocol -------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not subclass asyncio.Transport: cast, do not assert.
        self.transport = cast(asyncio.Transport, transport)
        if self.closed:
            self.transport.close()
            return
        self.transport.write(PING)
        self._arm(self.link.timeouts.handshake, "no pong within handshake_timeout")

    def stream_broken(self, exc: CodecError) -> None:
        self.abort(f"recipient sent an invalid stream: {exc}")

    def frames_received(self, frames: list[Frame | InvalidFrame]) -> None:
        for i, frame in enumerate(frames):
            if not isinstance(frame, Frame):
                self.refuse(f"recipient sent an invalid frame: {frame.reason}")
                return
            if not self.ready:
                if frame.type != "pong":
                    self.abort(f"recipient answered the handshake with {frame.type!r}")
                    return
                self._ready()
            elif frame.type not in ("pong", "resp"):
                # Each answer gets its `resp` (`reply`) once the store has it: with so
                # many waiting, the rest is held and the recipient not read (one read may
                # hold thousands of answers) until they drop under the limit.
                if self.unanswered >= self.link.limits.max_unanswered:
                    self.held = frames[i:]
                    if self.transport is not None:
                        self.transport.pause_reading()
                    return
                self.link.on_frame(self, frame)
                if self.closed:  # refused: nothing after it counts
                    return

    def _ready(self) -> None:
        self.ready = True
        self._disarm()
        queued, self.queued = self.queued, []
        for d in queued:
            self._push(d)

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost()

    def _lost(self) -> None:
        self.transport = None
        self.closed = True
        self._disarm()
        self._out.clear()
        self.held = []
        self.replies.clear()
        self.link.connection_lost(self, self._failure)

    def answered(self, d: Delivery, arrived: bool) -> None:
        if arrived:
            if self.single_use:
                self._disarm()
            return
        self.pushed.pop(d.msgid, None)


@dataclass(eq=False)
class RecipientLink:
    """Everything this broker has pushed to one recipient and not yet heard the end of."""

    owner: LinkOwner
    app: str
    rid: str
    host: str
    port: int
    caps: frozenset[str]
    _: KW_ONLY
    window: int
    timeouts: LinkTimeouts
    limits: LinkLimits
    inflight: dict[str, Delivery] = field(init=False, default_factory=dict)
    # Until then no new pushes: this recipient let pushes time out (SPEC 3: they go
    # elsewhere). An answer from it lifts the bench.
    benched_until: float = field(init=False, default=0.0)
    # Pushes given up on, kept (bounded) so that a late answer still names its attempt:
    # that attempt fences it off from a newer one, perhaps another broker's.
    expired: OrderedDict[str, Delivery] = field(init=False, default_factory=OrderedDict)
    connections: set[PushConnection] = field(init=False, default_factory=set)
    _shared: PushConnection | None = field(init=False, default=None)
    since: int = field(init=False, default_factory=now_ms)  # unix ms it was made

    @property
    def free(self) -> int:
        return self.window - len(self.inflight)

    # -- pushing ----------------------------------------------------------
    def push(self, d: Delivery) -> None:
        self.inflight[d.msgid] = d
        conn = self._shared
        if conn is None or conn.closed:
            conn = PushConnection(self, single_use="pipeline" not in self.caps)
            self.connections.add(conn)
            if not conn.single_use:
                self._shared = conn
        conn.send(d)

    def encode_push(self, d: Delivery) -> bytes:
        """Original peers get only the fields the original broker sends; a recipient that
        declared capabilities also gets the delivery metadata (attempt, stored_at)."""
        fields: list[tuple[str, str]] = [("appid", self.app), ("msgid", d.msgid)]
        if d.trace and tracing.tracer is not None:
            span = tracing.start("push", d.trace, self.app, d.msgid)
            d.pushed_as = tracing.traceparent(span)
            span.end()
        if self.caps:
            fields += (("attempt", str(d.attempt)), ("stored_at", str(d.stored_at)))
            if d.kind == "topic":
                fields.append(("recipient", self.rid))
            if d.token and "token" in self.caps:
                fields.append(("token", d.token))
            if d.trace:
                fields.append(("traceparent", d.pushed_as or d.trace))
        fields += self.owner.push_fields(self.app, d.msgid, d.content)
        return encode_frame("push", fields, d.content)

    # -- answers on this recipient's connections ----------------------------
    def on_frame(self, conn: PushConnection, frame: Frame) -> None:
        kind = frame.type
        msgid = frame.fields.get("msgid", "")
        if kind not in ANSWERS:
            conn.refuse(f"unexpected frame type {kind!r} from a recipient")
            return
        if not msgid:
            conn.refuse("msgid required")
            return

        reply = conn.replier(msgid)
        named = frame.fields.get("recipient")
        if named and named != self.rid:  # PROTOCOL.md 7: it narrows to that recipient
            reply(
                (
                    "reject",
                    f"the answer names recipient {named!r}; these pushes are to {self.rid!r}",
                )
            )
            return
        d = self.inflight.get(msgid)
        if d is None and kind in OUTCOMES:
            d = self.expired.pop(msgid, None)
        token = frame.fields.get("token")
        if d is None or (token is not None and d.token and token != d.token):
            self.owner.on_unknown_answer(self, frame, reply)
            return
        if kind == "extend" or (kind == "arrived" and d.arrived_at):
            self.owner.on_extend(self, d, reply)  # still working: another lease
            return
        if kind == "arrived":
            d.arrived_at = time.monotonic()
            if d.conn is not None:
                d.conn.answered(d, arrived=True)
            self.owner.on_arrived(self, d)
            reply((Status.ACK, "arrived"))
            return
        outcome = OUTCOMES[kind]
        self.take(msgid)
        self.benched_until = 0.0
        detail = (frame.content or b"").decode("utf-8", "replace") or DETAILS[kind]
        if d.pushed_as and tracing.tracer is not None:
            reply = self._traced_answer(d, kind, reply)
        self.owner.on_answer(self, d, outcome, detail, reply)

    def _traced_answer(
        self, d: Delivery, kind: str, reply: Callable[[Verdict], None]
    ) -> Callable[[Verdict], None]:
        """`reply`, ending a `skmq answer` span (a child of the push's) begun now: it
        lasts until the store took the answer."""
        span = tracing.start("answer", d.pushed_as, self.app, d.msgid, **{tracing.ANSWER: kind})

        def replied(verdict: Verdict) -> None:
            tracing.end(span, None if verdict[0] == Status.ACK else verdict[1])
            reply(verdict)

        return replied

    def connection_lost(self, conn: PushConnection, detail: str) -> None:
        self.connections.discard(conn)
        if self._shared is conn:
            self._shared = None
        never_written = [d for d in conn.queued if self.inflight.get(d.msgid) is d]
        broken = [
            d for d in conn.pushed.values() if not d.arrived_at and self.inflight.get(d.msgid) is d
        ]
        conn.queued.clear()
        for d in (*never_written, *broken):
            del self.inflight[d.msgid]
        if never_written:
            self.owner.on_unreachable(self, never_written, detail)
        if broken:
            self.owner.on_broken(self, broken, detail)

    # -- housekeeping -----------------------------------------------------
    def close_if_waiting_only(self, ack_wait: float, now: float) -> None:
        """SPEC 3: after `arrived` the broker waits ACK_WAIT for the final answer on the
        push connection, then may close it; the recipient answers on its own connection."""
        for conn in list(self.connections):
            if conn.waiting_only(ack_wait, now):
                conn.close()

    def drop_expired(self, now: float, ack_timeout: float) -> int:
        """Forget pushes older than ACK_TIMEOUT: by then each was answered elsewhere (on a
        connection of the recipient's own, perhaps to another broker) or reaped as a
        timeout in Redis. Returns how many window slots that freed."""
        expired = [m for m, d in self.inflight.items() if now - d.pushed_at > ack_timeout]
        for msgid in expired:
            self.timed_out(msgid, now, ack_timeout)
        return len(expired)

    def timed_out(self, msgid: str, now: float, bench_for: float, attempt: int = 0) -> None:
        """A push got no final answer in time: bench the recipient and drop the
        connection it went on, which is never reused (docs/PROTOCOL.md 6.1): its other
        unanswered pushes fail too. `attempt`: the one that timed out (0: whichever is
        pushed); a push of another attempt is not it (a new owner's push of a message
        whose earlier attempt, its old owner's, it reaps)."""
        d = self.inflight.get(msgid)
        if d is None or (attempt and d.attempt != attempt):
            return
        self.take(msgid)
        self.expired[msgid] = d
        if len(self.expired) > 4 * self.window:
            self.expired.popitem(last=False)
        if d.arrived_at:
            return
        self.benched_until = now + bench_for
        if d.conn is not None:
            d.conn.abort("push timed out")

    def benched(self, now: float) -> bool:
        return now < self.benched_until

    def stalled(self, now: float, after: float) -> bool:
        oldest = next(iter(self.inflight.values()), None)
        return oldest is not None and now - oldest.pushed_at > after

    def pushed(self, msgid: str) -> Delivery | None:
        """Its push of msgid, still waiting or given up on, if any."""
        return self.inflight.get(msgid) or self.expired.get(msgid)

    def take(self, msgid: str) -> Delivery | None:
        d = self.inflight.pop(msgid, None)
        if d is not None and d.conn is not None:
            d.conn.answered(d, arrived=False)
        return d

    def close(self) -> None:
        for conn in list(self.connections):
            conn.close()
