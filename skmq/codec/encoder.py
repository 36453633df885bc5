"""Frame encoding (SPEC section 1).

Strings are encoded as UTF-8 with ``surrogateescape``, the inverse of what the
decoder does, so a field decoded from the wire is written back byte for byte.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping

from skmq.jsonbody import dump_json

__all__ = ["PING", "PONG", "encode_frame", "encode_resp"]

PING: bytes = b"ping\r\n\r\n"
PONG: bytes = b"pong\r\n\r\n"

# Written by encode_frame itself: a caller's field of that name would corrupt the frame.
_RESERVED = frozenset(("type", "length", "content"))


def encode_frame(
    type: str,
    fields: Mapping[str, str] | Iterable[tuple[str, str]] = (),
    content: bytes | None = None,
) -> bytes:
    """Encode one frame: ``fields`` in order, then ``type``, then the content.

    ``length=N`` is written only when the content holds CR or LF, so frames without
    such bytes stay readable by original SKMQ peers. Raises ``ValueError`` for a key
    that is empty, holds ``=`` or is one of ``type``/``length``/``content``, and for
    CR or LF in a key, a value or the type.
    """
    items = fields.items() if isinstance(fields, Mapping) else fields
    parts: list[str] = []
    for key, value in items:
        if not key or "=" in key or key in _RESERVED:
            raise ValueError(f"invalid field name: {key!r}")
        parts.append(f"{key}={value}\r\n")
    parts.append(f"type={type}\r\n")
    text = "".join(parts)
    # Each part brings exactly one CR and one LF unless a key or value holds more.
    if text.count("\n") != len(parts) or text.count("\r") != len(parts):
        bad = next(p for p in parts if p.count("\r") + p.count("\n") != 2)
        raise ValueError(f"CR or LF inside a field: {bad[:-2]!r}")
    head = text.encode("utf-8", "surrogateescape")
    if content is None:
        return head + b"\r\n"
    if b"\r" in content or b"\n" in content:
        return b"".join((head, b"length=%d\r\ncontent=" % len(content), content, b"\r\n\r\n"))
    return b"".join((head, b"content=", content, b"\r\n\r\n"))


def encode_resp(status: str, content: str, msgid: str | None = None) -> bytes:
    """Encode the broker's answer: ``[msgid=..]\\r\\ntype=resp\\r\\ncontent={json}``.

    The JSON is compact, with lowercase keys, non-ASCII text kept as is. A string
    that cannot be UTF-8 encoded (a lone surrogate, e.g. from an undecodable msgid
    echoed back) makes the JSON fall back to ``\\uXXXX`` escapes, so the content is
    always valid JSON.
    """
    # The same few short answers recur; a long one (a pull's messages) is not kept.
    tail = _resp_tail(status, content) if len(content) <= 256 else _tail(status, content)
    if msgid is None:
        return b"type=resp" + tail
    if "\r" in msgid or "\n" in msgid:
        raise ValueError(f"CR or LF inside msgid: {msgid!r}")
    return b"".join((b"msgid=", msgid.encode("utf-8", "surrogateescape"), b"\r\ntype=resp", tail))


def _tail(status: str, content: str) -> bytes:
    """`\r\ncontent={json}\r\n\r\n`."""
    return b"\r\ncontent=" + dump_json({"status": status, "content": content}) + b"\r\n\r\n"


_resp_tail = functools.lru_cache(maxsize=1024)(_tail)
