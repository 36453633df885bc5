"""Prometheus metrics and health (`/metrics`, `/healthz`, served by skmq/http/).

The hot path only bumps plain dict counters (every delivery-log event passes through
`observe`); they become Prometheus families at scrape time, when the depth gauges are
also read from Redis. Both routes answer within about PROBE_TIMEOUT whatever Redis
does (a stalled Redis leaves the last depths; /healthz then says why it is unhealthy).
"""

from __future__ import annotations

import asyncio
import bisect
import platform
import time
from collections import defaultdict
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from redis.exceptions import RedisError

from skmq import __version__
from skmq.clock import now_ms
from skmq.deliverylog import DeliveryLog
from skmq.logarchive import LogArchive
from skmq.pull.groups import GroupInfo, Groups
from skmq.queue.owned_store import OwnedStore
from skmq.store import AppCounts
from skmq.supervisor import Supervisor

if TYPE_CHECKING:
    from skmq.workers.engine import Engine
    from skmq.workers.enqueue import Enqueuer

# delivery-log event -> (metric name, help)
COUNTERS = {
    "received": ("skmq_messages_received_total", "Producer messages received"),
    "stored": ("skmq_messages_stored_total", "Messages stored in Redis"),
    "duplicate": ("skmq_messages_duplicate_total", "Producer messages refused as duplicates"),
    "pushed": ("skmq_pushes_total", "Pushes to recipients"),
    "arrived": ("skmq_messages_arrived_total", "Deliveries a recipient said had arrived"),
    "acked": ("skmq_messages_acked_total", "Deliveries acked by a recipient"),
    "rejected": ("skmq_messages_rejected_total", "Deliveries rejected by a recipient"),
    "errored": ("skmq_messages_errored_total", "Deliveries that failed at the recipient"),
    "timeout": ("skmq_delivery_timeouts_total", "Deliveries with no final answer in time"),
    "unreachable": ("skmq_delivery_unreachable_total", "Pushes to an unreachable recipient"),
    "retry_scheduled": ("skmq_retries_total", "Retries scheduled"),
    "dead_lettered": ("skmq_messages_dead_lettered_total", "Deliveries moved to the DLQ"),
    "replayed": ("skmq_messages_replayed_total", "Dead letters replayed"),
    "expired": ("skmq_messages_expired_total", "Messages whose TTL ran out before an ack"),
    "extended": ("skmq_lease_extensions_total", "Leases extended by a recipient or consumer"),
}
LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
    300,
)
# /healthz and /metrics answer within about this, whatever Redis does.
PROBE_TIMEOUT = 0.5
PROBE_INTERVAL = 1.0


def _by_app(name: str, documentation: str, values: Mapping[str, int]) -> Metric:
    """A counter with an `app` label, a sample an app."""
    family = CounterMetricFamily(name, documentation, labels=["app"])
    for app, value in sorted(values.items()):
        family.add_metric([_label(app)], value)
    return family


def _label(value: str) -> str:
    """A label value the exposition can encode: an app stored before app ids had to be
    text (bytes of the wire that were not UTF-8) shows with those bytes escaped."""
    if value.isascii():
        return value
    return value.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


class Metrics(Collector):
    def __init__(
        self,
        store: OwnedStore,
        dlog: DeliveryLog,
        archive: LogArchive,
        supervisor: Supervisor,
        volatile: str | None = None,
    ) -> None:
        self.store = store
        # Why the store may lose acked messages (a Redis without AOF, ALLOW_VOLATILE_REDIS):
        # a line of /healthz and skmq_store_volatile 1. None: it persists them.
        self.volatile = volatile
        self.dlog = dlog
        self.archive = archive
        self.supervisor = supervisor
        self.redis_restarts = 0
        self.redis_rtt: float | None = None
        self.counts: defaultdict[tuple[str, str], int] = defaultdict(int)
        self.latency: dict[str, list[int]] = {}
        self.latency_sum: defaultdict[str, float] = defaultdict(float)
        self._depths: dict[str, AppCounts] = {}
        self._recipients: dict[str, tuple[int, int]] = {}
        self._groups: dict[str, list[GroupInfo]] = {}
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        ProcessCollector(registry=self.registry)
        self._engine: Engine | None = None
        self._enqueuer: Enqueuer | None = None

    # -- hot path -------------------------------------------------------------
    def observe(self, event: str, app: str) -> None:
        self.counts[(event, app)] += 1

    def observe_latency(self, app: str, ms: int) -> None:
        buckets = self.latency.get(app)
        if buckets is None:
            buckets = self.latency[app] = [0] * (len(LATENCY_BUCKETS) + 1)
        seconds = ms / 1000
        buckets[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self.latency_sum[app] += seconds

    # -- scrape ---------------------------------------------------------------
    def collect(self) -> Iterator[Metric]:
        for event, (name, doc) in COUNTERS.items():
            counter = CounterMetricFamily(name, doc, labels=["app"])
            for (ev, app), value in sorted(self.counts.items()):
                if ev == event and app:
                    counter.add_metric([_label(app)], value)
            yield counter
        engine = self._engine
        yield _by_app(
            "skmq_unroutable_total",
            "Messages stored for an app with no recipient and no consumer group",
            engine.routes.total if engine is not None else {},
        )
        yield _by_app(
            "skmq_stores_held_total",
            "Batches of an app's new messages held for its deliveries: the broker's CPU "
            "full and its line of due messages past STORE_HOLD_BACKLOG",
            engine.store_hold.held if engine is not None else {},
        )
        hist = HistogramMetricFamily(
            "skmq_delivery_latency_seconds", "Time from stored to acked", labels=["app"]
        )
        for app, buckets in sorted(self.latency.items()):
            cumulative, running = [], 0
            for bound, count in zip((*LATENCY_BUCKETS, float("inf")), buckets, strict=True):
                running += count
                cumulative.append((str(bound) if bound != float("inf") else "+Inf", running))
            hist.add_metric([_label(app)], cumulative, self.latency_sum[app])
        yield hist
        gauges: dict[str, GaugeMetricFamily] = {
            "pending": GaugeMetricFamily("skmq_pending_messages", "Ready to push", labels=["app"]),
            "delayed": GaugeMetricFamily("skmq_delayed_messages", "Not due yet", labels=["app"]),
            "in_flight": GaugeMetricFamily(
                "skmq_inflight_messages", "Pushed, not answered", labels=["app"]
            ),
            "dead": GaugeMetricFamily("skmq_dead_letters", "In the DLQ", labels=["app"]),
        }
        for app, c in sorted(self._depths.items()):
            for key, family in gauges.items():
                family.add_metric([_label(app)], getattr(c, key))
        yield from gauges.values()
        recipients = GaugeMetricFamily(
            "skmq_recipients", "Registered recipients", labels=["app", "state"]
        )
        for app, (alive, lost) in sorted(self._recipients.items()):
            recipients.add_metric([_label(app), "alive"], alive)
            recipients.add_metric([_label(app), "lost"], lost)
        yield recipients
        yield from self._group_gauges()
        yield from self._ops()

    def _group_gauges(self) -> Iterator[Metric]:
        """Per consumer group (pull consumption): backlog, in flight, delayed, dead."""
        about = {
            "backlog": "Messages a consumer group has not received yet",
            "in_flight": "Messages a consumer group holds leased",
            "delayed": "Messages of a consumer group waiting for a delay or a retry",
            "dead": "Dead letters of a consumer group",
        }
        for attr, doc in about.items():
            family = GaugeMetricFamily(f"skmq_group_{attr}", doc, labels=["app", "group"])
            for app, infos in sorted(self._groups.items()):
                for info in infos:
                    family.add_metric([_label(app), _label(info.name)], getattr(info, attr))
            yield family

    def _ops(self) -> Iterator[Metric]:
        """The broker's own health: restarts, delivery-log trouble, Redis round trips."""
        restarts = CounterMetricFamily(
            "skmq_task_restarts", "Supervised task restarts after a failure", labels=["task"]
        )
        for task, n in sorted(self.supervisor.restarts.items()):
            restarts.add_metric([task], n)
        yield restarts
        counters = (
            ("skmq_embedded_redis_restarts", "Embedded Redis restarts", self.redis_restarts),
            ("skmq_delivery_log_errors",
             "Delivery-log writes that failed (a batch of lines, counted once however often "
             "it is retried)", self.dlog.errors),
            ("skmq_delivery_log_dropped_lines",
             "Delivery-log lines dropped (backlog full while writes failed)", self.dlog.dropped),
            ("skmq_delivery_log_files_compressed",
             "Closed delivery-log files compressed (by this broker)", self.archive.compressed),
            ("skmq_delivery_log_files_pruned",
             "Delivery-log files removed by LOG_RETENTION_BYTES or LOG_RETENTION_AGE",
             self.archive.pruned),
        )  # fmt: skip
        for name, documentation, value in counters:
            yield CounterMetricFamily(name, documentation, value=value)
        yield GaugeMetricFamily(
            "skmq_delivery_log_backlog_lines",
            "Delivery-log lines waiting for a write to succeed",
            value=self.dlog.backlog_lines,
        )
        yield GaugeMetricFamily(
            "skmq_store_volatile",
            "1: the store's Redis runs without AOF (ALLOW_VOLATILE_REDIS), so a restart of it "
            "loses the messages acked since its last snapshot",
            value=int(self.volatile is not None),
        )
        rtt = GaugeMetricFamily(
            "skmq_redis_roundtrip_seconds", "Last Redis PING round trip (NaN: no answer)"
        )
        rtt.add_metric([], self.redis_rtt if self.redis_rtt is not None else float("nan"))
        yield rtt
        build = GaugeMetricFamily(
            "skmq_build_info", "SKMQ version and Python", labels=["version", "python"]
        )
        build.add_metric([__version__, platform.python_version()], 1)
        yield build

    async def refresh(self) -> None:
        """Depth gauges from Redis (bounded: a stalled Redis leaves the last values)."""
        async with asyncio.timeout(PROBE_TIMEOUT):
            apps = await self.store.apps()
            self._depths = await self.store.counts(apps, now_ms())
            self._groups = await Groups(self.store).describe_apps(apps)
        if self._engine is not None:
            reg = self._engine.registry
            self._recipients = {
                app: (len(reg.alive(app)), len(reg.all(app)) - len(reg.alive(app))) for app in apps
            }

    async def probe(self) -> bool:
        """One bounded PING; records the round trip."""
        started = time.perf_counter()
        try:
            async with asyncio.timeout(PROBE_TIMEOUT):
                await self.store.redis.ping()
        except (RedisError, OSError, TimeoutError):
            self.redis_rtt = None
            return False
        self.redis_rtt = time.perf_counter() - started
        return True

    async def probe_loop(self) -> None:
        """Keep the Redis round-trip gauge fresh between scrapes (a supervised task)."""
        while True:
            await self.probe()
            await asyncio.sleep(PROBE_INTERVAL)

    async def health(self) -> tuple[bool, str]:
        """(serving, one line why, then a line of each standing caveat): within
        PROBE_TIMEOUT whatever Redis does."""
        serving, why = await self._serving()
        if self.volatile is not None:
            why += f"\nvolatile store: {self.volatile}"
        return serving, why

    async def _serving(self) -> tuple[bool, str]:
        if self._engine is None:
            return False, "unhealthy: the delivery engine is not running"
        if not self._engine.healthy:
            return (
                False,
                f"unhealthy: the delivery engine's Redis calls fail: {self._engine.trouble}",
            )
        if not await self.probe():
            return False, f"unhealthy: no answer from Redis within {PROBE_TIMEOUT:g}s"
        if self._enqueuer is not None and (refused := self._enqueuer.refusing) is not None:
            return True, f"degraded: messages are not stored: {refused}"
        if self.dlog.error is not None:
            return True, (
                f"degraded: delivery log not writable ({self.dlog.error}); "
                f"{self.dlog.backlog_lines} line(s) waiting, {self.dlog.dropped} dropped"
            )
        failing = self.supervisor.recent_failures()
        if failing:
            tasks = ", ".join(f"{task} ({n}x)" for task, n in sorted(failing.items()))
            return (
                True,
                f"degraded: tasks restarted in the last {self.supervisor.window:g}s: {tasks}",
            )
        return True, "ok"

    def attach(self, engine: Engine, enqueuer: Enqueuer) -> None:
        """The engine and the enqueue worker whose health /healthz reports."""
        self._engine = engine
        self._enqueuer = enqueuer
