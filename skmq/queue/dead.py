"""An app's dead letters: a dead delivery leaves its owner's memory and
is kept in Redis, written by the owner's fenced flush (lua/flush.lua). Operators list,
replay, move and purge them here, from any process, with or without a broker running:
a replay or a move is a new entry of an app's inbox (its owner reads it as a store), so
the owner's state machine never sees a dead letter again.

Keys (under the app's hash tag): `dl` HASH delivery id -> value, `dead` ZSET delivery id
-> the ms it died, `dlt` HASH msgid -> how many copies of that topic message `dl` holds
(a msgid held as a dead letter is a duplicate of a store or a move: lua/lib.lua). A
value is `<inbox header>\\n<json>\\n<content>`: the header its replay stores it with
(skmq/queue/entries.py: its key and traceparent, a topic copy for its recipient alone,
no TTL), the json its history, the content last (the script copies it from the
delivery's log entry).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from skmq.queue.deliveries import QUEUE, Delivery
from skmq.queue.entries import Meta, decode_header, encode_header
from skmq.store.client import ENC, text
from skmq.store.store import SEP, DeadLetter


def delivery_id(d: Delivery) -> str:
    return text(d.msgid) if d.copy == QUEUE else f"{text(d.msgid)}{SEP}{d.copy}"


def value_head(d: Delivery) -> bytes:
    """What the flush writes before the content."""
    replay = Meta(d.topic, 0, 0, d.key, d.trace, d.copy if d.topic else "")
    return head(replay, d.stored_at, d.attempt, d.error, d.history, d.recipient)


def head(
    replay: Meta, stored: int, attempts: int, error: str, history: list[str], recipient: str
) -> bytes:
    """A dead letter's value before its content: the header its replay stores it with
    (no TTL), then its history."""
    about = {
        "k": "topic" if replay.topic else "queue",
        "s": stored,
        "n": attempts,
        "e": error,
        "h": history,
        "r": recipient,
    }
    return encode_header(replay) + b"\n" + json.dumps(about).encode() + b"\n"


def flush_args(dead: Sequence[Delivery], now: int) -> list[Any]:
    """The dead letters' part of lua/flush.lua's arguments."""
    args: list[Any] = [len(dead)]
    for d in dead:
        args += (delivery_id(d).encode("utf-8", ENC), now, value_head(d), d.entry)
        args.append(b"1" if d.inbox else b"0")
    return args


def letter(app: str, did: bytes, value: bytes, died: float) -> DeadLetter:
    _, about_raw, content = value.split(b"\n", 2)
    about = json.loads(about_raw)
    did_text = text(did)
    msgid, _, copy = did_text.partition(SEP)
    return DeadLetter(
        appid=app,
        delivery_id=did_text,
        msgid=msgid,
        kind=about["k"],
        recipient=copy or about["r"] or None,
        content=content,
        attempts=about["n"],
        last_error=about["e"],
        history=about["h"],
        died_at=int(died),
        stored_at=about["s"],
    )


def moved(did: str, value: bytes) -> tuple[bytes, bytes, Meta]:
    """The msgid, content and header a letter is stored with again (a move)."""
    header, _, content = value.split(b"\n", 2)  # (as `letter` reads it)
    return did.partition(SEP)[0].encode("utf-8", ENC), content, decode_header(header)
