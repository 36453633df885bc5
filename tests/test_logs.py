"""The server's log: a warning repeated each batch during a fault is said at most once an
interval, the next line counting those held back."""

from __future__ import annotations

import structlog
from structlog.testing import capture_logs

from skmq.logs import Throttled


def test_a_warning_repeated_within_its_interval_is_held_back_and_counted() -> None:
    now = [100.0]
    with capture_logs() as lines:
        faults = Throttled(structlog.get_logger("t"), interval=1.0, clock=lambda: now[0])
        for _ in range(5):
            faults.warning("store failed", apps=1)
        faults.warning("store unavailable")  # (another warning: its own interval)
        now[0] += 1.0
        faults.warning("store failed", apps=2)
        faults.warning("store failed", apps=3)
        now[0] += 1.0
        faults.warning("store failed", apps=4)
    assert [(e["event"], e.get("apps"), e.get("repeated")) for e in lines] == [
        ("store failed", 1, None),
        ("store unavailable", None, None),
        ("store failed", 2, 4),
        ("store failed", 4, 1),
    ]
    assert {e["log_level"] for e in lines} == {"warning"}
