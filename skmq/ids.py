"""Msgids and appids as the protocol and the HTTP gateway carry them: why one is refused.
Apart from the frame handler, so that an operator command checks an app's name without
importing the broker."""

from __future__ import annotations

from skmq.registry.registration import CONTROL, is_text

MAX_ID_BYTES = 256


def bad_id(value: str) -> str | None:
    """Why msgid/appid `value` is refused, or None. CR/LF never reach here (the codec)."""
    if (
        len(value) * 4 > MAX_ID_BYTES
        and len(value.encode("utf-8", "surrogateescape")) > MAX_ID_BYTES
    ):
        return f"longer than {MAX_ID_BYTES} bytes"
    if CONTROL.search(value):
        return "holds a control character"
    return None


def bad_app(value: str) -> str | None:
    """Why appid `value` is refused, or None: required, as a msgid, and text besides (an
    app names metrics, registrations and the status listing; a msgid may hold any bytes)."""
    if not value:
        return "required"
    if (why := bad_id(value)) is not None:
        return why
    if not is_text(value):
        return "is not UTF-8 text"
    return None
