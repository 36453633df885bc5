"""Every HTTP error as JSON, `{"error": "<one line>"}`, with a status that fits
(a Redis that does not answer: 503)."""

from __future__ import annotations

from collections.abc import Mapping

from aiohttp import web
from aiohttp.typedefs import Handler
from redis.exceptions import RedisError

from skmq.errors import ApiError

__all__ = ["ApiError", "error_response", "json_errors"]


def error_response(
    status: int, message: str, headers: Mapping[str, str] | None = None
) -> web.Response:
    return web.json_response({"error": message}, status=status, headers=headers)


@web.middleware
async def json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """ApiError and aiohttp's own errors (404, 405, 413...) as JSON."""
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
