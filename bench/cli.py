"""`python -m bench`: SKMQ against NATS JetStream and RabbitMQ, end to end, from separate
processes.

Scenarios (each SKMQ scenario on a freshly started broker with its own
DATA_DIR and embedded Redis persisting with AOF):

- ingest:  4 pipelined producers, no recipients: producer to `resp ack`, msg/s.
- e2e:     4 pipelined producers + 4 recipients: first send to last receipt,
           msg/s; lost and duplicated messages; latency under load.
- ordered: e2e with `key=k<n % --keys>` on every message (per-key ordered
           delivery, SKMQ only): what ordering costs against e2e.
- base:    e2e with recipients that declare no `caps`, as the original SKMQ's do
           (one push a connection, docs/PROTOCOL.md 6.2; SKMQ only, 20,000 messages
           unless --messages): what the original discipline costs against e2e.
- latency: paced runs, one a rate of --latency-rates (default 1,000, 2,000 and
           10,000 msg/s; results paced-1k, paced-2k, paced-10k), 1 producer and
           1 recipient, --latency-time s each: send-to-receipt p50/p99/max, the rate
           the producer achieved, CPU per delivered message of the broker (and of
           SKMQ's Redis); with system `floor` (bench/floor_bench.py), what the
           protocol's steps alone cost through Redis at the same rate (no broker
           logic), and with `floor-bare-lifecycle` through a lifecycle cut to its
           bones.
- backlog: 1,000,000 messages ingested with no recipients: broker RSS and
           Redis `used_memory` growth per message (SKMQ only); then --recipients
           recipients drain it (capped at --drain-backlog-time): drain msg/s, the
           broker's RSS peak meanwhile, lost and duplicated.

The same ingest / e2e / paced scenarios run against NATS JetStream with nats-py
(file-stored stream, js.publish_async with the window's PubAcks outstanding, explicit
acks, max_ack_pending 100 a consumer process) when it listens on 127.0.0.1:4222, and
against RabbitMQ with aio-pika (durable queue, persistent messages, publisher confirms,
manual acks, prefetch 100) when it listens on 127.0.0.1:5672. Everything is bounded in
time: the run stops by itself, kills what it started and removes its files.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import uvloop

from bench.floor_bench import run_floor
from bench.harness import BenchError, LoadPlan, LoadResult, run_load
from bench.report import (
    add_json_flag,
    as_json,
    backlog_table,
    json_path,
    machine,
    paced_name,
    paced_table,
    results_table,
    targets,
)
from bench.systems import (
    NATS_URL,
    RABBIT_URL,
    ExternalSystem,
    NatsSystem,
    RabbitSystem,
    SkmqBroker,
    port_open,
)

LOAD_SCENARIOS = ("ingest", "e2e", "ordered", "base", "latency")
# SKMQ only: per-key ordered delivery (`key=`) and recipients without caps, against its
# e2e run.
SKMQ_ONLY = frozenset({"ordered", "base"})
ALL_SCENARIOS = (*LOAD_SCENARIOS, "backlog")
# The floors (bench/floor_bench.py: the protocol's steps through Redis, no broker logic;
# plain commands, or a lifecycle cut to its bones) run in the paced runs only; the last
# only when asked for.
FLOORS = {"floor": "plain", "floor-bare-lifecycle": "bare"}
DEFAULT_SYSTEMS = ("skmq", "nats", "rabbitmq", "floor")
ALL_SYSTEMS = ("skmq", "nats", "rabbitmq", *FLOORS)
PACED_ONLY = frozenset(FLOORS)

# Process groups of brokers still running: killed by the last-resort alarm.
_LIVE_BROKER_PGIDS: set[int] = set()


def msgid_length(value: str) -> int:
    n = int(value)
    if n < 9:
        raise argparse.ArgumentTypeError("at least 9: 8 hex digits number the messages")
    return n


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--messages",
        type=int,
        default=None,
        help="messages of the ingest and e2e scenarios (default: 200,000 ingest, 100,000 e2e)",
    )
    p.add_argument("--backlog-messages", type=int, default=1_000_000)
    p.add_argument(
        "--scenarios",
        default=",".join(ALL_SCENARIOS),
        help="comma-separated subset of ingest,e2e,ordered,base,latency,backlog (default: all; "
        "latency: the paced runs of --latency-rates; backlog only if it fits the time limit, "
        "unless --backlog)",
    )
    p.add_argument(
        "--systems",
        default=",".join(DEFAULT_SYSTEMS),
        help=f"{','.join(ALL_SYSTEMS)} (default: all but floor-bare-lifecycle; the floors: "
        "paced only)",
    )
    p.add_argument("--broker-cmd", default="skmq serve", help="command starting the SKMQ broker")
    p.add_argument(
        "--broker-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="extra environment for the broker (repeatable), e.g. SKMQ_PUSH_WINDOW=256",
    )
    p.add_argument("--rabbit-url", default=RABBIT_URL)
    p.add_argument("--nats-url", default=NATS_URL, help="a NATS server with JetStream")
    p.add_argument(
        "--quiet-wait",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="before each scenario, wait up to this long for the machine to be idle "
        "(other processes under 15%% CPU); for shared machines (default: 0, off)",
    )
    p.add_argument("--time-limit", type=float, default=450.0, help="seconds for the whole run")
    p.add_argument(
        "--backlog", action="store_true", help="run the backlog scenario even if it may not fit"
    )
    p.add_argument("--no-backlog", action="store_true", help="skip the backlog scenario")
    p.add_argument("--producers", type=int, default=4)
    p.add_argument("--recipients", type=int, default=4)
    p.add_argument("--window", type=int, default=1000, help="unanswered messages per producer")
    p.add_argument("--ingest-time", type=float, default=20.0, help="cap on ingest sending, s")
    p.add_argument("--e2e-time", type=float, default=25.0, help="cap on e2e sending, s")
    p.add_argument("--drain-time", type=float, default=30.0, help="wait for the last deliveries, s")
    p.add_argument(
        "--latency-rates",
        default="1000,2000,10000",
        help="msg/s of the paced runs (scenario latency), comma-separated: one run each, "
        "named paced-1k, paced-2k, ... (default: 1000,2000,10000)",
    )
    p.add_argument(
        "--latency-rate",
        type=float,
        default=None,
        metavar="RATE",
        help="a single paced run at RATE msg/s (same as --latency-rates RATE)",
    )
    p.add_argument("--latency-time", type=float, default=10.0, help="duration of each paced run, s")
    p.add_argument("--latency-recipients", type=int, default=1, help="recipients of the paced runs")
    p.add_argument(
        "--keys", type=int, default=1000, help="ordering keys of the ordered run (key=k<n %% keys>)"
    )
    p.add_argument(
        "--msgid-length",
        type=msgid_length,
        default=32,
        help="length of every msgid, hex digits (at least 9): 32 is a uuid4 in hex, what SKMQ's "
        "client and the original SKMQ's make; Redis holds each msgid twice (default: 32)",
    )
    p.add_argument("--backlog-time", type=float, default=150.0, help="cap on backlog sending, s")
    p.add_argument(
        "--drain-backlog-time",
        type=float,
        default=120.0,
        help="cap on the backlog's drain by --recipients recipients, s (0: no drain)",
    )
    add_json_flag(p, "bench")
    p.add_argument(
        "--keep-logs",
        action="store_true",
        help="keep the load processes' files and the brokers' DATA_DIRs and logs",
    )
    args = p.parse_args(argv)
    args.scenario_list = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    args.system_list = [s.strip() for s in args.systems.split(",") if s.strip()]
    for s in args.scenario_list:
        if s not in ALL_SCENARIOS:
            p.error(f"unknown scenario {s!r}")
    for s in args.system_list:
        if s not in ALL_SYSTEMS:
            p.error(f"unknown system {s!r}")
    rates = args.latency_rates if args.latency_rate is None else str(args.latency_rate)
    try:
        args.rate_list = list(dict.fromkeys(float(x) for x in rates.split(",") if x.strip()))
    except ValueError:
        p.error(f"--latency-rates needs numbers, got {rates!r}")
    if not args.rate_list or any(r <= 0 for r in args.rate_list):
        p.error(f"--latency-rates needs rates above 0, got {rates!r}")
    if args.no_backlog and "backlog" in args.scenario_list:
        args.scenario_list.remove("backlog")
    args.backlog_explicit = args.backlog or (
        "backlog" in args.scenario_list and args.scenarios != ",".join(ALL_SCENARIOS)
    )
    if args.backlog and "backlog" not in args.scenario_list:
        args.scenario_list.append("backlog")
    extra_env: dict[str, str] = {}
    for item in args.broker_env:
        name, eq, value = item.partition("=")
        if not eq:
            p.error(f"--broker-env needs NAME=VALUE, got {item!r}")
        extra_env[name] = value
    args.extra_env = extra_env
    if extra_env.get("SKMQ_AUTH_TOKEN"):
        # the load processes (they inherit this environment) authenticate with it
        os.environ["SKMQ_TOKEN"] = extra_env["SKMQ_AUTH_TOKEN"]
    return args


class Runner:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.t0 = time.monotonic()
        self.deadline: float = self.t0 + float(args.time_limit)
        self.results: list[LoadResult] = []
        self.notes: list[str] = []
        self.versions = {"rabbitmq": "-", "nats": "-"}
        self.workdir = Path(tempfile.mkdtemp(prefix="skmq-bench-run-"))

    def log(self, text: str) -> None:
        print(f"[{time.monotonic() - self.t0:6.1f}s] {text}", flush=True)

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def plan(
        self, scenario: str, send_time: float | None = None, rate: float = 0.0
    ) -> LoadPlan | None:
        """The scenario's load, capped to the time left (None: no time left); `latency`:
        the paced run at `rate` msg/s (named paced-<rate>)."""
        a = self.args
        remaining = self.remaining()
        if scenario == "ingest":
            plan = LoadPlan(
                scenario, a.producers, 0, a.messages or 200_000, send_time=a.ingest_time
            )
            plan.ack_wait, plan.drain_time = 10.0, 0.0
        elif scenario == "e2e":
            plan = LoadPlan(
                scenario, a.producers, a.recipients, a.messages or 100_000, send_time=a.e2e_time
            )
            plan.ack_wait, plan.drain_time = 10.0, a.drain_time
        elif scenario == "ordered":
            plan = LoadPlan(
                scenario, a.producers, a.recipients, a.messages or 100_000, send_time=a.e2e_time
            )
            plan.ack_wait, plan.drain_time, plan.keys = 10.0, a.drain_time, a.keys
        elif scenario == "base":
            plan = LoadPlan(
                scenario, a.producers, a.recipients, a.messages or 20_000, send_time=a.e2e_time
            )
            plan.ack_wait, plan.drain_time, plan.caps = 10.0, a.drain_time, False
        elif scenario == "latency":
            count = int(rate * a.latency_time)
            plan = LoadPlan(paced_name(rate), 1, a.latency_recipients, count, rate=rate)
            plan.send_time, plan.ack_wait, plan.drain_time = a.latency_time + 5.0, 10.0, 10.0
        else:
            # Stored with no recipient; then the recipients start and drain it.
            drain = a.drain_backlog_time > 0 and a.recipients > 0
            plan = LoadPlan(
                scenario,
                a.producers,
                a.recipients if drain else 0,
                a.backlog_messages,
                send_time=a.backlog_time,
            )
            plan.ack_wait, plan.drain_time = 15.0, a.drain_backlog_time if drain else 0.0
            plan.recipients_late = drain
        if send_time is not None:
            plan.send_time = send_time
        plan.window = a.window
        plan.msgid_length = a.msgid_length
        # Fit in the time left: sending, answers and drain, plus ~15 s of setup.
        overhead = 15.0
        budget = remaining - overhead
        if budget < 8.0:
            return None
        plan.ack_wait = min(plan.ack_wait, max(budget * 0.1, 2.0))
        plan.drain_time = min(plan.drain_time, max(budget * 0.3, 2.0)) if plan.drain_time else 0.0
        plan.send_time = min(plan.send_time, budget - plan.ack_wait - plan.drain_time)
        if plan.send_time < 3.0:
            return None
        plan.deadline = time.time() + plan.send_time + plan.ack_wait + plan.drain_time + 90.0
        return plan

    def skipped(self, system: str, scenario: str, why: str, rate: float = 0.0) -> None:
        res = LoadResult(
            system=system, scenario=scenario, target_rate=rate, error=f"skipped: {why}"
        )
        self.results.append(res)
        self.log(f"{system} {scenario}: skipped ({why})")

    async def run(self) -> None:
        a = self.args
        systems = list(a.system_list)
        if "rabbitmq" in systems and not await port_open("127.0.0.1", 5672, 2.0):
            systems.remove("rabbitmq")
            self.notes.append("RabbitMQ: nothing listens on 127.0.0.1:5672, not measured")
            self.log("RabbitMQ not listening on 127.0.0.1:5672: skipped")
        nats_host, _, nats_port = a.nats_url.rpartition("//")[2].partition(":")
        if "nats" in systems and not await port_open(nats_host, int(nats_port or 4222), 2.0):
            systems.remove("nats")
            self.notes.append(f"NATS: nothing listens at {a.nats_url}, not measured")
            self.log(f"NATS not listening at {a.nats_url}: skipped")
        load = [s for s in a.scenario_list if s in LOAD_SCENARIOS]
        # Scenario by scenario, the systems back to back: on a shared machine both
        # sides of a comparison then run under about the same conditions.
        # `latency` is one paced run a rate, each with every system back to back.
        runs = [
            (scenario, rate)
            for scenario in load
            for rate in (a.rate_list if scenario == "latency" else [0.0])
        ]
        for scenario, rate in runs:
            for system in systems:
                if scenario in SKMQ_ONLY and system != "skmq":
                    continue
                if system in PACED_ONLY and scenario != "latency":
                    continue
                await self.one(system, scenario, rate)
        if "backlog" in a.scenario_list and "skmq" in systems:
            await self.backlog()

    async def wait_quiet(self) -> None:
        """Wait (bounded by --quiet-wait) until the machine is about idle."""
        limit = min(float(self.args.quiet_wait), self.remaining() - 60.0)
        if limit <= 0:
            return
        end = time.monotonic() + limit
        busy = 100.0
        while time.monotonic() < end:
            busy = await machine_busy_pct(1.0)
            if busy < 15.0:
                return
        self.log(f"machine still {busy:.0f}% busy after {limit:.0f}s: going on")

    async def one(self, system: str, scenario: str, rate: float = 0.0) -> None:
        await self.wait_quiet()
        plan = self.plan(scenario, rate=rate)
        if plan is None:
            name = paced_name(rate) if scenario == "latency" else scenario
            self.skipped(system, name, "time limit", rate)
            return
        scenario = plan.scenario
        self.log(
            f"{system} {scenario}: {plan.messages:,} messages, {plan.producers} producers, "
            f"{plan.recipients} recipients" + (f", {plan.rate:,.0f} msg/s" if plan.rate else "")
        )
        if system == "skmq":
            res = await self.skmq(plan)
        elif system in FLOORS:
            res = await run_floor(plan.messages, plan.rate, FLOORS[system])
            res.scenario = plan.scenario
        elif system == "nats":
            stream = f"skmqbench{plan.scenario.replace('-', '')}{os.getpid()}"
            nats = NatsSystem(self.args.nats_url, stream, consumers=plan.recipients)
            res = await self.external(nats, plan)
        else:
            queue = f"skmq-bench-{plan.scenario}-{os.getpid()}"
            res = await self.external(RabbitSystem(self.args.rabbit_url, queue), plan)
        self.results.append(res)
        self.log(f"{system} {scenario}: {summary(res)}")

    async def skmq(self, plan: LoadPlan, backlog: bool = False) -> LoadResult:
        a = self.args
        broker = SkmqBroker(
            a.broker_cmd, a.extra_env, appid=f"bench-{plan.scenario}", keep=a.keep_logs
        )
        res: LoadResult | None = None
        try:
            try:
                await broker.start(timeout=min(60.0, max(self.remaining(), 5.0)))
            except BenchError as exc:
                return LoadResult(system="skmq", scenario=plan.scenario, error=str(exc))
            if broker.proc is not None:
                _LIVE_BROKER_PGIDS.add(broker.proc.pid)
            if broker.redis_ps is None:
                self.notes.append("SKMQ: no redis.json with a live pid: Redis CPU not measured")
            extra: dict[str, Any] = {}
            peak = [broker.rss()]

            def sample() -> None:
                peak[0] = max(peak[0], broker.rss())

            mem0: dict[str, int] = {}

            async def stored(res: LoadResult) -> None:
                """The backlog's memory figures, once every producer is done (and before
                a drain: then `peak` restarts, to hold the drain's RSS peak)."""
                if not res.acked:
                    return
                await asyncio.sleep(1.0)
                sample()
                mem1 = await self._redis_memory(broker)
                extra["broker_rss_after"] = broker.rss()
                extra["broker_rss_peak"] = peak[0]
                extra["redis_used_memory_after"] = mem1.get("used_memory")
                extra["redis_used_memory_rss"] = mem1.get("used_memory_rss")
                extra["redis_dbsize"] = mem1.get("dbsize")
                if mem0.get("used_memory") is not None and mem1.get("used_memory") is not None:
                    delta = mem1["used_memory"] - mem0["used_memory"]
                    extra["redis_used_memory_delta"] = delta
                    extra["redis_bytes_per_msg"] = delta / res.acked
                extra["aof_bytes"] = broker.aof_bytes()
                peak[0] = broker.rss()

            if backlog:
                mem0 = await self._redis_memory(broker)
                extra["broker_rss_before"] = broker.rss()
                extra["redis_used_memory_before"] = mem0.get("used_memory")
            res = await run_load(
                broker,
                plan,
                self.workdir,
                on_sample=sample,
                before_drain=stored if backlog else None,
            )
            if backlog and not plan.recipients_late:
                await stored(res)
            if backlog and plan.recipients_late and "broker_rss_after" in extra:
                # the drain's peak (the stored backlog's is broker_rss_peak)
                extra["drain_broker_rss_peak"] = max(peak[0], broker.rss())
            else:
                extra["broker_rss_peak"] = max(peak[0], broker.rss())
            extra["delivery_log_bytes"] = broker.delivery_log_bytes()
            if plan.keys:
                extra["keys"] = plan.keys
            res.extra.update(extra)
            if not broker.alive():
                rc = broker.proc.returncode if broker.proc else None
                msg = f"broker exited during the run (code {rc}; the harness had not stopped it)"
                res.error = f"{res.error}; {msg}" if res.error else msg
                res.notes.append(f"broker log (last lines):\n{broker.log_tail()}")
                res.notes.append(f"Redis log (last lines):\n{broker.redis_log_tail()}")
            else:
                tail = broker.log_tail(5)
                if tail.strip():
                    res.notes.append(f"broker log (last lines):\n{tail}")
            if a.keep_logs:
                res.notes.append(f"kept: {broker.data_dir} and {broker.log_path}")
            return res
        finally:
            await broker.stop()
            if res is not None:  # its last file compressed by the broker as it stopped
                res.extra["delivery_log_bytes_stopped"] = broker.log_bytes_stopped
            if broker.proc is not None:
                _LIVE_BROKER_PGIDS.discard(broker.proc.pid)

    async def _redis_memory(self, broker: SkmqBroker) -> dict[str, int]:
        try:
            async with asyncio.timeout(15):
                return await broker.redis_memory()
        except Exception as exc:
            self.notes.append(f"SKMQ: Redis INFO memory failed: {exc!r}")
            return {}

    async def external(self, system: ExternalSystem, plan: LoadPlan) -> LoadResult:
        """A scenario on RabbitMQ or NATS: its queue or stream made, the load, then dropped."""
        try:
            await system.reset()
        except Exception as exc:
            error = f"{system.label} setup: {exc!r}"
            return LoadResult(system=system.name, scenario=plan.scenario, error=error)
        self.versions[system.name] = system.version
        if not system.procs:
            self.notes.append(f"{system.label}: no {system.process_name} process visible: "
                              "broker CPU not measured")  # fmt: skip
        try:
            return await run_load(system, plan, self.workdir)
        finally:
            try:
                await system.reset(delete=True)
            except Exception as exc:
                self.notes.append(f"{system.label}: dropping the scenario's queue failed: {exc!r}")

    async def backlog(self) -> None:
        a = self.args
        ingest = next(
            (r for r in self.results if r.system == "skmq" and r.scenario == "ingest"), None
        )
        rate = ingest.ingest_rate if ingest is not None and ingest.ingest_rate else 20_000.0
        needed = a.backlog_messages / rate * 1.2 + 20.0
        if a.drain_backlog_time > 0 and a.recipients > 0:
            # at about SKMQ's e2e rate, if measured; else the cap
            e2e = [r for r in self.results if r.system == "skmq" and r.scenario == "e2e"]
            drain_rate = e2e[0].e2e_rate or 0.0 if e2e else 0.0
            drain = a.backlog_messages / drain_rate * 1.2 if drain_rate else a.drain_backlog_time
            needed += min(drain, a.drain_backlog_time) + 5.0
        if not a.backlog_explicit and needed > self.remaining():
            self.skipped(
                "skmq",
                "backlog",
                f"needs ~{needed:.0f}s at {rate:,.0f} msg/s, {self.remaining():.0f}s left"
                " (use --backlog)",
            )
            return
        await self.wait_quiet()
        plan = self.plan("backlog")
        if plan is None:
            self.skipped("skmq", "backlog", "time limit")
            return
        then = (
            f", then {plan.recipients} recipients drain it (cap {plan.drain_time:.0f}s)"
            if plan.recipients_late
            else ""
        )
        self.log(
            f"skmq backlog: {plan.messages:,} messages, {plan.producers} producers, "
            f"no recipients{then}"
        )
        res = await self.skmq(plan, backlog=True)
        self.results.append(res)
        self.log(f"skmq backlog: {summary(res)}")

    def cleanup(self) -> None:
        if self.args.keep_logs:
            print(f"load processes' files kept in {self.workdir}", flush=True)
        else:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def report(self, started: dt.datetime, argv: list[str]) -> str:
        m = machine()
        lines = [
            "",
            "# SKMQ benchmark",
            "",
            f"- date: {started.isoformat(timespec='seconds')}",
            f"- machine: {m['nproc']} CPUs, {m['cpu_model']}, Linux {m['kernel']}, "
            f"Python {m['python']}",
            f"- command: python -m bench {' '.join(argv)}".rstrip(),
            f"- SKMQ broker: `{self.args.broker_cmd}` (fresh DATA_DIR per scenario, "
            "embedded Redis, AOF)"
            + (f", env {self.args.extra_env}" if self.args.extra_env else ""),
            f"- RabbitMQ: {self.versions['rabbitmq']} via aio-pika: durable queue, persistent "
            "messages, publisher confirms, manual acks, prefetch 100",
            f"- NATS JetStream: {self.versions['nats']} via nats-py: file-stored stream, "
            "js.publish_async (a message acked on its PubAck), one durable consumer (queue "
            "group), explicit acks, max_ack_pending 100 a consumer process",
            f"- load: {self.args.producers} producers ({self.args.window} unanswered each) and "
            f"{self.args.recipients} recipients, one process each; 100-byte bodies, "
            f"{self.args.msgid_length}-character msgids; paced runs "
            + ", ".join(f"{r:,.0f}" for r in self.args.rate_list)
            + f" msg/s for {self.args.latency_time:.0f}s each, 1 producer, "
            f"{self.args.latency_recipients} recipient(s)",
            f"- total time: {time.monotonic() - self.t0:.0f}s",
            "",
        ]
        rt = results_table(self.results)
        if rt:
            lines += [
                rt,
                "",
                "ingest msg/s: producer to `resp ack` (publisher confirm for RabbitMQ); e2e "
                "msg/s: first send to last receipt; latency: send to recipient receipt (wall "
                "clock across processes); CPU: user+system of the broker process (beam.smp for "
                "RabbitMQ, nats-server for NATS) and of its Redis, per acked (ingest) or "
                "delivered message; clients: the load processes; other CPU %: CPU used by the "
                "rest of the machine meanwhile (of all cores).",
            ]
        pt = paced_table(self.results)
        if pt:
            lines += [
                *([""] if rt else []),
                "Paced runs:",
                "",
                pt,
                "",
                "target/achieved msg/s: the producer's schedule and the rate it held (messages "
                "sent over the schedule's span); behind ms: how far its sends fell behind the "
                "schedule at worst (latency counts from the actual send); p50/p99/max: send to "
                "receipt; CPU µs per delivered message, user+system, from the producer's start "
                "to 0.5 s after the last delivery: broker = `skmq serve` (Redis apart), "
                "nats-server or beam.smp, for `floor` the relay of bench/floor_bench.py (the "
                "protocol's steps, store and finish in the embedded Redis with one plain command "
                "each, no broker logic: what a Python process and Redis cannot go below), for "
                "`floor-bare-lifecycle` the same relay through a lifecycle cut to its bones "
                "(bench/floor_lifecycles.py); B+R: "
                "broker + Redis; other CPU %: the rest of the machine.",
            ]
        bt = backlog_table(self.results)
        if bt:
            lines += ["", bt]
        check_lines, _ = targets(self.results)
        lines += ["", "Targets:", *check_lines]
        problems = []
        for r in self.results:
            if r.error:
                problems.append(f"- {r.system} {r.scenario}: {r.error}")
            for n in r.notes:
                problems.append(f"- {r.system} {r.scenario}: {n}")
            if r.unexpected:
                problems.append(
                    f"- {r.system} {r.scenario}: {r.unexpected} received ids never sent"
                )
            bg = r.extra.get("background_cpu_pct")
            if bg is not None and bg >= 10.0:
                problems.append(
                    f"- {r.system} {r.scenario}: other processes used {bg:.0f}% of the machine's "
                    "CPU during this run (shared machine): figures are pessimistic"
                )
            if r.stopped_early:
                problems.append(
                    f"- {r.system} {r.scenario}: sending stopped at the time cap "
                    f"({r.sent:,} of {r.planned:,} sent)"
                )
        problems += [f"- {n}" for n in dict.fromkeys(self.notes)]
        if problems:
            lines += ["", "Notes:", *problems]
        return "\n".join(lines)


async def machine_busy_pct(interval: float) -> float:
    """Busy share of all cores over `interval` seconds."""
    import psutil

    def busy() -> tuple[float, float]:
        t = psutil.cpu_times()
        idle = float(t.idle) + float(getattr(t, "iowait", 0.0))
        return float(sum(t)) - idle, float(sum(t))

    b0, t0 = busy()
    await asyncio.sleep(interval)
    b1, t1 = busy()
    return 100.0 * (b1 - b0) / max(t1 - t0, 1e-9)


def summary(r: LoadResult) -> str:
    if r.error and not r.acked:
        return f"FAILED: {r.error.splitlines()[0] if r.error else ''}"
    parts = [f"sent {r.sent:,}", f"acked {r.acked:,}", f"ingest {r.ingest_rate or 0:,.0f} msg/s"]
    if r.target_rate and r.achieved_rate is not None:
        parts.append(f"achieved {r.achieved_rate:,.0f} of {r.target_rate:,.0f} msg/s")
    if r.recipients_late:
        rate = r.extra.get("drain_rate")
        parts += [f"drained {r.unique:,}", f"drain {rate or 0:,.0f} msg/s"]
        parts += [f"lost {r.lost}", f"dup {r.duplicates}"]
    elif r.recipients:
        parts += [f"received {r.unique:,}", f"e2e {r.e2e_rate or 0:,.0f} msg/s"]
        if r.latency_ms:
            parts.append(f"p99 {r.latency_ms['p99']:.2f} ms")
        parts += [f"lost {r.lost}", f"dup {r.duplicates}"]
    if r.error:
        parts.append(f"error: {r.error.splitlines()[0]}")
    return ", ".join(parts)


def _last_resort(signum: int, frame: Any) -> None:
    """The run overran its bound by far: kill what it started and leave."""
    for pgid in list(_LIVE_BROKER_PGIDS):
        with contextlib.suppress(OSError):
            os.killpg(pgid, signal.SIGKILL)
    print("bench: hard time limit exceeded, aborting", file=sys.stderr, flush=True)
    os._exit(2)


async def amain(args: argparse.Namespace, argv: list[str]) -> int:
    started = dt.datetime.now(dt.UTC)
    runner = Runner(args)
    loop = asyncio.get_running_loop()
    main_task = asyncio.current_task()
    assert main_task is not None
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, main_task.cancel)
    interrupted = False
    try:
        try:
            async with asyncio.timeout(args.time_limit + 60):
                await runner.run()
        except TimeoutError:
            runner.notes.append("the run hit its time limit")
        except asyncio.CancelledError:
            interrupted = True
            runner.notes.append("interrupted")
        report = runner.report(started, argv)
        print(report, flush=True)
        if args.json is not None:
            path = json_path(args.json, "bench", started)
            path.parent.mkdir(parents=True, exist_ok=True)
            _, checks = targets(runner.results)
            payload = {
                "date": started.isoformat(timespec="seconds"),
                "machine": machine(),
                "command": ["python", "-m", "bench", *argv],
                "broker_cmd": args.broker_cmd,
                "broker_env": args.extra_env,
                "rabbitmq_version": runner.versions["rabbitmq"],
                "nats_version": runner.versions["nats"],
                "results": as_json(runner.results),
                "targets": checks,
                "notes": runner.notes,
            }
            path.write_text(json.dumps(payload, indent=2, default=str))
            print(f"\nJSON written to {path}", flush=True)
    finally:
        runner.cleanup()
    if interrupted:
        return 130
    failed = any(r.error and not r.error.startswith("skipped") for r in runner.results)
    return 1 if failed or not runner.results else 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    signal.signal(signal.SIGALRM, _last_resort)
    signal.alarm(int(args.time_limit + 180))
    try:
        return uvloop.run(amain(args, argv))
    finally:
        signal.alarm(0)
