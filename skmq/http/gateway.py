"""The HTTP gateway on aiohttp: produce, /metrics, /healthz, /openapi.json and the web
console (/ui/) on HOST:HTTP_PORT, and /metrics and /healthz alone on
METRICS_HOST:METRICS_PORT."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Protocol

from aiohttp import web
from prometheus_client import generate_latest
from redis.exceptions import RedisError

from skmq.admission import Admission
from skmq.auth import Tokens
from skmq.config import Settings
from skmq.http import ui
from skmq.http.console import ConsoleRoutes
from skmq.http.dlq import DlqRoutes
from skmq.http.errors import json_errors
from skmq.http.guard import CountedSite, ServerLog
from skmq.http.openapi import document
from skmq.http.produce import BODY_TIMEOUT, MAX_BODY, Producer, refuse_oversized
from skmq.http.pull import PullRoutes
from skmq.metrics import Metrics
from skmq.workers.enqueue import Enqueuer

PROMETHEUS_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Mountable(Protocol):
    """Routes that add themselves to the gateway's application."""

    def add_to(self, app: web.Application) -> None: ...


class Gateway:
    def __init__(
        self,
        settings: Settings,
        metrics: Metrics,
        enqueuer: Enqueuer,
        pull: PullRoutes,
        dlq: DlqRoutes,
        console: ConsoleRoutes,
        tokens: Tokens | None,
        admission: Admission | None = None,
        operator: Sequence[Mountable] = (),
    ) -> None:
        self.settings = settings
        self.admission = admission if admission is not None else Admission(settings)
        self.metrics = metrics
        self.producer = Producer(settings, enqueuer, tokens)
        self.pull = pull
        self.dlq = dlq
        self.console = console
        self.operator = operator  # further routes for operators (recipients, connections)
        self._openapi = document()
        self._runners: list[web.AppRunner] = []
        self.port: int | None = None

    # -- routes ---------------------------------------------------------------
    async def _metrics(self, request: web.Request) -> web.Response:
        with contextlib.suppress(RedisError, OSError, TimeoutError):
            await self.metrics.refresh()
        body = generate_latest(self.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": PROMETHEUS_TYPE})

    async def _healthz(self, request: web.Request) -> web.Response:
        ok, why = await self.metrics.health()
        return web.Response(text=why + "\n", status=200 if ok else 503)

    async def _openapi_json(self, request: web.Request) -> web.Response:
        return web.json_response(self._openapi)

    def _app(self, *, full: bool) -> web.Application:
        max_body = self.settings.http_max_body_bytes
        app = web.Application(middlewares=[json_errors, refuse_oversized], client_max_size=max_body)
        app[BODY_TIMEOUT] = self.settings.frame_timeout
        app[MAX_BODY] = max_body
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/healthz", self._healthz)
        if full:
            app.router.add_get("/openapi.json", self._openapi_json)
            app.router.add_post("/v1/apps/{app}/messages", self.producer.handle)
            self.pull.add_to(app)
            self.dlq.add_to(app)
            ui.add_to(app)
            self.console.add_to(app)
            for routes in self.operator:
                routes.add_to(app)
        return app

    # -- serving --------------------------------------------------------------
    async def _serve(self, app: web.Application, host: str, port: int) -> int:
        s = self.settings
        runner = web.AppRunner(
            app,
            access_log=None,
            logger=ServerLog(),
            handle_signals=False,
            shutdown_timeout=1.0,
            # aiohttp closes a connection whose next request's headers have not all come
            # within this of its opening or of its last answer: both the idle keep-alive
            # bound and the headers' FRAME_TIMEOUT (a long poll is an answer being made,
            # not waited for, so it is not cut). The body's bound is read_json's.
            keepalive_timeout=min(s.frame_timeout, s.idle_timeout),
            # A client that hangs up ends its request: a long poll waiting for it must
            # not take a message for nobody (leased until its visibility runs out).
            handler_cancellation=True,
        )
        await runner.setup()
        self._runners.append(runner)
        site = CountedSite(runner, host, port, self.admission)
        await site.start()
        bound: int = runner.addresses[-1][1]
        return bound

    async def serve(self, host: str, port: int) -> None:
        """The whole gateway (HTTP_PORT)."""
        self.port = await self._serve(self._app(full=True), host, port)

    async def serve_health(self, host: str, port: int) -> None:
        """Only /metrics and /healthz (METRICS_PORT)."""
        await self._serve(self._app(full=False), host, port)

    async def close(self) -> None:
        for runner in self._runners:
            await runner.cleanup()
        self._runners.clear()
