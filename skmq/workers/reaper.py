"""Timeouts: leases that ran out in Redis (pushes never answered, here or on a broker that
died) count a failed attempt, `timeout`, and wait for their retry or die."""

from __future__ import annotations

import time
from collections.abc import Callable

from skmq.deliverylog import now_ms
from skmq.events import Event
from skmq.store import Failed, Store, split_delivery
from skmq.workers.answers import AnswerBatcher
from skmq.workers.dispatch import Dispatcher
from skmq.workers.pusher import Pusher

# Apps a reap round checks in turn, besides those this broker claimed for lately.
REAP_SWEEP = 500


class Reaper:
    def __init__(
        self,
        store: Store,
        dispatchers: dict[str, Dispatcher],
        pusher: Pusher,
        answers: AnswerBatcher,
        notify: Callable[[str], None],
        ack_timeout: float,
    ) -> None:
        self.store = store
        self.dispatchers = dispatchers
        self.pusher = pusher
        self.answers = answers
        self.notify = notify
        self.ack_timeout = ack_timeout
        self._cursor = 0

    async def step(self) -> None:
        """One round trip a round: the apps this broker claimed for lately, and the next
        REAP_SWEEP apps in turn (leases of other brokers), so that a round's work does not
        grow with the number of apps."""
        recent = time.monotonic() - 2 * self.ack_timeout
        apps = list(self.dispatchers)
        start = self._cursor % len(apps) if apps else 0
        self._cursor = start + REAP_SWEEP
        turn = set(apps[start : start + REAP_SWEEP])
        turn.update(app for app, d in self.dispatchers.items() if d.last_claim > recent)
        for app, reaped in (await self.store.reap(sorted(turn), now_ms())).items():
            for r in reaped:
                if r.result.code == Failed.STALE:
                    continue
                msgid, crid = split_delivery(r.delivery_id)
                rid = crid or r.result.recipient
                self.pusher.timed_out(app, rid, msgid)
                self.answers.record_failure(
                    app, r.delivery_id, Event.TIMEOUT, "no final answer within ack_timeout", rid,
                    r.result,
                )  # fmt: skip
            if reaped:
                self.notify(app)
