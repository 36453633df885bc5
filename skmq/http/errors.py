"""Every HTTP error as JSON, `{"error": "<one line>"}`, with a status that fits
(a Redis that does not answer: 503; a fault of the broker: 500, its traceback in the
log and not in the answer). What aiohttp's HTTP parser refuses before any route runs
is its own plain text (docs/HTTP.md, Errors)."""

from __future__ import annotations

from collections.abc import Mapping

import structlog
from aiohttp import web
from aiohttp.typedefs import Handler
from redis.exceptions import RedisError

from skmq.errors import ApiError

__all__ = ["ApiError", "error_response", "json_errors"]

log = structlog.get_logger("skmq.http")


def error_response(
    status: int, message: str, headers: Mapping[str, str] | None = None
) -> web.Response:
    return web.json_response({"error": message}, status=status, headers=headers)


@web.middleware
async def json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """ApiError, aiohttp's own errors (404, 405, 413...) and any other exception (500)
    as JSON."""
    try:
        return await handler(request)
    except ApiError as exc:
        return error_response(exc.status, exc.message, exc.headers)
    except RedisError:
        return error_response(503, "store unavailable, try again", {"Retry-After": "1"})
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        headers = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
        return error_response(exc.status, exc.reason.lower(), headers)
    except ConnectionError:
        # The client is gone (aiohttp's reads and writes say so). Raised on, aiohttp
        # would log it as a fault with its traceback; answered, the answer goes nowhere.
        log.debug("http client gone", path=request.path, peer=request.remote)
        return error_response(400, "connection lost")
    except Exception:
        log.exception("http handler failed", method=request.method, path=request.path)
        return error_response(500, "internal error")
