"""The tokens of skmq/auth.py over HTTP: `Authorization: Bearer <token>`, same roles."""

from __future__ import annotations

from aiohttp import web

from skmq.auth import EVERY_APP, Grant, Role, Tokens
from skmq.http.errors import ApiError

_CHALLENGE = {"WWW-Authenticate": 'Bearer realm="skmq"'}


def _grant(tokens: Tokens, request: web.Request) -> Grant:
    """The grant of the request's token; ApiError 401 (no or unknown token)."""
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


def role_apps(
    tokens: Tokens | None, request: web.Request, role: Role
) -> tuple[frozenset[str] | None, str]:
    """The apps this request may act on as `role` (None: every app) and the token's name
    ("" with auth off); ApiError 401 (no or unknown token) or 403 (no app at all)."""
    if tokens is None:
        return None, ""
    grant = _grant(tokens, request)
    apps = grant.apps(role)
    if not apps:
        raise ApiError(403, f"not allowed: this token has the {role} role for no app")
    return (None if EVERY_APP in apps else apps), grant.name
