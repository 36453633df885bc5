"""The connections open on the broker port and the HTTP gateway, counted together.

Both listeners spend the same file descriptors, so MAX_CONNECTIONS and
MAX_CONNECTIONS_PER_HOST bound them together: a peer cannot dodge the broker port's
limits by opening its connections to HTTP_PORT instead (docs/SECURITY.md)."""

from __future__ import annotations

from collections import Counter

from skmq.config import Settings

# A refused connection (or one ended for an error) goes on being read for up to LINGER
# seconds and LINGER_BYTES, what it sends dropped, before it is closed: closing with its
# bytes unread would reset it, and the reset would take our answer (why it is refused)
# with it. At most MAX_LINGERING refused ones linger at once: past that, a flood is
# closed at once.
LINGER = 2.0
LINGER_BYTES = 16 << 20  # (read past this, the connection is closed: reading costs CPU)
MAX_LINGERING = 256


class Admission:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.total = 0
        self.per_host: Counter[str] = Counter()
        self.lingering = 0  # refused connections lingering now

    def refusal(self, host: str) -> str | None:
        """Why a new connection from `host` is refused, or None."""
        if self.total >= self.settings.max_connections:
            return "too many connections (MAX_CONNECTIONS)"
        if self.per_host[host] >= self.settings.max_connections_per_host:
            return f"too many connections from {host} (MAX_CONNECTIONS_PER_HOST)"
        return None

    def admit(self, host: str) -> None:
        self.total += 1
        self.per_host[host] += 1

    def release(self, host: str) -> None:
        self.total -= 1
        self.per_host[host] -= 1
        if not self.per_host[host]:
            del self.per_host[host]

    def linger(self) -> bool:
        """Whether a refused connection may linger (then counted until `lingered`): at
        most MAX_LINGERING at once."""
        if self.lingering >= MAX_LINGERING:
            return False
        self.lingering += 1
        return True

    def lingered(self) -> None:
        self.lingering -= 1
