"""The gateway's listening site: each connection counted against MAX_CONNECTIONS and
MAX_CONNECTIONS_PER_HOST with the broker port's (skmq/admission.py), and refused
beyond them with a 503; and aiohttp's server log, into the broker's.

aiohttp has no connection limits of its own, so the site wraps aiohttp's protocol
(one a connection) in `Counted`, which only counts and forwards; the time limits are
aiohttp's own (the keep-alive timer, see gateway.py) and the body reader's."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
from collections.abc import Callable
from typing import Any, cast

import structlog
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from skmq.admission import LINGER, Admission

log = structlog.get_logger("skmq.http")


def refusal_response(why: str) -> bytes:
    """A whole HTTP answer, written before any request is read: the connection was
    refused, it gets nothing else."""
    body = json.dumps({"error": why}).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\n"
        "Content-Type: application/json; charset=utf-8\r\n"
        f"Content-Length: {len(body)}\r\n"
        "Retry-After: 1\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode() + body


class Counted(asyncio.Protocol):
    """aiohttp's protocol for one connection, made only once the connection is admitted;
    every event is forwarded to it as is."""

    def __init__(self, make: Callable[[], asyncio.Protocol], admission: Admission) -> None:
        self._make = make
        self._admission = admission
        self._inner: asyncio.Protocol | None = None
        self._host: str | None = None
        self._linger: asyncio.TimerHandle | None = None  # refused, lingering (LINGER)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        peer = transport.get_extra_info("peername")
        host = str(peer[0]) if isinstance(peer, tuple) else ""
        why = self._admission.refusal(host)
        if why is not None:
            log.debug("http connection refused", peer=host, reason=why)
            # A transport of a stream socket (uvloop's too, though not a subclass).
            stream = cast(asyncio.WriteTransport, transport)
            stream.write(refusal_response(why))
            if not self._admission.linger():
                transport.close()
                return
            # what the client sends is dropped (data_received) until it closes, or LINGER
            self._linger = asyncio.get_running_loop().call_later(LINGER, transport.close)
            with contextlib.suppress(OSError, RuntimeError):
                stream.write_eof()
            return
        self._admission.admit(host)
        self._host = host
        self._inner = self._make()
        self._inner.connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._linger is not None:
            self._linger.cancel()
            self._linger = None
            self._admission.lingered()
        if self._host is not None:
            self._admission.release(self._host)
            self._host = None
        if self._inner is not None:
            self._inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._inner is not None:
            self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._inner is not None else False

    def pause_writing(self) -> None:
        if self._inner is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._inner is not None:
            self._inner.resume_writing()


class CountedSite(web.BaseSite):
    """web.TCPSite, but each connection goes through `Counted`."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, admission: Admission) -> None:
        super().__init__(runner, backlog=1024)
        self._host = host
        self._port = port
        self._admission = admission

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None
        admission = self._admission
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: Counted(server, admission),
            self._host,
            self._port,
            backlog=self._backlog,
            reuse_address=True,
        )


class ServerLog(logging.Logger):
    """The logger aiohttp's request handler is given. A request its parser refuses
    (a line or header too long, garbage, bad chunked framing or compression, which
    aiohttp also reports when it drains a body no route read) is the client's doing:
    one debug line, no traceback. Anything else it reports is the broker's fault:
    an error with its traceback, in the broker's log format."""

    def __init__(self) -> None:
        super().__init__("aiohttp.server")

    def exception(self, msg: object, *args: object, **kwargs: Any) -> None:
        exc_info = kwargs.get("exc_info", True)
        exc = exc_info if isinstance(exc_info, BaseException) else sys.exc_info()[1]
        text = str(msg) % args if args else str(msg)
        if isinstance(exc, HttpProcessingError | web.RequestPayloadError | ConnectionError):
            said = exc.message if isinstance(exc, HttpProcessingError) else str(exc)
            lines = said.removeprefix("400, message:").strip().splitlines()
            reason = (lines or [type(exc).__name__])[0][:200]
            log.debug("http request refused", what=text, reason=reason)
        else:
            log.error(text, exc_info=exc)
