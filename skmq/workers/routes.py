"""Which apps a stored message can reach: those with a recipient registered or a consumer
group. A message stored for any other app waits for one to come and is counted
unroutable (`skmq_unroutable_total{app}`, and in the app's tally shown by `skmq status`);
a producer that asks for `mandatory` has it refused instead (docs/PROTOCOL.md).

The check costs no Redis round trip a message: this broker's view is read for every
listed app on the engine's refresh (two HLENs an app, pipelined, riding with the
counts to add to the tallies), and an app is routable here at once when a registration
or a consumer group is made through this broker. How stale it can be: a recipient or
group made through another broker is seen here one refresh later (at most
min(1 s, HEARTBEAT_INTERVAL) plus a round trip), and until then a `mandatory` message
for that app is refused and others are counted unroutable; the last recipient or group
removed is seen as late, and until then messages pass as routable.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from skmq.store import Store


def unroutable_reason(app: str) -> str:
    """What a producer hears for a `mandatory` message no one can receive."""
    return f"unroutable: no recipient and no group for app {app}"


class Routes:
    def __init__(self, store: Store) -> None:
        self.store = store
        self._routable: set[str] = set()
        self._marked: set[str] = set()  # since the refresh under way began
        # Messages stored while unroutable, by app: `total` since start (Prometheus),
        # `unsaved` not yet added to the apps' tallies in Redis (the next refresh does).
        self.total: Counter[str] = Counter()
        self._unsaved: Counter[str] = Counter()

    def routable(self, app: str) -> bool:
        return app in self._routable

    def mark(self, app: str) -> None:
        """A recipient registered or a consumer group made for `app` through this broker."""
        self._routable.add(app)
        self._marked.add(app)

    def count(self, app: str, n: int) -> None:
        """`n` messages stored for `app`, which is unroutable as far as this broker knows."""
        self.total[app] += n
        self._unsaved[app] += n

    async def refresh(self, apps: Sequence[str]) -> None:
        """Read which of the listed `apps` are routable, and save the counts of the
        messages stored unroutable since the last refresh (kept for the next one if
        Redis fails)."""
        unsaved, self._unsaved = self._unsaved, Counter()
        self._marked = set()
        try:
            found = await self.store.routable(apps, unsaved)
        except BaseException:
            self._unsaved.update(unsaved)
            raise
        self._routable = found | self._marked  # (a mark the read may have missed stays)
