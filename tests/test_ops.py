"""Failure containment (issue 13): supervised tasks, a delivery log that cannot block
delivery, the embedded Redis kept alive and closed, health that never hangs."""

from __future__ import annotations

import asyncio
import ctypes.util
import errno
import itertools
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from redis.exceptions import AuthenticationError

from skmq.clock import now_ms
from skmq.codec import Frame
from skmq.deliverylog import DeliveryLog
from skmq.embedded import EmbeddedRedis, _write_private
from skmq.events import Event
from skmq.store.directory import shard_key
from skmq.store.engine_mark import OWNER, mark_key
from skmq.supervisor import Supervisor
from tests.conftest import BrokerFactory, BrokerProcess, eventually, free_port
from tests.disks import fill, small_disk
from tests.peers import FakeRecipient, RawClient
from tests.test_delivery import log_events
from tests.test_metrics import http_get


def metric(text: str, line_start: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(line_start + " "):
            return float(line.split()[-1])
    return None


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[EmbeddedRedis]:
    """A Redis of the test's own (never the session one): it gets stopped and stalled."""
    server = EmbeddedRedis(tmp_path / "own-redis")
    server.start()
    yield server
    if server.proc is not None and server.proc.poll() is None:
        server.proc.send_signal(signal.SIGCONT)
    server.stop()


# -- 1. supervision ----------------------------------------------------------------


async def test_supervisor_restarts_a_failing_task_with_backoff_and_counts_it() -> None:
    fatal: list[str] = []
    runs: list[float] = []
    healthy = asyncio.Event()

    async def flaky() -> None:
        runs.append(time.monotonic())
        if len(runs) <= 3:
            raise KeyError("host")
        healthy.set()
        await asyncio.Event().wait()

    sup = Supervisor(fatal.append, max_restarts=5)
    task = sup.start("refresh", flaky)
    async with asyncio.timeout(10):
        await healthy.wait()
    assert sup.restarts["refresh"] == 3 and not fatal
    gaps = [b - a for a, b in itertools.pairwise(runs)]
    # The backoff doubles from 0.1 s (a sleep is never early, a loaded machine only later).
    assert all(gap >= 0.1 * 2**i - 0.005 for i, gap in enumerate(gaps)), gaps
    task.cancel()
    async with asyncio.timeout(5):
        while sup.tasks:
            await asyncio.sleep(0.01)


async def test_supervisor_gives_up_on_a_task_that_keeps_failing() -> None:
    fatal: list[str] = []

    async def broken() -> None:
        raise ValueError("bad state")

    sup = Supervisor(fatal.append, max_restarts=2)
    task = sup.start("dispatch", broken, app="shop")
    async with asyncio.timeout(10):
        await task
    assert len(fatal) == 1 and "dispatch" in fatal[0] and "bad state" in fatal[0], fatal
    assert sup.restarts["dispatch"] == 3


async def test_a_recipient_record_of_another_shape_is_skipped_not_fatal(
    make_broker: BrokerFactory, redis: aioredis.Redis, prefix: str
) -> None:
    app = "odd"
    base = f"{prefix}:{{{app}}}:"
    await redis.set(mark_key(prefix), OWNER)  # (a store of this SKMQ's)
    await redis.sadd(shard_key(prefix, app), app)
    # Written by hand or an older release: no host, and one that is not even JSON.
    await redis.hset(base + "recipients", "old", json.dumps({"id": "old", "port": 9}))
    await redis.hset(base + "recipients", "junk", b"\xff not json")
    broker = await make_broker()  # starts beside the bad records
    assert broker.engine.registry.all(app) == []
    rec = await FakeRecipient(app, "good").start()
    assert (await rec.register(broker.server.port))["status"] == "ack"
    client = await RawClient.connect(broker.server.port)
    for i in range(5):
        assert (await client.request("queue", b"x", appid=app, msgid=f"m{i}"))["status"] == "ack"
    got = {(await rec.next_push()).fields["msgid"] for _ in range(5)}
    assert got == {f"m{i}" for i in range(5)}
    # A record of another shape written while the broker runs: the refresh goes on.
    await redis.hset(base + "recipients", "later", json.dumps({"id": "later", "host": None}))
    other = await FakeRecipient(app, "other").start()
    await redis.hset(
        base + "recipients",
        "other",
        json.dumps({"id": "other", "app_id": app, "host": "127.0.0.1", "port": other.port}),
    )

    async def refreshed() -> bool:
        return {r.id for r in broker.engine.registry.all(app)} == {"good", "other"}

    await eventually(refreshed)
    for i in range(5, 10):
        assert (await client.request("queue", b"x", appid=app, msgid=f"m{i}"))["status"] == "ack"

    def later() -> list[str]:
        pushed = [f.fields["msgid"] for f in rec.received + other.received]
        return sorted(m for m in pushed if m >= "m5")

    async def delivered() -> bool:
        return len(later()) >= 5

    await eventually(delivered)
    assert later() == [f"m{i}" for i in range(5, 10)]
    assert broker.supervisor.restarts == {}
    await other.stop()
    await client.close()
    await rec.stop()


def test_a_broker_process_starts_beside_a_bad_recipient_record(
    broker_process: BrokerProcess, broker_env: dict[str, str], own_redis: EmbeddedRedis
) -> None:
    import redis as syncredis

    client = syncredis.Redis.from_url(own_redis.url)
    client.set(mark_key("skmq"), OWNER)  # (a store of this SKMQ's)
    client.sadd(shard_key("skmq", "odd"), "odd")
    client.hset("skmq:{odd}:recipients", "old", json.dumps({"id": "old", "port": 9}))
    client.close()
    broker_env["SKMQ_REDIS_URL"] = own_redis.url
    broker_process.start()
    assert broker_process.proc is not None and broker_process.proc.poll() is None
    log = broker_process.log_path.read_text()
    assert "Traceback" not in log, log
    assert "recipient record skipped" in log and "problem=\"no field 'host'\"" in log, log
    status = subprocess.run(
        [sys.executable, "-m", "skmq.cli", "status", "--json"],
        env=broker_env, capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert status.returncode == 0, status.stderr
    (odd,) = [a for a in json.loads(status.stdout)["apps"] if a["appid"] == "odd"]
    assert [(r["id"], r["host"]) for r in odd["recipients"]] == [("old", None)]


def test_an_unrecoverable_failure_stops_the_broker_with_one_line(
    broker_process: BrokerProcess, broker_env: dict[str, str], tmp_path: Path
) -> None:
    """The embedded Redis dies and its port is taken: restarting cannot help, so the
    broker stops with a clear line and a non-zero status, never half alive."""
    broker_env["SKMQ_TASK_MAX_RESTARTS"] = "2"
    proc = broker_process.start().proc
    assert proc is not None
    info = json.loads((tmp_path / "data" / "redis.json").read_text())
    proc.send_signal(signal.SIGSTOP)  # so that it cannot restart Redis before we block it
    try:
        os.kill(int(info["pid"]), signal.SIGKILL)
        squatter = socket.socket()
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        deadline = time.monotonic() + 10
        while True:
            try:
                squatter.bind(("127.0.0.1", int(info["port"])))
                break
            except OSError:
                assert time.monotonic() < deadline, "the killed server's port stays busy"
                time.sleep(0.02)
        squatter.listen()
    finally:
        proc.send_signal(signal.SIGCONT)
    try:
        status = proc.wait(60)
    finally:
        squatter.close()
    log = broker_process.log_path.read_text()
    assert status == 1, log
    last = log.strip().splitlines()[-1]
    assert last.startswith("skmq serve: task embedded-redis failed"), log


# -- 2. the delivery log never blocks delivery -------------------------------------------


async def test_a_full_log_disk_never_blocks_delivery_and_recovers(
    make_broker: BrokerFactory, tmp_path: Path
) -> None:
    log_dir = tmp_path / "log"
    log_dir.mkdir()
    log_file = log_dir / "delivery-b1-000000.jsonl"
    log_file.symlink_to("/dev/full")  # every write: ENOSPC
    broker = await make_broker(broker_id="b1", log_dir=log_dir, metrics_port=free_port())
    mport = broker.settings.metrics_port
    rec = await FakeRecipient("full", "r").start()
    assert (await rec.register(broker.server.port))["status"] == "ack"
    client = await RawClient.connect(broker.server.port)
    async with asyncio.timeout(5):
        answers = await client.produce("full", [f"m{i}" for i in range(500)])
    assert {a["status"] for a in answers} == {"ack"}
    async with asyncio.timeout(10):
        pushed = {(await rec.next_push()).fields["msgid"] for _ in range(500)}
    assert len(pushed) == 500
    status, body = await http_get(mport, "/healthz")
    assert status == 200 and body.startswith("degraded: delivery log"), body
    _, text = await http_get(mport, "/metrics")
    assert (metric(text, "skmq_delivery_log_errors_total") or 0) > 0
    assert (metric(text, "skmq_delivery_log_backlog_lines") or 0) > 0

    log_file.unlink()  # room again: the kept lines reach the log

    async def written() -> bool:
        return log_file.exists() and log_file.read_text().count('"event":"stored"') == 500

    await eventually(written, 10)
    assert (await http_get(mport, "/healthz")) == (200, "ok\n")
    await client.close()
    await rec.stop()


async def test_log_lines_past_the_backlog_bound_are_dropped_and_counted(
    make_broker: BrokerFactory, tmp_path: Path
) -> None:
    log_dir = tmp_path / "log"
    log_dir.mkdir()
    (log_dir / "delivery-b2-000000.jsonl").symlink_to("/dev/full")
    broker = await make_broker(
        broker_id="b2", log_dir=log_dir, metrics_port=free_port(), log_backlog_bytes=0
    )
    mport = broker.settings.metrics_port
    client = await RawClient.connect(broker.server.port)
    for i in range(20):
        assert (await client.request("queue", b"x", appid="drop", msgid=f"m{i}"))["status"] == (
            "ack"
        )
    _, text = await http_get(mport, "/metrics")
    dropped = metric(text, "skmq_delivery_log_dropped_lines_total") or 0
    backlog = metric(text, "skmq_delivery_log_backlog_lines") or 0
    assert dropped > 0 and dropped + backlog == 40, text  # received + stored per message
    await client.close()


def test_a_failed_log_write_is_counted_once_however_often_it_is_retried(tmp_path: Path) -> None:
    log_file = tmp_path / "delivery-b3-000000.jsonl"
    log_file.symlink_to("/dev/full")  # every write: ENOSPC
    dlog = DeliveryLog(tmp_path, "b3")
    for i in range(10):  # no event loop: each line is its own write (batch)
        dlog.event(Event.STORED, f"m{i}", "app", "queue")
    for _ in range(5):  # retries of the same ten writes
        dlog.flush()
    assert (dlog.errors, dlog.backlog_lines, dlog.error) == (10, 10, "No space left on device")

    log_file.unlink()  # room again
    dlog._retry_flush()  # what the retry timer does: the file opened again, the lines written
    assert (dlog.errors, dlog.backlog_lines, dlog.error) == (10, 0, None)
    assert log_file.read_text().count('"event":"stored"') == 10
    dlog.close()


def test_a_log_directory_removed_by_an_operator_is_made_again(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    dlog = DeliveryLog(logs, "b4")
    dlog.event(Event.STORED, "m0", "app", "queue")
    shutil.rmtree(logs)  # the open file goes with it: writes to it reach nothing
    dlog._retry_flush()  # what the retry timer does after a failed write: opened again
    dlog.event(Event.STORED, "m1", "app", "queue")
    assert dlog.error is None
    assert (logs / "delivery-b4-000000.jsonl").read_text().count('"event":"stored"') == 1
    dlog.close()


# -- 3. the embedded Redis: supervised and closed ----------------------------------------


def test_the_embedded_redis_is_restarted_after_kill9_and_keeps_every_message(
    broker_process: BrokerProcess, broker_env: dict[str, str], tmp_path: Path
) -> None:
    mport = free_port()
    broker_env["SKMQ_METRICS_PORT"] = str(mport)
    broker_process.start()
    sent = subprocess.run(
        [sys.executable, "-m", "skmq.cli", "send", "--port", broker_env["SKMQ_PORT"],
         "--app", "keep", "kept"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert sent.returncode == 0, sent.stderr
    msgid = json.loads(sent.stdout)["msgid"]
    info = json.loads((tmp_path / "data" / "redis.json").read_text())
    os.kill(int(info["pid"]), signal.SIGKILL)
    killed = time.monotonic()

    def healthz() -> tuple[int, str]:
        return asyncio.run(http_get(mport, "/healthz"))

    while (
        healthz()[0] != 200
        or json.loads((tmp_path / "data" / "redis.json").read_text())["pid"] == info["pid"]
    ):
        assert time.monotonic() - killed < 15, "not healthy again within 15 s"
        time.sleep(0.1)
    _, text = asyncio.run(http_get(mport, "/metrics"))
    assert metric(text, "skmq_embedded_redis_restarts_total") == 1.0
    assert "embedded redis exited, starting it again" in broker_process.log_path.read_text()
    listed = subprocess.run(
        [sys.executable, "-m", "skmq.cli", "status", "--json"],
        env=broker_env, capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert listed.returncode == 0, listed.stderr
    apps = {a["appid"]: a for a in json.loads(listed.stdout)["apps"]}
    assert apps["keep"]["pending"] == 1, (msgid, apps)


def on_small_disk(broker_env: dict[str, str], data: Path, tmp_path: Path) -> int:
    """The broker's DATA_DIR `data` on a small disk, its log apart; returns the metrics
    port it gets."""
    mport = free_port()
    broker_env.update(SKMQ_DATA_DIR=str(data), SKMQ_METRICS_PORT=str(mport),
                      SKMQ_LOG_DIR=str(tmp_path / "log"),
                      SKMQ_DISK_FREE_LIMIT=str(1 << 20))  # fmt: skip
    return mport


async def test_the_embedded_redis_restarts_on_a_full_data_disk(
    broker_process: BrokerProcess, broker_env: dict[str, str], tmp_path: Path
) -> None:
    with small_disk(tmp_path / "disk") as disk:
        data = disk / "data"
        mport = on_small_disk(broker_env, data, tmp_path)
        try:
            await asyncio.to_thread(broker_process.start)
            info = json.loads((data / "redis.json").read_text())
            filler = fill(disk)
            os.kill(int(info["pid"]), signal.SIGKILL)

            async def restarted() -> bool:
                assert broker_process.proc is not None and broker_process.proc.poll() is None
                _, text = await http_get(mport, "/metrics")
                log = broker_process.log_path.read_text()
                return (
                    metric(text, "skmq_embedded_redis_restarts_total") == 1.0
                    and "its info file is not written" in log
                    and await http_get(mport, "/healthz") == (200, "ok\n")
                )

            await eventually(restarted, 20)
            log = broker_process.log_path.read_text()
            assert "Traceback" not in log and "task failed" not in log, log
            assert not list(data.rglob("*.tmp"))

            filler.unlink()  # room again: the restarted server takes messages
            sent = await asyncio.to_thread(
                subprocess.run,
                [sys.executable, "-m", "skmq.cli", "send", "--port", str(broker_process.port),
                 "--app", "full", "after"],
                capture_output=True, text=True, timeout=30,
            )  # fmt: skip
            assert sent.returncode == 0, sent.stderr
            _, text = await http_get(mport, "/metrics")
            assert metric(text, "skmq_embedded_redis_restarts_total") == 1.0
            assert await asyncio.to_thread(broker_process.terminate) == 0
        finally:
            if broker_process.proc is not None and broker_process.proc.poll() is None:
                broker_process.proc.kill()
                broker_process.proc.wait(10)


async def test_a_broker_killed_on_a_full_data_disk_starts_again_with_its_messages(
    broker_process: BrokerProcess, broker_env: dict[str, str], tmp_path: Path
) -> None:
    """kill -9 with the data disk full: the new start cannot write its info file
    (redis.json: the new server's pid), and serves all the same, what was stored kept."""
    with small_disk(tmp_path / "disk") as disk:
        mport = on_small_disk(broker_env, disk / "data", tmp_path)
        send = [sys.executable, "-m", "skmq.cli", "send", "--app", "full", "kept"]
        try:
            await asyncio.to_thread(broker_process.start)
            sent = await asyncio.to_thread(
                subprocess.run, [*send, "--port", str(broker_process.port)],
                capture_output=True, text=True, timeout=30,
            )  # fmt: skip
            assert sent.returncode == 0, sent.stderr
            fill(disk)
            await asyncio.to_thread(broker_process.kill)
            await asyncio.to_thread(broker_process.start)
            log = broker_process.log_path.read_text()
            assert "its info file is not written" in log and "Traceback" not in log, log

            async def counted() -> bool:  # (once the new start owns the app)
                _, text = await http_get(mport, "/metrics")
                return metric(text, 'skmq_pending_messages{app="full"}') == 1.0

            await eventually(counted, 10)
        finally:
            if broker_process.proc is not None and broker_process.proc.poll() is None:
                broker_process.proc.kill()
                broker_process.proc.wait(10)


def test_a_failed_private_write_leaves_no_temporary_file(tmp_path: Path) -> None:
    with small_disk(tmp_path / "disk", "64k") as disk:
        conf = disk / "skmq.conf"
        _write_private(conf, "requirepass x\n")
        before = conf.stat().st_mtime_ns
        filler = fill(disk)
        _write_private(conf, "requirepass x\n")  # unchanged: not written, no space needed
        assert conf.stat().st_mtime_ns == before
        with pytest.raises(OSError) as failed:
            _write_private(conf, "requirepass y" + "y" * 8192 + "\n")
        assert failed.value.errno == errno.ENOSPC
        assert sorted(p.name for p in disk.iterdir()) == ["filler", "skmq.conf"]
        assert conf.read_text() == "requirepass x\n"
        filler.unlink()


async def test_the_embedded_redis_is_loopback_only_with_a_private_password(
    tmp_path: Path,
) -> None:
    server = EmbeddedRedis(tmp_path / "d")
    server.start()
    try:
        for name in ("redis.json", "redis.secret"):
            mode = stat.S_IMODE((tmp_path / "d" / name).stat().st_mode)
            assert mode == 0o600, (name, oct(mode))
        info = json.loads((tmp_path / "d" / "redis.json").read_text())
        secret = (tmp_path / "d" / "redis.secret").read_text().strip()
        assert secret and f":{secret}@" in info["url"]
        anonymous = aioredis.Redis(host="127.0.0.1", port=server.port)
        with pytest.raises(AuthenticationError):
            await anonymous.set("k", "v")
        await anonymous.aclose()
        client = aioredis.Redis.from_url(server.url)
        bind = await client.config_get("bind")
        assert list(bind.values()) in ([b"127.0.0.1"], ["127.0.0.1"]), bind
        await client.aclose()
        assert secret not in " ".join(
            Path(f"/proc/{server.proc.pid}/cmdline").read_text().split("\0")  # type: ignore[union-attr]
        )
    finally:
        server.stop()
    with pytest.raises(ValueError, match="loopback only"):
        EmbeddedRedis(tmp_path / "e", host="0.0.0.0").start()
    # The same password after a restart: operator commands keep working.
    again = EmbeddedRedis(tmp_path / "d")
    again.start()
    try:
        assert f":{secret}@" in again.url
    finally:
        again.stop()


async def test_the_embedded_redis_runs_on_jemalloc_where_the_system_has_it(
    tmp_path: Path,
) -> None:
    """REDIS_ALLOCATOR `auto` preloads jemalloc into the embedded server when the system
    has it (skmq/embedded.py: JEMALLOC); `libc` leaves the server its own malloc."""
    system_has_it = ctypes.util.find_library("jemalloc") is not None
    for allocator, preloaded in (("auto", system_has_it), ("libc", False)):
        with EmbeddedRedis(tmp_path / allocator, allocator=allocator) as server:
            assert server.proc is not None
            maps = Path(f"/proc/{server.proc.pid}/maps").read_text()
            assert ("libjemalloc" in maps) == preloaded, allocator
            client = aioredis.Redis.from_url(server.url)
            assert await client.set("k", "v" * 1000) and await client.get("k") == b"v" * 1000
            await client.aclose()


# What the broker says of a Redis set to allkeys-lru, at start and while it runs.
EVICTING_REFUSAL = (
    "Redis maxmemory-policy is allkeys-lru: it would evict stored messages; "
    "set maxmemory-policy noeviction"
)


async def test_a_redis_that_evicts_keys_is_refused(
    own_redis: EmbeddedRedis, broker_env: dict[str, str]
) -> None:
    client = aioredis.Redis.from_url(own_redis.url)
    await client.config_set("maxmemory-policy", "allkeys-lru")
    await client.aclose()
    env = {**broker_env, "SKMQ_REDIS_URL": own_redis.url}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "skmq.cli", "serve",
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    async with asyncio.timeout(30):
        _, err = await proc.communicate()
    lines = err.decode().strip().splitlines()
    assert proc.returncode == 1 and "Traceback" not in err.decode(), err
    assert lines[-1] == f"skmq serve: {EVICTING_REFUSAL}"


async def test_a_redis_made_to_evict_keys_while_the_broker_runs_gets_nothing_stored(
    make_broker: BrokerFactory, own_redis: EmbeddedRedis
) -> None:
    """An operator sets an evicting maxmemory-policy on a running Redis: within
    REDIS_CHECK_INTERVAL producers get `error` naming it instead of `ack` (Redis might
    evict what was acknowledged), and once the policy evicts no more, stores go on."""
    broker = await make_broker(redis_url=own_redis.url, redis_check_interval=0.1)
    client = await RawClient.connect(broker.server.port)
    admin = aioredis.Redis.from_url(own_redis.url)
    answers: list[dict[str, str]] = []

    async def answer() -> dict[str, str]:
        answers.extend(await client.produce("evict", [f"m{len(answers)}"]))
        return answers[-1]

    assert (await answer())["content"] == "stored"
    await admin.config_set("maxmemory-policy", "allkeys-lru")

    async def refused() -> bool:
        a = await answer()
        return a["status"] == "error" and a["content"] == EVICTING_REFUSAL

    await eventually(refused)
    acked = sum(a["content"] == "stored" for a in answers)  # before the watch saw it
    assert (await broker.store.counts(["evict"], now_ms()))["evict"].pending == acked
    assert (await answer())["content"] == EVICTING_REFUSAL
    assert await broker.metrics.health() == (
        True, f"degraded: messages are not stored: {EVICTING_REFUSAL}"
    )  # fmt: skip
    await admin.config_set("maxmemory-policy", "noeviction")

    async def stored() -> bool:
        return (await answer())["content"] == "stored"

    await eventually(stored)
    assert await broker.metrics.health() == (True, "ok")
    await admin.aclose()


async def test_a_message_stored_after_its_store_timed_out_is_logged_stored(
    make_broker: BrokerFactory, own_redis: EmbeddedRedis
) -> None:
    """Redis stalled (SIGSTOP) past STORE_TIMEOUT: the producer hears `error` (it may be
    stored); Redis runs the script once it goes on. The next store that Redis answers
    has the broker look the message up, and log it `received` and `stored` (its own
    stored time), so that the audit finds it stored when it is pushed and acked."""
    broker = await make_broker(redis_url=own_redis.url, store_timeout=0.5)
    client = await RawClient.connect(broker.server.port)
    admin = aioredis.Redis.from_url(own_redis.url)
    [first] = await client.produce("uncertain", ["first"])  # (the app is known from now)
    assert first["content"] == "stored"
    assert own_redis.proc is not None
    os.kill(own_redis.proc.pid, signal.SIGSTOP)
    try:
        [late] = await client.produce("uncertain", ["late"])
    finally:
        os.kill(own_redis.proc.pid, signal.SIGCONT)
    assert late["status"] == "error" and "may be stored" in late["content"], late

    async def stored_anyway() -> bool:  # the write, queued on the stalled connection
        return (await broker.store.stored_of("uncertain", ["late"], now_ms())) != [None]

    await eventually(stored_anyway)
    assert log_events(broker, "late") == []
    [after] = await client.produce("uncertain", ["after"])
    assert after["content"] == "stored"

    async def logged() -> bool:
        return [e["event"] for e in log_events(broker, "late")] == ["received", "stored"]

    await eventually(logged)
    # and delivered, as any message stored
    rec = await FakeRecipient("uncertain", "r1").start()
    try:
        assert (await rec.register(broker.server.port))["status"] == "ack"
        got = {(await rec.next_push()).fields["msgid"] for _ in range(3)}
    finally:
        await rec.stop()
    assert got == {"first", "late", "after"}
    await client.close()
    await admin.aclose()


async def test_an_ack_recorded_after_its_finish_timed_out_is_logged_acked(
    make_broker: BrokerFactory, own_redis: EmbeddedRedis
) -> None:
    """Redis stalled (SIGSTOP) as an ack comes: the recorded ack's call times out (the
    connection's 10 s), the recipient hears `error`; Redis records the ack once it goes
    on, and the next ack that Redis answers has the broker look the first up and log it
    `acked`: not in flight for ever to the audit."""
    broker = await make_broker(redis_url=own_redis.url)
    assert own_redis.proc is not None
    pid = own_redis.proc.pid

    def ack_stalled(frame: Frame) -> str:
        if frame.fields["msgid"] == "first":  # Redis stops before the ack goes
            os.kill(pid, signal.SIGSTOP)
        return "ack"

    rec = FakeRecipient("unsure", "r1", ack_stalled)
    await rec.start()
    assert (await rec.register(broker.server.port))["status"] == "ack"
    client = await RawClient.connect(broker.server.port)
    admin = aioredis.Redis.from_url(own_redis.url)
    try:
        [first] = await client.produce("unsure", ["first"])
        assert first["content"] == "stored"

        async def told() -> bool:
            return bool(rec.resps)

        await eventually(told, timeout=30)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert json.loads(rec.resps[0].content or b"")["status"] == "error", rec.resps[0]

    async def recorded_anyway() -> bool:  # (0: settled within the dedupe window)
        return await broker.store.stored_of("unsure", ["first"], now_ms()) == [0]

    await eventually(recorded_anyway)
    assert "acked" not in [e["event"] for e in log_events(broker, "first")]
    [second] = await client.produce("unsure", ["second"])
    assert second["content"] == "stored"

    async def logged() -> bool:
        return "acked" in [e["event"] for e in log_events(broker, "first")]

    await eventually(logged)
    await client.close()
    await admin.aclose()
    await rec.stop()


# -- 4. health and metrics never hang ----------------------------------------------------


async def test_healthz_and_metrics_answer_within_a_second_while_redis_is_stalled(
    make_broker: BrokerFactory, own_redis: EmbeddedRedis
) -> None:
    broker = await make_broker(metrics_port=free_port(), redis_url=own_redis.url)
    mport = broker.settings.metrics_port
    assert (await http_get(mport, "/healthz"))[0] == 200
    _, text = await http_get(mport, "/metrics")
    assert (metric(text, "skmq_redis_roundtrip_seconds") or 1) < 0.5
    assert own_redis.proc is not None
    own_redis.proc.send_signal(signal.SIGSTOP)
    try:
        for path in ("/healthz", "/metrics", "/healthz"):
            started = time.monotonic()
            status, body = await http_get(mport, path)
            took = time.monotonic() - started
            assert took < 1.0, (path, took)
            if path == "/healthz":
                assert status == 503 and body.startswith("unhealthy"), body
            else:
                assert status == 200 and "skmq_build_info" in body
    finally:
        own_redis.proc.send_signal(signal.SIGCONT)

    async def healthy() -> bool:
        return (await http_get(mport, "/healthz"))[0] == 200

    await eventually(healthy, 15)


async def test_healthz_names_the_error_redis_answers(
    make_broker: BrokerFactory, own_redis: EmbeddedRedis
) -> None:
    """A Redis that refuses writes (here NOREPLICAS; MISCONF on a full disk): /healthz
    says what Redis says, not that it cannot be reached."""
    broker = await make_broker(metrics_port=free_port(), redis_url=own_redis.url)
    mport = broker.settings.metrics_port
    admin = aioredis.Redis.from_url(own_redis.url)
    await admin.config_set("min-replicas-to-write", 1)
    try:

        async def named() -> bool:
            status, body = await http_get(mport, "/healthz")
            return status == 503 and "NOREPLICAS" in body

        await eventually(named)
    finally:
        await admin.config_set("min-replicas-to-write", 0)
        await admin.aclose()


async def test_metrics_users_expect(make_broker: BrokerFactory) -> None:
    mport = (await make_broker(metrics_port=free_port())).settings.metrics_port
    _, text = await http_get(mport, "/metrics")
    from skmq import __version__

    assert f'skmq_build_info{{python="{sys.version.split()[0]}",version="{__version__}"}} 1.0' in (
        text
    )
    for name in (
        "process_cpu_seconds_total",
        "process_resident_memory_bytes",
        "process_open_fds",
        "skmq_redis_roundtrip_seconds",
        "skmq_delivery_log_errors_total",
        "skmq_embedded_redis_restarts_total",
    ):
        assert metric(text, name) is not None, name
    assert "# TYPE skmq_task_restarts_total counter" in text


async def test_task_restarts_are_counted_per_task_in_metrics(make_broker: BrokerFactory) -> None:
    broker = await make_broker(metrics_port=free_port())
    mport = broker.settings.metrics_port
    failures = 0
    recovered = asyncio.Event()

    async def flaky() -> None:
        nonlocal failures
        if failures < 2:
            failures += 1
            raise RuntimeError("boom")
        recovered.set()

    broker.supervisor.start("flaky", flaky)
    async with asyncio.timeout(10):
        await recovered.wait()
    _, text = await http_get(mport, "/metrics")
    assert metric(text, 'skmq_task_restarts_total{task="flaky"}') == 2.0, text
    assert await http_get(mport, "/healthz") == (
        200,
        "degraded: tasks restarted in the last 60s: flaky (2x)\n",
    )
