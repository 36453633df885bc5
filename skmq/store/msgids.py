"""Msgids as an earlier SKMQ's store holds them (the per-transition scripts engine, whose
store a broker converts when it starts: skmq/queue/migrate.py); a consumer group's log
may hold one so too (`unpack`).

That engine's Redis held every stored msgid twice (a field of `msgs`, an entry of
`ready`), and most msgids are a uuid4 in hex: what SKMQ's client and the original SKMQ
make, 32 characters. Held as its 16 bytes behind a tag byte instead, such a message cost
Redis 31 bytes less. So, in a store whose format was `packed` or `compact`, a msgid of
exactly 32 lowercase hex digits is held as `\\x00` and its 16 bytes; any other msgid as
its text. No text msgid starts with `\\x00` (the broker
refuses control characters in ids, skmq/handler.py), so a held msgid reads back without
knowing which form it took. A text msgid holds no `\\x1f` either, which separates a
topic copy's recipient from its msgid in a delivery id; a packed one may, and is cut
off by its length instead (`split_held`, lib.lua's `split`).

Such a store chose its format once, when the first client met it: `compact` (packed
msgids, compact message headers: skmq/store/messages.py) if no broker ran on it before
and it listed no app; otherwise `text`, since what it held (dedupe sets and group logs
too, which outlive their app's listing) was written that way; a store made by the
version before that is `packed` (packed msgids, text headers). The choice is the
global key `<prefix>:msgids`.
"""

from __future__ import annotations

from skmq.store.client import ENC, text

TAG = b"\x00"
SEP = b"\x1f"


def pack(msgid: str) -> bytes:
    """msgid as a packed store holds it."""
    if len(msgid) == 32:
        try:
            raw = bytes.fromhex(msgid)
        except ValueError:
            raw = b""
        # (fromhex also takes upper case and spaces: only what reads back the same packs)
        if raw.hex() == msgid:
            return TAG + raw
    return msgid.encode("utf-8", ENC)


def split_held(held: bytes) -> tuple[bytes, bytes]:
    """A delivery id as Redis holds it: its msgid, then b"" or `\\x1f` and the copy's
    recipient (as lib.lua's split() cuts it)."""
    cut = 17 if held[:1] == TAG else held.find(SEP)
    return (held, b"") if cut < 0 or cut >= len(held) else (held[:cut], held[cut:])


def unpack(held: bytes | str) -> str:
    """The text of a msgid or delivery id as Redis holds it, in either format."""
    if isinstance(held, bytes) and held[:1] == TAG and len(held) >= 17:
        return held[1:17].hex() + text(held[17:])
    return text(held)
