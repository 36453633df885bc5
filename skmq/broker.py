"""The broker process: its Redis (embedded or REDIS_URL), the delivery log, the delivery
engine and the pipeline server, started and stopped in the right order."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import gc
import os
import re
import signal
import socket
import time
import uuid
from collections.abc import Iterator
from urllib.parse import urlsplit

import redis.asyncio as aioredis
import structlog
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisError

from skmq.admission import Admission
from skmq.aio import cancel_and_wait, unless_set
from skmq.auth import broker_tokens, push_signer
from skmq.clock import StoreClock, now_ms
from skmq.config import Settings
from skmq.deliverylog import DeliveryLog
from skmq.embedded import EmbeddedRedis, preloaded_allocator
from skmq.errors import Misconfigured, UsageError, redis_error_text
from skmq.handler import FrameHandler
from skmq.http import Gateway
from skmq.http.connections import ConnectionRoutes
from skmq.http.console import ConsoleRoutes
from skmq.http.dlq import DlqRoutes
from skmq.http.pull import PullApi, PullRoutes
from skmq.http.recipients import RecipientRoutes
from skmq.logarchive import LogArchive
from skmq.metrics import Metrics
from skmq.pull.groups import Groups
from skmq.pull.longpoll import LongPoll
from skmq.pull.trimmer import Trimmer
from skmq.pull.wakeups import Wakeups
from skmq.queue.migrate import convert_legacy
from skmq.queue.owned_store import OwnedStore
from skmq.queue.runtime import OwnerRuntime
from skmq.registry.own_addresses import OwnAddresses
from skmq.server import Server
from skmq.store import (
    EvictionWatch,
    check_eviction_policy,
    check_listpack_sizes,
    connect_redis,
    redacted,
    tcp_port,
)
from skmq.store.checks import check_persistence
from skmq.store.client import RedisClient
from skmq.store.disk import DiskSpace
from skmq.store.engine_mark import claim_store
from skmq.supervisor import Supervisor
from skmq.throughput import Throughput
from skmq.workers.engine import Engine
from skmq.workers.enqueue import Enqueuer

log = structlog.get_logger("skmq.broker")


def make_broker_id() -> str:
    host = re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname())[:32]
    return f"{host}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


async def wait_for_redis(redis: RedisClient, deadline: float, least: float) -> None:
    """Ping until Redis answers (every primary of a cluster), until `deadline` (monotonic),
    each ping bounded by the time left, but at least `least` (a server
    that accepts and never answers must not hold the start for a socket timeout and its
    retries, and a Sentinel's refusal takes its retries to tell); said once as a warning
    (then at debug level): a broker started before its Redis should not fill the
    terminal."""
    delay = 0.05
    say = log.warning
    every = {"target_nodes": RedisCluster.PRIMARIES} if isinstance(redis, RedisCluster) else {}
    while True:
        try:
            async with asyncio.timeout(max(least, deadline - time.monotonic())):
                await redis.ping(**every)
            return
        except (RedisError, OSError, TimeoutError) as exc:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                # A stop (SIGTERM, Ctrl-C) that reached redis-py's connect comes out of
                # it as a ConnectionError: a stop all the same, not a retry.
                raise asyncio.CancelledError from exc
            if time.monotonic() >= deadline:
                raise
            error = f"{type(exc).__name__}: {redis_error_text(exc) or 'no answer'}"
            say("redis unreachable, retrying (REDIS_WAIT)", error=error, retry_in=delay)
            say = log.debug
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)


def host_port(host: str, port: int) -> str:
    """`host:port`, an IPv6 address in brackets (`[::1]:1734`)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class BadAddress(UsageError):
    """HOST or METRICS_HOST is not an address this machine can listen on."""


@contextlib.contextmanager
def listening(host: str, port: int, settings: str) -> Iterator[None]:
    """A failure to listen as one line naming the address and its settings."""
    try:
        yield
    except OSError as exc:
        where = f"cannot listen on {host}:{port} ({settings})"
        if isinstance(exc, socket.gaierror) or exc.errno == errno.EADDRNOTAVAIL:
            raise BadAddress(f"{where}: not an address of this machine") from None
        why = "address already in use" if exc.errno == errno.EADDRINUSE else exc.strerror
        raise Misconfigured(f"{where}: {why}") from None


class Broker:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.broker_id = settings.broker_id or make_broker_id()
        # First, before anything starts: a bad AUTH_FILE or SIGNING_SECRET, or a public
        # address without auth, is one clear error (SecurityConfigError).
        self.tokens = broker_tokens(settings)
        self.signer = push_signer(settings)
        self.embedded: EmbeddedRedis | None = None
        self.stopping = asyncio.Event()
        # Why the broker stopped by itself (a task the supervisor could not keep alive).
        self.failure: str | None = None
        self.supervisor = Supervisor(self.fail, settings.task_max_restarts)
        self.owned: OwnerRuntime | None = None

    def fail(self, reason: str) -> None:
        """Stop the broker for a failure it cannot recover from (exit non-zero)."""
        if self.failure is None:
            self.failure = reason
            log.error("broker stopping after an unrecoverable failure", reason=reason)
        self.stopping.set()

    def start_embedded_redis(self) -> str:
        """Start the embedded server (in the main thread: its death signal follows this thread)."""
        if self.settings.redis_url:
            return self.settings.redis_url
        self.embedded = EmbeddedRedis(
            self.settings.data_dir, self.settings.redis_appendfsync, self.settings.redis_allocator
        )
        self.embedded.start()
        log.info(
            "embedded redis started",
            url=redacted(self.embedded.url),
            server=str(self.embedded.server),
            data_dir=str(self.settings.data_dir),
            allocator=preloaded_allocator(self.settings.redis_allocator) or "its own",
        )
        return self.embedded.url

    async def start(self) -> None:
        s = self.settings
        url = self.start_embedded_redis()
        self.redis = connect_redis(url, s.redis_pool_size, s.store_timeout)
        deadline = time.monotonic() + s.redis_wait
        try:
            waiting = wait_for_redis(self.redis, deadline, s.store_timeout)
            if not await unless_set(self.stopping, waiting):
                return  # stopped (SIGTERM, Ctrl-C) while waiting: not a failure
        except (RedisError, OSError, TimeoutError) as exc:
            raise Misconfigured(
                f"cannot reach Redis at {redacted(url)} within {s.redis_wait:g}s "
                f"(REDIS_WAIT): {redis_error_text(exc) or 'no answer'}"
            ) from None
        await check_eviction_policy(self.redis)
        volatile = await check_persistence(self.redis, s.allow_volatile_redis)
        await check_listpack_sizes(self.redis)
        clock = StoreClock(self.redis, s.clock_interval)
        await clock.follow()  # (before anything is stored: every time is the store's)
        self.supervisor.start("store-clock", clock.run)
        self.eviction = EvictionWatch(self.redis, s.redis_check_interval, s.store_timeout)
        self.supervisor.start("eviction-watch", self.eviction.run)
        self.store = OwnedStore.configured(s, self.redis)
        await convert_legacy(self.store, now_ms())  # (a store an earlier version wrote)
        await claim_store(self.redis, s.key_prefix)
        self.dlog = DeliveryLog(
            s.delivery_log_dir, self.broker_id, s.log_rotate_bytes, s.log_backlog_bytes
        )
        self.archive = LogArchive(s.delivery_log_dir, s.log_retention_bytes, s.log_retention_age)
        self.dlog.on_rotate = self.archive.wake
        self.supervisor.start("log-archive", self.archive.run)
        self.metrics = Metrics(self.store, self.dlog, self.archive, self.supervisor, volatile)
        self.dlog.listener = self.metrics.observe
        self.own = OwnAddresses()
        self.own.add_redis_url(url)
        if isinstance(self.redis, aioredis.Redis) and urlsplit(url).scheme == "unix":
            self.own.add("localhost", await tcp_port(self.redis))
        if isinstance(self.redis, RedisCluster):  # the nodes it found, not only the seeds
            for node in self.redis.get_nodes():
                self.own.add(node.host, node.port)
        self.own.add(s.host, s.port)
        if s.metrics_port:
            self.own.add(s.metrics_host, s.metrics_port)
        self.engine = Engine(
            s,
            self.store,
            self.dlog,
            self.broker_id,
            self.supervisor,
            self.metrics.observe_latency,
            own=self.own,
            signer=self.signer,
            throughput=Throughput(self.metrics.counts).last_minute,
        )
        self.owned = await OwnerRuntime.start(
            s,
            url,
            self.redis,
            self.store,
            self.broker_id,
            self.engine,
            self.supervisor,
            orphans=self.embedded is not None,
        )
        while True:
            try:
                await self.engine.start(orphans=self.embedded is not None)
                break
            except (RedisError, OSError) as exc:
                if self.stopping.is_set() or time.monotonic() > deadline:
                    raise
                log.warning("redis not ready for the engine, retrying", error=repr(exc))
                await asyncio.sleep(0.5)

        def stored(apps: set[str]) -> None:
            for app in apps:
                self.engine.notify(app)

        self.enqueuer = Enqueuer(
            self.store,
            self.dlog,
            stored,
            self.engine.note_apps,
            max_pending_bytes=s.max_store_pending_bytes,
            timeout=s.store_timeout,
            carry_claims=self.engine.apps.carry_claims,
            disk=(
                DiskSpace(self.embedded.redis_dir, s.disk_free_limit)
                if self.embedded is not None
                else None
            ),
            refusal=lambda: self.eviction.refusal,
            routes=self.engine.routes,
            hold=self.engine.store_hold,
        )
        self.metrics.attach(self.engine, self.enqueuer)
        self.groups = Groups(self.store, self.dlog)
        self.engine.store_hold.lines.append(self.groups.pace.behind)
        self.wakeups = Wakeups(self.redis, s.key_prefix)
        stalls = self.engine.stalls
        longpoll = LongPoll(self.groups, self.wakeups, s.pull_max_waiting, stalls.settled)
        self.pull = PullApi(
            s, self.groups, longpoll, self.dlog, self.engine.routes.mark, stalls.answered_ms
        )
        pull = PullRoutes(self.pull, self.tokens, self.engine.connections)
        dlq = DlqRoutes(self.store, self.dlog, self.tokens)
        console = ConsoleRoutes(self.store, self.dlog, self.tokens)
        admission = Admission(s)  # one count of connections for PORT and HTTP_PORT
        operator = (
            RecipientRoutes(self.store, self.dlog, self.tokens, self.engine.registry.unregister),
            ConnectionRoutes(self.store, self.tokens),
        )
        self.gateway = Gateway(
            s, self.metrics, self.enqueuer, pull, dlq, console, self.tokens, admission, operator
        )
        handler = FrameHandler(s, self.enqueuer, self.engine, self.tokens, self.pull)
        self.server = Server(s, handler, self.supervisor, admission)
        self.engine.connections.add_source(
            lambda: (c for conn in self.server.connections for c in conn.peer.described())
        )
        with listening(s.host, s.port, "HOST/PORT"):
            await self.server.start()
        self.own.add(s.host, self.server.port)
        if self.embedded is not None:
            keep = functools.partial(self.embedded.keep_running, self._embedded_restarted)
            self.supervisor.start("embedded-redis", keep)
        await self.start_gateway()
        log.info(
            "broker listening",
            **self.listening_addresses(),
            auth="on" if self.tokens is not None else "off",
            signed_pushes=self.signer is not None,
            broker=self.broker_id,
            redis=redacted(url),
            log_dir=str(s.delivery_log_dir),
        )

    def listening_addresses(self) -> dict[str, str]:
        """Every address the broker listens on, for its start-up line: the protocol port,
        the HTTP gateway ("off" with HTTP_PORT=0), and /metrics when on a port of its own."""
        s = self.settings
        where = {
            "protocol": host_port(s.host, self.server.port),
            "http": host_port(s.host, self.gateway.port) if self.gateway.port else "off",
        }
        if s.metrics_port:
            where["metrics"] = host_port(s.metrics_host, s.metrics_port)
        return where

    async def start_gateway(self) -> None:
        """The HTTP gateway on HOST:HTTP_PORT, /metrics and /healthz on METRICS_PORT."""
        s = self.settings
        if s.http_port:
            if self.own.used_by_broker(s.host, s.http_port):
                raise Misconfigured(
                    f"HTTP_PORT {s.http_port} is an address the broker uses already "
                    "(its Redis, PORT or METRICS_PORT)"
                )
            with listening(s.host, s.http_port, "HOST/HTTP_PORT"):
                await self.gateway.serve(s.host, s.http_port)
            self.own.add(s.host, s.http_port)
        # Long polls wait for these, over HTTP and on the TCP port alike.
        self.supervisor.start("pull-wakeups", self.wakeups.run)
        trimmer = Trimmer(self.groups, self.broker_id, s.group_log_trim_interval)
        self.supervisor.start("group-log-trim", trimmer.run)
        if s.metrics_port:
            with listening(s.metrics_host, s.metrics_port, "METRICS_HOST/METRICS_PORT"):
                await self.gateway.serve_health(s.metrics_host, s.metrics_port)
        if s.http_port or s.metrics_port:
            self.supervisor.start("redis-probe", self.metrics.probe_loop)

    def _embedded_restarted(self, status: int) -> None:
        self.metrics.redis_restarts += 1
        log.error("embedded redis exited, starting it again", status=status,
                  restarts=self.metrics.redis_restarts)  # fmt: skip

    async def stop(self) -> None:
        log.info("broker stopping", broker=self.broker_id)
        await self.server.stop_accepting()
        # Frames read are answered (a store waiting on Redis answers by STORE_TIMEOUT).
        await self.server.stop(timeout=self.settings.shutdown_timeout)
        await self.enqueuer.drain()
        await self.engine.stop()
        if self.owned is not None:
            await self.owned.stop()
        await self.gateway.close()
        await cancel_and_wait(self.supervisor.tasks)
        self.dlog.close()
        # Its last file too: closed now, compressed unless that takes too long (the next
        # sweep, of any broker sharing LOG_DIR, finishes it then).
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(
                asyncio.to_thread(self.archive.sweep), self.settings.shutdown_timeout
            )
        self.store.close()
        await self.redis.aclose()
        if self.embedded is not None:
            self.embedded.stop()
        log.info("broker stopped", broker=self.broker_id)


class BrokerFailed(RuntimeError):
    """The broker stopped by itself: the message says why, in one line."""


# Allocations between collections of young objects (CPython's default: 700).
GC_THRESHOLD = 100_000


def tune_gc() -> None:
    """Fewer cyclic collections: at the default threshold (700 allocations) a busy broker
    spent about 11% of its CPU in the collector (issue 19's profile), walking the same
    long-lived objects again and again. What exists once the broker started (modules,
    settings, connections) is frozen out of collections; young objects are collected
    every GC_THRESHOLD allocations. Reference counting still frees everything that is
    not in a cycle at once; cycles wait a little longer."""
    gc.freeze()
    gc.set_threshold(GC_THRESHOLD, 50, 1000)


async def serve(settings: Settings) -> None:
    """Run a broker until SIGTERM/SIGINT; raises BrokerFailed if it had to stop itself."""
    broker = Broker(settings)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, broker.stopping.set)
    try:
        await broker.start()
        tune_gc()
        await broker.stopping.wait()
    finally:
        if hasattr(broker, "server"):
            await broker.stop()
        else:
            await cancel_and_wait(broker.supervisor.tasks)
            if broker.embedded is not None:
                broker.embedded.stop()
    if broker.failure is not None:
        raise BrokerFailed(broker.failure)
