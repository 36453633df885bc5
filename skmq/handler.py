"""The handle stage: every decoded frame becomes exactly one reply (but a fatal error,
which becomes a reply and a close).

Producer frames of one batch are stored together by the enqueue worker; answers and
registrations run as tasks; everything else is answered on the spot. A reply is bytes,
or a pending reply (bytes once done) that the server writes, in frame order, when it is
done.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import structlog
from redis.exceptions import RedisError

from skmq import __version__, tracing
from skmq.aio import spawn
from skmq.auth import Role, Tokens
from skmq.clock import now_ms
from skmq.codec import (
    ANSWER_TYPES,
    PONG,
    PRODUCER_TYPES,
    CodecError,
    Frame,
    FrameType,
    InvalidFrame,
    Status,
    encode_resp,
)
from skmq.config import Settings
from skmq.errors import ApiError
from skmq.ids import bad_app, bad_id
from skmq.jsonbody import dump_json, parse_json
from skmq.peer import Peer
from skmq.registry.registration import (
    CONTROL,
    RegistrationRefused,
    check_address,
    parse_registration,
    parse_unregistration,
)
from skmq.store import NewMessage
from skmq.workers.engine import Engine
from skmq.workers.enqueue import EnqueueBatch, Enqueuer
from skmq.workers.routes import unroutable_reason

log = structlog.get_logger("skmq.handler")

#: The extensions this broker names in its answer to `hello` (docs/PROTOCOL.md).
BROKER_CAPS = (
    *("auth", "delay", "extend", "hello", "key", "length", "mandatory", "pipeline", "pull"),
    *("recipient", "token", "trace", "ttl", "unregister"),
)
HELLO_BODY = json.dumps(
    {"server": "skmq", "version": __version__, "caps": list(BROKER_CAPS)}, separators=(",", ":")
)


class PendingReply(Protocol):
    """A reply still being worked out (a task, or a producer frame's StoreReply): the
    server writes it from its done callback (no task a connection waits on it)."""

    def done(self) -> bool: ...

    def result(self) -> bytes: ...

    def add_done_callback(self, callback: Callable[[Any], object]) -> None: ...


Reply = bytes | PendingReply


class PullCalls(Protocol):
    """Consumer groups and pull consumption (skmq/http/pull.py's PullApi): a JSON body in,
    a JSON-able answer out, ApiError for a refusal."""

    async def call(
        self,
        op: str,
        app: str,
        group: str,
        raw: Any,
        who: str = "",
        gone: asyncio.Event | None = None,
    ) -> dict[str, Any]: ...


@dataclass(slots=True)
class Outcome:
    reply: Reply
    close: bool = False


# W3C Trace Context, version 00 (https is not linked: docs/PROTOCOL.md names it); a
# trace id or parent id of only zeros is invalid.
TRACEPARENT = re.compile(r"00-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}")


def bad_timing(
    settings: Settings, now: int, delay: int, deliver_at: int, ttl: int | None
) -> str | None:
    """Why a message's delay, deliver_at or ttl is refused, or None. Each is bounded
    (MAX_DELAY, MAX_TTL): a delay of 310 digits was once stored, and Redis then read its
    due time as infinity in every claim of its app."""
    if delay > settings.max_delay or deliver_at > now + settings.max_delay:
        field = "delay and deliver_at reach" if deliver_at else "delay reaches"
        return f"{field} at most {settings.max_delay} ms ahead (MAX_DELAY)"
    if ttl is not None and ttl > settings.max_ttl:
        return f"ttl is at most {settings.max_ttl} ms (MAX_TTL)"
    return None


def _auth_token(frame: Frame) -> bytes:
    """An `auth` frame's token: its `token` field (docs/PROTOCOL.md) or its content (our
    clients'); both, differing, are no token."""
    content = frame.content or b""
    field = frame.fields.get("token")
    if field is None:
        return content
    token = field.encode("utf-8", "surrogateescape")
    return token if not content or content == token else b""


def _int_field(frame: Frame, key: str) -> int | None:
    """The field as a non-negative integer, None when absent; ValueError when invalid
    (anything but ASCII digits: int() alone takes spaces, `_` and other scripts' digits)."""
    raw = frame.fields.get(key)
    if raw is None or raw == "":
        return None
    if not (raw.isascii() and raw.isdigit()):
        raise ValueError
    return int(raw)


@dataclass(eq=False)
class FrameHandler:
    settings: Settings
    enqueuer: Enqueuer
    engine: Engine
    # None: auth is off, every connection may do everything (SECURITY.md).
    tokens: Tokens | None = None
    pull: PullCalls | None = None
    _id_prefix: str = field(init=False, default_factory=lambda: uuid.uuid4().hex[:16])
    _id_counter: Iterator[int] = field(init=False, default_factory=lambda: itertools.count(1))
    _tasks: set[asyncio.Task[bytes]] = field(init=False, default_factory=set)
    # Answers and registrations of all connections at the store at once: a flood of
    # them waits here, and the rest of the Redis pool stays for producers and delivery.
    peer_store_calls: asyncio.Semaphore = field(init=False)

    def __post_init__(self) -> None:
        s = self.settings
        self.peer_store_calls = asyncio.Semaphore(
            max(1, min(s.max_peer_store_calls, s.redis_pool_size // 2))
        )

    async def store_room(self) -> None:
        """Backpressure: wait while too much producer content waits for the store."""
        await self.enqueuer.room()

    def has_store_room(self) -> bool:
        """No backpressure now: producer frames may be handled at once."""
        return self.enqueuer.has_room()

    def handle_batch(
        self, items: list[tuple[Peer, Frame | InvalidFrame | CodecError | None]]
    ) -> list[Outcome]:
        """items: (peer, decoded item); None is the end of the peer's stream."""
        batch = EnqueueBatch()
        out = [self._handle(peer, item, batch) for peer, item in items]
        self.enqueuer.submit(batch)
        return out

    def _handle(
        self, peer: Peer, item: Frame | InvalidFrame | CodecError | None, batch: EnqueueBatch
    ) -> Outcome:
        if item is None:
            return Outcome(b"", close=True)
        if isinstance(item, CodecError):
            return Outcome(encode_resp(Status.ERROR, f"frame refused, closing: {item}"), close=True)
        if isinstance(item, Frame) and item.type == FrameType.PING:
            return Outcome(PONG)
        if isinstance(item, Frame) and item.type == FrameType.HELLO:  # says nothing of any app
            return Outcome(self._resp(HELLO_BODY, item.fields.get("msgid"), Status.ACK))
        if self.tokens is not None and not peer.authenticated:
            return self._before_auth(self.tokens, peer, item)
        if isinstance(item, InvalidFrame):
            return Outcome(self._resp(f"invalid frame: {item.reason}", item.fields.get("msgid")))
        kind = item.type
        if kind in PRODUCER_TYPES:
            return Outcome(self._produce(item, batch, peer))
        if kind in ANSWER_TYPES:
            app = item.fields.get("appid") or ""
            if (refused := self._refusal(peer, "consume", app)) is not None:
                return Outcome(self._resp(refused, item.fields.get("msgid"), Status.REJECT))
            return Outcome(spawn(self._answer(item, peer), self._tasks))
        if kind == FrameType.REGISTER:
            return Outcome(spawn(self._register(item, peer), self._tasks))
        if kind == FrameType.UNREGISTER:
            return Outcome(spawn(self._unregister(item, peer), self._tasks))
        if kind == FrameType.PULL:
            return Outcome(spawn(self._pull(item, peer), self._tasks))
        msgid = item.fields.get("msgid")
        if kind == FrameType.AUTH:
            if self.tokens is None:
                return Outcome(self._resp("authentication is not required here", msgid, Status.ACK))
            return Outcome(self._resp("already authenticated", msgid, Status.REJECT))
        if not kind:
            return Outcome(self._resp("frame without a type field", msgid))
        return Outcome(self._resp(f"unknown frame type {kind!r}", msgid))

    # -- authentication and authorization (skmq/auth.py) ---------------------
    def _before_auth(self, tokens: Tokens, peer: Peer, item: Frame | InvalidFrame) -> Outcome:
        """Until an `auth` frame succeeds, everything (but `ping` and `hello`, answered
        before) is refused, changing nothing. A wrong token closes the
        connection. The token itself is never logged."""
        msgid = item.fields.get("msgid")
        if isinstance(item, InvalidFrame) or item.type != FrameType.AUTH:
            return Outcome(
                self._resp("authentication required: send auth first", msgid, Status.REJECT)
            )
        grant = tokens.check(_auth_token(item))
        if grant is None:
            log.warning("authentication failed, closing", peer=peer.host)
            return Outcome(self._resp("authentication failed", msgid, Status.REJECT), close=True)
        peer.admit(grant)
        log.info("authenticated", peer=peer.host, principal=grant.name)
        return Outcome(self._resp("authenticated", msgid, Status.ACK))

    def _refusal(self, peer: Peer, role: Role, app: str) -> str | None:
        """Why `peer` may not act as `role` for `app`, or None (always None with auth off)."""
        if self.tokens is None or peer.may(role, app):
            return None
        if not app:  # an answer without appid; the engine would look in every app
            return f"appid required: this connection's token has the {role} role for some apps only"
        return f"not allowed: this connection's token lacks the {role} role for app {app!r}"

    @staticmethod
    def _resp(content: str, msgid: str | None = None, status: str = Status.ERROR) -> bytes:
        """A `resp` (an error unless said otherwise), echoing msgid where it can."""
        if msgid is not None and ("\r" in msgid or "\n" in msgid):
            msgid = None
        return encode_resp(status, content, msgid)

    # -- producers ----------------------------------------------------------
    def _produce(self, frame: Frame, batch: EnqueueBatch, peer: Peer) -> Reply:
        fields = frame.fields
        msgid = fields.get("msgid")
        app = fields.get("appid") or ""
        if (why := bad_app(app)) is not None:
            return self._resp(f"appid {why}", msgid)
        if (refused := self._refusal(peer, "produce", app)) is not None:
            return self._resp(refused, msgid, Status.REJECT)
        if msgid is None or msgid == "":
            msgid = f"{self._id_prefix}-{next(self._id_counter)}"
        elif (why := bad_id(msgid)) is not None:
            return self._resp(f"msgid {why}", None)
        if frame.content is None:
            return self._resp("content required", msgid)
        if len(frame.content) > (limit := self.settings.max_content_bytes):
            return self._resp(
                f"content over {limit} bytes (MAX_FRAME_BYTES less the push's fields)", msgid
            )
        key = fields.get("key") or ""
        if key and (why := bad_id(key)) is not None:
            return self._resp(f"key {why}", msgid)
        if key and frame.type != "queue":
            return self._resp("key= (ordered delivery) applies to queue messages only", msgid)
        mandatory = fields.get("mandatory") or "0"
        if mandatory not in ("0", "1"):
            return self._resp("mandatory must be 0 or 1", msgid)
        if mandatory == "1" and not self.engine.routes.routable(app):
            return self._resp(unroutable_reason(app), msgid, Status.REJECT)
        trace = fields.get("traceparent") or ""
        if trace and TRACEPARENT.fullmatch(trace) is None:
            return self._resp(
                "traceparent must be a W3C trace context (00-<32 hex>-<16 hex>-<2 hex>)", msgid
            )
        try:
            delay = _int_field(frame, "delay")
            deliver_at = _int_field(frame, "deliver_at")
            ttl = _int_field(frame, "ttl")
        except ValueError:
            return self._resp("delay, deliver_at and ttl must be non-negative integers (ms)", msgid)
        now = now_ms()
        if (why := bad_timing(self.settings, now, delay or 0, deliver_at or 0, ttl)) is not None:
            return self._resp(why, msgid)
        due = 0
        if delay or deliver_at:
            due = max(deliver_at or 0, now + (delay or 0))
        if ttl is None:
            ttl = self.settings.app_ttl(app)
        expires = now + ttl if ttl else 0
        peer.took("producer", app)
        message = NewMessage(msgid, frame.type, frame.content, due, expires, key, trace)
        if trace and tracing.tracer is not None:
            return batch.add_traced(app, message)
        return batch.add(app, message)

    # -- recipients' answers and registrations ------------------------------
    async def _answer(self, frame: Frame, peer: Peer) -> bytes:
        msgid = frame.fields.get("msgid")
        try:
            async with peer.store_calls:
                apps = await self.engine.router.apps_of(frame, peer)  # (no shared slot)
                async with self.peer_store_calls:
                    status, content = await self.engine.answer(frame, peer, apps)
        except (RedisError, OSError):
            status, content = "error", "store unavailable, answer again later"
        return self._resp(content, msgid, status)

    async def _register(self, frame: Frame, peer: Peer) -> bytes:
        msgid = frame.fields.get("msgid")
        try:
            reg = parse_registration(frame.content, peer.host, self.settings.max_registration_bytes)
            if (refused := self._refusal(peer, "consume", reg.app)) is not None:
                raise RegistrationRefused(refused)
            check_address(reg.host, peer.host, self.settings.recipient_networks)
            if self.engine.own.used_by_broker(reg.host, reg.port):
                raise RegistrationRefused(
                    f"address {reg.host}:{reg.port} is one the broker uses itself "
                    "(its store or its own ports): never a recipient's"
                )
            async with peer.store_calls, self.peer_store_calls:
                taken = await self.engine.registry.register(reg)
                await self.engine.note_apps({reg.app})
        except RegistrationRefused as exc:
            return self._resp(str(exc), msgid, Status.REJECT)
        except (RedisError, OSError) as exc:
            log.warning("store unavailable for a registration", error=repr(exc))
            return self._resp("store unavailable, register again later", msgid)
        self.engine.routes.mark(reg.app)
        reply = self._resp("registered", msgid, Status.ACK)
        if taken and not CONTROL.search(taken):
            # An extension field, which the original's clients ignore as they do msgid.
            reply = b"took_over=" + taken.encode("utf-8", "surrogateescape") + b"\r\n" + reply
        return reply

    async def _pull(self, frame: Frame, peer: Peer) -> bytes:
        """A `pull` frame (extension, docs/PROTOCOL.md): one operation of a consumer group,
        its JSON body the content, its JSON answer the resp's content; a refusal is
        `reject` (`error`: try again) with the HTTP gateway's status first."""
        fields = frame.fields
        msgid = fields.get("msgid")
        app = fields.get("appid") or ""
        if self.pull is None:
            return self._resp("pull consumption is not served here", msgid, Status.REJECT)
        if not app:
            return self._resp("400 appid required", msgid, Status.REJECT)
        if (refused := self._refusal(peer, "consume", app)) is not None:
            return self._resp(f"403 {refused}", msgid, Status.REJECT)
        try:
            raw = parse_json(frame.content) if frame.content else None
        except ValueError as exc:
            return self._resp(f"400 content {exc}", msgid, Status.REJECT)
        op, group = fields.get("op") or "", fields.get("group") or ""
        who = peer.principal or peer.host
        peer.took("pull consumer", app)
        try:
            if op == "receive":  # a long poll: bounded by PULL_MAX_WAITING, not held here
                answer = await self.pull.call(op, app, group, raw, who, peer.gone)
            else:
                async with peer.store_calls, self.peer_store_calls:
                    answer = await self.pull.call(op, app, group, raw, who)
        except ApiError as exc:
            status = Status.ERROR if exc.status >= 500 else Status.REJECT
            return self._resp(f"{exc.status} {exc.message}", msgid, status)
        except (RedisError, OSError):
            return self._resp("503 store unavailable, try again", msgid)
        return self._resp(dump_json(answer).decode("utf-8"), msgid, Status.ACK)

    async def _unregister(self, frame: Frame, peer: Peer) -> bytes:
        msgid = frame.fields.get("msgid")
        try:
            app, rid = parse_unregistration(frame.content, self.settings.max_registration_bytes)
            if (refused := self._refusal(peer, "consume", app)) is not None:
                raise RegistrationRefused(refused)
            async with peer.store_calls, self.peer_store_calls:
                removed = await self.engine.registry.unregister(app, rid)
        except RegistrationRefused as exc:
            return self._resp(str(exc), msgid, Status.REJECT)
        except (RedisError, OSError) as exc:
            log.warning("store unavailable for an unregistration", error=repr(exc))
            return self._resp("store unavailable, unregister again later", msgid)
        return self._resp("unregistered" if removed else "was not registered", msgid, Status.ACK)
