"""Harness side of the load processes, and the load run shared by every system.

`Child` starts one load process (`python -m bench.<module> ...`) and follows its
JSON event lines; `run_load` runs one scenario (recipients, then producers,
then the drain wait) against a `System` and computes the figures: rates,
latency percentiles, lost and duplicated messages, CPU per message. With
`LoadPlan.recipients_late` (the backlog's drain) the recipients start only once
every producer is done: the stored backlog's drain rate, lost and duplicated.
Every wait is bounded; every child is killed when the scenario ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import psutil

from bench.childio import msgid

BENCH_ROOT = Path(__file__).resolve().parent.parent


class BenchError(Exception):
    """A scenario could not run (setup failure, a child died, a timeout)."""


class Child:
    """One load process and its event stream."""

    def __init__(self, name: str, module: str, args: list[str], workdir: Path) -> None:
        self.name = name
        self.module = module
        self.args = args
        self.workdir = workdir
        self.result_path = workdir / f"{name}.result.json"
        self.log_path = workdir / f"{name}.log"
        self.proc: asyncio.subprocess.Process | None = None
        self.events: dict[str, dict[str, Any]] = {}
        self.progress: dict[str, Any] = {}
        self._changed = asyncio.Event()
        self._reader: asyncio.Task[None] | None = None

    async def start(self) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(BENCH_ROOT), env.get("PYTHONPATH", "")) if p
        )
        with open(self.log_path, "wb") as log:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                self.module,
                *self.args,
                "--result",
                str(self.result_path),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=log,
                env=env,
                cwd=str(BENCH_ROOT),
            )
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        while True:
            line = await self.proc.stdout.readline()
            if not line:
                break
            try:
                event = json.loads(line)
            except ValueError:
                continue
            name = str(event.get("event", ""))
            if name == "progress":
                self.progress = event
            else:
                self.events[name] = event
            self._changed.set()
        await self.proc.wait()
        self.events.setdefault("exit", {"code": self.proc.returncode})
        self._changed.set()

    def log_tail(self, n: int = 15) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    async def wait_event(self, name: str, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            if name in self.events:
                return self.events[name]
            if "exit" in self.events or "error" in self.events:
                raise BenchError(
                    f"{self.name} ended before '{name}': {self.events}\n{self.log_tail()}"
                )
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise BenchError(f"{self.name}: no '{name}' within {timeout:.0f}s")
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(remaining):
                    await self._changed.wait()

    def send(self, command: str) -> None:
        if self.proc is not None and self.proc.stdin is not None:
            with contextlib.suppress(Exception):
                self.proc.stdin.write(command.encode() + b"\n")

    async def result(self, timeout: float) -> dict[str, Any]:
        await self.wait_event("done", timeout)
        data: dict[str, Any] = json.loads(self.result_path.read_text())
        return data

    async def kill(self) -> None:
        proc = self.proc
        if proc is None:
            return
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGKILL)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(5):
                    await proc.wait()
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(BaseException):
                await self._reader


class System(Protocol):
    """What `run_load` needs from a system under test."""

    name: str

    def producer_cmd(
        self, index: int, count: int, rate: float, prefix: str
    ) -> tuple[str, list[str]]:
        """Module and arguments of producer `index`."""
        ...

    def recipient_cmd(self, index: int) -> tuple[str, list[str]]:
        """Module and arguments of recipient `index`."""
        ...

    def cpu(self) -> dict[str, float | None]:
        """CPU seconds used so far: {"broker": s, "redis": s or None}."""
        ...

    def alive(self) -> bool:
        """False once the system under test is known to be gone."""
        ...


@dataclass
class LoadPlan:
    scenario: str
    producers: int
    recipients: int
    messages: int
    rate: float = 0.0  # total messages/s of all producers; 0: as fast as possible
    window: int = 1000
    send_time: float = 30.0  # producers stop sending after this
    ack_wait: float = 20.0  # then wait this long for the last answers
    drain_time: float = 30.0  # then wait this long for the recipients to get everything
    settle_time: float = 0.5  # and this long more, to catch late duplicates
    deadline: float = 0.0  # unix time: every child's hard exit
    keys: int = 0  # ordering keys (SKMQ's key=): message n gets key k<n % keys>; 0: none
    # SKMQ's recipients register with caps (pipeline, length); False: without, as an
    # original peer does (one push a connection, docs/PROTOCOL.md 6.2).
    caps: bool = True
    # Msgids padded to this many characters (a uuid4 hex, as real producers send, is 32).
    msgid_length: int = 32
    # Start the recipients only after the producers are done (and `before_drain` ran):
    # they drain a stored backlog; `drain_time` caps the drain.
    recipients_late: bool = False


@dataclass
class LoadResult:
    system: str
    scenario: str
    producers: int = 0
    recipients: int = 0
    planned: int = 0
    sent: int = 0
    acked: int = 0
    failed: int = 0
    received: int = 0
    unique: int = 0
    duplicates: int = 0
    lost: int | None = None
    unexpected: int = 0
    unconfirmed_received: int = 0
    ingest_rate: float | None = None
    e2e_rate: float | None = None
    send_seconds: float | None = None
    e2e_seconds: float | None = None
    latency_ms: dict[str, float] = field(default_factory=dict)
    broker_cpu_us: float | None = None
    redis_cpu_us: float | None = None
    clients_cpu_us: float | None = None
    cpu_basis: int = 0
    stopped_early: bool = False
    # paced runs (plan.rate > 0): the schedule's rate, the rate the producers achieved
    # (msg/s, summed) and how far their sends fell behind the schedule at worst (ms)
    target_rate: float = 0.0
    achieved_rate: float | None = None
    lag_max_ms: float | None = None
    # recipients started after ingest (the backlog's drain): figures in extra["drain_*"]
    recipients_late: bool = False
    notes: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


def percentile(sorted_values: list[int], q: float) -> float:
    """Nearest-rank percentile of an ascending list."""
    if not sorted_values:
        return math.nan
    rank = max(math.ceil(q / 100.0 * len(sorted_values)), 1)
    return float(sorted_values[min(rank, len(sorted_values)) - 1])


def latency_summary(latencies_us: list[int]) -> dict[str, float]:
    values = sorted(latencies_us)
    if not values:
        return {}
    return {
        "p50": percentile(values, 50) / 1000.0,
        "p95": percentile(values, 95) / 1000.0,
        "p99": percentile(values, 99) / 1000.0,
        "max": values[-1] / 1000.0,
        "samples": float(len(values)),
    }


def _cpu_delta(a: dict[str, float | None], b: dict[str, float | None], key: str) -> float | None:
    x, y = a.get(key), b.get(key)
    if x is None or y is None:
        return None
    return y - x


async def run_load(
    system: System,
    plan: LoadPlan,
    workdir: Path,
    on_sample: Callable[[], None] | None = None,
    before_drain: Callable[[LoadResult], Awaitable[None]] | None = None,
) -> LoadResult:
    """Run one scenario; never raises for a load problem (see `LoadResult.error`).

    `before_drain` (with `plan.recipients_late`): awaited once the producers are done,
    before the recipients start (the backlog's memory figures)."""
    res = LoadResult(system=system.name, scenario=plan.scenario, target_rate=plan.rate)
    res.producers, res.recipients, res.planned = plan.producers, plan.recipients, plan.messages
    res.recipients_late = plan.recipients_late
    children: list[Child] = []
    try:
        await _run_load(system, plan, workdir, res, children, on_sample, before_drain)
    except BenchError as exc:
        res.error = str(exc)
    finally:
        await asyncio.gather(*(c.kill() for c in children), return_exceptions=True)
    return res


async def _run_load(
    system: System,
    plan: LoadPlan,
    workdir: Path,
    res: LoadResult,
    children: list[Child],
    on_sample: Callable[[], None] | None,
    before_drain: Callable[[LoadResult], Awaitable[None]] | None,
) -> None:
    common = ["--deadline", f"{plan.deadline:.3f}"]
    recipients: list[Child] = []
    if not plan.recipients_late:
        recipients = await _start_recipients(system, plan, workdir, children)

    producers: list[Child] = []
    per = plan.messages // plan.producers
    extra = plan.messages - per * plan.producers
    prefixes: list[str] = []
    for i in range(plan.producers):
        count = per + (1 if i < extra else 0)
        prefix = os.urandom(plan.msgid_length).hex()[: plan.msgid_length - 8]  # childio.msgid
        prefixes.append(prefix)
        module, args = system.producer_cmd(i, count, plan.rate / plan.producers, prefix)
        args = [
            *args,
            "--window",
            str(plan.window),
            "--send-time",
            f"{plan.send_time:.1f}",
            "--ack-wait",
            f"{plan.ack_wait:.1f}",
            *(["--keys", str(plan.keys)] if plan.keys else []),
            *common,
        ]
        child = Child(f"{plan.scenario}-producer{i}", module, args, workdir)
        children.append(child)
        producers.append(child)
        await child.start()
    for child in producers:
        await child.wait_event("ready", 30)

    cpu0 = _sample(system)
    for child in producers:
        child.send("go")
    producer_results: list[dict[str, Any]] = []
    for child in producers:
        budget = plan.send_time + plan.ack_wait + 15
        producer_results.append(await _wait_with_samples(child.result(budget), on_sample))
    cpu_after_ingest = _sample(system)

    res.sent = sum(int(r["sent"]) for r in producer_results)
    res.acked = sum(int(r["acked"]) for r in producer_results)
    failed_ids: set[str] = set()
    for r in producer_results:
        failed_ids.update(r["failed"])
        if r.get("failed_samples"):
            res.notes.append(f"{r['prefix']}: not acked, e.g. {r['failed_samples'][0]}")
        if r.get("connection_lost") and int(r["responses"]) < int(r["sent"]):
            res.notes.append(f"{r['prefix']}: connection lost after {r['responses']} answers")
        if int(r["responses"]) < int(r["sent"]):
            res.notes.append(f"{r['prefix']}: {int(r['sent']) - int(r['responses'])} unanswered")
    res.failed = len(failed_ids)
    res.stopped_early = any(bool(r.get("stopped_early")) for r in producer_results)
    if plan.rate > 0:
        # Producers run in parallel, each at its share of the rate: the rates add up.
        res.achieved_rate = sum(float(r.get("achieved_rate", 0.0)) for r in producer_results)
        res.lag_max_ms = max(float(r.get("lag_max_ms", 0.0)) for r in producer_results)
    t_start = min(int(r["t_start"]) for r in producer_results)
    t_end = max(int(r["t_end"]) for r in producer_results)
    res.send_seconds = max((t_end - t_start) / 1e9, 1e-9)
    res.ingest_rate = res.acked / res.send_seconds
    clients_cpu = sum(float(r.get("cpu_s", 0.0)) for r in producer_results)

    if plan.recipients_late or not recipients:
        # Ingest CPU, per acked message (a late drain's CPU goes to extra["drain_*"]).
        res.cpu_basis = res.acked
        _set_cpu(res, cpu0, cpu_after_ingest, clients_cpu)
        clients_cpu = 0.0
    cpu_drain0, t_drain0 = cpu_after_ingest, 0
    if plan.recipients_late and plan.recipients and res.acked:
        if before_drain is not None:
            await before_drain(res)
        if not system.alive():
            raise BenchError("the system under test is gone before the drain")
        cpu_drain0 = _sample(system)
        t_drain0 = time.time_ns()
        recipients = await _start_recipients(system, plan, workdir, children)
    if not recipients:
        return

    # Drain: wait until the recipients hold every acked message (bounded).
    t_wait0 = time.monotonic()
    deadline = t_wait0 + plan.drain_time
    capped = False  # the wait ended at its cap, not everything received
    while True:
        if time.monotonic() >= deadline:
            capped = True
            break
        if any("exit" in c.events for c in recipients) or not system.alive():
            break
        unique = sum(int(c.progress.get("unique", 0)) for c in recipients)
        if unique >= res.acked:
            break
        if on_sample is not None:
            on_sample()
        await asyncio.sleep(0.1)
    waited = time.monotonic() - t_wait0
    await asyncio.sleep(plan.settle_time)
    cpu1 = _sample(system)
    for child in recipients:
        child.send("stop")
    recipient_results = [await c.result(30) for c in recipients]

    acked_ids: set[str] = set()
    sent_ids: set[str] = set()
    for prefix, r in zip(prefixes, producer_results, strict=True):
        # SKMQ answers in order (unanswered: the tail); RabbitMQ producers list theirs.
        answered = int(r["sent"]) if "unanswered" in r else int(r["responses"])
        unanswered = set(r.get("unanswered", ()))
        for seq in range(int(r["sent"])):
            mid = msgid(prefix, seq)
            sent_ids.add(mid)
            if seq < answered and mid not in failed_ids and mid not in unanswered:
                acked_ids.add(mid)
    received: set[str] = set()
    latencies: list[int] = []
    t_last = 0
    for r in recipient_results:
        res.received += int(r["received"])
        received.update(r["msgids"])
        latencies.extend(int(x) for x in r["latencies_us"])
        t_last = max(t_last, int(r["t_last"]))
        clients_cpu += float(r.get("cpu_s", 0.0))
        if r.get("other_samples"):
            res.notes.append(f"{r['rid']}: unexpected frames, e.g. {r['other_samples'][0]!r}")
    res.unique = len(received)
    res.duplicates = res.received - res.unique
    res.lost = len(acked_ids - received)
    res.unexpected = len(received - sent_ids)
    res.unconfirmed_received = len((received & sent_ids) - acked_ids)
    if plan.recipients_late:
        # The drain of the stored backlog: from the recipients' start to the last receipt.
        # Latency (send to receipt) would only count the time spent stored: not reported.
        delivered = len(received & acked_ids)
        seconds = max((t_last - t_drain0) / 1e9, 1e-9) if t_last else None
        t_first = min((int(r["t_first"]) for r in recipient_results if r["t_first"]), default=0)
        res.extra["drain_delivered"] = delivered
        res.extra["drain_seconds"] = seconds
        res.extra["drain_rate"] = delivered / seconds if seconds else None
        res.extra["drain_first_receipt_s"] = (t_first - t_drain0) / 1e9 if t_first else None
        res.extra["drain_cap_s"] = plan.drain_time
        res.extra["drain_capped"] = capped
        res.extra["drain_waited_s"] = round(waited, 3)
        cpu_basis = max(res.unique, 1)
        for key in ("broker", "redis"):
            spent = _cpu_delta(cpu_drain0, cpu1, key)
            res.extra[f"drain_{key}_cpu_us"] = spent * 1e6 / cpu_basis if spent else None
        res.extra["drain_clients_cpu_us"] = clients_cpu * 1e6 / cpu_basis
        if capped:
            res.notes.append(
                f"backlog drain stopped at its cap ({plan.drain_time:.0f}s): "
                f"{delivered:,} of {res.acked:,} stored messages received"
            )
        return
    if t_last:
        res.e2e_seconds = max((t_last - t_start) / 1e9, 1e-9)
        res.e2e_rate = res.unique / res.e2e_seconds
    res.latency_ms = latency_summary(latencies)
    res.cpu_basis = res.unique
    _set_cpu(res, cpu0, cpu1, clients_cpu)


async def _start_recipients(
    system: System, plan: LoadPlan, workdir: Path, children: list[Child]
) -> list[Child]:
    """Start the plan's recipients and wait (bounded) until each one is registered."""
    common = ["--deadline", f"{plan.deadline:.3f}", *([] if plan.caps else ["--no-caps"])]
    recipients: list[Child] = []
    for i in range(plan.recipients):
        module, args = system.recipient_cmd(i)
        child = Child(f"{plan.scenario}-recipient{i}", module, [*args, *common], workdir)
        children.append(child)
        recipients.append(child)
        await child.start()
    for child in recipients:
        ready = await child.wait_event("ready", 30)
        if ready.get("registered") is False:
            raise BenchError(f"{child.name}: registration refused: {ready.get('answer')}")
    return recipients


def _set_cpu(
    res: LoadResult,
    before: dict[str, float | None],
    after: dict[str, float | None],
    clients_cpu: float,
) -> None:
    if res.cpu_basis <= 0:
        return
    broker = _cpu_delta(before, after, "broker")
    redis = _cpu_delta(before, after, "redis")
    res.broker_cpu_us = broker * 1e6 / res.cpu_basis if broker is not None else None
    res.redis_cpu_us = redis * 1e6 / res.cpu_basis if redis is not None else None
    res.clients_cpu_us = clients_cpu * 1e6 / res.cpu_basis
    # What the rest of the machine used meanwhile (a shared machine skews the figures).
    wall = _cpu_delta(before, after, "_wall")
    busy = _cpu_delta(before, after, "_busy")
    own = _cpu_delta(before, after, "_self")
    if wall and busy is not None and own is not None:
        ours = (broker or 0.0) + (redis or 0.0) + clients_cpu + own
        capacity = wall * (os.cpu_count() or 1)
        res.extra["machine_busy_pct"] = round(100.0 * busy / capacity, 1)
        res.extra["background_cpu_pct"] = round(100.0 * max(busy - ours, 0.0) / capacity, 1)


def _sample(system: System) -> dict[str, float | None]:
    """The system's CPU counters, plus the whole machine's busy time and ours."""
    out = dict(system.cpu())
    t = psutil.cpu_times()
    out["_busy"] = float(sum(t)) - float(t.idle) - float(getattr(t, "iowait", 0.0))
    out["_wall"] = time.monotonic()
    own = os.times()
    out["_self"] = own.user + own.system
    return out


async def _wait_with_samples(
    awaitable: Any,
    on_sample: Callable[[], None] | None,
) -> dict[str, Any]:
    task: asyncio.Task[dict[str, Any]] = asyncio.ensure_future(awaitable)
    try:
        while not task.done():
            if on_sample is not None:
                on_sample()
            await asyncio.wait({task}, timeout=0.25)
        return task.result()
    finally:
        task.cancel()
