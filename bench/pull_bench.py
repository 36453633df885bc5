"""Pull consumption: cross-broker long-poll wake-up latency over HTTP beside SQS-style
short polling, Redis commands/s under idle long polls, and pull throughput over HTTP and
over TCP (`pull` frames).

Two `skmq serve` processes share one embedded Redis; broker A takes the messages, the
polls wait on broker B. Run: python -m bench.pull_bench [--rounds 200] [--idle 1000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import redis.asyncio as aioredis

from skmq.client import Producer
from skmq.embedded import EmbeddedRedis, free_port

APP = "bench"


def start_broker(name: str, redis_url: str, work: Path) -> tuple[subprocess.Popen[bytes], str, int]:
    """A broker process: it, its HTTP base for the app, its TCP port."""
    port, tcp = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SKMQ_")}
    env.update(
        SKMQ_PORT=str(tcp), SKMQ_HTTP_PORT=str(port), SKMQ_REDIS_URL=redis_url,
        SKMQ_DATA_DIR=str(work / name), SKMQ_LOG_LEVEL="warning", SKMQ_RETRY_BACKOFF="0.2",
    )  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-m", "skmq.cli", "serve"], env=env)
    return proc, f"http://127.0.0.1:{port}/v1/apps/{APP}", tcp


async def until_up(http: aiohttp.ClientSession, base: str) -> None:
    root = base.split("/v1/")[0]
    deadline = time.monotonic() + 60
    while True:
        try:
            async with http.get(f"{root}/healthz") as r:
                if r.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"broker at {root} did not come up")
        await asyncio.sleep(0.1)


async def post(http: aiohttp.ClientSession, url: str, body: Any) -> Any:
    async with http.post(url, json=body) as r:
        if r.status >= 300:
            raise RuntimeError(f"{url}: {r.status} {await r.text()}")
        return await r.json()


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * p))] * 1000


async def poll(http: aiohttp.ClientSession, b: str, group: str, short_poll: float | None) -> float:
    """Receive one message on broker B (a long poll, or short polls every `short_poll`
    seconds) and ack it; returns when it was received (perf_counter)."""
    while True:
        wait = 0 if short_poll is not None else 20
        res = await post(http, f"{b}/groups/{group}/receive", {"wait": wait, "max": 1})
        if res["messages"]:
            got_at = time.perf_counter()
            receipts = [m["receipt"] for m in res["messages"]]
            await post(http, f"{b}/groups/{group}/ack", {"receipts": receipts})
            return got_at
        if short_poll is not None:
            await asyncio.sleep(short_poll)


async def wakeups(
    http: aiohttp.ClientSession, a: str, b: str, rounds: int, short_poll: float | None
) -> tuple[list[float], list[float]]:
    """(send -> received, stored answer -> received) each round, seconds."""
    group = "short" if short_poll is not None else "long"
    await post(http, f"{a}/groups", {"group": group})
    sent_to_got, stored_to_got = [], []
    for i in range(rounds):
        task = asyncio.create_task(poll(http, b, group, short_poll))
        await asyncio.sleep(0.05)  # the poll is waiting (long) or looping (short)
        sent = time.perf_counter()
        await post(http, f"{a}/messages", {"msgid": f"{group}-{i}", "content": "x"})
        stored = time.perf_counter()
        got_at = await asyncio.wait_for(task, 30)
        sent_to_got.append(got_at - sent)
        stored_to_got.append(max(0.0, got_at - stored))
    await post(http, f"{a}/groups/{group}/reset", {"position": "latest"})
    return sent_to_got, stored_to_got


async def commands_per_second(redis: aioredis.Redis, seconds: float) -> float:
    before = int((await redis.info("stats"))["total_commands_processed"])
    await asyncio.sleep(seconds)
    after = int((await redis.info("stats"))["total_commands_processed"])
    return (after - before - 1) / seconds


async def idle(b: str, redis: aioredis.Redis, polls: int, seconds: float) -> tuple[float, float]:
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        await post(http, f"{b}/groups", {"group": "idle"})
        quiet = await commands_per_second(redis, seconds)
        body = {"wait": 20, "max": 1}
        tasks = [
            asyncio.create_task(post(http, f"{b}/groups/idle/receive", body)) for _ in range(polls)
        ]
        await asyncio.sleep(2)  # every poll received nothing and waits
        busy = await commands_per_second(redis, seconds)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return quiet, busy


# One pull operation (create, receive, ack) of a consumer on broker 0 (A) or 1 (B).
Call = Callable[[int, str, dict[str, Any]], Awaitable[Any]]


async def throughput(
    http: aiohttp.ClientSession, a: str, group: str, n: int, consumers: int, call: Call
) -> float:
    """n messages stored through A; `consumers` consumers, alternately on A and B, each
    receiving up to 100 at a time and acking them in one call."""
    await call(0, "create", {"group": group})
    for start in range(0, n, 100):
        batch = [{"msgid": f"{group}-{i}", "content": "x" * 100} for i in range(start, start + 100)]
        await post(http, f"{a}/messages", {"messages": batch})
    left = n
    began = time.perf_counter()

    async def consume(i: int) -> None:
        nonlocal left
        while left > 0:
            res = await call(i, "receive", {"max": 100, "wait": 1})
            if res["messages"]:
                left -= len(res["messages"])
                await call(i, "ack", {"receipts": [m["receipt"] for m in res["messages"]]})

    await asyncio.gather(*(consume(i) for i in range(consumers)))
    return n / (time.perf_counter() - began)


def http_calls(http: aiohttp.ClientSession, bases: list[str], group: str) -> Call:
    async def call(i: int, op: str, body: dict[str, Any]) -> Any:
        base = bases[i % 2]
        url = f"{base}/groups" if op == "create" else f"{base}/groups/{group}/{op}"
        return await post(http, url, body)

    return call


def tcp_calls(connections: list[Producer], group: str) -> Call:
    """Consumer i on its own connection (a long poll holds a connection's answers)."""

    async def call(i: int, op: str, body: dict[str, Any]) -> Any:
        fields = (("appid", APP), ("group", group), ("op", op))
        resp = await connections[i].request("pull", fields, json.dumps(body).encode())
        if not resp.ok:
            raise RuntimeError(f"pull {op}: {resp.status} {resp.content}")
        return json.loads(resp.content)

    return call


async def main(args: argparse.Namespace) -> None:
    work = Path(tempfile.mkdtemp(prefix="skmq-pull-bench-"))
    redis_server = EmbeddedRedis(work / "redis")
    redis_server.start()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        proc_a, a, tcp_a = start_broker("a", redis_server.url, work)
        proc_b, b, tcp_b = start_broker("b", redis_server.url, work)
        procs += [proc_a, proc_b]
        redis = aioredis.Redis.from_url(redis_server.url)
        timeout = aiohttp.ClientTimeout(total=60)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            await until_up(http, a)
            await until_up(http, b)
            runs: list[tuple[str, Callable[[], Awaitable[tuple[list[float], list[float]]]]]] = [
                ("long poll (wait=20) on B", lambda: wakeups(http, a, b, args.rounds, None)),
                (f"short poll every {args.short_poll * 1000:g} ms on B",
                 lambda: wakeups(http, a, b, args.rounds, args.short_poll)),
            ]  # fmt: skip
            print(f"wake-up latency, message produced through A, {args.rounds} rounds:")
            for name, run in runs:
                sent, stored = await run()
                print(
                    f"  {name}: send->received p50 {pct(sent, 0.5):.1f} ms, "
                    f"p99 {pct(sent, 0.99):.1f} ms; stored->received p50 "
                    f"{pct(stored, 0.5):.1f} ms, p99 {pct(stored, 0.99):.1f} ms "
                    f"(mean {statistics.mean(sent) * 1000:.1f} ms)"
                )
            quiet, busy = await idle(b, redis, args.idle, args.seconds)
            print(
                f"Redis commands/s: {quiet:.1f} with no poll, {busy:.1f} with "
                f"{args.idle} idle long polls on B"
            )
            how = f"{args.messages} messages, {args.consumers} consumers, receive max=100 + ack"
            calls = http_calls(http, [a, b], "tp-http")
            rate = await throughput(http, a, "tp-http", args.messages, args.consumers, calls)
            print(f"pull throughput over HTTP: {rate:.0f} msg/s ({how})")
            ports = [tcp_a if i % 2 == 0 else tcp_b for i in range(args.consumers)]
            connections = [Producer("127.0.0.1", port) for port in ports]
            for c in connections:
                await c.connect()
            try:
                calls = tcp_calls(connections, "tp-tcp")
                rate = await throughput(http, a, "tp-tcp", args.messages, args.consumers, calls)
            finally:
                for c in connections:
                    await c.close()
            print(f"pull throughput over TCP: {rate:.0f} msg/s ({how})")
        await redis.aclose()
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=15)
        redis_server.stop()


def cli() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=200)
    p.add_argument("--short-poll", type=float, default=0.1, help="seconds between short polls")
    p.add_argument("--idle", type=int, default=1000, help="idle long polls")
    p.add_argument("--seconds", type=float, default=5.0, help="Redis commands/s window")
    p.add_argument("--messages", type=int, default=5000)
    p.add_argument("--consumers", type=int, default=4)
    asyncio.run(main(p.parse_args()))


if __name__ == "__main__":
    cli()
