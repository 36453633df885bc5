"""Delivery tokens: a push to a recipient that declared the `token` capability carries
`token=<attempt>.<mac>`; an answer that echoes it is matched to exactly that delivery,
recipient and attempt, on any connection and at any broker of the store (they share the
key), and nobody who did not receive the push can forge one. The recipient is in the
MAC because a queue message's delivery id is its msgid alone: after a `dlq replay`
(attempts start again) attempt 1 may go to another recipient, which the token of the
first recipient's attempt 1 must not settle."""

from __future__ import annotations

import base64
import hashlib
import hmac

from skmq.store import SEP


class DeliveryTokens:
    def __init__(self, secret: bytes) -> None:
        self._secret = secret

    def _mac(self, app: str, delivery_id: str, recipient: str, attempt: int) -> str:
        msg = f"{app}{SEP}{delivery_id}{SEP}{recipient}{SEP}{attempt}"
        digest = hmac.new(
            self._secret, msg.encode("utf-8", "surrogateescape"), hashlib.sha256
        ).digest()[:16]
        return base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")

    def make(self, app: str, delivery_id: str, recipient: str, attempt: int) -> str:
        return f"{attempt}.{self._mac(app, delivery_id, recipient, attempt)}"

    def attempt_of(self, token: str, app: str, delivery_id: str, recipient: str) -> int | None:
        """The attempt a token was made for, or None when it is not this delivery's to
        this recipient."""
        head, _, mac = token.partition(".")
        if not (head.isascii() and head.isdigit()) or len(head) > 9:
            return None
        attempt = int(head)
        expected = self._mac(app, delivery_id, recipient, attempt).encode()
        if hmac.compare_digest(mac.encode("utf-8", "surrogateescape"), expected):
            return attempt
        return None
