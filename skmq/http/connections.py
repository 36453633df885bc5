"""GET /v1/connections (docs/HTTP.md), for operators: the producers, push links and pull
polls of every live broker, as their broker notes list them (skmq/connections.py). A
token with the admin role for some apps only sees the connections of those apps."""

from __future__ import annotations

from typing import Literal

from aiohttp import web
from pydantic import BaseModel, Field

from skmq.auth import Tokens
from skmq.clock import now_ms
from skmq.connections import live_connections, visible
from skmq.http.bearer import role_apps
from skmq.store import Store


class ConnectionRow(BaseModel):
    broker: str = Field(description="the broker's id")
    peer: str = Field(description="host:port of the other end")
    role: Literal["producer", "recipient push link", "pull consumer", "http"]
    apps: list[str]
    since_s: float = Field(description="seconds since it took this role")


class ConnectionList(BaseModel):
    connections: list[ConnectionRow]
    truncated: int = Field(description="connections the brokers' notes left out (a cap each)")


class ConnectionRoutes:
    def __init__(self, store: Store, tokens: Tokens | None) -> None:
        self.store = store
        self.tokens = tokens

    def add_to(self, app: web.Application) -> None:
        app.router.add_get("/v1/connections", self.list_connections)

    async def list_connections(self, request: web.Request) -> web.Response:
        allowed, _ = role_apps(self.tokens, request, "admin")
        rows, truncated = live_connections(await self.store.brokers(), now_ms())
        rows = visible(rows, allowed)
        listed = ConnectionList.model_validate({"connections": rows, "truncated": truncated})
        return web.json_response(listed.model_dump())


MODELS = (ConnectionRow, ConnectionList)
