"""JSON from a peer (an HTTP body, a `pull` frame's content), its faults told apart."""

from __future__ import annotations

import json
from typing import Any


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
