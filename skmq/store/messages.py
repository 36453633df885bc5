"""Messages as an earlier SKMQ's store holds them (the per-transition scripts engine,
whose store a broker converts when it starts: skmq/queue/migrate.py): a field of the
app's `msgs` hash, from the msgid (as skmq/store/msgids.py holds it) to a header and the
content. The header tells the kind (queue or topic) and the unix ms the message was
stored, in one of two forms:

- text: `q` or `t`, then the ms in 13 digits (14 bytes);
- compact: 5 bytes, big-endian: a 1 bit, the kind (0 queue, 1 topic), then the stored
  ms modulo 2**38 (8.7 years).

A compact header starts with a byte of 128 or more, a text one with `q` or `t`: a value
reads back whatever form wrote it. A stored ms modulo 2**38 reads back as the latest
time that fits it up to a day after now (a message is never older than 8.7 years less a
day; a day covers clocks of brokers apart).

Why 5 bytes: Redis holds a hash entry's field and value in one allocation, and with the
embedded valkey's allocator (libc's) a 17-byte packed msgid with a value of up to 105
bytes takes a class 24 bytes smaller than with 106 to 121: a 100-byte content then fits.

Only a store whose format (`<prefix>:msgids`, skmq/store/msgids.py) is `compact` was
written compact.
"""

from __future__ import annotations

WRAP = 1 << 38
DAY_MS = 86_400_000
_COMPACT = 1 << 39
_TOPIC = 1 << 38


def header(kind: str, stored_ms: int, compact: bool) -> bytes:
    """The header of a message of `kind` stored at `stored_ms`."""
    if not compact:
        return (b"t" if kind == "topic" else b"q") + b"%013d" % stored_ms
    bits = _COMPACT | (_TOPIC if kind == "topic" else 0) | stored_ms % WRAP
    return bits.to_bytes(5, "big")


def read(value: bytes, now_ms: int) -> tuple[str, int, bytes]:
    """A `msgs` value's kind, stored ms and content."""
    if value[0] < 128:
        return ("topic" if value[:1] == b"t" else "queue"), int(value[1:14]), value[14:]
    bits = int.from_bytes(value[:5], "big")
    top = now_ms + DAY_MS
    stored = top - (top - bits % WRAP) % WRAP
    return ("topic" if bits & _TOPIC else "queue"), stored, value[5:]
