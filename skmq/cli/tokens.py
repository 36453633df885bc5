"""Tokens on the command line: `--token` (env SKMQ_TOKEN) for the commands that talk to
the broker, and the admin role the operator commands (`status`, `dlq`) require when the
settings they load configure auth (AUTH_TOKEN / AUTH_FILE; docs/SECURITY.md)."""

from __future__ import annotations

import argparse
import os
import sys

from skmq.auth import EVERY_APP, SecurityConfigError, load_tokens
from skmq.config import Settings


def add_token_flag(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument(
        "--token",
        default=os.environ.get("SKMQ_TOKEN") or None,
        help=f"{what} (default: $SKMQ_TOKEN; prefer the variable: flags show in `ps`)",
    )


def _refuse(why: str) -> SystemExit:
    sys.stderr.write(f"skmq: {why}\n")
    return SystemExit(2)


def admin_apps(settings: Settings, token: str | None) -> frozenset[str] | None:
    """The apps an operator command may see and change: None (every app) when the settings
    configure no auth, else the apps `token` has the admin role for. Exits with status 2
    and one line when auth is configured and the token is missing, unknown or not admin."""
    try:
        tokens = load_tokens(settings)
    except SecurityConfigError as exc:
        raise _refuse(str(exc)) from None
    if tokens is None:
        return None
    if not token:
        raise _refuse("auth is configured (AUTH_TOKEN/AUTH_FILE): give an admin token, "
                      "--token or SKMQ_TOKEN")  # fmt: skip
    grant = tokens.check(token)
    apps = grant.apps("admin") if grant is not None else frozenset()
    if not apps:
        raise _refuse("this token is unknown or has no admin role")
    return None if EVERY_APP in apps else apps
