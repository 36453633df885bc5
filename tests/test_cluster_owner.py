"""The owner engine on a Redis Cluster (issue 42 on the owner-held queues' core): each app's
writes go on the owner's connection to the app's master (skmq/store/wires.py), so that:

- the core delivery path works, apps spread over every master, each app's log on its
  own master;
- REPLICA_ACKS's WAIT runs on the master that stored the message: the app of a master
  whose replica is down is answered `error` (outcome unknown), never `ack`, while the
  other masters' apps of the same moment are acked;
- one master down refuses only its own apps; the others go on, and its app is served
  again once the master is back;
- a failover (kill -9 of a master, its replica promoted): the owner takes the app again
  through the new master, and every message acked is delivered.
"""

from __future__ import annotations

import asyncio
import signal
from collections import Counter
from pathlib import Path

from redis.asyncio.cluster import RedisCluster

from skmq.embedded_cluster import LocalCluster
from skmq.pull.consumer import PullConsumer
from skmq.queue.journal import AppKeys
from tests.conftest import BrokerFactory, eventually
from tests.peers import RawClient
from tests.test_cluster import cluster, one_app_a_master, promoted
from tests.test_reliability import Holder, produce, until

__all__ = ["cluster"]  # the fixture, shared with tests/test_cluster.py


def master_port(client: RedisCluster, prefix: str, app: str) -> int:
    return int(client.get_node_from_key(AppKeys.of(prefix, app).log).port)


async def recipients_for(port: int, apps: list[str]) -> dict[str, Holder]:
    holders = {app: await Holder(app, f"r-{app}").start() for app in apps}
    for holder in holders.values():
        assert (await holder.register(port))["status"] == "ack"
    return holders


async def send_each(client: RawClient, apps: list[str], msgid: str) -> dict[str, dict[str, object]]:
    """One message to each app, pipelined in one write; each app's answer."""
    for app in apps:
        client.send("queue", b"x", appid=app, msgid=msgid)
    return {app: await client.resp() for app in apps}


async def test_owner_core_on_a_cluster_spreads_apps_over_the_masters(
    make_broker: BrokerFactory, cluster: LocalCluster, prefix: str
) -> None:
    broker = await make_broker(redis_url=cluster.url)
    store = broker.store
    assert isinstance(store.redis, RedisCluster)
    apps = [f"spread{i}" for i in range(12)]
    assert {master_port(store.redis, prefix, a) for a in apps} == set(cluster.master_ports)
    holders = await recipients_for(broker.server.port, apps)
    sent = {app: [f"{app}-{i}" for i in range(20)] for app in apps}
    acked = await asyncio.gather(*(produce(broker.server.port, sent[a], app=a) for a in apps))
    assert list(acked) == list(sent.values())
    for app, holder in holders.items():
        await until(lambda h=holder, a=app: set(h.msgids()) >= set(sent[a]), timeout=15)  # type: ignore[misc]
        assert {m: c for m, c in Counter(holder.msgids()).items() if c != 1} == {}
    assert set(await store.apps()) >= set(apps)
    for app in apps:  # written by the app's owner: its journal
        assert await store.redis.exists(AppKeys.of(prefix, app).journal) == 1
    for holder in holders.values():
        await holder.stop()


async def test_owner_replica_acks_wait_on_the_apps_own_master(
    make_broker: BrokerFactory, tmp_path: Path, prefix: str
) -> None:
    """REPLICA_ACKS=1 on 3+3: the replica of one master killed and left down. That
    master's app is answered `error` (outcome unknown: stored on its master, not
    confirmed), never `ack`, though the other masters (with a replica) would answer 1
    to a WAIT sent to them; the other apps of the same writes are acked."""
    local = LocalCluster(tmp_path / "c", masters=3, replicas=1).start()
    try:
        broker = await make_broker(redis_url=local.url, replica_acks=1)
        assert isinstance(broker.store.redis, RedisCluster)
        apps = one_app_a_master(broker.store.redis, broker.store, local.master_ports)
        client = await RawClient.connect(broker.server.port)
        answers = await send_each(client, list(apps.values()), "m0")
        assert all(r["status"] == "ack" for r in answers.values()), answers
        lonely = local.master_ports[0]
        local.kill(local.ports[local.masters + 0])  # its replica
        for n in range(1, 4):
            answers = await send_each(client, list(apps.values()), f"m{n}")
            alone = answers.pop(apps[lonely])
            assert alone["status"] == "error", alone
            assert str(alone["content"]).startswith("outcome unknown"), alone
            assert all(r["status"] == "ack" for r in answers.values()), answers
        await client.close()
    finally:
        local.stop()


async def test_owner_one_master_down_refuses_only_its_apps(
    make_broker: BrokerFactory, tmp_path: Path, prefix: str
) -> None:
    """One master of 3 killed (no replica): the other masters' apps are acked and
    delivered; the dead one's are answered `error`, never `ack`; back up (its AOF), its
    app is stored and delivered again."""
    local = LocalCluster(tmp_path / "c", masters=3).start()
    try:
        broker = await make_broker(redis_url=local.url)
        assert isinstance(broker.store.redis, RedisCluster)
        apps = one_app_a_master(broker.store.redis, broker.store, local.master_ports)
        holders = await recipients_for(broker.server.port, list(apps.values()))
        client = await RawClient.connect(broker.server.port)
        assert all(
            r["status"] == "ack"
            for r in (await send_each(client, list(apps.values()), "m0")).values()
        )
        down = local.master_ports[1]
        local.kill(down)
        not_stored = []
        for n in range(1, 6):
            answers = await send_each(client, list(apps.values()), f"m{n}")
            dead = answers.pop(apps[down])
            assert dead["status"] == "error", dead
            assert str(dead["content"]).startswith(("not stored", "outcome unknown")), dead
            if str(dead["content"]).startswith("not stored"):
                not_stored.append(f"m{n}")
            assert all(r["status"] == "ack" for r in answers.values()), answers
        assert "m5" in not_stored  # (once its node refuses connections: certainly not)
        for port, app in apps.items():
            if port != down:
                await until(
                    lambda h=holders[app]: {"m1", "m2", "m3"} <= set(h.msgids()), timeout=10
                )  # type: ignore[misc]
        local.launch(down)
        back: list[str] = []

        async def stored_again() -> bool:
            answer = (await send_each(client, [apps[down]], f"back{len(back)}"))[apps[down]]
            if answer["status"] == "ack":
                back.append(f"back{len(back)}")
            return len(back) >= 3

        await eventually(stored_again, timeout=30)
        await until(lambda: set(back) <= set(holders[apps[down]].msgids()), timeout=15)
        assert not set(not_stored) & set(holders[apps[down]].msgids())  # the answer was true
        await client.close()
        for holder in holders.values():
            await holder.stop()
    finally:
        local.stop()


async def test_owner_follows_a_failover_and_loses_no_acked_message(
    make_broker: BrokerFactory, tmp_path: Path, prefix: str
) -> None:
    """kill -9 of the master holding the app, REPLICA_ACKS=1: its replica takes over;
    the owner drops the app (its connection closed) and takes it again through the new
    master, its state rebuilt there; every message acked before or after is delivered."""
    local = LocalCluster(tmp_path / "c", masters=3, replicas=1).start()
    try:
        broker = await make_broker(redis_url=local.url, replica_acks=1)
        assert isinstance(broker.store.redis, RedisCluster)
        app = "failover"
        holder = (await recipients_for(broker.server.port, [app]))[app]
        before = [f"before-{i}" for i in range(20)]
        assert await produce(broker.server.port, before, app=app) == before
        old = master_port(broker.store.redis, prefix, app)
        replica = local.client(local.ports[local.masters + local.master_ports.index(old)])
        local.kill(old)

        await eventually(lambda: promoted(replica), timeout=20)
        replica.close()
        local.launch(old)  # back as a replica of the new master: REPLICA_ACKS=1 can hold
        after: list[str] = []

        async def stored_after_failover() -> bool:
            msgid = f"after-{len(after)}"
            after.extend(await produce(broker.server.port, [msgid], app=app))
            return len(after) >= 20

        await eventually(stored_after_failover, timeout=30)
        await until(lambda: set(holder.msgids()) >= set(before + after), timeout=20)
        await holder.stop()
    finally:
        local.stop()


async def test_owner_a_stalled_master_holds_up_only_its_apps(
    make_broker: BrokerFactory, tmp_path: Path, prefix: str
) -> None:
    """One master of 3 frozen (SIGSTOP) for over two leases: the other masters' apps
    are stored, pushed and settled all along, and stay owned (their renewals and
    checkpoints do not wait for the frozen node); the frozen app's store is answered
    `error` at STORE_TIMEOUT; woken, its app is served again."""
    local = LocalCluster(tmp_path / "c", masters=3).start()
    frozen = local.master_ports[2]
    try:
        broker = await make_broker(redis_url=local.url, store_timeout=1.0)
        assert isinstance(broker.store.redis, RedisCluster) and broker.owned is not None
        apps = one_app_a_master(broker.store.redis, broker.store, local.master_ports)
        holders = await recipients_for(broker.server.port, list(apps.values()))
        clients = {app: await RawClient.connect(broker.server.port) for app in apps.values()}
        for app, client in clients.items():
            assert (await send_each(client, [app], "m0"))[app]["status"] == "ack"
        healthy = [app for port, app in apps.items() if port != frozen]
        local.procs[frozen].send_signal(signal.SIGSTOP)
        stalled = asyncio.ensure_future(send_each(clients[apps[frozen]], [apps[frozen]], "f1"))
        loop = asyncio.get_running_loop()
        until_time = loop.time() + 2.5 * broker.settings.owner_lease
        sent: list[str] = []
        while loop.time() < until_time:
            msgid = f"h{len(sent)}"
            for app in healthy:
                answer = (await send_each(clients[app], [app], msgid))[app]
                assert answer["status"] == "ack", (app, answer)
            sent.append(msgid)
            for app in healthy:  # pushed and settled meanwhile, not after the stall
                await until(lambda h=holders[app], m=msgid: m in h.msgids(), timeout=2)  # type: ignore[misc]
        assert set(healthy) <= set(broker.owned.owners.owned)
        for app in healthy:  # renewed all along: another broker could not take them
            assert await broker.store.redis.pttl(AppKeys.of(prefix, app).owner) > 0, app
        answer = (await asyncio.wait_for(stalled, 5))[apps[frozen]]
        assert answer["status"] == "error", answer
        local.procs[frozen].send_signal(signal.SIGCONT)
        back: list[str] = []

        async def stored_again() -> bool:
            app = apps[frozen]
            if (await send_each(clients[app], [app], f"b{len(back)}"))[app]["status"] == "ack":
                back.append(f"b{len(back)}")
            return len(back) >= 2

        await eventually(stored_again, timeout=30)
        await until(lambda: set(back) <= set(holders[apps[frozen]].msgids()), timeout=15)
        for client in clients.values():
            await client.close()
        for holder in holders.values():
            await holder.stop()
    finally:
        local.procs[frozen].send_signal(signal.SIGCONT)
        local.stop()


async def test_pull_long_polls_are_woken_with_the_subscriptions_master_down(
    make_broker: BrokerFactory, tmp_path: Path, prefix: str
) -> None:
    """The master the pull wake-ups' subscription is on, killed and left down: the
    broker subscribes again on another master (a PUBLISH reaches every node), so a long
    poll of an app on a healthy master hears its message at once, not when its wait
    ends."""
    local = LocalCluster(tmp_path / "c", masters=3).start()
    try:
        broker = await make_broker(redis_url=local.url)
        assert isinstance(broker.store.redis, RedisCluster)

        async def subscribed() -> bool:
            return bool(broker.wakeups.node)

        await eventually(subscribed)
        dead = broker.wakeups.node
        apps = one_app_a_master(broker.store.redis, broker.store, local.master_ports)
        app = next(a for port, a in apps.items() if dead != f"127.0.0.1:{port}")
        gateway = f"tcp://127.0.0.1:{broker.server.port}"
        async with PullConsumer(gateway, app, "g", wait=15, batch=10) as consumer:
            polling = asyncio.ensure_future(consumer.receive())
            local.kill(int(dead.rpartition(":")[2]))
            assert await produce(broker.server.port, ["p1"], app=app) == ["p1"]
            got = await asyncio.wait_for(polling, 5)  # (its wait: 15 s)
            assert [m.msgid for m in got] == ["p1"]
            await consumer.ack_all(got)
        assert broker.wakeups.node != dead
    finally:
        local.stop()


async def test_owner_replica_acks_after_a_failover_with_the_master_left_down(
    make_broker: BrokerFactory, tmp_path: Path, prefix: str
) -> None:
    """REPLICA_ACKS=1 on 3+3, a master killed and left down: its replica, promoted, has
    no replica of its own. Its app's stores are never answered `ack` (before the
    promotion, during it, after it: `error`), while the other masters' apps are acked
    all along; no message answered `ack` is lost."""
    local = LocalCluster(tmp_path / "c", masters=3, replicas=1).start()
    try:
        broker = await make_broker(redis_url=local.url, replica_acks=1)
        assert isinstance(broker.store.redis, RedisCluster)
        apps = one_app_a_master(broker.store.redis, broker.store, local.master_ports)
        holders = await recipients_for(broker.server.port, list(apps.values()))
        client = await RawClient.connect(broker.server.port)
        down = local.master_ports[1]
        lonely = apps[down]
        replica = local.client(local.ports[local.masters + 1])
        local.kill(down)
        acked: list[tuple[str, str]] = []

        n = 0
        give_up = asyncio.get_running_loop().time() + 30
        while n < 20 or not await promoted(replica):  # (stores all the while: none acked)
            n += 1
            answers = await send_each(client, list(apps.values()), f"m{n}")
            assert answers[lonely]["status"] == "error", answers[lonely]
            acked += [(app, f"m{n}") for app, r in answers.items() if r["status"] == "ack"]
            assert asyncio.get_running_loop().time() < give_up, "no promotion"
        replica.close()
        for k in range(n + 1, n + 6):  # promoted, with no replica: still never `ack`
            answers = await send_each(client, list(apps.values()), f"m{k}")
            assert answers.pop(lonely)["status"] == "error"
            assert all(r["status"] == "ack" for r in answers.values()), answers
            acked += [(app, f"m{k}") for app in answers]
        await client.close()
        for app, msgid in acked:
            await until(lambda a=app, m=msgid: m in holders[a].msgids(), timeout=10)  # type: ignore[misc]
        for holder in holders.values():
            await holder.stop()
    finally:
        local.stop()
