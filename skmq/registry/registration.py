"""Parsing a `register` / `unregister` content, and the recipient address allowlist (SPEC 4)."""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from skmq.jsonbody import parse_json

MAX_ID = 256
# What a recipient may declare it supports (extensions). One that declares none is an
# original SKMQ peer and gets the original broker's discipline (docs/PROTOCOL.md).
KNOWN_CAPS = frozenset(("pipeline", "length", "token", "identity"))
MAX_CAPS = 16
MAX_WEIGHT = 1_000_000


class RegistrationRefused(ValueError):
    """Answered `reject` with this reason."""


@dataclass(frozen=True, slots=True)
class Registration:
    app: str
    id: str
    host: str
    port: int
    weight: int
    caps: frozenset[str] = frozenset()

    def as_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "app_id": self.app,
            "host": self.host,
            "port": self.port,
            "weight": self.weight,
            "caps": sorted(self.caps),
        }


def parse_caps(value: Any) -> frozenset[str]:
    """The capabilities a register JSON declares; unknown names are ignored (a newer
    recipient may know more than this broker)."""
    if value is None:
        return frozenset()
    if not isinstance(value, list) or len(value) > MAX_CAPS:
        raise RegistrationRefused(f"caps must be a list of at most {MAX_CAPS} strings")
    if not all(isinstance(c, str) for c in value):
        raise RegistrationRefused("caps must be a list of strings")
    return frozenset(value) & KNOWN_CAPS


# C0 and C1 controls, DEL, and the Unicode line and paragraph separators: characters
# that break a line or drive a terminal where ids end up (logs, metrics labels, listings).
CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def _text(obj: dict[str, Any], key: str) -> str:
    value = obj.get(key)
    if not isinstance(value, str) or not value:
        raise RegistrationRefused(f"{key} must be a non-empty string")
    if len(value) > MAX_ID or CONTROL.search(value):
        raise RegistrationRefused(f"{key} must be at most {MAX_ID} printable characters")
    if not is_text(value):
        raise RegistrationRefused(f"{key} holds a lone surrogate (not Unicode text)")
    return value


def is_text(value: str) -> bool:
    """Unicode text: no lone surrogate (bytes of the wire that were not UTF-8)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _int(value: Any, key: str, default: int | None = None) -> int:
    if value is None or value == "":
        if default is None:
            raise RegistrationRefused(f"{key} is required")
        return default
    if isinstance(value, bool):
        raise RegistrationRefused(f"{key} must be an integer")
    if isinstance(value, str):  # (the original client sends the port as a string)
        if not (value.isascii() and value.isdigit()):
            raise RegistrationRefused(f"{key} must be an integer, got {value!r}")
        return int(value)
    if isinstance(value, int):
        return value
    raise RegistrationRefused(f"{key} must be an integer")


def _object(content: bytes | None, max_bytes: int) -> dict[str, Any]:
    """The content as a flat JSON object: at most `max_bytes`, no value an object or array
    but `caps`, a list of strings (nesting past the parser's recursion limit is refused,
    not raised)."""
    if not content:
        raise RegistrationRefused("content must be a JSON object")
    if len(content) > max_bytes:
        raise RegistrationRefused(f"content over {max_bytes} bytes (MAX_REGISTRATION_BYTES)")
    try:
        obj = parse_json(content)
    except ValueError as exc:
        raise RegistrationRefused(f"content {exc}") from None
    if not isinstance(obj, dict):
        raise RegistrationRefused("content must be a JSON object")
    if any(isinstance(v, dict | list) for k, v in obj.items() if k != "caps"):
        raise RegistrationRefused("content must be a flat JSON object (no nested values)")
    return obj


def parse_registration(
    content: bytes | None, peer_host: str, max_bytes: int = 4096
) -> Registration:
    """The original sends `port` as a JSON string and may leave `host` empty (then: the peer)."""
    obj = _object(content, max_bytes)
    port = _int(obj.get("port"), "port")
    if not 0 < port < 65536:
        raise RegistrationRefused("port must be 1-65535")
    weight = _int(obj.get("weight"), "weight", default=0)
    if not 0 <= weight <= MAX_WEIGHT:
        raise RegistrationRefused(f"weight must be 0-{MAX_WEIGHT}")
    host = obj.get("host")
    if host is None or host == "":
        host = peer_host
    if not isinstance(host, str) or len(host) > 255:
        raise RegistrationRefused("host must be a string")
    caps = parse_caps(obj.get("caps"))
    return Registration(_text(obj, "app_id"), _text(obj, "id"), host, port, weight, caps)


def parse_unregistration(content: bytes | None, max_bytes: int = 4096) -> tuple[str, str]:
    obj = _object(content, max_bytes)
    return _text(obj, "app_id"), _text(obj, "id")


def check_address(host: str, peer_host: str, networks: Sequence[str]) -> None:
    """Allowed: loopback, the registering connection's own address, or RECIPIENT_NETWORKS.

    Host names other than `localhost` are refused: resolving them would let DNS decide
    where the broker connects.
    """
    if host == "localhost":
        return
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        raise RegistrationRefused(
            f"host {host!r} is not an IP address (only IP literals and localhost are accepted)"
        ) from None
    if addr.is_loopback:
        return
    try:
        if addr == ipaddress.ip_address(peer_host):
            return
    except ValueError:
        pass
    for net in networks:
        if addr in ipaddress.ip_network(net, strict=False):
            return
    raise RegistrationRefused(
        f"address {host} not allowed: only loopback, the registering peer's own address, "
        "or RECIPIENT_NETWORKS"
    )
