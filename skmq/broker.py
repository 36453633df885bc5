"""The broker process: its Redis (embedded or REDIS_URL), the delivery log, the delivery
engine and the pipeline server, started and stopped in the right order."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import uuid
from collections.abc import Callable

import redis.asyncio as aioredis
import structlog
from redis.exceptions import RedisError

from skmq.config import Settings
from skmq.deliverylog import DeliveryLog
from skmq.embedded import EmbeddedRedis
from skmq.handler import Handler
from skmq.metrics import Metrics
from skmq.server import Server
from skmq.store import Store, connect_redis
from skmq.workers.engine import Engine
from skmq.workers.enqueue import Enqueuer

log = structlog.get_logger("skmq.broker")


def make_broker_id() -> str:
    host = re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname())[:32]
    return f"{host}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def make_store(settings: Settings, redis: aioredis.Redis) -> Store:
    return Store(
        redis,
        settings.key_prefix,
        retry_times=settings.retry_times,
        backoff=settings.retry_backoff,
        ack_timeout=settings.ack_timeout,
        dedupe_window=settings.dedupe_window,
    )


async def wait_for_redis(redis: aioredis.Redis, give_up: Callable[[], bool]) -> None:
    delay = 0.05
    while True:
        try:
            await redis.ping()
            return
        except (RedisError, OSError) as exc:
            if give_up():
                raise
            log.warning("redis unreachable, retrying", error=repr(exc), retry_in=delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)


class Broker:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.broker_id = settings.broker_id or make_broker_id()
        self.embedded: EmbeddedRedis | None = None
        self.stopping = asyncio.Event()

    def start_embedded_redis(self) -> str:
        """Start the embedded server (in the main thread: its death signal follows this thread)."""
        if self.settings.redis_url:
            return self.settings.redis_url
        self.embedded = EmbeddedRedis(self.settings.data_dir, self.settings.redis_appendfsync)
        self.embedded.start()
        log.info(
            "embedded redis started", url=self.embedded.url, data_dir=str(self.settings.data_dir)
        )
        return self.embedded.url

    async def start(self) -> None:
        s = self.settings
        url = self.start_embedded_redis()
        self.redis = connect_redis(url, s.redis_pool_size, s.store_timeout)
        await wait_for_redis(self.redis, self.stopping.is_set)
        self.store = make_store(s, self.redis)
        self.dlog = DeliveryLog(s.delivery_log_dir, self.broker_id, s.log_rotate_bytes)
        self.metrics = Metrics(self.store)
        self.dlog.listener = self.metrics.observe
        self.engine = Engine(s, self.store, self.dlog, self.broker_id, self.metrics.observe_latency)
        while True:
            try:
                await self.engine.start(orphans=self.embedded is not None)
                break
            except (RedisError, OSError) as exc:
                if self.stopping.is_set():
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
        )
        self.server = Server(s, Handler(s, self.enqueuer, self.engine))
        await self.server.start()
        if s.metrics_port:
            await self.metrics.serve(s.metrics_host, s.metrics_port, self.engine)
        log.info(
            "broker listening",
            host=s.host,
            port=self.server.port,
            broker=self.broker_id,
            redis=url,
            log_dir=str(s.delivery_log_dir),
        )

    async def stop(self) -> None:
        log.info("broker stopping", broker=self.broker_id)
        await self.server.stop_accepting()
        await self.server.stop(timeout=min(2.0, self.settings.shutdown_timeout))
        await self.enqueuer.drain()
        await self.engine.stop()
        await self.metrics.close()
        self.dlog.close()
        await self.redis.aclose()
        if self.embedded is not None:
            self.embedded.stop()
        log.info("broker stopped", broker=self.broker_id)


async def serve(settings: Settings) -> None:
    broker = Broker(settings)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, broker.stopping.set)
    try:
        await broker.start()
        await broker.stopping.wait()
    finally:
        if hasattr(broker, "server"):
            await broker.stop()
        elif broker.embedded is not None:
            broker.embedded.stop()
