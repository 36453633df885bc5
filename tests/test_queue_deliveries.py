"""The owner's deliveries in memory (skmq/queue/deliveries.py): sans-IO, so each test
drives the clock itself."""

from __future__ import annotations

import pytest

from skmq.lifecycle import Record, Refused, State, Trigger
from skmq.queue.deliveries import QUEUE, AppQueue, Delivery, Policy, parse_records

T = 1_700_000_000_000


def queue(**policy: object) -> AppQueue:
    return AppQueue(Policy(**policy), rand=lambda: 0.5)  # type: ignore[arg-type]


def message(n: int, copy: str = QUEUE, **kw: object) -> Delivery:
    return Delivery(f"{T}-{n}".encode(), f"m{n}".encode(), copy, State.DELAYED, **kw)  # type: ignore[arg-type]


def pushed(q: AppQueue, now: int = T, n: int = 10, to: str = "r1") -> list[Delivery]:
    out = list(q.take(n, now))
    for d in out:
        q.push(d, to, now)
    return out


def kinds(q: AppQueue) -> list[Record]:
    blob, *_ = q.drain()
    return [r[0] for r in parse_records(blob)] if blob else []


def test_a_message_goes_pending_pushed_acked_and_leaves_memory() -> None:
    q = queue()
    q.add(message(1), T)
    assert q.deliveries[(b"m1", QUEUE)].state is State.PENDING
    (d,) = pushed(q)
    assert (d.state, d.attempt, d.recipient, d.due) == (State.IN_FLIGHT, 1, "r1", T + 30_000)
    q.ack(b"m1", QUEUE, 1, T + 5)
    assert d.state is State.ACKED and not q.deliveries
    blob, settled, forgotten, _ = q.drain()
    assert settled == forgotten == [b"m1"]
    assert list(parse_records(blob)) == [
        (Record.PUSHED, b"m1", QUEUE, 1, f"{T + 30_000} r1"),
        (Record.ACKED, b"m1", QUEUE, 1, ""),
    ]
    assert q.drain() == (b"", [], [], [])


def test_a_delayed_message_falls_due_on_time_and_not_before() -> None:
    q = queue()
    q.add(message(1, deliver_at=T + 500), T)
    assert list(q.take(10, T)) == [] and q.next_due() == T + 500
    assert q.tick(T + 499) == []
    (change,) = q.tick(T + 500)
    assert change.delivery.state is State.PENDING and pushed(q, T + 500)


def test_failures_retry_after_the_backoff_then_die_after_retry_times() -> None:
    q = queue(retry_times=2, backoff_ms=(100, 1000))
    q.add(message(1), T)
    pushed(q)
    change = q.fail(b"m1", QUEUE, 1, "error: boom", T)
    d = change.delivery
    assert (d.state, d.due, d.error) == (State.WAITING_RETRY, T + 100, "error: boom")
    assert list(q.take(10, T + 99)) == []
    q.tick(T + 100)
    pushed(q, T + 100)
    assert d.attempt == 2
    q.fail(b"m1", QUEUE, 2, "reject", T + 101)
    assert d.state is State.DEAD and not q.deliveries and q.dead == [d]
    assert d.history == [
        f"{T} attempt=1 recipient=r1 error: boom",
        f"{T + 101} attempt=2 recipient=r1 reject",
    ]
    assert kinds(q) == [Record.PUSHED, Record.RETRIED, Record.PUSHED, Record.DEAD]


def test_a_lease_that_runs_out_is_a_failed_attempt() -> None:
    q = queue(lease_ms=1000, backoff_ms=(50,))
    q.add(message(1), T)
    (d,) = pushed(q)
    assert q.next_due() == T + 1000
    (change,) = q.tick(T + 1000)
    assert change.delivery is d and d.state is State.WAITING_RETRY
    assert d.error.startswith("timeout")


def test_an_answer_is_refused_unless_its_attempt_is_in_flight() -> None:
    q = queue(backoff_ms=(10,))
    q.add(message(1), T)
    q.add(message(2, deliver_at=T + 1000), T)
    with pytest.raises(Refused):
        q.ack(b"m2", QUEUE, 0, T)  # delayed: not in flight
    with pytest.raises(Refused):
        q.ack(b"nope", QUEUE, 0, T)  # never held
    pushed(q)
    q.fail(b"m1", QUEUE, 1, "error", T)
    q.tick(T + 10)
    pushed(q, T + 10)
    with pytest.raises(Refused):
        q.ack(b"m1", QUEUE, 1, T + 11)  # a late answer to attempt 1 cannot settle 2
    assert q.ack(b"m1", QUEUE, 2, T + 11).delivery.state is State.ACKED
    with pytest.raises(Refused):
        q.ack(b"m1", QUEUE, 2, T + 12)  # acked twice


def test_one_message_of_a_key_at_a_time_in_stored_order() -> None:
    q = queue(retry_times=1)
    for n in (1, 2, 3):
        q.add(message(n, key="k"), T)
    q.add(message(4, key="other"), T)
    assert [d.msgid for d in pushed(q)] == [b"m1", b"m4"]
    assert q.deliveries[(b"m2", QUEUE)].state is State.WAITING_KEY
    assert q.behind_keys == 2
    q.ack(b"m1", QUEUE, 1, T)
    assert q.behind_keys == 1
    assert [d.msgid for d in pushed(q)] == [b"m2"]
    q.fail(b"m2", QUEUE, 1, "error", T)  # dead (retry_times 1): the next goes too
    assert [d.msgid for d in pushed(q)] == [b"m3"]
    q.ack(b"m3", QUEUE, 1, T)
    assert not q.keys.get("k") and q.behind_keys == 0


def test_a_message_purged_behind_its_key_lets_the_head_be_acked() -> None:
    q = queue()
    for n in (1, 2, 3):
        q.add(message(n, key="k"), T)
    pushed(q, n=1)
    assert q.purge(b"m2", QUEUE, T).delivery.state is State.PURGED  # behind m1
    assert q.behind_keys == 1
    assert q.ack(b"m1", QUEUE, 1, T).delivery.state is State.ACKED
    assert [d.msgid for d in pushed(q)] == [b"m3"]
    q.ack(b"m3", QUEUE, 1, T)
    assert not q.keys and not q.deliveries


def test_a_retry_blocks_its_key_not_the_app() -> None:
    q = queue(backoff_ms=(1000,))
    q.add(message(1, key="k"), T)
    q.add(message(2, key="k"), T)
    q.add(message(3), T)
    pushed(q, n=1)
    q.fail(b"m1", QUEUE, 1, "error", T)
    assert [d.msgid for d in pushed(q)] == [b"m3"]


def test_an_expired_message_is_never_pushed_dead_or_dropped() -> None:
    q = queue()
    q.add(message(1, expires=T + 10), T)
    assert list(q.take(10, T + 10)) == []
    (change,) = q.expired
    assert change.delivery.state is State.DEAD and change.delivery.error.startswith("expired")
    dropping = queue(drop_expired=True)
    dropping.add(message(1, expires=T + 10), T)
    assert list(dropping.take(10, T + 10)) == [] and not dropping.deliveries
    assert kinds(dropping) == [Record.DROPPED]


def test_a_delay_past_the_expiry_falls_due_at_the_expiry() -> None:
    q = queue()
    q.add(message(1, deliver_at=T + 1000, expires=T + 100), T)
    assert q.next_due() == T + 100


def test_a_failure_after_the_expiry_expires_but_an_ack_still_counts() -> None:
    q = queue()
    q.add(message(1, expires=T + 100), T)
    q.add(message(2, expires=T + 100), T)
    pushed(q)
    assert q.fail(b"m1", QUEUE, 1, "error", T + 100).delivery.state is State.DEAD
    assert q.ack(b"m2", QUEUE, 1, T + 100).delivery.state is State.ACKED


def test_a_lease_is_extended_max_extensions_times() -> None:
    q = queue(lease_ms=1000, max_extensions=2)
    q.add(message(1), T)
    (d,) = pushed(q)
    assert q.extend(b"m1", QUEUE, 1, T + 500) is not None and d.due == T + 1500
    assert q.extend(b"m1", QUEUE, 1, T + 600) is not None
    assert q.extend(b"m1", QUEUE, 1, T + 700) is None and d.due == T + 1600


def test_a_release_spends_no_attempt() -> None:
    q = queue()
    q.add(message(1), T)
    (d,) = pushed(q)
    q.release(b"m1", QUEUE, 1, T)
    assert (d.state, d.attempt) == (State.PENDING, 0)
    assert pushed(q)[0].attempt == 1


def test_operators_purge_waiting_deliveries_only() -> None:
    q = queue()
    for n in (1, 2, 3):
        q.add(message(n, deliver_at=T + 1_000 if n == 3 else 0), T)
    (d,) = pushed(q, n=1)
    with pytest.raises(Refused):
        q.purge(d.msgid, QUEUE, T)  # in flight: only waiting ones are purged
    assert q.purge(b"m2", QUEUE, T).delivery.state is State.PURGED
    assert q.purge(b"m3", QUEUE, T).delivery.state is State.PURGED  # delayed
    assert set(q.deliveries) == {(b"m1", QUEUE)}
    assert kinds(q)[-2:] == [Record.PURGED, Record.PURGED]


def test_a_topic_message_is_settled_when_its_last_copy_is_acked() -> None:
    q = queue()
    q.add(message(1, copy="r1", topic=True), T)
    q.add(message(1, copy="r2", topic=True), T)
    assert q.lines() == ["r1", "r2"] and list(q.take(10, T)) == []
    copies = [*q.take(10, T, "r1"), *q.take(10, T, "r2")]
    for d in copies:
        q.push(d, d.copy, T)
    q.ack(b"m1", "r1", 1, T)
    assert q.settled == []
    q.ack(b"m1", "r2", 1, T)
    assert q.settled == [b"m1"]


def replayed(live: AppQueue, messages: list[Delivery], now: int) -> AppQueue:
    """A new owner that materialised the same log entries and replayed the records."""
    blob, *_ = live.drain()
    new = queue()
    for m in messages:
        new.add(
            Delivery(m.entry, m.msgid, m.copy, State.DELAYED, key=m.key, deliver_at=m.deliver_at),
            T,
        )
    for record in parse_records(blob):
        assert new.apply(*record, now)
    new.tick(now)  # (what the new owner's loop does next)
    return new


def test_a_new_owner_replaying_the_records_holds_the_same_states() -> None:
    q = queue(backoff_ms=(100,), retry_times=2)
    msgs = [message(1), message(2), message(3, key="k"), message(4, key="k")]
    msgs.append(message(5, deliver_at=T + 10_000))
    for m in msgs:
        q.add(m, T)
    pushed(q)  # 1, 2, 3
    q.ack(b"m1", QUEUE, 1, T + 1)
    q.fail(b"m2", QUEUE, 1, "error: x", T + 1)
    q.ack(b"m3", QUEUE, 1, T + 2)  # 4 may go now
    pushed(q, T + 3)  # 4
    q.tick(T + 101)
    pushed(q, T + 101)  # 2, attempt 2
    q.fail(b"m2", QUEUE, 2, "reject", T + 102)  # dead: out of memory
    q.tick(T + 10_000)  # 5 falls due
    live = {k: (d.state, d.attempt, d.due, d.recipient) for k, d in q.deliveries.items()}

    new = replayed(q, msgs, T + 10_000)
    again = {k: (d.state, d.attempt, d.due, d.recipient) for k, d in new.deliveries.items()}
    assert again == live
    blob, settled, _, dead = new.drain()
    assert (blob, settled, dead) == (b"", [], [])  # replaying records writes none


def test_a_takeover_pushes_again_what_the_old_owner_had_in_flight() -> None:
    q = queue(retry_times=2)
    q.add(message(1), T)
    q.add(message(2), T)
    pushed(q)
    q.fail(b"m2", QUEUE, 1, "error", T)
    q.tick(T + 10_000)
    pushed(q, T + 10_000)  # m2's last attempt
    changes = q.adopt(T + 20_000)
    assert q.deliveries[(b"m1", QUEUE)].state is State.PENDING
    assert (b"m2", QUEUE) not in q.deliveries and q.dead[0].msgid == b"m2"
    # the failed attempts alone, one a delivery (the reaper logs each as a timeout)
    assert sorted((c.delivery.msgid, c.trigger) for c in changes) == [
        (b"m1", Trigger.RETRY), (b"m2", Trigger.GIVE_UP)
    ]  # fmt: skip
    (again,) = pushed(q, T + 20_000, to="r2")
    assert again.msgid == b"m1" and again.attempt == 2
    # the change that adopted m1 still names the attempt that failed, and to whom: the
    # reaper logs it after the new push, which it must not take for it
    adopted = [(c.attempt, c.recipient) for c in changes if c.delivery is again]
    assert adopted and set(adopted) == {(1, "r1")}


def test_an_adopt_leaves_only_the_timers_of_deliveries_still_timed() -> None:
    """After a takeover, what was in flight is pending again: the timers of its leases,
    and of the retries it went through to pending, are dropped at once (next_due dropped
    them one by one: 0.75 s of a takeover at 100,000 in flight)."""
    q = queue()
    for n in range(1, 6):
        q.add(message(n), T)
    q.add(message(6, deliver_at=T + 5000), T)
    pushed(q, n=5)
    new = queue()
    new.restore(q.snapshot(), T)
    assert len(new.timers) == 6
    new.adopt(T + 1)
    assert [(when, d.msgid) for when, _, d in new.timers] == [(T + 5000, b"m6")]
    assert [d.msgid for d in pushed(new, T + 1)] == [b"m1", b"m2", b"m3", b"m4", b"m5"]


def test_a_delivery_back_to_pending_before_its_turn_is_taken_once() -> None:
    # a new owner: pending from the log, its push replayed, then adopted (pending again)
    q = queue()
    q.add(message(1), T)
    assert q.apply(Record.PUSHED, b"m1", QUEUE, 1, f"{T + 30_000} r1", T)
    q.adopt(T + 1)
    assert [d.msgid for d in pushed(q, T + 1)] == [b"m1"]
    assert pushed(q, T + 1) == []


def test_a_checkpoint_restores_every_delivery_held() -> None:
    q = queue(backoff_ms=(100,))
    for m in (message(1), message(2), message(3, key="k"), message(4, key="k")):
        q.add(m, T)
    q.add(message(5, deliver_at=T + 5000), T)
    pushed(q, n=2)  # 1, 2
    q.fail(b"m1", QUEUE, 1, "error", T)
    new = queue()
    new.restore(q.snapshot(), T)
    fields = lambda d: (d.state, d.attempt, d.due, d.recipient, d.key, d.error)  # noqa: E731
    assert {k: fields(d) for k, d in new.deliveries.items()} == {
        k: fields(d) for k, d in q.deliveries.items()
    }
    assert [d.msgid for d in new.take(10, T)] == [b"m3"]  # 4 waits for its key
    assert new.behind_keys == q.behind_keys == 1
    assert new.next_due() == T + 100  # m1's retry before m2's lease and m5's delay


@pytest.mark.parametrize("key", ["k", "k\udcff"])  # (a key of bytes that are not UTF-8)
def test_a_checkpoint_keeps_text_as_it_was(key: str) -> None:
    """A snapshot is orjson's where it can be, json's (\\u escapes) for a string UTF-8
    cannot carry: either restores the same text."""
    q = queue()
    q.add(message(1, key=key), T)
    q.add(message(2, key="\u00e9t\u00e9"), T)
    new = queue()
    new.restore(q.snapshot(), T)
    assert sorted(d.key for d in new.deliveries.values()) == sorted([key, "\u00e9t\u00e9"])
