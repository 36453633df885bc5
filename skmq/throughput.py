"""Each broker's messages in (stored) and out (acked) per app over the last minute, for
`skmq apps` and GET /v1/apps (skmq/console.py), with no work on the hot path: the
running totals are the delivery-log counters that /metrics already keeps
(skmq/metrics.py); every refresh of the engine samples them, and a minute's totals are
the difference from the oldest sample of the window. The engine publishes them in its
broker note (`Store.note_broker`), where the console sums the live brokers'."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping

from skmq.events import Event

WINDOW = 60.0  # seconds
IN, OUT = Event.STORED.value, Event.ACKED.value


class Throughput:
    def __init__(
        self,
        counts: Mapping[tuple[str, str], int],
        window: float = WINDOW,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.counts = counts  # (event, app) -> running total (Metrics.counts)
        self.window = window
        self.clock = clock
        # (when, app -> (in, out)): the samples of the window, and the one before it
        self._samples: deque[tuple[float, dict[str, tuple[int, int]]]] = deque()

    def _totals(self) -> dict[str, tuple[int, int]]:
        totals: dict[str, tuple[int, int]] = {}
        for (event, app), n in list(self.counts.items()):
            if event in (IN, OUT):
                was_in, was_out = totals.get(app, (0, 0))
                totals[app] = (was_in + n, was_out) if event == IN else (was_in, was_out + n)
        return totals

    def last_minute(self) -> dict[str, list[int]]:
        """Per app with traffic: [in, out] since the window's start (since the broker
        started, if it is younger)."""
        now, totals = self.clock(), self._totals()
        self._samples.append((now, totals))
        while len(self._samples) > 1 and self._samples[1][0] <= now - self.window:
            self._samples.popleft()
        _, start = self._samples[0]
        out = {}
        for app, (n_in, n_out) in totals.items():
            was_in, was_out = start.get(app, (0, 0))
            if n_in > was_in or n_out > was_out:
                out[app] = [n_in - was_in, n_out - was_out]
        return out
