"""Signed pushes (extension; docs/SECURITY.md), after the Standard Webhooks scheme.

With SIGNING_SECRET set, every push carries two more fields::

    timestamp=<unix seconds when it was written>
    signature=v1,<base64 HMAC-SHA256>

The HMAC is over ``msgid LF timestamp LF appid LF content``. Standard Webhooks signs
``id.timestamp.payload``; SKMQ ids may hold dots, and LF is the one byte no msgid or appid
can hold, so a signature cannot be moved to another split of the same bytes. The msgid
is the scheme's id (the same on every redelivery). As in the scheme, a secret written
``whsec_<base64>`` is the base64-decoded key (any other secret: its UTF-8 bytes), and
`signature` may hold several space-separated ``v1,...`` entries (key rotation), one
match being enough. A recipient refuses a push whose timestamp is more than a tolerance
(default 5 minutes) away from its clock, or none of whose signatures matches.

Original peers ignore both fields (SPEC 1: an unknown key is ignored).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import time
from collections.abc import Callable, Iterable, Mapping

TIMESTAMP_FIELD = "timestamp"
SIGNATURE_FIELD = "signature"
VERSION = "v1"
DEFAULT_TOLERANCE = 300.0
_PREFIX = "whsec_"

Clock = Callable[[], float]
Fields = tuple[tuple[str, str], ...]


def secret_key(secret: str) -> bytes:
    """The HMAC key of a secret: ``whsec_<base64>`` decoded, else the UTF-8 bytes."""
    if secret.startswith(_PREFIX):
        try:
            return base64.b64decode(secret[len(_PREFIX) :], validate=True)
        except binascii.Error:
            raise ValueError("a whsec_ signing secret must be base64 after the prefix") from None
    if not secret:
        raise ValueError("the signing secret is empty")
    return secret.encode("utf-8")


def signature(key: bytes, msgid: str, timestamp: str, appid: str, content: bytes) -> str:
    """``v1,<base64 HMAC-SHA256>`` of one push."""
    return _signature(hmac.new(key, digestmod=hashlib.sha256), msgid, timestamp, appid, content)


def _signature(mac: hmac.HMAC, msgid: str, timestamp: str, appid: str, content: bytes) -> str:
    """Sign with `mac`, a fresh HMAC object (a copy of a keyed one costs less than keying)."""
    mac.update(f"{msgid}\n{timestamp}\n{appid}\n".encode("utf-8", "surrogateescape"))
    mac.update(content)
    return f"{VERSION},{base64.b64encode(mac.digest()).decode('ascii')}"


class PushSigner:
    """The broker's side: the extra fields of each push."""

    def __init__(self, secret: str, clock: Clock = time.time) -> None:
        self._keyed = hmac.new(secret_key(secret), digestmod=hashlib.sha256)
        self._clock = clock

    def fields(self, appid: str, msgid: str, content: bytes) -> Fields:
        ts = str(int(self._clock()))
        return (
            (TIMESTAMP_FIELD, ts),
            (SIGNATURE_FIELD, _signature(self._keyed.copy(), msgid, ts, appid, content)),
        )


class PushVerifier:
    """A recipient's side: why a push must be refused, or None when it is authentic."""

    def __init__(
        self,
        secrets: str | Iterable[str],
        tolerance: float = DEFAULT_TOLERANCE,
        clock: Clock = time.time,
    ) -> None:
        self._keys = [secret_key(s) for s in ([secrets] if isinstance(secrets, str) else secrets)]
        if not self._keys:
            raise ValueError("at least one signing secret is needed")
        self.tolerance = tolerance
        self._clock = clock

    def refusal(self, fields: Mapping[str, str], content: bytes) -> str | None:
        ts = fields.get(TIMESTAMP_FIELD, "")
        given = fields.get(SIGNATURE_FIELD, "")
        if not ts or not given:
            return "unsigned push"
        if not ts.isascii() or not ts.isdigit() or len(ts) > 12:
            return "invalid push timestamp"
        if abs(self._clock() - int(ts)) > self.tolerance:
            return f"stale push: timestamp {ts} is more than {self.tolerance:g}s from now"
        msgid = fields.get("msgid", "")
        appid = fields.get("appid", "")
        offered = [s.encode("utf-8", "surrogateescape") for s in given.split(" ") if s]
        for key in self._keys:
            expected = signature(key, msgid, ts, appid, content).encode("ascii")
            # Every offered signature is compared, each in constant time.
            if sum(hmac.compare_digest(expected, s) for s in offered):
                return None
        return "bad push signature"
