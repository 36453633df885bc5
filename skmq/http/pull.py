"""Consumer groups and pull consumption over HTTP (docs/HTTP.md): create, list, reset
and delete groups; receive (with a long poll), ack, nack and extend by receipt."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar

from aiohttp import web
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError
from pydantic_core import PydanticCustomError

from skmq import tracing
from skmq.auth import Role, Tokens
from skmq.clock import now_ms
from skmq.config import Settings
from skmq.connections import Connections, peer_address
from skmq.deliverylog import DeliveryLog
from skmq.events import GROUP_PREFIX, Event
from skmq.http.bearer import authorize
from skmq.http.errors import ApiError
from skmq.http.produce import field_errors, path_app, read_json
from skmq.ids import bad_app
from skmq.jsonbody import content_json, dump_json_text
from skmq.pull.groups import (
    Groups,
    NoSuchGroup,
    Pulled,
    Receipt,
    Received,
    bad_group,
    parse_receipt,
)
from skmq.pull.longpoll import LongPoll, TooManyWaiting
from skmq.pull.position import HELP, BadPosition, Position, parse_position

M = TypeVar("M", bound=BaseModel)
Receipts = Annotated[
    list[Annotated[str, Field(max_length=80)]], Field(min_length=1, max_length=1000)
]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


def _position(value: Any) -> Position:
    """A position (skmq/pull/position.py), or a 400 that says what one is."""
    try:
        return parse_position(value)
    except BadPosition as exc:
        raise PydanticCustomError("position", str(exc)) from None


PositionIn = Annotated[str | int, BeforeValidator(_position)]


class NewGroup(_Body):
    group: str = Field(description="1 to 64 letters, digits, '_', '.' or '-'")
    position: PositionIn = Field(
        "latest",
        description=f"where a new group reads from: {HELP}; an existing one stays as it is",
    )


class GroupReset(_Body):
    position: PositionIn = Field(description=HELP)


class ReceiveRequest(_Body):
    max: Annotated[int, Field(ge=1)] = Field(1, description="most messages (PULL_MAX_MESSAGES)")
    wait: Annotated[float, Field(ge=0)] = Field(
        0, description="seconds to wait for a message (long poll; PULL_MAX_WAIT)"
    )
    visibility: Annotated[float, Field(gt=0)] | None = Field(
        None, description="seconds the messages stay hidden (lease); PULL_VISIBILITY if absent"
    )


class AckRequest(_Body):
    receipts: Receipts


class NackRequest(_Body):
    receipts: Receipts
    delay: Annotated[int, Field(ge=0)] | None = Field(
        None, description="ms before the retry; the retry backoff (RETRY_BACKOFF) if absent"
    )


class ExtendRequest(_Body):
    receipts: Receipts
    visibility: Annotated[float, Field(gt=0)] = Field(description="seconds from now")


class PulledMessage(BaseModel):
    receipt: str
    msgid: str
    kind: Literal["queue", "topic"]
    content: str
    encoding: Literal["text", "base64"] = Field(description="base64 when not UTF-8 text")
    attempt: int
    traceparent: str | None = Field(
        None, description="the W3C trace context it was sent with (absent: none)"
    )


class ReceiveResult(BaseModel):
    messages: list[PulledMessage]


class ReceiptResult(BaseModel):
    receipt: str
    status: Literal["acked", "retry", "dead", "extended", "stale"]


class ReceiptResults(BaseModel):
    results: list[ReceiptResult]


class GroupCreated(BaseModel):
    group: str
    created: bool = Field(description="false: the group existed already (answered 200)")


class GroupDeleted(BaseModel):
    group: str
    deleted: Literal[True]


class GroupPosition(BaseModel):
    group: str
    position: Literal["latest", "earliest"] | int = Field(
        description="where the group reads from now (a time: unix ms)"
    )


class GroupState(BaseModel):
    group: str
    backlog: int = Field(description="messages stored for the group, not yet received")
    in_flight: int
    delayed: int
    dead: int
    oldest_age_s: float | None = Field(
        description="seconds since the oldest message the group has not settled was stored "
        "(its dead letters aside); null: none"
    )


class GroupList(BaseModel):
    groups: list[GroupState]


MODELS = (
    NewGroup, GroupReset, ReceiveRequest, AckRequest, NackRequest, ExtendRequest,
    PulledMessage, ReceiveResult, ReceiptResult, ReceiptResults, GroupState, GroupList,
    GroupCreated, GroupDeleted, GroupPosition,
)  # fmt: skip


def _pulled(p: Pulled) -> dict[str, Any]:
    """A PulledMessage as JSON. Built as a dict, not through the model (which documents
    it in the OpenAPI spec): every field comes from the store, valid by construction,
    and a model a message was a fifth of the broker's cost of a pulled message."""
    content, encoding = content_json(p.content)
    out = {
        "receipt": p.receipt, "msgid": p.msgid, "kind": "topic" if p.kind == "topic" else "queue",
        "content": content, "encoding": encoding, "attempt": p.attempt,
    }  # fmt: skip
    if p.trace:
        out["traceparent"] = p.trace
    return out


@dataclass(eq=False)
class PullApi:
    """The group and pull operations behind the HTTP routes (PullRoutes, below) and the
    TCP protocol's `pull` frame (skmq/handler.py): a JSON body in, a JSON-able answer
    out, ApiError (with the HTTP status that fits) for a refusal. Authorization is the
    caller's: it knows how the peer proved who it is."""

    #: The operations a `pull` frame may ask for (the consume role's; reset and delete
    #: are the admin's, over HTTP and `skmq groups`).
    FRAME_OPS = frozenset({"create", "receive", "ack", "nack", "extend"})

    settings: Settings
    groups: Groups
    longpoll: LongPoll
    dlog: DeliveryLog
    # Told of each group made (the app has somewhere to deliver: skmq/workers/routes.py).
    on_group: Callable[[str], None] = lambda app: None
    # The time an ack is judged by (skmq/stall.py: a woken broker's pause is not the
    # consumer's; StallWatch.answered_ms)
    answered_ms: Callable[[], int] = now_ms

    async def call(
        self,
        op: str,
        app: str,
        group: str,
        raw: Any,
        who: str = "",
        gone: asyncio.Event | None = None,
    ) -> dict[str, Any]:
        """One of FRAME_OPS for `app` and `group` (both checked here), for consumer `who`
        (its token's name or its address: in the delivery log); a receive waits no longer
        once `gone` is set (its connection ended)."""
        if op not in self.FRAME_OPS:
            raise ApiError(400, f"op must be one of {', '.join(sorted(self.FRAME_OPS))}")
        if (why := bad_app(app)) is not None:
            raise ApiError(400, f"appid {why}")
        group = self.group_name(group)
        if op == "create":  # the frame's group field names it; a body is not needed
            return (await self.create(app, self._frame_group(group, raw)))[1]
        try:
            if op == "receive":  # no content: every field of ReceiveRequest as its default
                return await self.receive(app, group, {} if raw is None else raw, who, gone)
            calls = {"ack": self.ack, "nack": self.nack, "extend": self.extend}
            return await calls[op](app, group, raw)
        except NoSuchGroup:
            raise self.no_such_group(app, group) from None

    @staticmethod
    def no_such_group(app: str, group: str) -> ApiError:
        return ApiError(404, f"no group {group!r} for app {app!r}")

    @staticmethod
    def group_name(name: str) -> str:
        if (why := bad_group(name)) is not None:
            raise ApiError(400, f"group {why}")
        return name

    @staticmethod
    def _frame_group(group: str, raw: Any) -> Any:
        """A `create` frame's body: its content (none: {}) with the frame's group."""
        if raw is None:
            return {"group": group}
        if isinstance(raw, dict) and raw.get("group", group) == group:
            return {**raw, "group": group}
        raise ApiError(400, "content: a JSON object, its group (if any) the frame's")

    @staticmethod
    async def _started(start: Awaitable[bool]) -> bool:
        """A create or reset (a position after the store's clock: 400)."""
        try:
            return await start
        except BadPosition as exc:
            raise ApiError(400, f"position: {exc}") from None

    @staticmethod
    def _body(raw: Any, model: type[M]) -> M:
        try:
            return model.model_validate(raw)
        except ValidationError as exc:
            raise ApiError(400, field_errors(exc)) from None

    @staticmethod
    def _receipts(receipts: list[str]) -> list[Receipt]:
        parsed = []
        for receipt in receipts:
            one = parse_receipt(receipt)
            if one is None:
                raise ApiError(400, f"not a receipt: {receipt[:64]!r}")
            parsed.append(one)
        return parsed

    def _lease_ms(self, seconds: float | None) -> int:
        seconds = self.settings.pull_visibility if seconds is None else seconds
        if seconds > self.settings.pull_max_visibility:
            raise ApiError(400, f"visibility: at most {self.settings.pull_max_visibility:g} s")
        return max(1, int(seconds * 1000))

    async def _log_settled(
        self,
        app: str,
        group: str,
        receipts: list[str],
        parsed: list[Receipt],
        attempts: list[int],
        outcomes: list[list[tuple[Event, str]]],
    ) -> None:
        """The delivery log's lines of settled receipts: outcomes[i], (event, detail) each,
        for receipt i (none: refused) of attempts[i]. The msgids come from the group log."""
        if not any(outcomes):
            return
        entries = await self.groups.settled_entries(app, group, [e for e, _, _ in parsed])
        who = GROUP_PREFIX + group
        for receipt, attempt, (msgid, kind), lines in zip(
            receipts, attempts, entries, outcomes, strict=True
        ):
            for event, detail in lines:
                self.dlog.event(event, msgid, app, kind, who, attempt, f"{detail}receipt {receipt}")

    def _ended(self, app: str, group: str, got: Received) -> None:
        """Log what a receive ended: entries whose TTL ran out before the group handed
        them out, and leases that ran out (a timed-out attempt: retried, or dead on its
        last, as a push's)."""
        who = GROUP_PREFIX + group
        for p in got.expired:
            self.dlog.expired(p.msgid, app, p.kind, who, p.attempt, p.content == b"dead")
        for p in got.ran_out:
            receipt = f"receipt {p.receipt}"
            self.dlog.event(Event.TIMEOUT, p.msgid, app, p.kind, who, p.attempt,
                            f"lease ran out; {receipt}")  # fmt: skip
            if p.content == b"dead":
                event = Event.DEAD_LETTERED
                detail = f"after {p.attempt} attempts; last: timeout; {receipt}"
            else:
                event = Event.RETRY_SCHEDULED
                detail = f"next attempt at {int(p.content)}; {receipt}"
            self.dlog.event(event, p.msgid, app, p.kind, who, p.attempt, detail)

    @staticmethod
    def _results(receipts: list[str], statuses: list[str]) -> dict[str, Any]:
        """A ReceiptResults as JSON (a dict, as _pulled's, for the same reason)."""
        pairs = zip(receipts, statuses, strict=True)
        return {"results": [{"receipt": r, "status": s} for r, s in pairs]}

    # -- groups -------------------------------------------------------------
    async def list_groups(self, app: str) -> dict[str, Any]:
        infos = await self.groups.describe(app)
        now = now_ms()
        states = [
            GroupState(group=i.name, backlog=i.backlog, in_flight=i.in_flight,
                       delayed=i.delayed, dead=i.dead, oldest_age_s=i.oldest_age_s(now))
            for i in infos
        ]  # fmt: skip
        return GroupList(groups=states).model_dump()

    async def create(self, app: str, raw: Any) -> tuple[bool, dict[str, Any]]:
        """(created, answer): False when the group existed already."""
        body = self._body(raw, NewGroup)
        group, position = self.group_name(body.group), parse_position(body.position)
        created = await self._started(self.groups.create(app, group, position))
        self.on_group(app)
        return created, GroupCreated(group=group, created=created).model_dump()

    async def delete(self, app: str, group: str) -> dict[str, Any]:
        if not await self.groups.delete(app, group):
            raise self.no_such_group(app, group)
        return GroupDeleted(group=group, deleted=True).model_dump()

    async def reset(self, app: str, group: str, raw: Any) -> dict[str, Any]:
        position = parse_position(self._body(raw, GroupReset).position)  # (checked: typed)
        if not await self._started(self.groups.reset(app, group, position)):
            raise self.no_such_group(app, group)
        return GroupPosition(group=group, position=position).model_dump()

    # -- pull ---------------------------------------------------------------
    async def receive(
        self, app: str, group: str, raw: Any, who: str = "", gone: asyncio.Event | None = None
    ) -> dict[str, Any]:
        body = self._body(raw, ReceiveRequest)
        s = self.settings
        if body.max > s.pull_max_messages:
            raise ApiError(400, f"max: at most {s.pull_max_messages} (PULL_MAX_MESSAGES)")
        if body.wait > s.pull_max_wait:
            raise ApiError(400, f"wait: at most {s.pull_max_wait:g} s (PULL_MAX_WAIT)")
        lease = self._lease_ms(body.visibility)
        try:
            ended = functools.partial(self._ended, app, group)
            got = await self.longpoll.receive(app, group, body.max, body.wait, lease, ended, gone)
        except TooManyWaiting as exc:
            raise ApiError(503, str(exc), {"Retry-After": "1"}) from None
        by = f"pulled by {who}; " if who else "pulled; "
        for p in got:
            self.dlog.event(Event.PUSHED, p.msgid, app, p.kind, GROUP_PREFIX + group, p.attempt,
                            f"{by}receipt {p.receipt}")  # fmt: skip
            if p.trace and tracing.tracer is not None:
                span = tracing.start("pull", p.trace, app, p.msgid, **{tracing.GROUP: group})
                p.trace = tracing.traceparent(span)  # (the consumer's receive: its child)
                span.end()
        return {"messages": [_pulled(p) for p in got]}  # (a ReceiveResult)

    async def ack(self, app: str, group: str, raw: Any) -> dict[str, Any]:
        body = self._body(raw, AckRequest)
        parsed = self._receipts(body.receipts)
        done = await self.groups.ack(app, group, parsed, self.answered_ms())
        logged = [[(Event.ACKED, "")] if ok else [] for ok in done]
        await self._log_settled(app, group, body.receipts, parsed, done, logged)
        return self._results(body.receipts, ["acked" if ok else "stale" for ok in done])

    async def nack(self, app: str, group: str, raw: Any) -> dict[str, Any]:
        body = self._body(raw, NackRequest)
        if body.delay is not None and body.delay > self.settings.max_delay:
            raise ApiError(400, f"delay: at most {self.settings.max_delay} ms (MAX_DELAY)")
        wait = -1 if body.delay is None else body.delay
        parsed = self._receipts(body.receipts)
        codes = await self.groups.nack(app, group, [(*r, wait) for r in parsed], now_ms())
        logged: list[list[tuple[Event, str]]] = []
        for code, due, attempt in codes:
            then = {
                1: (Event.RETRY_SCHEDULED, f"next attempt at {due}; "),
                2: (Event.DEAD_LETTERED, f"after {attempt} attempts; last: errored; "),
            }
            logged.append([(Event.ERRORED, "nack; "), then[code]] if code else [])
        attempts = [attempt for _, _, attempt in codes]
        await self._log_settled(app, group, body.receipts, parsed, attempts, logged)
        names = {0: "stale", 1: "retry", 2: "dead"}
        return self._results(body.receipts, [names[code] for code, _, _ in codes])

    async def extend(self, app: str, group: str, raw: Any) -> dict[str, Any]:
        body = self._body(raw, ExtendRequest)
        lease = self._lease_ms(body.visibility)
        parsed = self._receipts(body.receipts)
        done = await self.groups.extend(app, group, [(*r, lease) for r in parsed], now_ms())
        logged = [[(Event.EXTENDED, f"lease {lease} ms; ")] if ok else [] for ok in done]
        await self._log_settled(app, group, body.receipts, parsed, done, logged)
        return self._results(body.receipts, ["extended" if ok else "stale" for ok in done])


class PullRoutes:
    """The HTTP routes of PullApi: path parameters, Bearer tokens, JSON bodies."""

    def __init__(self, api: PullApi, tokens: Tokens | None, connections: Connections) -> None:
        self.api = api
        self.tokens = tokens
        self.connections = connections  # (lists the long polls waiting: skmq connections)

    def add_to(self, app: web.Application) -> None:
        r = app.router
        r.add_get("/v1/apps/{app}/groups", self.list_groups)
        r.add_post("/v1/apps/{app}/groups", self.create)
        r.add_delete("/v1/apps/{app}/groups/{group}", self.delete)
        r.add_post("/v1/apps/{app}/groups/{group}/reset", self.reset)
        for verb in ("receive", "ack", "nack", "extend"):
            r.add_post(f"/v1/apps/{{app}}/groups/{{group}}/{verb}", self.pull)

    def _app(self, request: web.Request, role: Role) -> str:
        return self._caller(request, role)[0]

    def _caller(self, request: web.Request, role: Role) -> tuple[str, str]:
        """The app of the path, and who asks (its token's name, else its address: for the
        delivery log); ApiError unless it may act as `role` for the app."""
        app = path_app(request)
        who = authorize(self.tokens, request, role, app)
        return app, who or str(request.remote or "")

    def _group(self, request: web.Request) -> str:
        return self.api.group_name(request.match_info["group"])

    async def list_groups(self, request: web.Request) -> web.Response:
        return web.json_response(await self.api.list_groups(self._app(request, "consume")))

    async def create(self, request: web.Request) -> web.Response:
        app = self._app(request, "consume")
        created, answer = await self.api.create(app, await read_json(request))
        return web.json_response(answer, status=201 if created else 200)

    async def delete(self, request: web.Request) -> web.Response:
        app = self._app(request, "admin")
        return web.json_response(await self.api.delete(app, self._group(request)))

    async def reset(self, request: web.Request) -> web.Response:
        app = self._app(request, "admin")
        group = self._group(request)
        return web.json_response(await self.api.reset(app, group, await read_json(request)))

    async def pull(self, request: web.Request) -> web.Response:
        """receive, ack, nack and extend: the verb is the path's last part."""
        app, who = self._caller(request, "consume")
        group = self._group(request)
        verb = request.path.rsplit("/", 1)[1]
        raw = await read_json(request, optional=verb == "receive")
        if verb != "receive":
            answer = await self.api.call(verb, app, group, raw, who)
        else:
            with self.connections.polling(peer_address(request.transport), app):
                answer = await self.api.call(verb, app, group, raw, who)
        return web.json_response(answer, dumps=dump_json_text)
