"""Authentication and authorization (extension; docs/SECURITY.md): the tokens the broker
accepts and what each one grants.

Two sources, either or both:

- AUTH_TOKEN: one secret that grants every role for every app.
- AUTH_FILE: a TOML file of many tenants' tokens, each granting roles for some apps::

      [[tokens]]
      name = "orders-service"          # shown in logs instead of the token (optional)
      token = "a long random secret"   # at least 16 characters
      apps = ["orders", "invoices"]    # or ["*"]: every app
      roles = ["produce", "consume"]   # produce, consume, admin

A token is kept only as its SHA-256 digest, and a presented token is compared with every
digest by `hmac.compare_digest` (same time whatever matches, whatever the lengths).
Neither a token nor a digest is ever logged or put in an error message.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

from skmq.config import Settings
from skmq.errors import UsageError
from skmq.signing import PushSigner

Role = Literal["produce", "consume", "admin"]
ROLES: tuple[Role, ...] = get_args(Role)
EVERY_APP = "*"
MIN_TOKEN_CHARS = 16
_ENTRY_KEYS = frozenset({"name", "token", "apps", "roles"})


class SecurityConfigError(UsageError):
    """The auth or signing settings cannot be used. One line, never holding a secret."""


@dataclass(frozen=True, slots=True)
class Grant:
    """What one token lets a connection do: for each role, the apps ("*": every app)."""

    name: str
    apps_by_role: Mapping[Role, frozenset[str]]

    def apps(self, role: Role) -> frozenset[str]:
        return self.apps_by_role.get(role, frozenset())

    def allows(self, role: Role, app: str) -> bool:
        apps = self.apps(role)
        return EVERY_APP in apps or app in apps


def _digest(token: str | bytes) -> bytes:
    raw = token.encode("utf-8", "surrogateescape") if isinstance(token, str) else token
    return hashlib.sha256(raw).digest()


def _given_twice(entries: list[tuple[bytes, Grant]]) -> str | None:
    """Which entries give one token twice (digests), or None."""
    digests = [d for d, _ in entries]
    if len(set(digests)) == len(digests):
        return None
    names = sorted(g.name for d, g in entries if digests.count(d) > 1)
    return f"one token is given twice (entries {', '.join(names)})"


class Tokens:
    """The accepted tokens (as digests) and their grants."""

    def __init__(self, entries: Iterable[tuple[str, Grant]]) -> None:
        self._entries = [(_digest(token), grant) for token, grant in entries]
        if why := _given_twice(self._entries):
            raise SecurityConfigError(why)

    def check(self, token: str | bytes) -> Grant | None:
        """The grant of `token`, None if no token matches. Every digest is compared (no
        early exit), each in constant time."""
        presented = _digest(token)
        found: Grant | None = None
        for digest, grant in self._entries:
            if hmac.compare_digest(digest, presented):
                found = grant
        return found


def _entry(index: int, raw: Any) -> tuple[str, Grant]:
    """One [[tokens]] table; ValueError saying what is wrong with it (never the token)."""
    where = f"tokens[{index}]"
    if not isinstance(raw, dict):
        raise ValueError(f"{where} must be a table")
    unknown = sorted(set(raw) - _ENTRY_KEYS)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(unknown)}")
    name = raw.get("name", where)
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}.name must be a non-empty string")
    token = raw.get("token")
    if not isinstance(token, str) or len(token) < MIN_TOKEN_CHARS:
        raise ValueError(f"{where}.token must be a string of at least {MIN_TOKEN_CHARS} chars")
    apps = raw.get("apps")
    if not isinstance(apps, list) or not apps or not all(isinstance(a, str) and a for a in apps):
        raise ValueError(f'{where}.apps must be a non-empty list of app ids (or "*")')
    roles = raw.get("roles")
    if not isinstance(roles, list) or not roles or any(r not in ROLES for r in roles):
        raise ValueError(f"{where}.roles must be a non-empty list of {', '.join(ROLES)}")
    granted = frozenset(apps)
    return token, Grant(name, {role: granted for role in roles})


def read_auth_file(path: Path) -> list[tuple[str, Grant]]:
    """The entries of an AUTH_FILE; SecurityConfigError naming the file and the problem."""
    try:
        with path.open("rb") as fh:
            doc = tomllib.load(fh)
    except OSError as exc:
        raise SecurityConfigError(f"AUTH_FILE {path}: cannot read it: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise SecurityConfigError(f"AUTH_FILE {path}: not valid TOML: {exc}") from None
    except UnicodeDecodeError:
        raise SecurityConfigError(f"AUTH_FILE {path}: not UTF-8 text") from None
    entries = doc.get("tokens")
    if not isinstance(entries, list) or not entries:
        raise SecurityConfigError(f"AUTH_FILE {path}: needs at least one [[tokens]] table")
    try:
        read = [_entry(i, raw) for i, raw in enumerate(entries)]
    except ValueError as exc:
        raise SecurityConfigError(f"AUTH_FILE {path}: {exc}") from None
    if why := _given_twice([(_digest(token), grant) for token, grant in read]):
        raise SecurityConfigError(f"AUTH_FILE {path}: {why}")
    return read


def load_tokens(settings: Settings) -> Tokens | None:
    """The tokens AUTH_TOKEN and AUTH_FILE configure; None when neither is set (auth off)."""
    entries: list[tuple[str, Grant]] = []
    if settings.auth_token is not None:
        token = settings.auth_token.get_secret_value()
        if len(token) < MIN_TOKEN_CHARS:
            raise SecurityConfigError(f"AUTH_TOKEN must be at least {MIN_TOKEN_CHARS} characters")
        everything = {role: frozenset({EVERY_APP}) for role in ROLES}
        entries.append((token, Grant("AUTH_TOKEN", everything)))
    if settings.auth_file is not None:
        entries.extend(read_auth_file(settings.auth_file))
    return Tokens(entries) if entries else None


def push_signer(settings: Settings) -> PushSigner | None:
    """The signer of pushes SIGNING_SECRET configures; None when it is not set."""
    if settings.signing_secret is None:
        return None
    try:
        return PushSigner(settings.signing_secret.get_secret_value())
    except ValueError as exc:
        raise SecurityConfigError(f"SIGNING_SECRET: {exc}") from None


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def broker_tokens(settings: Settings) -> Tokens | None:
    """The tokens a broker accepts. Like Redis's protected mode, a broker that would listen
    beyond loopback with auth off refuses to start unless ALLOW_UNAUTHENTICATED says so."""
    tokens = load_tokens(settings)
    if tokens is None and not settings.allow_unauthenticated and not is_loopback(settings.host):
        raise SecurityConfigError(
            f"refusing to listen on {settings.host or 'every address'} without authentication:"
            " set AUTH_TOKEN or AUTH_FILE, or ALLOW_UNAUTHENTICATED=true if only trusted"
            " peers can reach this port"
        )
    return tokens
