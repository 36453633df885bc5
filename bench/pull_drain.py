"""Pull at NATS's pace: SKMQ's pull consumption (its public client, over TCP and over
HTTP) beside NATS JetStream pull consumers, in the same run, with the machine's load.

    python -m bench.pull_drain [--messages 50000] [--consumers 4] [--batch 100]
                               [--json [PATH]]

Scenarios, each system in turn (a fresh `skmq serve`, or a fresh NATS stream, each):

- drain: a backlog of `--messages` 100-byte messages is stored (not timed); then
  `--consumers` consumer processes (bench.pull_load) drain it, `--batch` at most a
  receive: SKMQ with `consumer.receive()` then `consumer.ack_all(msgs)` (one ack
  request a batch), NATS with one durable pull consumer shared by the processes,
  `fetch(batch)` then `msg.ack()` each. msg/s from the first receive to the last ack.
- drain-sent (SKMQ only): the same, the batch's `consumer.ack_all(msgs)` not awaited (it
  is sent at the end of the event-loop turn, as `msg.ack()` is): the ack goes with the
  next receive.
- drain-each (SKMQ only): the same through the README's loop: `async for msg in
  consumer`, each handled in `async with msg.leased()`, then `msg.ack()` (sent without
  waiting, with the other acks of the event-loop turn: one ack request a batch).
- drain-each-wait (SKMQ only): each `await msg.ack()` before the next message is taken:
  one ack request a message.
- drain-gather (SKMQ only): each message of a received batch handled in a task of its
  own that awaits its `msg.ack()` (`asyncio.gather`): the acks of the batch are made in
  one event-loop turn and go in one request.
- e2e: the consumers first, then `--producers` producers at full speed (SKMQ: the
  pipelined producer of `python -m bench`; NATS: js.publish_async, up to 1000 PubAcks
  outstanding, bench.nats_load): msg/s from the first send to the last receipt,
  send-to-receipt latency.

Server CPU is user+system time over the scenario: SKMQ's broker process and its
embedded redis-server; NATS's nats-server process (shared with whatever else uses
it: its delta over the run counts their work too).

Where a drain's time went (Linux), as shares of its wall time: the machine's idle CPU
(of all its CPUs), and for SKMQ the broker's event-loop thread and Redis's main thread,
each the time it ran on a CPU and the time it waited, runnable, for one
(/proc/PID/schedstat). A single-threaded server that waits for a CPU while the machine
has idle CPU is held back by where the scheduler put it, not by the broker's code.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psutil
import uvloop

from bench.harness import BenchError, Child, LoadPlan, latency_summary, run_load
from bench.report import add_json_flag, json_path
from bench.systems import NATS_URL, NatsSystem, SkmqBroker, free_port, port_open

APP = "bench"
GROUP = "drain"
BACKLOG_PRODUCERS = 4
SCENARIOS = ("drain", "drain-sent", "drain-gather", "drain-each", "drain-each-wait", "e2e")


class SkmqPull(SkmqBroker):
    """A fresh `skmq serve` (HTTP on) with the group the consumers share;
    its consumers on `transport` (tcp or http)."""

    def __init__(self, cmd: str, transport: str, batch: int) -> None:
        self.http_port = free_port()
        env = {"SKMQ_HTTP_PORT": str(self.http_port)}
        super().__init__(cmd, env, APP)
        self.name = f"skmq-{transport}"
        self.transport = transport
        self.batch = batch
        self.ack = "batch"
        self.wait_go = False

    async def start(self, timeout: float = 60.0) -> None:
        from skmq.pull.consumer import PullConsumer

        await super().start(timeout)
        # The group first: a message stored before an app has a group is in none.
        async with PullConsumer(f"tcp://{self.host}:{self.port}", APP, GROUP):
            pass

    def gateway(self) -> str:
        if self.transport == "tcp":
            return f"tcp://{self.host}:{self.port}"
        return f"http://{self.host}:{self.http_port}"

    def recipient_cmd(self, index: int) -> tuple[str, list[str]]:
        args = ["skmq", "--gateway", self.gateway(), "--app", APP, "--group", GROUP]
        args += ["--batch", str(self.batch), "--ack", self.ack, "--rid", f"c{index + 1}"]
        return "bench.pull_load", [*args, *(["--wait-go"] if self.wait_go else [])]


class NatsPull(NatsSystem):
    """A fresh file-stored stream and one durable pull consumer (explicit acks) that
    every consumer process fetches from."""

    def __init__(self, url: str, batch: int, consumers: int) -> None:
        super().__init__(url, f"skmqpull{os.urandom(4).hex()}")
        self.batch = batch
        self.consumers = consumers
        self.wait_go = False

    async def start(self) -> None:
        import nats
        from nats.js.api import AckPolicy, ConsumerConfig

        await self.reset()
        nc = await nats.connect(self.url, connect_timeout=10)
        try:
            js = nc.jetstream(timeout=10)
            # Room for every process's batch in flight (nats-server's default is 1000).
            pending = max(1000, 2 * self.batch * self.consumers)
            config = ConsumerConfig(
                durable_name=GROUP, ack_policy=AckPolicy.EXPLICIT, max_ack_pending=pending
            )
            await js.add_consumer(self.stream, config)
        finally:
            await nc.close()

    async def stop(self) -> None:
        await self.reset(delete=True)

    def recipient_cmd(self, index: int) -> tuple[str, list[str]]:
        args = ["nats", "--url", self.url, "--subject", self.subject, "--stream", self.stream]
        args += ["--durable", GROUP, "--batch", str(self.batch), "--rid", f"c{index + 1}"]
        return "bench.pull_load", [*args, *(["--wait-go"] if self.wait_go else [])]


System = SkmqPull | NatsPull


@dataclass
class Row:
    scenario: str
    system: str
    stored: int = 0  # drain: the backlog; e2e: acked to the producers
    delivered: int = 0  # distinct messages received
    rate: float | None = None
    seconds: float | None = None
    broker_cpu_us: float | None = None
    redis_cpu_us: float | None = None
    clients_cpu_us: float | None = None
    receive_ms: dict[str, float] = field(default_factory=dict)  # drain: a receive call
    latency_ms: dict[str, float] = field(default_factory=dict)  # e2e: send to receipt
    lost: int | None = None
    duplicates: int = 0
    error: str | None = None
    # drain: shares (%) of its wall time: the machine's idle CPU; SKMQ's broker loop and
    # Redis main thread, time run and time waited runnable for a CPU (None: not measured)
    idle_pct: float | None = None
    sched_pct: dict[str, tuple[float, float]] = field(default_factory=dict)

    @property
    def server_cpu_us(self) -> float | None:
        if self.broker_cpu_us is None:
            return None
        return self.broker_cpu_us + (self.redis_cpu_us or 0.0)


def per_message(
    before: dict[str, float | None], after: dict[str, float | None], key: str, basis: int
) -> float | None:
    """CPU µs a message of one server process (None: not measured)."""
    x, y = before.get(key), after.get(key)
    return None if x is None or y is None else (y - x) * 1e6 / max(basis, 1)


Window = tuple[float, float, dict[str, tuple[float, float] | None]]


def _window(system: System) -> Window:
    """Now (monotonic), the machine's idle CPU seconds (all CPUs), and the SKMQ
    servers' schedstat."""
    times = psutil.cpu_times()
    idle = times.idle + getattr(times, "iowait", 0.0)
    return time.monotonic(), idle, system.sched() if isinstance(system, SkmqPull) else {}


def _time_went(row: Row, before: Window, after: Window) -> None:
    """Row's idle_pct and sched_pct over the window between `before` and `after`."""
    wall = max(after[0] - before[0], 1e-9)
    row.idle_pct = 100 * (after[1] - before[1]) / (wall * (os.cpu_count() or 1))
    for key, start in before[2].items():
        end = after[2].get(key)
        if start is not None and end is not None:
            ran, waited = (100 * (e - s) / wall for s, e in zip(start, end, strict=True))
            row.sched_pct[key] = (ran, waited)


async def store_backlog(system: System, args: argparse.Namespace, workdir: Path) -> int:
    """Store `--messages` messages with BACKLOG_PRODUCERS pipelined producers; how many
    were acked."""
    children: list[Child] = []
    try:
        per, extra = divmod(args.messages, BACKLOG_PRODUCERS)
        for i in range(BACKLOG_PRODUCERS):
            prefix = os.urandom(16).hex()[:24]
            module, flags = system.producer_cmd(i, per + (i < extra), 0.0, prefix)
            flags += ["--window", "1000", "--send-time", f"{args.drain_time:.0f}"]
            flags += ["--deadline", f"{time.time() + args.drain_time + 60:.3f}"]
            children.append(Child(f"backlog-producer{i}", module, flags, workdir))
            await children[-1].start()
        for child in children:
            await child.wait_event("ready", 30)
        for child in children:
            child.send("go")
        results = [await c.result(args.drain_time + 45) for c in children]
        return sum(int(r["acked"]) for r in results)
    finally:
        await asyncio.gather(*(c.kill() for c in children), return_exceptions=True)


async def drain(system: System, args: argparse.Namespace, scenario: str, workdir: Path) -> Row:
    """Store the backlog, then time its drain by `--consumers` processes."""
    row = Row(scenario, system.name)
    row.stored = await store_backlog(system, args, workdir)
    if row.stored < args.messages:
        raise BenchError(f"backlog: {row.stored} of {args.messages} messages stored")
    system.wait_go = True
    consumers: list[Child] = []
    try:
        for i in range(args.consumers):
            module, flags = system.recipient_cmd(i)
            flags += ["--deadline", f"{time.time() + args.drain_time + 60:.3f}"]
            consumers.append(Child(f"{scenario}-{system.name}-c{i}", module, flags, workdir))
            await consumers[-1].start()
        for child in consumers:
            await child.wait_event("ready", 30)
        cpu0 = system.cpu()
        window0 = _window(system)
        for child in consumers:
            child.send("go")
        deadline = time.monotonic() + args.drain_time
        while time.monotonic() < deadline:
            if any("exit" in c.events for c in consumers):
                break
            if sum(int(c.progress.get("acked", 0)) for c in consumers) >= row.stored:
                break
            await asyncio.sleep(0.05)
        cpu1 = system.cpu()
        _time_went(row, window0, _window(system))
        for child in consumers:
            child.send("stop")
        results = [await c.result(30) for c in consumers]
    finally:
        await asyncio.gather(*(c.kill() for c in consumers), return_exceptions=True)
    got: set[str] = set()
    receive_us: list[int] = []
    for r in results:
        got.update(r["msgids"])
        receive_us += r["receive_us"]
    row.delivered = len(got)
    row.duplicates = sum(int(r["received"]) for r in results) - row.delivered
    row.lost = row.stored - row.delivered
    if not row.delivered:
        raise BenchError(f"nothing received within {args.drain_time:.0f}s")
    t_first = min(int(r["t_first"]) for r in results if r["t_first"])
    t_acked = max(int(r["t_acked"]) for r in results)
    row.seconds = max((t_acked - t_first) / 1e9, 1e-9)
    row.rate = row.delivered / row.seconds
    row.clients_cpu_us = sum(float(r["cpu_s"]) for r in results) * 1e6 / max(row.delivered, 1)
    row.broker_cpu_us = per_message(cpu0, cpu1, "broker", row.delivered)
    row.redis_cpu_us = per_message(cpu0, cpu1, "redis", row.delivered)
    row.receive_ms = latency_summary(receive_us)
    return row


async def e2e(system: System, args: argparse.Namespace, workdir: Path) -> Row:
    """Consumers, then producers at full speed: bench.harness's e2e run."""
    system.wait_go = False
    plan = LoadPlan(
        "e2e",
        args.producers,
        args.consumers,
        args.messages,
        send_time=args.drain_time,
        drain_time=args.drain_time,
        deadline=time.time() + 3 * args.drain_time + 90,
    )
    res = await run_load(system, plan, workdir)
    if res.error:
        raise BenchError(res.error)
    return Row(
        "e2e",
        system.name,
        stored=res.acked,
        delivered=res.unique,
        rate=res.e2e_rate,
        seconds=res.e2e_seconds,
        broker_cpu_us=res.broker_cpu_us,
        redis_cpu_us=res.redis_cpu_us,
        clients_cpu_us=res.clients_cpu_us,
        latency_ms=res.latency_ms,
        lost=res.lost,
        duplicates=res.duplicates,
    )


def make_system(name: str, args: argparse.Namespace) -> System:
    if name == "nats":
        return NatsPull(args.nats_url, args.batch, args.consumers)
    return SkmqPull(args.broker_cmd, name.removeprefix("skmq-"), args.batch)


async def run_one(name: str, scenario: str, args: argparse.Namespace, workdir: Path) -> Row:
    system = make_system(name, args)
    try:
        await system.start()
        if scenario == "e2e":
            return await e2e(system, args, workdir)
        if isinstance(system, SkmqPull) and scenario.startswith("drain-"):
            system.ack = scenario.removeprefix("drain-")
        return await drain(system, args, scenario, workdir)
    except Exception as exc:  # (a row of its own: the other systems still run)
        print(f"{scenario} {name} failed: {exc!s}", file=sys.stderr)  # (a child's log tail)
        return Row(scenario, name, error=(str(exc) or repr(exc)).splitlines()[0][:300])
    finally:
        await system.stop()


def fmt(value: float | None, spec: str = ",.0f") -> str:
    return "-" if value is None else format(value, spec)


def p50_p99(figures: dict[str, float]) -> str:
    if not figures:
        return "-"
    return f"{figures['p50']:.2f} / {figures['p99']:.2f}"


def table(rows: list[Row]) -> list[str]:
    head = (
        f"{'scenario':<12} {'system':<10} {'msg/s':>8} {'server µs/msg':>13} "
        f"{'(broker + redis)':>16} {'client µs/msg':>13} {'receive p50/p99 ms':>18} "
        f"{'e2e p50/p99 ms':>17} {'lost':>5} {'dup':>4}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        if r.error:
            lines.append(f"{r.scenario:<12} {r.system:<10} error: {r.error}")
            continue
        split = (
            ""
            if r.redis_cpu_us is None
            else f"({fmt(r.broker_cpu_us, '.1f')} + {fmt(r.redis_cpu_us, '.1f')})"
        )
        lines.append(
            f"{r.scenario:<12} {r.system:<10} {fmt(r.rate):>8} {fmt(r.server_cpu_us, '.1f'):>13} "
            f"{split:>16} {fmt(r.clients_cpu_us, '.1f'):>13} {p50_p99(r.receive_ms):>18} "
            f"{p50_p99(r.latency_ms):>17} {fmt(r.lost, 'd'):>5} {r.duplicates:>4}"
        )
    return lines


def time_went(rows: list[Row]) -> list[str]:
    """The drains' shares of wall time: idle CPU, and SKMQ's servers ran / waited."""
    lines = []
    for r in rows:
        if r.error or r.idle_pct is None:
            continue
        servers = "".join(
            f"; {key} ran {ran:.0f}%, waited for a CPU {waited:.0f}%"
            for key, (ran, waited) in r.sched_pct.items()
        )
        lines.append(f"{r.scenario:<12} {r.system:<10} machine idle {r.idle_pct:.0f}%{servers}")
    return lines


def ratios(rows: list[Row]) -> list[str]:
    """SKMQ's rows against NATS's of the same scenario (drain-sent, drain-gather,
    drain-each and drain-each-wait: NATS's drain)."""
    nats = {r.scenario: r for r in rows if r.system == "nats" and not r.error}
    lines = []
    for r in rows:
        base = nats.get("drain" if r.scenario.startswith("drain") else r.scenario)
        if r.system == "nats" or r.error or base is None:
            continue
        rate = r.rate / base.rate if r.rate and base.rate else None
        cpu = (
            r.server_cpu_us / base.server_cpu_us if r.server_cpu_us and base.server_cpu_us else None
        )
        lines.append(
            f"{r.scenario:<12} {r.system + '/nats':<15} msg/s {fmt(rate, '.2f')}x"
            f"   server CPU a message {fmt(cpu, '.2f')}x"
            + ("   (against NATS's drain)" if r.scenario.startswith("drain-") else "")
        )
    return lines


def loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


async def amain(args: argparse.Namespace) -> int:
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    host, _, port = args.nats_url.rpartition("/")[2].partition(":")
    if "nats" in systems and not await port_open(host, int(port or 4222), 2.0):
        print(f"NATS not answering at {args.nats_url}: skipped", file=sys.stderr)
        systems.remove("nats")
    started = datetime.now(UTC)
    load_start = loadavg()
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="skmq-pull-drain-") as tmp:
        for scenario in args.scenarios.split(","):
            for name in systems:
                if scenario.startswith("drain-") and name == "nats":
                    continue
                rows.append(await run_one(name, scenario, args, Path(tmp)))
                print(
                    f"  {scenario} {name}: {fmt(rows[-1].rate)} msg/s"
                    + (f" ({rows[-1].error})" if rows[-1].error else ""),
                    file=sys.stderr,
                    flush=True,
                )
    load_end = loadavg()
    out = [
        f"Pull consumption: {args.messages:,} messages of 100 B, "
        f"{args.consumers} consumer processes, batch {args.batch}; e2e: {args.producers} "
        f"producer(s) at full speed",
        f"load average (1, 5, 15 min): at start {load_start}; at end {load_end} "
        f"({os.cpu_count()} CPUs)",
        "",
        *table(rows),
        "",
        "Over each drain, shares of its wall time (idle: of all CPUs; the broker's event-loop "
        "and Redis's main thread):",
        *time_went(rows),
        "",
        "SKMQ / NATS (msg/s: above 1 is faster; server CPU a message: below 1 is cheaper)",
        *ratios(rows),
    ]
    print("\n".join(out), flush=True)
    if args.json is not None:
        path = json_path(args.json, "pull-drain", started)
        path.parent.mkdir(parents=True, exist_ok=True)
        payload: dict[str, Any] = {
            "date": started.isoformat(timespec="seconds"),
            "command": ["python", "-m", "bench.pull_drain", *sys.argv[1:]],
            "loadavg": {"start": load_start, "end": load_end},
            "results": [asdict(r) for r in rows],
        }
        path.write_text(json.dumps(payload, indent=2))
        print(f"\nJSON written to {path}")
    return 1 if any(r.error for r in rows) else 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.pull_drain",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--messages", type=int, default=50_000)
    p.add_argument("--consumers", type=int, default=4)
    p.add_argument("--batch", type=int, default=100, help="most messages a receive or fetch")
    p.add_argument("--producers", type=int, default=1, help="e2e: producers at full speed")
    p.add_argument("--systems", default="skmq-tcp,skmq-http,nats")
    p.add_argument("--scenarios", default="drain,drain-sent,drain-gather,drain-each,e2e")
    p.add_argument("--nats-url", default=NATS_URL)
    p.add_argument("--broker-cmd", default=f"{sys.executable} -m skmq.cli serve")
    p.add_argument(
        "--drain-time",
        type=float,
        default=300.0,
        help="cap, seconds, on storing the backlog, on its drain, on e2e's sending",
    )
    add_json_flag(p, "pull-drain")
    args = p.parse_args(argv)
    for name in args.systems.split(","):
        if name not in ("skmq-tcp", "skmq-http", "nats"):
            p.error(f"--systems: {name!r} is not one of skmq-tcp, skmq-http, nats")
    for name in args.scenarios.split(","):
        if name not in SCENARIOS:
            p.error(f"--scenarios: {name!r} is not one of {', '.join(SCENARIOS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    return uvloop.run(amain(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
