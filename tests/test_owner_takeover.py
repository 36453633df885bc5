"""An owner stalled past its lease (SIGSTOP) loses its app to another broker,
which takes over and delivers; woken (SIGCONT), the stalled owner writes nothing (its
writes are fenced by Redis, each one a line of its log) and nothing is lost."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import redis.asyncio as aioredis

from skmq.queue.journal import AppKeys
from tests.conftest import BrokerFactory, BrokerProcess, eventually
from tests.peers import FakeRecipient
from tests.test_delivery import log_events, produce, registered

APP = "stall"


async def _acked(where: list[Path], ids: list[str]) -> bool:
    acked = {e["msgid"] for place in where for e in log_events(place, event="acked")}
    return acked >= set(ids)


async def test_an_owner_stopped_past_its_lease_is_fenced_and_nothing_is_lost(
    broker_process: BrokerProcess,
    make_broker: BrokerFactory,
    redis: aioredis.Redis,
    redis_url: str,
    prefix: str,
) -> None:
    env = broker_process.env
    env.update(SKMQ_REDIS_URL=redis_url, SKMQ_KEY_PREFIX=prefix)
    env["SKMQ_LOG_DIR"] = env["SKMQ_DATA_DIR"] + "-stalled-log"
    stalled_log = Path(env["SKMQ_LOG_DIR"])
    await asyncio.to_thread(broker_process.start)
    rec = await FakeRecipient(APP, "r").start()
    try:
        await registered(broker_process.port, rec)
        first = [f"a{i}" for i in range(20)]
        await produce(broker_process.port, APP, first)  # it owns the app: the only broker
        await eventually(lambda: _acked([stalled_log], first))
        keys = AppKeys.of(prefix, APP)
        stalled_epoch = int(await redis.get(keys.epoch))
        other = await make_broker()
        await registered(other.server.port, rec)
        assert broker_process.proc is not None
        broker_process.proc.send_signal(signal.SIGSTOP)
        try:
            # stored through the other broker while the owner is stopped: in the inbox,
            # delivered once the other took the app over (after the lease)
            second = [f"b{i}" for i in range(20)]
            await produce(other.server.port, APP, second)
            where = [stalled_log, other.settings.delivery_log_dir]
            await eventually(lambda: _acked(where, second), timeout=30)
            assert int(await redis.get(keys.epoch)) > stalled_epoch
        finally:
            broker_process.proc.send_signal(signal.SIGCONT)
        third = [f"c{i}" for i in range(20)]
        await produce(other.server.port, APP, third)
        await eventually(lambda: _acked(where, [*first, *second, *third]), timeout=30)

        async def let_go() -> bool:  # the woken owner learns it lost the app
            return "app taken over by another broker" in broker_process.log_path.read_text()

        await eventually(let_go, timeout=30)
        # nothing the woken owner tried to write landed: a journal entry names the epoch
        # that wrote it, and none after the new owner's first is of the stalled owner's
        text = broker_process.log_path.read_text()
        assert "Traceback" not in text, text
        journal = await redis.xrange(keys.journal, "-", "+")
        epochs = [int(fields[b"e"]) for _, fields in journal]
        # (none of the new owner's own: its checkpoint trimmed them, and every entry
        # before, so none may be the stalled owner's either)
        taken = next((i for i, epoch in enumerate(epochs) if epoch > stalled_epoch), 0)
        assert stalled_epoch not in epochs[taken:], (epochs, stalled_epoch)
        fenced = text.count("owner write fenced")  # (its tries, refused by Redis)
        print(f"writes of the woken owner fenced: {fenced}")
    finally:
        await rec.stop()


async def test_a_dead_owners_app_is_taken_as_its_lease_runs_out_not_at_the_next_round(
    broker_process: BrokerProcess,
    make_broker: BrokerFactory,
    redis: aioredis.Redis,
    redis_url: str,
    prefix: str,
) -> None:
    """The other broker learns when the owner's lease runs out (its refused acquires
    say) and takes the app then: with a lease of 6 s its rounds come every 2 s, and the
    app would otherwise wait for the next one (up to 2 s after the lease)."""
    lease = 6.0
    env = broker_process.env
    env.update(SKMQ_REDIS_URL=redis_url, SKMQ_KEY_PREFIX=prefix, SKMQ_OWNER_LEASE=str(lease))
    await asyncio.to_thread(broker_process.start)
    rec = await FakeRecipient("lapse", "r").start()
    try:
        await registered(broker_process.port, rec)
        await produce(broker_process.port, "lapse", ["m0"])  # it owns the app
        keys = AppKeys.of(prefix, "lapse")
        owner = (await redis.get(keys.owner)).decode()
        other = await make_broker(owner_lease=lease)
        assert other.owned is not None
        lapsing = other.owned.ownership.lapsing

        async def seen() -> bool:  # (a refused acquire of the other's said when)
            return "lapse" in lapsing

        await eventually(seen, timeout=3 * lease)
        assert broker_process.proc is not None
        broker_process.proc.send_signal(signal.SIGKILL)
        await asyncio.to_thread(broker_process.proc.wait)
        loop = asyncio.get_running_loop()
        runs_out = loop.time() + await redis.pttl(keys.owner) / 1000

        async def taken() -> bool:
            return (await redis.get(keys.owner) or owner.encode()).decode() != owner

        await eventually(taken, timeout=2 * lease)
        late = loop.time() - runs_out
        assert late < 1.0, f"taken {late:.2f} s after the lease ran out"
    finally:
        await rec.stop()
