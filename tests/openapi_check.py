"""Every answer of the gateway checked against its OpenAPI document (skmq/http/openapi.py),
with openapi-core: the HTTP tests' client (the `http` fixtures) runs each response through
`check_against_openapi`, so that every request of those tests also checks that the
document describes the answer it got, its status and its body, as a generated client
would read it. A request outside the document (an unknown path, a method a path does not
have) is not checked: the document does not promise anything for it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping

import aiohttp
from openapi_core import OpenAPI
from openapi_core.templating.paths.exceptions import OperationNotFound, PathNotFound
from openapi_core.testing import MockRequest, MockResponse
from yarl import URL

from skmq.http.openapi import document

Handler = Callable[[aiohttp.ClientRequest], Awaitable[aiohttp.ClientResponse]]

_spec: OpenAPI | None = None


def spec() -> OpenAPI:
    """The document the gateway serves (built once)."""
    global _spec
    if _spec is None:
        _spec = OpenAPI.from_dict(document())
    return _spec


def check_response(
    method: str,
    url: URL,
    status: int,
    content_type: str,
    body: bytes,
    headers: Mapping[str, str] | None = None,
) -> None:
    """AssertionError unless the document has this answer (status, content type, body,
    the headers it names) for the operation; nothing for a request outside it."""
    request = MockRequest(str(url.origin()), method.lower(), url.path)
    response = MockResponse(body, status, dict(headers or {}), content_type)
    try:
        spec().validate_response(request, response)
    except (PathNotFound, OperationNotFound):
        return
    except Exception as exc:
        causes = getattr(exc, "schema_errors", None) or [exc.__cause__ or exc]
        why = "; ".join(str(c).splitlines()[0] for c in causes)
        raise AssertionError(
            f"{method} {url.path} answered {status} {body[:300]!r}, which the OpenAPI "
            f"document does not describe: {type(exc).__name__}: {why}"
        ) from exc


async def check_against_openapi(
    request: aiohttp.ClientRequest, handler: Handler
) -> aiohttp.ClientResponse:
    """An aiohttp client middleware: the response, read whole (the test reads it again
    from the cache), checked by check_response."""
    response = await handler(request)
    body = await response.read()
    check_response(
        request.method, request.url, response.status, response.content_type, body,
        response.headers,
    )  # fmt: skip
    return response
