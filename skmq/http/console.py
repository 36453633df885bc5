"""The operator's console over HTTP (docs/HTTP.md): the apps at a glance, a look at an
app's waiting messages or dead letters, and a purge of its waiting messages, as `skmq
apps|peek|purge` do (skmq/console.py). Every route needs the admin role (GET /v1/apps
lists the apps the token is admin of); a purge is logged, naming the token."""

from __future__ import annotations

from typing import Annotated

import structlog
from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from skmq.auth import Tokens
from skmq.clock import now_ms
from skmq.console import PEEK_MAX, dead_json, overview, purge, waiting_json
from skmq.deliverylog import DeliveryLog
from skmq.http.bearer import authorize, role_apps
from skmq.http.errors import ApiError
from skmq.http.produce import field_errors, path_app, read_json
from skmq.queue.owned_store import OwnedStore

log = structlog.get_logger("skmq.console")


class Recipients(BaseModel):
    alive: int
    lost: int


class AppInfo(BaseModel):
    app: str
    pending: int
    delayed: int
    in_flight: int
    dead: int
    oldest_pending_age_s: float | None = Field(description="seconds; null: none pending")
    recipients: Recipients
    groups: int = Field(description="consumer groups")
    rate_in: float = Field(description="messages stored a second, over the last minute")
    rate_out: float = Field(description="deliveries acked a second, over the last minute")
    unroutable: int = Field(
        description="messages stored while the app had no recipient and no consumer group"
    )


class AppList(BaseModel):
    apps: list[AppInfo]


class MessageInfo(BaseModel):
    msgid: str
    age_s: float = Field(description="seconds since it was stored")
    attempts: int
    key: str | None = Field(description="its ordering key")
    size: int = Field(description="of its content, bytes")
    preview: str = Field(
        description="its first 64 bytes: UTF-8 kept, other bytes \\xNN, controls escaped"
    )


class MessageList(BaseModel):
    messages: list[MessageInfo]


class PurgeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    older_than_s: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = Field(
        None, description="only messages stored at least this long ago"
    )
    max: Annotated[int, Field(ge=1)] | None = Field(None, description="at most N, oldest first")
    dry_run: bool = Field(False, description="say what would be purged, change nothing")


class PurgeResult(BaseModel):
    app: str
    purged: int = Field(description="how many were purged (on a dry run: would be)")
    dry_run: bool
    msgids: list[str] = Field(description="oldest first (a topic copy: its message's msgid)")


class ConsoleRoutes:
    def __init__(self, store: OwnedStore, dlog: DeliveryLog, tokens: Tokens | None) -> None:
        self.store = store
        self.dlog = dlog
        self.tokens = tokens

    def add_to(self, app: web.Application) -> None:
        app.router.add_get("/v1/apps", self.apps)
        app.router.add_get("/v1/apps/{app}/messages", self.peek)
        app.router.add_post("/v1/apps/{app}/purge", self.purge)

    async def apps(self, request: web.Request) -> web.Response:
        only, _ = role_apps(self.tokens, request, "admin")
        listed = AppList.model_validate({"apps": await overview(self.store, only, now_ms())})
        return web.json_response(listed.model_dump())

    async def peek(self, request: web.Request) -> web.Response:
        app = path_app(request)
        authorize(self.tokens, request, "admin", app)
        raw = request.query.get("max", "100")
        if not (raw.isascii() and raw.isdigit()) or not 1 <= int(raw) <= PEEK_MAX:
            raise ApiError(400, f"max: a whole number from 1 to {PEEK_MAX}")
        dead = request.query.get("dead", "0")
        if dead not in ("0", "1"):
            raise ApiError(400, "dead: 0 or 1")
        now = now_ms()
        if dead == "1":
            found = [dead_json(d, now) for d in await self.store.dead_letters(app, int(raw))]
        else:
            found = [waiting_json(w, now) for w in await self.store.peek(app, int(raw), now)]
        listed = MessageList.model_validate({"messages": found})
        return web.json_response(listed.model_dump())

    async def purge(self, request: web.Request) -> web.Response:
        app = path_app(request)
        principal = authorize(self.tokens, request, "admin", app)
        try:
            body = PurgeRequest.model_validate(await read_json(request))
        except ValidationError as exc:
            raise ApiError(400, field_errors(exc)) from None
        who = f"token {principal}" if principal else "http, auth off"
        purged = await purge(self.store, self.dlog, app, body.older_than_s, body.max,
                             body.dry_run, who, now_ms())  # fmt: skip
        if not body.dry_run:
            log.info("operator action", action="purge", via="http", principal=principal,
                     app=app, done=len(purged))  # fmt: skip
        result = PurgeResult(
            app=app, purged=len(purged), dry_run=body.dry_run, msgids=[p.msgid for p in purged]
        )
        return web.json_response(result.model_dump())


MODELS = (Recipients, AppInfo, AppList, MessageInfo, MessageList, PurgeRequest, PurgeResult)
