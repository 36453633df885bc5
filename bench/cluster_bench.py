"""Throughput with 1, 2 and 3 brokers on a local 3-master Redis Cluster against one
Redis, CPU per message of each component, and a projection for N cores.

    python -m bench.cluster_bench [--messages 12000] [--brokers 1,2,3] [--apps 6]
    python -m bench.cluster_bench --stores replicas,wait1 --brokers 1   # WAIT's cost

Each run: a fresh store (one embedded Redis, no AOF fsync wait: `appendfsync
everysec`; `cluster`: a LocalCluster of 3 masters with AOF everysec; `replicas`: 3
masters + 3 replicas; `wait1`: the same with REPLICA_ACKS=1), k `skmq serve`
processes on it, `--apps` apps each with one recipient (bench/skmq_load.py, registered
at broker i % k) and one producer sending `messages / apps` queue messages to broker
i % k. Throughput: delivered messages / (last receipt - first send). CPU: user+system
seconds of every broker process and every Redis process over the run, per delivered
message.

Projection (the method): with c_b the brokers' CPU per message (all brokers), c_r the
Redis nodes' (all nodes, replicas included), k brokers and m Redis masters (each one
thread: at most one core each; m = 1 for one Redis), and N cores for the brokers and
Redis (load generators elsewhere):
    rate(N) = min(N / (c_b + c_r), k / c_b, m / c_r)
with k = m = N / 2 rounded up. It assumes the per-message cost stays what it was here
(batches get smaller when the load spreads over more processes: optimistic) and apps
spread evenly over the nodes. On a shared 2-core machine the measured absolute rates
cannot grow with k; the CPU figures are what the projection uses.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from bench.harness import BenchError, Child
from bench.systems import free_port, port_open
from skmq.embedded import EmbeddedRedis
from skmq.embedded_cluster import LocalCluster


@dataclass
class Run:
    store: str
    brokers: int
    delivered: int
    seconds: float
    broker_cpu: float
    redis_cpu: float

    @property
    def rate(self) -> float:
        return self.delivered / self.seconds if self.seconds else 0.0

    def per_msg_us(self, cpu: float) -> float:
        return 1e6 * cpu / self.delivered if self.delivered else float("nan")

    def projection(self, cores: int) -> float:
        c_b = self.broker_cpu / max(self.delivered, 1)
        c_r = self.redis_cpu / max(self.delivered, 1)
        k = m = math.ceil(cores / 2)
        m = 1 if self.store == "single" else m
        return min(cores / (c_b + c_r), k / c_b, m / c_r)


def _cpu(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            t = psutil.Process(pid).cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
    return total


async def _start_broker(
    url: str, workdir: Path, name: str, replica_acks: int
) -> tuple[asyncio.subprocess.Process, int]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SKMQ_")}
    env.update(
        SKMQ_REDIS_URL=url, SKMQ_PORT=str(port), SKMQ_HOST="127.0.0.1",
        SKMQ_DATA_DIR=str(workdir / name), SKMQ_KEY_PREFIX="bench", SKMQ_LOG_LEVEL="warning",
        SKMQ_REPLICA_ACKS=str(replica_acks),
    )  # fmt: skip
    with open(workdir / f"{name}.log", "wb") as log:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "skmq.cli", "serve", env=env, stdout=log, stderr=log
        )
    deadline = time.monotonic() + 30
    while not await port_open("127.0.0.1", port, 0.5):
        if proc.returncode is not None or time.monotonic() > deadline:
            raise BenchError(
                f"broker {name} did not start: {(workdir / f'{name}.log').read_text()[-800:]}"
            )
        await asyncio.sleep(0.1)
    return proc, port


async def one_run(store: str, k: int, messages: int, apps: int, workdir: Path) -> Run:
    single: EmbeddedRedis | None = None
    cluster: LocalCluster | None = None
    if store == "single":
        single = EmbeddedRedis(workdir / "redis", auth=False)
        single.start()
        assert single.proc is not None
        url, redis_pids = single.url, [single.proc.pid]
    else:
        replicas = 0 if store == "cluster" else 1
        cluster = LocalCluster(workdir / "cluster", masters=3, replicas=replicas)
        await asyncio.to_thread(cluster.start)
        url, redis_pids = cluster.url, [p.pid for p in cluster.procs.values()]
    brokers: list[asyncio.subprocess.Process] = []
    children: list[Child] = []
    try:
        ports = []
        for i in range(k):
            proc, port = await _start_broker(url, workdir, f"broker{i}", int(store == "wait1"))
            brokers.append(proc)
            ports.append(port)
        deadline = str(time.time() + 600)
        recipients, producers = [], []
        for i in range(apps):
            common = ["--port", str(ports[i % k]), "--appid", f"app{i}", "--deadline", deadline]
            r = Child(f"r{i}", "bench.skmq_load", ["recipient", *common, "--rid", f"r{i}"], workdir)
            p = Child(f"p{i}", "bench.skmq_load",
                      ["producer", *common, "--count", str(messages // apps), "--prefix", f"m{i}",
                       "--send-time", "120", "--ack-wait", "60"], workdir)  # fmt: skip
            recipients.append(r)
            producers.append(p)
            children += [r, p]
            await r.start()
            await p.start()
        for child in children:
            await child.wait_event("ready", 60)
        cpu0 = (_cpu([b.pid for b in brokers]), _cpu(redis_pids))
        t0 = time.monotonic()
        for p in producers:
            p.send("go")
        results = [await p.result(180) for p in producers]
        acked = sum(int(res["acked"]) for res in results)
        end = time.monotonic() + 60
        while sum(int(r.progress.get("unique", 0)) for r in recipients) < acked:
            if time.monotonic() > end:
                break
            await asyncio.sleep(0.05)
        seconds = time.monotonic() - t0
        cpu1 = (_cpu([b.pid for b in brokers]), _cpu(redis_pids))
        delivered = sum(int(r.progress.get("unique", 0)) for r in recipients)
        return Run(store, k, delivered, seconds, cpu1[0] - cpu0[0], cpu1[1] - cpu0[1])
    finally:
        for r in recipients if children else []:
            r.send("stop")
        for child in children:
            await child.kill()
        for proc in brokers:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), 15)
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
        if single is not None:
            single.stop()
        if cluster is not None:
            cluster.stop()


def table(runs: list[Run]) -> str:
    lines = [
        "| store | brokers | delivered | msg/s | broker CPU us/msg | Redis CPU us/msg "
        "| projected msg/s, 4 / 8 / 16 cores |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        proj = " / ".join(f"{r.projection(n):,.0f}" for n in (4, 8, 16))
        lines.append(
            f"| {r.store} | {r.brokers} | {r.delivered} | {r.rate:,.0f} "
            f"| {r.per_msg_us(r.broker_cpu):.0f} | {r.per_msg_us(r.redis_cpu):.0f} | {proj} |"
        )
    return "\n".join(lines)


async def amain(args: argparse.Namespace) -> int:
    runs = []
    load = os.getloadavg()[0]
    for store in args.stores.split(","):
        for k in (int(x) for x in args.brokers.split(",")):
            with tempfile.TemporaryDirectory(prefix="skmq-cluster-bench-") as tmp:
                run = await one_run(store, k, args.messages, args.apps, Path(tmp))
            runs.append(run)
            sys.stdout.write(f"{store} x{k}: {run.delivered} delivered, {run.rate:,.0f} msg/s\n")
            sys.stdout.flush()
    sys.stdout.write(f"\n{table(runs)}\n\nload average at start: {load:.2f} "
                     f"(cores: {os.cpu_count()})\n")  # fmt: skip
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.cluster_bench", description=__doc__)
    p.add_argument("--messages", type=int, default=12000)
    p.add_argument("--brokers", default="1,2,3")
    p.add_argument("--apps", type=int, default=6)
    p.add_argument("--stores", default="single,cluster")
    args = p.parse_args(argv)
    try:
        return asyncio.run(amain(args))
    except BenchError as exc:
        sys.stderr.write(f"cluster bench failed: {exc}\n")
        return 1


if __name__ == "__main__":
    sys.exit(main())
