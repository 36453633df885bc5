"""The tokens of skmq/auth.py over HTTP: `Authorization: Bearer <token>`, same roles."""

from __future__ import annotations

from aiohttp import web

from skmq.auth import EVERY_APP, Grant, Role, Tokens
from skmq.http.errors import ApiError

_CHALLENGE = {"WWW-Authenticate": 'Bearer realm="skmq"'}


def _grant(tokens: Tokens, request: web.Request) -> Grant:
    """The grant of the request's Bearer token; ApiError 401 when none or unknown."""
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise ApiError(401, "authentication required: Authorization: Bearer <token>", _CHALLENGE)
    grant = tokens.check(token.strip())
    if grant is None:
        raise ApiError(401, "authentication failed", _CHALLENGE)
    return grant


def authorize(tokens: Tokens | None, request: web.Request, role: Role, app: str) -> str:
    """The name of the token that lets this request act as `role` for `app` ("" with auth
    off); ApiError 401 (no or unknown token) or 403 (the token lacks the role)."""
    if tokens is None:
        return ""
    grant = _grant(tokens, request)
    if not grant.allows(role, app):
        raise ApiError(403, f"not allowed: this token lacks the {role} role for app {app!r}")
    return grant.name


def scope(tokens: Tokens | None, request: web.Request, role: Role) -> frozenset[str] | None:
    """The apps the request's token has `role` for, for a route about every app: None for
    every app (or auth off); ApiError 401, or 403 when it has the role for no app."""
    if tokens is None:
        return None
    apps = _grant(tokens, request).apps(role)
    if not apps:
        raise ApiError(403, f"not allowed: this token has the {role} role for no app")
    return None if EVERY_APP in apps else apps
