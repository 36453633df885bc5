"""The tokens of skmq/auth.py over HTTP: `Authorization: Bearer <token>`, same roles."""

from __future__ import annotations

from aiohttp import web

from skmq.auth import Role, Tokens
from skmq.http.errors import ApiError

_CHALLENGE = {"WWW-Authenticate": 'Bearer realm="skmq"'}


def authorize(tokens: Tokens | None, request: web.Request, role: Role, app: str) -> str:
    """The name of the token that lets this request act as `role` for `app` ("" with auth
    off); ApiError 401 (no or unknown token) or 403 (the token lacks the role)."""
    if tokens is None:
        return ""
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise ApiError(401, "authentication required: Authorization: Bearer <token>", _CHALLENGE)
    grant = tokens.check(token.strip())
    if grant is None:
        raise ApiError(401, "authentication failed", _CHALLENGE)
    if not grant.allows(role, app):
        raise ApiError(403, f"not allowed: this token lacks the {role} role for app {app!r}")
    return grant.name
