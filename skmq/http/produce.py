"""POST /v1/apps/{app}/messages: one message or a batch, stored through the same enqueue
worker as TCP producers (skmq/workers/enqueue.py) and answered only once stored."""

from __future__ import annotations

import asyncio
import base64
import binascii
import uuid
from typing import Annotated, Any, Literal
from urllib.parse import unquote_to_bytes

import structlog
from aiohttp import hdrs, web
from aiohttp.typedefs import Handler
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from skmq.auth import Tokens
from skmq.clock import now_ms
from skmq.config import Settings
from skmq.handler import bad_timing
from skmq.http.bearer import authorize
from skmq.http.errors import ApiError
from skmq.ids import bad_app, bad_id
from skmq.jsonbody import parse_json
from skmq.registry.registration import is_text
from skmq.store import NewMessage
from skmq.workers.enqueue import UNAVAILABLE, EnqueueBatch, Enqueuer
from skmq.workers.routes import unroutable_reason

log = structlog.get_logger("skmq.http")


class OutgoingMessage(BaseModel):
    """One message to store."""

    model_config = ConfigDict(extra="forbid", strict=True)

    content: str = Field(description="the content, as text or (encoding base64) base64")
    encoding: Literal["text", "base64"] = "text"
    msgid: Annotated[str, Field(min_length=1, max_length=256)] | None = Field(
        None, description="for deduplication; made up by the broker when absent"
    )
    kind: Literal["queue", "topic"] = Field(
        "queue", description="queue: one recipient; topic: every recipient"
    )
    delay: Annotated[int, Field(ge=0)] = Field(0, description="ms before it is delivered")
    ttl: Annotated[int, Field(ge=0)] | None = Field(
        None, description="ms it may wait to be delivered (0: forever); the app's by default"
    )
    key: Annotated[str, Field(max_length=256)] = Field(
        "", description="ordering key (queue only): one at a time, in stored order, per key"
    )
    mandatory: bool = Field(
        False,
        description="refuse it (422, nothing of the request stored) when the app has no "
        "recipient and no consumer group, instead of storing it to wait for one",
    )


class MessageBatch(BaseModel):
    """Several messages stored in one step (HTTP_MAX_BATCH at most)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    messages: Annotated[list[OutgoingMessage], Field(min_length=1)]


class StoreResult(BaseModel):
    """What became of one message: stored, or refused as a duplicate of a stored msgid."""

    msgid: str
    status: Literal["stored", "duplicate"]


class BatchResult(BaseModel):
    results: list[StoreResult]


def field_errors(exc: ValidationError) -> str:
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "body"
    more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    return f"{where}: {first['msg']}{more}"


#: Seconds a request's body may take to arrive once its handler reads it (FRAME_TIMEOUT).
BODY_TIMEOUT = web.AppKey("body_timeout", float)
#: The Content-Encodings of a body that aiohttp decodes without an optional package
#: (it reads any other it does not know, `x-gzip` too, as none).
BODY_ENCODINGS = ("identity", "gzip", "deflate")


#: HTTP_MAX_BODY_BYTES, for `refuse_oversized` (aiohttp's client_max_size applies it as
#: a body is read).
MAX_BODY = web.AppKey("max_body", int)


@web.middleware
async def refuse_oversized(request: web.Request, handler: Handler) -> web.StreamResponse:
    """A body announced (Content-Length) over HTTP_MAX_BODY_BYTES: 413 before a byte of
    it is read, not once it has all come or FRAME_TIMEOUT has run out."""
    limit = request.app[MAX_BODY]
    if (size := request.content_length) is not None and size > limit:
        raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=size)
    return await handler(request)


async def read_json(request: web.Request, optional: bool = False) -> Any:
    """The request's JSON body: 415 unless application/json, 400 unless valid JSON (or
    nested past the parser's recursion limit), 408 unless it all arrives within
    FRAME_TIMEOUT; HTTP_MAX_BODY_BYTES (413) is aiohttp's client_max_size. `optional`:
    no body at all is None (a receive's defaults, as for a `pull` frame with no content)."""
    if optional and not request.body_exists:
        return None
    if request.content_type != "application/json":
        raise ApiError(415, "send Content-Type: application/json")
    encoding = request.headers.get(hdrs.CONTENT_ENCODING, "identity").strip().lower()
    if encoding not in BODY_ENCODINGS:  # (aiohttp would read an unknown one as none)
        raise ApiError(415, "Content-Encoding: send gzip, deflate or none")
    timeout = request.app[BODY_TIMEOUT]
    try:
        async with asyncio.timeout(timeout):
            body = await request.read()
    except TimeoutError:
        log.info("http body not complete within FRAME_TIMEOUT", peer=request.remote)
        raise ApiError(408, f"body not complete within FRAME_TIMEOUT ({timeout:g} s)") from None
    except ConnectionError:
        # The client went away mid-body: nobody hears the answer, nothing to log loudly.
        log.debug("http client gone before its body was complete", peer=request.remote)
        raise ApiError(400, "connection lost before the body was complete") from None
    except web.RequestPayloadError:
        raise ApiError(400, "body is malformed (chunked framing or Content-Encoding)") from None
    try:
        return parse_json(body)
    except ValueError as exc:
        raise ApiError(400, f"body {exc}") from None


def path_app(request: web.Request) -> str:
    """The app of a `/v1/apps/{app}/...` path, decoded here: yarl leaves an escape it
    cannot decode as UTF-8 as it was, so `a%FF` would name the app `a%FF`, which `a%25FF`
    names too. ApiError 400 unless an app id (app_id)."""
    segment = request.raw_path.partition("?")[0].split("/")[3]
    try:
        app = unquote_to_bytes(segment).decode("utf-8")
    except UnicodeDecodeError:
        raise ApiError(400, "appid is not UTF-8 text") from None
    return app_id(app)


def app_id(value: str, name: str = "appid") -> str:
    """`value` as an app id (of the path, or a body's field `name`); ApiError 400 unless
    one (a JSON string may hold a lone surrogate, which is no text)."""
    if (why := bad_app(value)) is not None:
        raise ApiError(400, f"{name} {why}")
    return value


class Producer:
    def __init__(self, settings: Settings, enqueuer: Enqueuer, tokens: Tokens | None) -> None:
        self.settings = settings
        self.enqueuer = enqueuer
        self.tokens = tokens

    async def handle(self, request: web.Request) -> web.Response:
        app = path_app(request)
        authorize(self.tokens, request, "produce", app)
        raw = await read_json(request)
        batch = isinstance(raw, dict) and "messages" in raw
        try:
            if batch:
                messages = MessageBatch.model_validate(raw).messages
            else:
                messages = [OutgoingMessage.model_validate(raw)]
        except ValidationError as exc:
            raise ApiError(400, field_errors(exc)) from None
        if len(messages) > self.settings.http_max_batch:
            raise ApiError(
                413, f"{len(messages)} messages: at most {self.settings.http_max_batch} a batch"
            )
        routes = self.enqueuer.routes
        if any(m.mandatory for m in messages) and routes is not None and not routes.routable(app):
            raise ApiError(422, unroutable_reason(app))
        stored = await self._store(
            app, [self._new(app, m, i, batch) for i, m in enumerate(messages)]
        )
        if not batch:
            return web.json_response(stored[0].model_dump())
        return web.json_response(BatchResult(results=stored).model_dump())

    def _new(self, app: str, m: OutgoingMessage, index: int, batch: bool) -> NewMessage:
        where = f"messages.{index}." if batch else ""
        if m.msgid is not None and (why := bad_id(m.msgid)) is not None:
            raise ApiError(400, f"{where}msgid {why}")
        if m.encoding == "base64":
            try:
                content = base64.b64decode(m.content, validate=True)
            except (binascii.Error, ValueError):
                raise ApiError(400, f"{where}content: not valid base64") from None
        elif not is_text(m.content):
            raise ApiError(
                400,
                f"{where}content: holds a lone surrogate (not Unicode text; send bytes as base64)",
            )
        else:
            content = m.content.encode("utf-8")
        if len(content) > (limit := self.settings.max_content_bytes):
            raise ApiError(
                413,
                f"{where}content: {len(content)} bytes, over {limit} "
                "(MAX_FRAME_BYTES less the push's fields)",
            )
        if m.key and (why := bad_id(m.key)) is not None:
            raise ApiError(400, f"{where}key {why}")
        if m.key and m.kind != "queue":
            raise ApiError(400, f"{where}key: ordered delivery applies to queue messages only")
        msgid = m.msgid or uuid.uuid4().hex
        now = now_ms()
        if (why := bad_timing(self.settings, now, m.delay, 0, m.ttl)) is not None:
            raise ApiError(400, f"{where}{why}")
        due = now + m.delay if m.delay else 0
        ttl = self.settings.app_ttl(app) if m.ttl is None else m.ttl
        return NewMessage(msgid, m.kind, content, due, now + ttl if ttl else 0, m.key)

    async def _store(self, app: str, messages: list[NewMessage]) -> list[StoreResult]:
        """Stored through the enqueue worker; 503 when the batch is not acknowledged (the
        store did not answer in time, or its disk is nearly full)."""
        batch = EnqueueBatch()
        for m in messages:
            batch.add(app, m)
        try:
            async with asyncio.timeout(self.settings.store_timeout):
                await self.enqueuer.room()
            self.enqueuer.submit(batch)
            # The enqueuer answers every batch within STORE_TIMEOUT; the bound is a guard.
            async with asyncio.timeout(self.settings.store_timeout + 1):
                stored = (await batch.future)[app]
        except TimeoutError:
            stored = UNAVAILABLE
        if isinstance(stored, str):
            raise ApiError(503, stored, {"Retry-After": "1"})
        return [
            StoreResult(msgid=m.msgid, status="stored" if ok else "duplicate")
            for m, ok in zip(messages, stored, strict=True)
        ]
