"""Delivery tokens: a push to a recipient that declared the `token` capability carries
`token=<attempt>.<mac>`; an answer that echoes it is matched to exactly that delivery and
attempt, on any connection and at any broker of the store (they share the key), and
nobody who did not receive the push can forge one."""

from __future__ import annotations

import base64
import hashlib
import hmac

from skmq.store import SEP


class DeliveryTokens:
    def __init__(self, secret: bytes) -> None:
        self._secret = secret

    def _mac(self, app: str, delivery_id: str, attempt: int) -> str:
        msg = f"{app}{SEP}{delivery_id}{SEP}{attempt}".encode("utf-8", "surrogateescape")
        digest = hmac.new(self._secret, msg, hashlib.sha256).digest()[:16]
        return base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")

    def make(self, app: str, delivery_id: str, attempt: int) -> str:
        return f"{attempt}.{self._mac(app, delivery_id, attempt)}"

    def attempt_of(self, token: str, app: str, delivery_id: str) -> int | None:
        """The attempt a token was made for, or None when it is not this delivery's."""
        head, _, mac = token.partition(".")
        if not (head.isascii() and head.isdigit()) or len(head) > 9:
            return None
        attempt = int(head)
        expected = self._mac(app, delivery_id, attempt).encode()
        if hmac.compare_digest(mac.encode("utf-8", "surrogateescape"), expected):
            return attempt
        return None
