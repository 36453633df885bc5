"""Errors that reach a user as one line (see skmq.cli)."""

from __future__ import annotations


class UsageError(Exception):
    """A bad setting, file or address; the message names it. `skmq` exits with status 2."""
