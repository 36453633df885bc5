"""Errors that reach a user as one line (see skmq.cli)."""

from __future__ import annotations

from collections.abc import Mapping


class UsageError(Exception):
    """A bad setting, file or address; the message names it. `skmq` exits with status 2."""


class Misconfigured(RuntimeError):
    """What the broker runs on makes a safe start impossible (its Redis evicts keys, its
    port is taken, Redis cannot be reached); the message says what to change. Status 1."""


class ApiError(Exception):
    """A request refused, with the HTTP status that fits: answered as `status` with
    `{"error": message}` (and `headers`) by the gateway, and as a `resp` whose content
    starts with the status by the TCP `pull` frame."""

    def __init__(self, status: int, message: str, headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = dict(headers or {})
