"""Timeouts: leases that ran out in Redis (pushes never answered, here or on a broker that
died) count a failed attempt, `timeout`, and wait for their retry or die."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from skmq.clock import now_ms
from skmq.events import Event
from skmq.queue.owned_store import OwnedStore
from skmq.store import Failed, split_delivery
from skmq.workers.answers import AnswerBatcher
from skmq.workers.dispatch import Dispatcher
from skmq.workers.pusher import Pusher
from skmq.workers.rotation import APPS_A_ROUND, Rotation


@dataclass(eq=False)
class Reaper:
    store: OwnedStore
    dispatchers: dict[str, Dispatcher]
    pusher: Pusher
    answers: AnswerBatcher
    notify: Callable[[str], None]
    ack_timeout: float
    _turns: Rotation = field(init=False, default_factory=lambda: Rotation(APPS_A_ROUND))

    async def step(self) -> None:
        """One round trip a round: the apps this broker claimed for lately, and the next
        APPS_A_ROUND apps in turn (leases of other brokers), so that a round's work does
        not grow with the number of apps."""
        recent = time.monotonic() - 2 * self.ack_timeout
        turn = set(self._turns.take(list(self.dispatchers)))
        turn.update(app for app, d in self.dispatchers.items() if d.last_claim > recent)
        for app, reaped in (await self.store.reap(sorted(turn), now_ms())).items():
            self.answers.log_recovered(app, self.store.recovered_acks(app))
            for r in reaped:
                if r.result.code == Failed.STALE:
                    continue
                msgid, crid = split_delivery(r.delivery_id)
                rid = crid or r.result.recipient
                self.pusher.timed_out(app, rid, msgid, r.result.attempt)
                self.answers.record_failure(
                    app, r.delivery_id, Event.TIMEOUT, "no final answer within ack_timeout", rid,
                    r.result,
                )  # fmt: skip
            if reaped:
                self.notify(app)
