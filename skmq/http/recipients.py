"""The registered recipients over HTTP (docs/HTTP.md), for operators: list them, and remove
one gone for good as an `unregister` would (skmq/registry/recipients.py). Every route needs
the admin role (for the app, or for each app listed); a removal is logged, naming the
token."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Literal

from aiohttp import web
from pydantic import BaseModel, Field

from skmq.auth import Tokens
from skmq.clock import now_ms
from skmq.deliverylog import DeliveryLog
from skmq.http.bearer import authorize, role_apps
from skmq.http.errors import ApiError
from skmq.http.produce import app_id, path_app
from skmq.registry.recipients import recipient_rows, remove_recipient
from skmq.registry.registration import CONTROL, MAX_ID
from skmq.store import Store


class RecipientInfo(BaseModel):
    app: str
    id: str
    address: str = Field(description="host:port the broker pushes to")
    weight: int
    state: Literal["alive", "lost"]
    last_seen_age_s: float | None = Field(
        description="seconds since its last heartbeat or registration (null: never)"
    )


class RecipientList(BaseModel):
    recipients: list[RecipientInfo]


class RecipientRemoved(BaseModel):
    app: str
    id: str
    removed: bool = Field(description="false: it was not registered")


class RecipientRoutes:
    def __init__(
        self,
        store: Store,
        dlog: DeliveryLog,
        tokens: Tokens | None,
        unregister: Callable[[str, str], Awaitable[bool]],
    ) -> None:
        self.store = store
        self.dlog = dlog
        self.tokens = tokens
        self.unregister = unregister  # the broker's registry's: its view follows at once

    def add_to(self, app: web.Application) -> None:
        app.router.add_get("/v1/recipients", self.list_recipients)
        app.router.add_delete("/v1/apps/{app}/recipients/{id}", self.remove)

    async def list_recipients(self, request: web.Request) -> web.Response:
        wanted = request.query.get("app")
        if wanted is not None:
            authorize(self.tokens, request, "admin", app_id(wanted, "app"))
            apps = [wanted]
        else:
            allowed, _ = role_apps(self.tokens, request, "admin")
            apps = [a for a in await self.store.apps() if allowed is None or a in allowed]
        rows = recipient_rows(await self.store.recipients(apps), now_ms())
        listed = RecipientList.model_validate({"recipients": rows})
        return web.json_response(listed.model_dump())

    async def remove(self, request: web.Request) -> web.Response:
        app = path_app(request)
        principal = authorize(self.tokens, request, "admin", app)
        rid = request.match_info["id"]
        if len(rid) > MAX_ID or CONTROL.search(rid):
            raise ApiError(400, f"id must be at most {MAX_ID} printable characters")
        removed = await remove_recipient(
            self.unregister, self.dlog, app, rid, f"{principal or 'anonymous'} via http"
        )
        answer = RecipientRemoved(app=app, id=rid, removed=removed)
        return web.json_response(answer.model_dump())


MODELS = (RecipientInfo, RecipientList, RecipientRemoved)
