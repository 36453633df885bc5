"""`skmq serve` with the delivery log's writes patched out (metrics still counted).

For measuring what the delivery log costs, A/B against the real broker:

    python -m bench --systems skmq --scenarios e2e --broker-cmd "python -m bench.nolog_serve"
    python -m bench --systems skmq --scenarios e2e
"""

from __future__ import annotations

import sys

from skmq import deliverylog
from skmq.cli import main


def _count_only(
    self: deliverylog.DeliveryLog,
    event: str,
    msgid: str,
    appid: str,
    kind: str | None,
    recipient: str | None = None,
    attempt: int | None = None,
    detail: str | None = None,
    ts: int | None = None,
) -> None:
    if self.listener is not None:
        self.listener(event, appid)


if __name__ == "__main__":
    deliverylog.DeliveryLog.event = _count_only  # type: ignore[method-assign]
    sys.exit(main(["serve", *sys.argv[1:]]))
