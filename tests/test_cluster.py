"""Redis Cluster as the store (`redis+cluster://`): the apps directory's race with
forget, the core delivery path, apps spread over the masters, several brokers and
kill -9 on a local 3-master cluster, and REPLICA_ACKS (WAIT) on a 3+3 one."""

from __future__ import annotations

import asyncio
import json
import signal
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster

from skmq.broker import Broker, Misconfigured
from skmq.client import Producer as ClientProducer
from skmq.clock import now_ms
from skmq.embedded import free_port
from skmq.embedded_cluster import LocalCluster
from skmq.queue.journal import AppKeys
from skmq.queue.owned_store import OwnedStore
from skmq.store import NewMessage, Store, connect_redis
from skmq.store.client import url_hosts
from skmq.store.wire import Wire
from tests.conftest import BrokerFactory, eventually
from tests.peers import FakeRecipient, RawClient
from tests.test_cli_ops import skmq
from tests.test_queue_owners import owners
from tests.test_reliability import (
    ACK_TIMEOUT,
    APP,
    Producer,
    Spawn,
    all_in,
    log_events,
    produce,
    shared,
    spawn,
    start_recipient,
    until,
)

__all__ = ["spawn"]  # the fixture, shared with tests/test_reliability.py

NOW = 1_700_000_000_000


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    local = LocalCluster(tmp_path_factory.mktemp("cluster"), masters=3)
    try:
        yield local.start()
    finally:
        local.stop()


@pytest.fixture
async def cluster_redis(cluster: LocalCluster) -> AsyncIterator[RedisCluster]:
    client = connect_redis(cluster.url)
    assert isinstance(client, RedisCluster)
    yield client
    await client.aclose()


# -- the apps directory and forget (any store: here the single Redis) ------------------


async def test_a_store_racing_a_forget_keeps_the_app(
    wire: Wire, redis: aioredis.Redis, prefix: str
) -> None:
    """forget = drop the empty app (one script) then take it out of its shard set; a
    store or a registration between the two must leave the app listed."""
    store = OwnedStore(redis, prefix)
    store.owners = await owners(wire, prefix, "a")
    await store.add_apps(["a", "r", "idle"])
    assert await store.drop_empty(["a", "r", "idle"]) == ["a", "r", "idle"]
    stored = await store.store({"a": [NewMessage("m1", "queue", b"x")]}, NOW)
    assert stored == {"a": [True]}
    await store.register("r", "rid", {"id": "rid"}, NOW, 10)
    assert await store.unlist(["a", "r", "idle"]) == ["idle"]
    assert await store.apps() == ["a", "r"]
    # The app holds its message: a later forget keeps it too.
    assert await store.forget_apps(["a"]) == []


# -- a 3-master cluster -------------------------------------------------------------


def test_cluster_url_hosts() -> None:
    url = "redis+cluster://:pw@h1:7000,h2,[::1]:7002"
    assert url_hosts(url, 6379) == [("h1", 7000), ("h2", 6379), ("::1", 7002)]


async def test_core_delivery_path_on_a_cluster(
    make_broker: BrokerFactory, cluster: LocalCluster, cluster_redis: RedisCluster
) -> None:
    """produce, push, ack; an error answer retried; always failing: dead letter. The URL
    names one node: the broker finds the others, and refuses them as recipients."""
    broker = await make_broker(redis_url=f"redis+cluster://127.0.0.1:{cluster.ports[0]}")
    assert all(broker.own.used_by_broker("127.0.0.1", p) for p in cluster.master_ports)
    client = await RawClient.connect(broker.server.port)
    node = {"id": "x", "app_id": APP, "host": "127.0.0.1", "port": cluster.master_ports[-1]}
    resp = await client.request("register", json.dumps(node).encode())
    assert resp["status"] == "reject" and "uses itself" in resp["content"], resp
    await client.close()
    tries: Counter[str] = Counter()

    def policy(frame: object) -> str:
        msgid = frame.fields["msgid"]  # type: ignore[attr-defined]
        tries[msgid] += 1
        if msgid.startswith("dead") or (msgid == "retry" and tries[msgid] == 1):
            return "error"
        return "ack"

    recipient = await FakeRecipient(APP, "r1", policy).start()
    assert (await recipient.register(broker.server.port))["status"] == "ack"
    sent = ["ok", "retry", "dead", "dead2", "dead3"]
    assert await produce(broker.server.port, sent) == sent
    prefix = broker.settings.key_prefix
    await all_in(cluster_redis, prefix, ["ok", "retry"], ("done",), 10)
    await all_in(cluster_redis, prefix, sent[2:], ("dead",), 10)
    assert tries["retry"] == 2 and tries["dead"] == broker.settings.retry_times
    dead = await broker.store.dead_letters(APP)
    assert sorted((d.msgid, d.attempts) for d in dead) == [
        (m, broker.settings.retry_times) for m in sent[2:]
    ]
    assert await broker.store.apps() == [APP]
    await recipient.stop()
    await _moved_across_masters(broker, cluster, cluster_redis)  # (to other masters)


async def _moved_across_masters(
    broker: Broker, cluster: LocalCluster, cluster_redis: RedisCluster
) -> None:
    """By the broker (the target's owner), by the CLI into an app the broker owns (asked
    of it) and into one no broker owns (appended to its inbox): each step one node's."""
    prefix = broker.settings.key_prefix
    home = cluster_redis.get_node_from_key(AppKeys.of(prefix, APP).dead)
    elsewhere = (
        name
        for name in (f"archive-{i}" for i in range(1000))
        if cluster_redis.get_node_from_key(AppKeys.of(prefix, name).dead) != home
    )
    owned, unowned = next(elsewhere), next(elsewhere)
    assert await broker.store.move(APP, owned, ["dead"], now_ms()) == [1]
    env = {"SKMQ_REDIS_URL": cluster.url, "SKMQ_KEY_PREFIX": prefix}
    for target, msgid in ((owned, "dead2"), (unowned, "dead3")):
        code, out, err = await asyncio.to_thread(
            skmq, "dlq", "replay", "--app", APP, "--to-app", target, msgid, env=env
        )
        assert (code, out.strip()) == (0, f"replay into {target}: 1 of 1 dead letter(s)"), err
    assert await broker.store.dead_letters(APP) == []
    assert sorted(w.msgid for w in await broker.store.peek(owned, 10, now_ms())) == [
        "dead",
        "dead2",
    ]
    await eventually(lambda: _waiting(broker, unowned, ["dead3"]))


async def _waiting(broker: Broker, app: str, msgids: list[str]) -> bool:
    """The broker owns `app` (it takes what the apps directory lists) and holds `msgids`."""
    try:
        return [w.msgid for w in await broker.store.peek(app, 10, now_ms())] == msgids
    except redis.RedisError:  # (not owned yet)
        return False


async def test_a_cluster_node_that_may_evict_is_refused(
    make_broker: BrokerFactory, cluster: LocalCluster
) -> None:
    node = aioredis.Redis(host="127.0.0.1", port=cluster.master_ports[-1])
    await node.config_set("maxmemory-policy", "allkeys-lru")
    try:
        with pytest.raises(Misconfigured, match="allkeys-lru"):
            await make_broker(redis_url=cluster.url)
    finally:
        await node.config_set("maxmemory-policy", "noeviction")
        await node.aclose()


async def test_24_apps_spread_over_every_master(
    make_broker: BrokerFactory, cluster: LocalCluster, prefix: str
) -> None:
    broker = await make_broker(redis_url=cluster.url)
    apps = [f"app{i}" for i in range(24)]
    client = await RawClient.connect(broker.server.port)
    for app in apps:
        assert (await client.request("queue", b"x", appid=app, msgid="m"))["status"] == "ack"
    await client.close()
    assert await broker.store.apps() == sorted(apps)
    apps_on: dict[int, set[str]] = {}
    shard_sets_on: dict[int, int] = {}
    for port in cluster.master_ports:
        node = aioredis.Redis(host="127.0.0.1", port=port)
        keys = [k.decode() async for k in node.scan_iter(match=f"{prefix}:*", count=1000)]
        await node.aclose()
        app_keys = [k for k in keys if k.startswith(f"{prefix}:{{")]
        apps_on[port] = {k.split("{")[1].split("}")[0] for k in app_keys}
        shard_sets_on[port] = sum(":apps:" in k for k in keys)
    assert all(apps_on.values()), apps_on
    assert set().union(*apps_on.values()) == set(apps)
    assert all(shard_sets_on.values()), "the apps directory is spread too"


async def test_two_brokers_on_a_cluster_deliver_each_message_once(
    spawn: Spawn, cluster: LocalCluster, cluster_redis: RedisCluster, prefix: str
) -> None:
    a = spawn("a", **shared(cluster.url, prefix))
    b = spawn("b", **shared(cluster.url, prefix))
    await asyncio.gather(a.up(), b.up())
    r1 = await start_recipient(a.port, "r1")
    r2 = await start_recipient(b.port, "r2")
    sent = [f"a-{i}" for i in range(100)], [f"b-{i}" for i in range(100)]
    acked = await asyncio.gather(produce(a.port, sent[0]), produce(b.port, sent[1]))
    msgids = acked[0] + acked[1]
    assert len(msgids) == 200
    await all_in(cluster_redis, prefix, msgids, ("done",), 15)
    received = Counter(r1.msgids() + r2.msgids())
    assert {m: c for m, c in received.items() if c != 1} == {}
    assert set(received) == set(msgids)
    events = log_events(a.log_dir(), b.log_dir())
    pushers = {e["broker"] for e in events if e["event"] == "pushed"}
    assert pushers <= {e["broker"] for e in events}
    assert len(pushers) == 1  # (the app's owner pushes)
    await r1.stop()
    await r2.stop()


async def test_kill9_of_a_broker_on_a_cluster_loses_nothing(
    spawn: Spawn, cluster: LocalCluster, cluster_redis: RedisCluster, prefix: str
) -> None:
    a = spawn("a", **shared(cluster.url, prefix))
    b = spawn("b", **shared(cluster.url, prefix))
    await asyncio.gather(a.up(), b.up())
    recipient = await start_recipient(b.port, "r1")
    producers = [Producer("p0"), Producer("p1")]
    tasks = [asyncio.create_task(p.run(a.port, batch=20, pause=0.01)) for p in producers]
    await until(lambda: len(recipient.received) >= 40)
    assert a.proc is not None
    a.proc.send_signal(signal.SIGKILL)
    await a.exited()
    await asyncio.wait_for(asyncio.gather(*tasks), 10)
    acked = [m for p in producers for m in p.acked]
    assert len(acked) >= 40
    await all_in(cluster_redis, prefix, acked, ("done",), 3 * ACK_TIMEOUT + 10)
    assert set(recipient.msgids()) >= set(acked)
    await recipient.stop()


async def test_a_retry_elsewhere_leaves_the_connections_in_use_alone(
    cluster_redis: RedisCluster, prefix: str
) -> None:
    """Issue 42, after a recovery: redis-py's cluster pipeline, failing to reach a node,
    closed every connection of the client before trying again, under the commands others
    were running on them ("Connection closed by server", `'NoneType' object has no
    attribute 'writelines'`). Here it only refreshes the slot map: a round trip running
    on another node meanwhile (a blocked BLPOP) ends as it would have."""
    key = f"{prefix}:{{retry}}:list"
    await cluster_redis.initialize()
    node = cluster_redis.get_node_from_key(key)
    running = asyncio.ensure_future(node.execute_command("BLPOP", key, 2))
    watcher = aioredis.Redis(host=node.host, port=node.port)

    async def blocked() -> bool:
        return any(c["cmd"] == "blpop" for c in await watcher.client_list())

    await eventually(blocked)
    await watcher.aclose()
    pipe = cluster_redis.pipeline()
    # (a node nobody listens on: the first try fails to connect, redis-py calls aclose
    # and tries again, sending the GET to the node of its key: redis-py drops the
    # target_nodes of the first try, the way WAIT went to another node)
    pipe.execute_command("GET", key, target_nodes=ClusterNode("127.0.0.1", free_port()))
    assert await pipe.execute() == [None]
    assert await running is None


# -- REPLICA_ACKS: WAIT before the producer's ack -----------------------------------


async def test_replica_acks_wait_for_replicas_or_refuse(
    make_broker: BrokerFactory, tmp_path: Path
) -> None:
    """On a 3+3 cluster, REPLICA_ACKS=1 acks once a replica has the message. With the
    replicas frozen (SIGSTOP), the WAIT on the connection that stored it times out: the
    producer gets `error` (outcome unknown), though the message is stored on its
    master; sent again once the replicas run, it is acked as a duplicate, delivered once."""
    local = LocalCluster(tmp_path / "c", masters=3, replicas=1).start()
    replicas = [local.procs[p] for p in local.ports[local.masters :]]
    try:
        broker = await make_broker(redis_url=local.url, replica_acks=1, replica_ack_timeout=0.3)
        client = await RawClient.connect(broker.server.port)
        assert (await client.request("queue", b"x", appid="w", msgid="m1"))["status"] == "ack"
        for proc in replicas:
            proc.send_signal(signal.SIGSTOP)
        resp = await client.request("queue", b"x", appid="w2", msgid="m2")
        assert resp["status"] == "error" and "outcome unknown" in resp["content"], resp
        assert "w2" in await broker.store.apps()  # stored on its master: listed
        for proc in replicas:
            proc.send_signal(signal.SIGCONT)
        resp = await client.request("queue", b"x", appid="w2", msgid="m2")
        assert resp["status"] == "ack" and "duplicate" in resp["content"], resp
        await client.close()
        counts = await broker.store.counts(["w", "w2"], NOW * 2)
        assert counts["w"].pending == 1 and counts["w2"].pending == 1
    finally:
        for proc in replicas:
            proc.send_signal(signal.SIGCONT)
        local.stop()


async def test_a_master_killed_fails_over_and_loses_no_acked_message(
    make_broker: BrokerFactory, tmp_path: Path, prefix: str
) -> None:
    """kill -9 of the master holding the app, with REPLICA_ACKS=1: its replica takes
    over; the broker follows (MOVED, a new slot map); every message acked before or
    after is delivered. (Until the old master is back as a replica, the new one has no
    replica: REPLICA_ACKS=1 answers `error` meanwhile, as it should.)"""
    local = LocalCluster(tmp_path / "c", masters=3, replicas=1).start()
    try:
        broker = await make_broker(redis_url=local.url, replica_acks=1)
        recipient = await start_recipient(broker.server.port, "r1")
        before = [f"before-{i}" for i in range(20)]
        assert await produce(broker.server.port, before) == before
        store_client = broker.store.redis
        assert isinstance(store_client, RedisCluster)
        master = store_client.get_node_from_key(f"{prefix}:{{{APP}}}:msgs")
        replica = local.client(local.ports[local.masters + local.master_ports.index(master.port)])
        local.kill(master.port)

        await eventually(lambda: promoted(replica), timeout=20)
        replica.close()
        # The old master comes back as a replica of the new one: REPLICA_ACKS=1 can hold.
        local.launch(master.port)
        after: list[str] = []

        async def stored_after_failover() -> bool:
            msgid = f"after-{len(after)}"
            after.extend(await produce(broker.server.port, [msgid]))
            return len(after) >= 20

        await eventually(stored_after_failover, timeout=30)
        await until(lambda: set(recipient.msgids()) >= set(before + after), timeout=20)
        await recipient.stop()
    finally:
        local.stop()


async def promoted(replica: redis.Redis) -> bool:
    """Whether a replica (the sync client LocalCluster.client gives) is a master now."""
    role = await asyncio.to_thread(replica.execute_command, "ROLE")
    return bool(role[0] in (b"master", "master"))


def one_app_a_master(client: RedisCluster, store: Store, ports: list[int]) -> dict[int, str]:
    """An app whose keys each master holds, by master port."""
    found: dict[int, str] = {}
    for i in range(1000):
        node = client.get_node_from_key(store.base(f"app{i}") + "msgs")
        found.setdefault(node.port, f"app{i}")
        if len(found) == len(ports):
            return found
    raise AssertionError(found)


async def test_a_master_down_fails_only_its_apps_and_says_so(
    make_broker: BrokerFactory, tmp_path: Path
) -> None:
    """Issue 42: one master of 3 killed (no replica: its slots stay unserved). Stores
    pipelined for an app of each master, in one write: the other masters' apps are
    acked; the dead one's hear `error`, `not stored` once its node refuses connections
    (never `ack`); the messages answered `ack` are stored, those `not stored` are not."""
    local = LocalCluster(tmp_path / "c", masters=3).start()
    try:
        broker = await make_broker(redis_url=local.url)
        store = broker.store
        assert isinstance(store.redis, RedisCluster)
        apps = one_app_a_master(store.redis, store, local.master_ports)
        down = local.master_ports[1]
        client = await RawClient.connect(broker.server.port)

        async def send_all(msgid: str) -> dict[int, dict[str, object]]:
            for app in apps.values():
                client.send("queue", b"x", appid=app, msgid=msgid)
            return {port: await client.resp() for port in apps}

        assert all(r["status"] == "ack" for r in (await send_all("m0")).values())
        # m0 in the node's AOF before the kill: appendfsync everysec lets Redis hold its
        # AOF buffer up to 2 s while an fsync is slow (a loaded disk; once seen in CI),
        # replies sent. A write of ours after m0's, fsynced (WAITAOF), covers it: the AOF
        # is written in order.
        node = local.client(down)
        node.set(store.base(apps[down]) + "aof-probe", 1)  # (a key of that node's slots)
        assert node.execute_command("WAITAOF", 1, 0, 5000)[0] == 1
        node.close()
        local.kill(down)
        for n in range(1, 4):
            resps = await send_all(f"m{n}")
            assert all(r["status"] == "ack" for p, r in resps.items() if p != down), resps
            dead = resps[down]
            assert dead["status"] == "error", dead
            assert str(dead["content"]).startswith(("not stored", "outcome unknown")), dead
        assert str(dead["content"]).startswith("not stored"), dead
        await client.close()
        for port, app in apps.items():
            if port != down:
                assert None not in await store.stored_of(app, ["m1", "m2", "m3"], NOW)
        local.launch(down)  # (its AOF: m0 is there, m3 never was)
        [m0, m3] = await store.stored_of(apps[down], ["m0", "m3"], NOW)
        assert m0 is not None and m3 is None
    finally:
        local.stop()


async def test_replica_acks_on_a_redis_without_replicas_refuses(
    make_broker: BrokerFactory,
) -> None:
    broker = await make_broker(replica_acks=1, replica_ack_timeout=0.1)
    client = await RawClient.connect(broker.server.port)
    resp = await client.request("queue", b"x", appid="w", msgid="m1")
    assert resp["status"] == "error", resp
    assert resp["content"].startswith("outcome unknown: stored on its master"), resp
    await client.close()


async def test_a_wait_for_missing_replicas_holds_up_no_lease_renewal(
    make_broker: BrokerFactory,
) -> None:
    """REPLICA_ACKS=1 on a Redis without replicas (a promoted master before its replica
    is back), REPLICA_ACK_TIMEOUT twice the lease (1.5 s): each store's WAIT holds its
    connection for 3 s. The owner's renewals do not wait behind it (they did: its
    lease ran out, and the other broker or itself took the app again at a new epoch)."""
    a = await make_broker(replica_acks=1, replica_ack_timeout=3.0)
    b = await make_broker(replica_acks=1, replica_ack_timeout=3.0)
    client = await RawClient.connect(a.server.port)
    assert (await client.request("queue", b"x", appid="w", msgid="m0"))["status"] == "error"

    def holders() -> dict[str, int]:
        return {
            x.broker_id: x.owned.ownership.held["w"].epoch
            for x in (a, b)
            if x.owned is not None and "w" in x.owned.ownership.held
        }

    async def held() -> bool:
        return bool(holders())

    await eventually(held)
    before = holders()
    owner = a if a.broker_id in before else b
    producers = [await RawClient.connect(owner.server.port) for _ in range(4)]

    async def produce_two(producer: RawClient, k: int) -> None:
        for i in range(2):  # (two rounds of WAITs: more than two leases)
            resp = await producer.request("queue", b"x", appid="w", msgid=f"m{k}-{i}")
            assert resp["status"] == "error" and "not confirmed" in resp["content"], resp
        await producer.close()

    await asyncio.gather(*(produce_two(p, k) for k, p in enumerate(producers)))
    assert holders() == before
    await client.close()


async def test_the_client_sends_an_unknown_outcome_again_with_the_same_msgid(
    make_broker: BrokerFactory,
) -> None:
    """REPLICA_ACKS=1 on a Redis without replicas: every store is stored, not confirmed
    (`outcome unknown`). Our client sends it again with the same msgid, unknown_retries
    times: one message is stored, the others are duplicates (the delivery log)."""
    broker = await make_broker(replica_acks=1, replica_ack_timeout=0.05)
    async with ClientProducer("127.0.0.1", broker.server.port, unknown_retries=2,
                        unknown_wait=0) as producer:  # fmt: skip
        resp = await producer.send("w", b"x", msgid="m1")
        assert resp.outcome_unknown and resp.msgid == "m1", resp
        [resp] = await producer.send_many("w", [b"y"])
        assert resp.outcome_unknown, resp
    counts = await broker.store.counts(["w"], NOW * 2)
    assert counts["w"].pending == 2
    events = log_events(broker.settings.delivery_log_dir)
    m1 = [e["event"] for e in events if e["msgid"] == "m1"]
    assert m1.count("stored") == 1 and m1.count("duplicate") == 2, m1


# -- docker/compose.cluster.yaml (no Docker engine here: checked, not run) ------------


def test_compose_cluster_file_is_valid_and_its_brokers_reach_the_cluster(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("check_jsonschema", reason="the compose-spec schema ships with it")
    yaml = pytest.importorskip("ruamel.yaml")
    from importlib.resources import files

    from skmq.config import Settings
    from tests.test_docker import DOCKER, environment, interpolate

    raw = yaml.YAML(typ="safe", pure=True).load((DOCKER / "compose.cluster.yaml").read_text())
    project = interpolate(raw, {})
    schema_file = files("check_jsonschema.builtin_schemas.vendor") / "compose-spec.json"
    schema = json.loads(schema_file.read_text())
    validator = jsonschema.validators.validator_for(schema)(schema)
    assert not sorted(validator.iter_errors(project), key=str)
    services = project["services"]
    nodes = {n for n, svc in services.items() if "--cluster-enabled" in svc.get("command", [])}
    assert len(nodes) == 6
    init = services["redis-cluster-init"]
    assert "--cluster-replicas 1" in init["command"][0]
    found = {n: s for n, s in services.items() if "SKMQ_REDIS_URL" in environment(s)}
    assert len(found) == 2
    for svc in found.values():
        for key, value in environment(svc).items():
            monkeypatch.setenv(key, value)
        settings = Settings.load()
        assert settings.replica_acks == 1
        assert {h for h, _ in url_hosts(settings.redis_url, 6379)} <= nodes
        assert svc["depends_on"]["redis-cluster-init"]["condition"] == (
            "service_completed_successfully"
        )


async def test_a_broker_waits_redis_wait_for_every_master_of_a_cluster(
    make_broker: BrokerFactory, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A master down when the broker starts: it waits (REDIS_WAIT) for every master,
    not only the one its first ping reached, and serves once the master is back."""
    local = LocalCluster(tmp_path / "c", masters=3).start()
    try:
        down = local.master_ports[-1]
        local.kill(down)
        starting = asyncio.ensure_future(make_broker(redis_url=local.url, redis_wait=60))
        said = []

        async def waiting() -> bool:
            said.append(capsys.readouterr().out)
            assert not starting.done() or starting.exception() is None, starting.exception()
            return "redis unreachable, retrying (REDIS_WAIT)" in "".join(said)

        await eventually(waiting, timeout=20)
        local.launch(down)
        broker = await asyncio.wait_for(starting, 60)
        assert await produce(broker.server.port, ["after"]) == ["after"]
    finally:
        local.stop()
