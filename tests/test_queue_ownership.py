"""Ownership of apps' queues among brokers (skmq/queue/ownership.py), over the tests'
real Redis; time is passed in, and a lease running out is its key's expiry."""

from __future__ import annotations

import asyncio

import pytest

from skmq.queue.journal import AppKeys, Lease
from skmq.queue.ownership import Ownership, preferred
from skmq.store.wire import Wire
from skmq.store.wires import Wires

T = 1_700_000_000_000
LEASE = 3_000
APPS = [f"app{n}" for n in range(24)]


def broker(name: str, wire: Wire, prefix: str, log: list[tuple[str, str, int]]) -> Ownership:
    async def gained(app: str, lease: Lease) -> None:
        log.append((name, app, lease.epoch))

    async def lost(app: str) -> None:
        log.append((name, app, -1))

    return Ownership(name, prefix, LEASE, Wires.over(wire), gained, lost)


async def run_out(wire: Wire, prefix: str, o: Ownership) -> None:
    """o stops (killed or paused): its leases and its membership run out."""
    for app in o.held:
        await wire.call("DEL", AppKeys.of(prefix, app).owner)
    await wire.call("ZREM", o.members_key, o.broker)


async def test_each_app_has_one_owner_spread_over_the_live_brokers(wire: Wire, prefix: str) -> None:
    log: list[tuple[str, str, int]] = []
    a, b = broker("A", wire, prefix, log), broker("B", wire, prefix, log)
    await a.live(T)
    await b.live(T)
    for o in (a, b, a, b):
        await o.round(APPS, T)
    assert set(a.held).isdisjoint(b.held) and set(a.held) | set(b.held) == set(APPS)
    assert set(a.held) == {app for app in APPS if preferred(app, ["A", "B"]) == "A"}
    assert 0 < len(a.held) < len(APPS)


async def test_a_dead_brokers_apps_go_to_the_others_after_the_lease(
    wire: Wire, prefix: str
) -> None:
    log: list[tuple[str, str, int]] = []
    a, b = broker("A", wire, prefix, log), broker("B", wire, prefix, log)
    await a.live(T)
    await b.live(T)
    await a.round(APPS, T)
    await b.round(APPS, T)
    theirs = dict(b.held)
    await run_out(wire, prefix, b)
    await a.round(APPS, T + 1)  # B is no longer alive: A prefers those apps now
    assert set(a.held) == set(APPS)
    assert all(a.held[app].epoch == lease.epoch + 1 for app, lease in theirs.items())

    # B wakes (SIGCONT): its renewals fail, it lets go of every app it believed it held
    await b.round(APPS, T + 2)
    assert not b.held
    assert {app for name, app, epoch in log if name == "B" and epoch == -1} == set(theirs)


async def test_an_app_preferred_by_a_silent_broker_is_taken_after_a_lease(
    wire: Wire, prefix: str
) -> None:
    log: list[tuple[str, str, int]] = []
    a = broker("A", wire, prefix, log)
    await wire.call("ZADD", a.members_key, T + 60_000, "ghost")  # alive on paper only
    await a.round(APPS, T)
    mine = set(a.held)
    assert mine == {app for app in APPS if preferred(app, ["A", "ghost"]) == "A"}
    await a.round(APPS, T + LEASE)
    assert set(a.held) == set(APPS)


async def test_a_broker_that_stops_hands_its_apps_over_at_once(wire: Wire, prefix: str) -> None:
    log: list[tuple[str, str, int]] = []
    a, b = broker("A", wire, prefix, log), broker("B", wire, prefix, log)
    await a.live(T)
    await b.live(T)
    await a.round(APPS, T)
    await b.round(APPS, T)
    await a.release_all()
    await b.round(APPS, T + 1)
    assert set(b.held) == set(APPS) and not a.held


async def test_takes_at_the_same_time_share_one_acquire(wire: Wire, prefix: str) -> None:
    """A round and a store taking the same app at once: one epoch, not two (the second
    would fence the first)."""
    log: list[tuple[str, str, int]] = []
    a = broker("A", wire, prefix, log)
    await a.live(T)
    a.brokers = ["A"]
    assert await asyncio.gather(*(a.take("app0", T) for _ in range(5))) == [True] * 5
    assert log == [("A", "app0", 1)] and a.held["app0"].epoch == 1


async def test_a_dead_owners_apps_are_taken_as_its_leases_run_out_not_at_a_round(
    wire: Wire, prefix: str
) -> None:
    """A refused acquire says when the holder's lease runs out; the apps are tried for
    then, and a holder that let its lease run out is no longer preferred, though it
    still counts as alive (its membership has not run out)."""
    log: list[tuple[str, str, int]] = []
    a, b = broker("A", wire, prefix, log), broker("B", wire, prefix, log)
    await a.live(T)
    await b.live(T)
    await b.round(APPS, T)
    theirs = set(b.held)
    await a.round(APPS, T)
    await wire.call("ZADD", a.members_key, T + 60_000, "B")  # B alive on paper
    await a.round(APPS, T + LEASE)  # unowned for a lease: A asks for B's apps, refused
    assert theirs and not theirs & set(a.held)
    assert set(a.lapsing) == theirs and {b for b, _ in a.lapsing.values()} == {"B"}
    first, last = a.next_lapse(), max(when for _, when in a.lapsing.values())
    assert first is not None and T + LEASE < first <= last <= T + 2 * LEASE

    await a.take_lapsed(first - 1)  # not yet: nothing tried
    assert set(a.lapsing) == theirs
    for app in theirs:  # B dies: its leases run out unrenewed
        await wire.call("DEL", AppKeys.of(prefix, app).owner)
    await a.take_lapsed(last)
    assert theirs <= set(a.held) and a.next_lapse() is None
    assert all(epoch == 2 for name, app, epoch in log if name == "A" and app in theirs)


async def test_a_holder_that_renewed_is_tried_again_only_when_its_new_lease_runs_out(
    wire: Wire, prefix: str
) -> None:
    log: list[tuple[str, str, int]] = []
    a, b = broker("A", wire, prefix, log), broker("B", wire, prefix, log)
    a.brokers = b.brokers = ["A", "B"]
    app = next(app for app in APPS if preferred(app, ["A", "B"]) == "B")
    assert await b.take(app, T)
    assert not await a.take(app, T)  # B's by rendezvous: not asked for
    assert app not in a.lapsing
    assert not await a.take(app, T + LEASE)  # unowned for a lease, on paper: refused
    lapse = a.lapsing[app][1]
    await b.renew_all()  # B is alive: its lease runs on
    await a.take_lapsed(lapse)
    assert app not in a.held and app in b.held
    again = a.next_lapse()
    assert again is not None and again > lapse  # refused again: when to try next
    await a.take_lapsed(lapse)  # (not before then)
    assert a.lapsing[app][1] == again


async def test_a_take_whose_state_fails_to_load_lets_the_lease_go(wire: Wire, prefix: str) -> None:
    """The load failed (its node in trouble): not held, its lease released, and the next
    take is a new attempt (not the failed one's result, nor a lease renewed for
    nobody)."""
    epochs: list[int] = []

    async def gained(app: str, lease: Lease) -> None:
        epochs.append(lease.epoch)
        if len(epochs) == 1:
            raise OSError("load failed")

    async def lost(app: str) -> None:
        pass

    a = Ownership("A", prefix, LEASE, Wires.over(wire), gained, lost)
    a.brokers = ["A"]
    owner = AppKeys.of(prefix, "app0").owner
    with pytest.raises(OSError):
        await a.take("app0", T)
    assert "app0" not in a.held and not a.taking
    assert await wire.call("GET", owner) is None
    assert await a.take("app0", T)
    assert epochs == [1, 2] and a.held["app0"].epoch == 2


async def test_a_take_while_the_state_loads_waits_for_the_load(wire: Wire, prefix: str) -> None:
    """The lease is held while the state loads (renewed meanwhile), but the app is not
    owned until it is loaded: a store taking it then waits for the load, rather than
    hear True, find no owner, and append to an inbox whose wake-up came too soon for
    the loading owner to see (a message stored, never pushed: seen after a Redis
    restart)."""
    loading, loaded = asyncio.Event(), asyncio.Event()

    async def gained(app: str, lease: Lease) -> None:
        loading.set()
        await loaded.wait()

    async def lost(app: str) -> None:
        pass

    a = Ownership("A", prefix, LEASE, Wires.over(wire), gained, lost)
    a.brokers = ["A"]
    first = asyncio.ensure_future(a.take("app0", T))
    await loading.wait()
    assert "app0" in a.held  # (renewed while it loads)
    second = asyncio.ensure_future(a.take("app0", T))
    await asyncio.sleep(0)  # (its turn: it would answer now if it did not wait)
    assert not second.done()
    loaded.set()
    assert await first and await second


async def test_a_lease_with_no_end_is_not_waited_for(wire: Wire, prefix: str) -> None:
    log: list[tuple[str, str, int]] = []
    a = broker("A", wire, prefix, log)
    a.brokers = ["A"]
    await wire.call("SET", AppKeys.of(prefix, "app0").owner, "B:1")  # (by hand: no PX)
    assert not await a.take("app0", T)
    assert a.next_lapse() is None
