"""A stored message as the log holds it: `m` msgid, `c` content, and `h` a header only
where the message is not a plain queue message (a topic, a delay, a TTL, an ordering key
or a traceparent), so that most entries share the stream's field names and Redis stores
them compactly (a stream's listpack keeps the fields of its first entry once)."""

from __future__ import annotations

from dataclasses import dataclass

SEP = b"\x1f"  # (no control character is allowed in a key or a traceparent)
QUESTION = b"q"  # the field of an inbox entry holding an answer forwarded to the owner


def is_question(fields: list[bytes]) -> bool:
    """Whether an inbox entry is a forwarded answer (skmq/queue/forward.py)."""
    return fields[:1] == [QUESTION]


@dataclass(frozen=True, slots=True)
class Meta:
    topic: bool = False
    deliver_at: int = 0  # unix ms; 0: now
    expires: int = 0  # unix ms; 0: never
    key: str = ""
    trace: str = ""
    only: str = ""  # a topic message for this recipient alone (a dead copy replayed)


PLAIN = Meta()


def encode_header(meta: Meta) -> bytes:
    if meta == PLAIN:
        return b""
    return SEP.join(
        (
            b"t" if meta.topic else b"q",
            b"%d" % meta.deliver_at,
            b"%d" % meta.expires,
            meta.key.encode(),
            meta.trace.encode(),
            *((meta.only.encode(),) if meta.only else ()),
        )
    )


def decode_header(header: bytes) -> Meta:
    if not header:
        return PLAIN
    kind, deliver_at, expires, key, trace, *only = header.split(SEP, 5)
    return Meta(
        kind == b"t",
        int(deliver_at),
        int(expires),
        key.decode(),
        trace.decode(),
        only[0].decode() if only else "",
    )


@dataclass(frozen=True, slots=True)
class Entry:
    """One log (or inbox) entry as read back."""

    entry: bytes
    msgid: bytes
    content: bytes
    meta: Meta


def parse_entry(entry: bytes, fields: list[bytes]) -> Entry:
    """An entry of XRANGE's reply: its id and [b"m", msgid, b"c", content(, b"h", h)]."""
    if len(fields) == 4 and fields[0] == b"m" and fields[2] == b"c":  # (most: a plain one)
        return Entry(entry, fields[1], fields[3], PLAIN)
    values = dict(zip(fields[::2], fields[1::2], strict=True))
    return Entry(entry, values[b"m"], values[b"c"], decode_header(values.get(b"h", b"")))


def entry_order(entry: bytes) -> tuple[int, int]:
    ms, _, seq = entry.partition(b"-")
    return int(ms), int(seq)
