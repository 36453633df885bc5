"""JSON from a peer (an HTTP body, a `pull` frame's content), its faults told apart; JSON
out, compact (to a peer, or an owner's checkpoint), and read back."""

from __future__ import annotations

import base64
import json
from typing import Any

try:  # a pulled batch's answer, a checkpoint, in a tenth of json's time; CPython only
    import orjson
except ImportError:  # pragma: no cover (elsewhere: json)
    orjson = None  # type: ignore[assignment]

_json_compact = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode
_json_ascii = json.JSONEncoder(separators=(",", ":")).encode


def dump_json(value: Any) -> bytes:
    """`value` as compact UTF-8 JSON, non-ASCII text kept as is. A string that UTF-8
    cannot carry (a lone surrogate, from an undecodable field echoed back) makes it fall
    back to `\\uXXXX` escapes, so the answer is always valid JSON."""
    if orjson is not None:
        try:
            return orjson.dumps(value)
        except TypeError:  # (orjson.JSONEncodeError: a surrogate, an int past 64 bits)
            return _json_ascii(value).encode("ascii")
    try:
        return _json_compact(value).encode("utf-8")
    except UnicodeEncodeError:
        return _json_ascii(value).encode("ascii")


def dump_json_text(value: Any) -> str:
    """dump_json as text (aiohttp's json_response takes a `dumps` giving str)."""
    return dump_json(value).decode("utf-8")


def parse_json(data: bytes | str) -> Any:
    """The value; ValueError saying what is wrong, to follow "body " or "content "."""
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError("is nested too deeply") from None
    except ValueError as exc:  # (UnicodeDecodeError too)
        if "integer string conversion" in str(exc):  # Python's bound on digits
            raise ValueError("holds a number of more than 4300 digits") from None
        raise ValueError("is not valid JSON") from None


def load_json(data: bytes) -> Any:
    """JSON this broker wrote (dump_json: a checkpoint), not a peer's: orjson where it
    is, json for what orjson refuses (a lone surrogate's escape, dump_json's fallback)."""
    if orjson is not None:
        try:
            return orjson.loads(data)
        except ValueError:  # (orjson.JSONDecodeError)
            pass
    return json.loads(data)


def content_json(content: bytes) -> tuple[str, str]:
    """A message's content in a JSON answer, and its `encoding`: the text where it is
    UTF-8, else base64 (so that no byte is lost)."""
    try:
        return content.decode("utf-8"), "text"
    except UnicodeDecodeError:
        return base64.b64encode(content).decode(), "base64"
