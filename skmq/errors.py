"""Errors that reach a user as one line (see skmq.cli)."""

from __future__ import annotations


class UsageError(Exception):
    """A bad setting, file or address; the message names it. `skmq` exits with status 2."""


class Misconfigured(RuntimeError):
    """What the broker runs on makes a safe start impossible (its Redis evicts keys, its
    port is taken, Redis cannot be reached); the message says what to change. Status 1."""
