"""Tokens on the command line: `--token` (env SKMQ_TOKEN) for the commands that talk to
the broker, and the admin role the operator commands (`status`, `dlq`) require when the
settings they load configure auth (AUTH_TOKEN / AUTH_FILE; docs/SECURITY.md)."""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

from skmq.errors import UsageError

if TYPE_CHECKING:  # the client commands import this module: keep their start fast
    from skmq.config import Settings


def add_token_flag(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument(
        "--token",
        default=os.environ.get("SKMQ_TOKEN") or None,
        help=f"{what} (default: $SKMQ_TOKEN; prefer the variable: flags show in `ps`)",
    )


def admin_apps(settings: Settings, token: str | None) -> frozenset[str] | None:
    """The apps an operator command may see and change: None (every app) when the settings
    configure no auth, else the apps `token` has the admin role for. Exits with status 2
    and one line when auth is configured and the token is missing, unknown or not admin."""
    from skmq.auth import EVERY_APP, load_tokens

    tokens = load_tokens(settings)
    if tokens is None:
        return None
    if not token:
        raise UsageError("auth is configured (AUTH_TOKEN/AUTH_FILE): give an admin token, "
                      "--token or SKMQ_TOKEN")  # fmt: skip
    grant = tokens.check(token)
    apps = grant.apps("admin") if grant is not None else frozenset()
    if not apps:
        raise UsageError("this token is unknown or has no admin role")
    return None if EVERY_APP in apps else apps


def add_operator_flags(parser: argparse.ArgumentParser, json: bool = True) -> None:
    """What an operator's command takes: the store's settings, the admin token (where
    the settings configure auth) and, with `json`, --json."""
    from skmq.config import STORE_FLAGS, add_settings_flags

    if json:
        parser.add_argument("--json", action="store_true", help="print JSON for scripts")
    add_settings_flags(parser, STORE_FLAGS)
    add_token_flag(parser, "admin token, when the settings configure auth")
