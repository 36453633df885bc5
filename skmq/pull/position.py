"""Where a consumer group starts reading the app's group log, when it is created or reset:
`latest` (what is stored from then on), `earliest` (all the log still holds) or a time
(what was stored at or after it: unix ms, or an ISO-8601 time with its offset).

The group log holds a message only once the app has a group (a message stored before
holds no place in it), and loses the entries every group has read and settled (the
trimmer, skmq/pull/trimmer.py): `earliest` and a time reach no further back than that.
A time is compared with the log entries' ids, the Redis server's clock when they were
stored; a time after that clock's now is refused (`latest` is what it would mean)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Literal

Position = Literal["latest", "earliest"] | int  # an int: unix ms
# Unix ms up to the end of year 9999: a larger number is not a time (nor is a negative).
MAX_MS = 253_402_300_799_999
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_RANGE = f"a time in unix ms is 0 to {MAX_MS}"
HELP = (
    "latest (only what is stored from now on), earliest (all the group log still holds) "
    "or a time: unix ms, or ISO-8601 with its offset (2026-11-28T12:00:00Z)"
)


class BadPosition(ValueError):
    """A position that is none of latest, earliest or a time (its message says why)."""


class FuturePosition(BadPosition):
    """A time after the store's clock: the group would have to skip what is stored
    before that time, which the log cannot do."""


def parse_position(value: object) -> Position:
    """A position from JSON or a command line: "latest", "earliest", unix ms (an integer
    or its digits) or an ISO-8601 time with its offset; BadPosition otherwise."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise BadPosition(f"must be a string or an integer: {HELP}")
    if isinstance(value, str):
        if value in ("latest", "earliest"):
            return value  # type: ignore[return-value]  # (narrowed by the test above)
        value = _time_of(value)
    if not 0 <= value <= MAX_MS:
        raise BadPosition(_RANGE)
    return value


def _time_of(text: str) -> int:
    if text.isascii() and text.isdigit():
        if len(text) > len(str(MAX_MS)):
            raise BadPosition(_RANGE)
        return int(text)
    if len(text) > 40 or not text.isascii():
        raise BadPosition(f"not one of {HELP}")
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise BadPosition(f"{text!r} is not one of {HELP}") from None
    if when.tzinfo is None:
        raise BadPosition(f"{text!r}: an ISO-8601 time needs its offset (Z, +02:00)")
    return (when - _EPOCH) // timedelta(milliseconds=1)


def position_arg(position: Position) -> str:
    """The position as the group scripts take it (group_position.lua)."""
    return position if isinstance(position, str) else str(position)
