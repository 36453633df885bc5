"""The dead-letter queue over HTTP (docs/HTTP.md), for operators: list, and replay or
purge with the filters of `skmq dlq` (skmq/dlq.py). Every route needs the admin role
for the app; every replay and purge is logged, naming the token."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import structlog
from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from skmq.auth import Tokens
from skmq.deliverylog import DeliveryLog
from skmq.dlq import (
    DeadLetters,
    Filters,
    UnknownDeadLetter,
    Verb,
    choose,
    dead_letters_of,
    redrive,
)
from skmq.http.bearer import authorize
from skmq.http.errors import ApiError
from skmq.http.produce import app_id, field_errors, path_app, read_json
from skmq.pull.groups import bad_group
from skmq.queue.owned_store import OwnedStore

log = structlog.get_logger("skmq.dlq")
Ms = Annotated[int, Field(ge=0, description="unix ms")]


class DlqRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    msgids: list[Annotated[str, Field(max_length=256)]] | None = Field(
        None,
        min_length=1,
        max_length=10_000,
        description="only these (absent: every dead letter of the app)",
    )
    reason: str | None = Field(None, max_length=256, description="text of the last error")
    since: Ms | None = Field(None, description="died at or after (unix ms)")
    until: Ms | None = Field(None, description="died before (unix ms)")
    max: Annotated[int, Field(ge=1)] | None = Field(None, description="at most N, oldest first")
    dry_run: bool = Field(False, description="say what would be done, change nothing")
    to_app: str | None = Field(None, description="replay only: into this app, as new messages")
    group: str | None = Field(
        None, description="the dead letters of this consumer group (absent: of the pushes)"
    )


class DlqResult(BaseModel):
    action: Literal["replay", "purge"]
    dry_run: bool
    selected: list[str] = Field(description="msgids selected by the request, oldest first")
    done: int = Field(description="how many were replayed or purged (0 on a dry run)")


class DeadLetterInfo(BaseModel):
    appid: str
    msgid: str
    kind: Literal["queue", "topic"]
    recipient: str | None = Field(
        description="the recipient of a topic copy; `group:<name>` for a group's"
    )
    content: str = Field(description="the content: text, or base64 (encoding)")
    attempts: int
    last_error: str
    history: list[str]
    died_at: int = Field(description="unix ms")
    stored_at: int = Field(description="unix ms")
    encoding: Literal["text", "base64"] = Field(description="base64 when not UTF-8 text")


class DeadLetterList(BaseModel):
    dead_letters: list[DeadLetterInfo]


class DlqRoutes:
    def __init__(self, store: OwnedStore, dlog: DeliveryLog, tokens: Tokens | None) -> None:
        self.store = store
        self.dlog = dlog
        self.tokens = tokens

    def add_to(self, app: web.Application) -> None:
        app.router.add_get("/v1/apps/{app}/dlq", self.list_letters)
        app.router.add_post("/v1/apps/{app}/dlq/replay", self.replay)
        app.router.add_post("/v1/apps/{app}/dlq/purge", self.purge)

    def _app(self, request: web.Request, name: str | None = None) -> tuple[str, str]:
        if name is None:
            app = path_app(request)
        else:
            app = app_id(name, "to_app")
        return app, authorize(self.tokens, request, "admin", app)

    def _letters(self, group: str | None) -> DeadLetters:
        """The app's dead letters, or those of its consumer group `group`."""
        if group is not None and (why := bad_group(group)) is not None:
            raise ApiError(400, f"group {why}")
        return dead_letters_of(self.store, group)

    async def list_letters(self, request: web.Request) -> web.Response:
        app, _ = self._app(request)
        raw = request.query.get("limit", "1000")
        if not (raw.isascii() and raw.isdigit()) or not 1 <= int(raw) <= 100_000:
            raise ApiError(400, "limit: a whole number from 1 to 100000")
        letters = await self._letters(request.query.get("group")).dead_letters(app, int(raw))
        listed = DeadLetterList.model_validate({"dead_letters": [d.as_json() for d in letters]})
        return web.json_response(listed.model_dump())

    async def replay(self, request: web.Request) -> web.Response:
        return await self._redrive(request, "replay")

    async def purge(self, request: web.Request) -> web.Response:
        return await self._redrive(request, "purge")

    async def _redrive(self, request: web.Request, verb: Verb) -> web.Response:
        app, principal = self._app(request)
        try:
            body = DlqRequest.model_validate(await read_json(request))
        except ValidationError as exc:
            raise ApiError(400, field_errors(exc)) from None
        if body.to_app is not None:
            if verb != "replay":
                raise ApiError(400, "to_app: replay only")
            if body.group is not None:
                raise ApiError(400, "to_app: a group's dead letters replay into their group")
            self._app(request, body.to_app)
        letters = self._letters(body.group)
        filters = Filters(body.reason, body.since, body.until, body.max)
        try:
            chosen = choose(await letters.dead_letters(app), body.msgids or (), filters, app)
        except UnknownDeadLetter as exc:
            raise ApiError(404, str(exc)) from None
        done = 0
        if not body.dry_run:
            done = await redrive(letters, self.dlog, verb, chosen, body.to_app)
            log.info("operator action", action=f"dlq {verb}", via="http", principal=principal,
                     app=app, group=body.group, to_app=body.to_app, done=done,
                     selected=len(chosen))  # fmt: skip
        result: dict[str, Any] = DlqResult(
            action=verb, dry_run=body.dry_run, selected=[d.msgid for d in chosen], done=done
        ).model_dump()
        return web.json_response(result)


MODELS = (DlqRequest, DlqResult, DeadLetterInfo, DeadLetterList)
