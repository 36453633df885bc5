"""Errors that reach a user as one line (see skmq.cli)."""

from __future__ import annotations

import re
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


_SENTINEL_ADDRESS = re.compile(r"\bhost=([^,]+),port=(\d+)")


def redis_error_text(exc: BaseException) -> str:
    """A Redis client error's message, short. redis-py's MasterNotFoundError lists every
    Sentinel it asked by the repr of its client (about 1.5 KB of pool internals each):
    that becomes `No master found for 'svc' (Sentinel h:p: ConnectionError)`."""
    text = str(exc)
    if type(exc).__name__ != "MasterNotFoundError" or " : " not in text:
        return text
    head, _, tail = text.partition(" : ")
    reasons = []
    for asked in re.split(r", (?=<redis\.)", tail):
        where = _SENTINEL_ADDRESS.search(asked)
        why = asked.rpartition(" - ")[2] if " - " in asked else "no answer"
        reasons.append(f"Sentinel {where[1]}:{where[2]}: {why}" if where else why)
    return f"{head} ({'; '.join(reasons)})"
