"""The floor under a paced run on this machine: what a message's path costs with no
broker logic at all. A producer process sends timestamped 100-byte lines at a steady
rate to a relay process (uvloop, asyncio protocols); the relay sends each through the
embedded Redis (one trivial script call, by its unix socket, pipelined as they come) and
writes the reply's line to a recipient process, which takes send-to-receipt latency.
`--no-redis`: the relay forwards at once. Prints p50/p95/p99 and the relay's and
Redis's CPU a message, to set beside `python -m bench --scenarios latency`.

Usage: python -m bench.floor_bench [--rate 2000] [--messages 20000] [--no-redis]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import hiredis
import uvloop

from bench.harness import latency_summary
from skmq.embedded import EmbeddedRedis, free_port
from skmq.store.client import hiredis_pack

SCRIPT = "redis.call('RPUSH', KEYS[1], ARGV[1]); return redis.call('LPOP', KEYS[1])"


class _RedisSide(asyncio.Protocol):
    """Replies of the relay's script calls, in order: each one's line to the recipient."""

    def __init__(self, out: asyncio.StreamWriter) -> None:
        self.out = out
        self.parser = hiredis.Reader()
        self.lines: list[bytes | None] = []  # (None: the AUTH's reply)
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.parser.feed(data)
        while self.parser.gets() is not False:
            line = self.lines.pop(0)
            if line is not None:
                self.out.write(line)


class _ProducerSide(asyncio.Protocol):
    def __init__(self, out: asyncio.StreamWriter, redis: _RedisSide | None) -> None:
        self.out = out
        self.redis = redis
        self.buffer = b""

    def data_received(self, data: bytes) -> None:
        *lines, self.buffer = (self.buffer + data).split(b"\n")
        if not lines:
            return
        if self.redis is None:
            self.out.write(b"".join(line + b"\n" for line in lines))
            return
        calls = []
        for line in lines:
            self.redis.lines.append(line + b"\n")
            calls.append(hiredis_pack(("EVAL", SCRIPT, 1, "floor", line)))
        assert self.redis.transport is not None
        self.redis.transport.write(b"".join(calls))


async def relay(port: int, recipient_port: int, redis_socket: str, password: str) -> None:
    loop = asyncio.get_running_loop()
    for _ in range(500):  # (until the recipient listens)
        try:
            _, out = await asyncio.open_connection("127.0.0.1", recipient_port)
            break
        except OSError:
            await asyncio.sleep(0.02)
    else:
        raise RuntimeError(f"no recipient on {recipient_port}")
    redis: _RedisSide | None = None
    if redis_socket:
        _, redis = await loop.create_unix_connection(lambda: _RedisSide(out), redis_socket)
        assert redis.transport is not None
        redis.lines.append(None)
        redis.transport.write(hiredis_pack(("AUTH", password)))
    server = await loop.create_server(lambda: _ProducerSide(out, redis), "127.0.0.1", port)
    async with server:
        await server.serve_forever()


async def recipient(port: int, messages: int, out: str) -> None:
    latencies: list[int] = []
    done = asyncio.Event()

    async def take(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while len(latencies) < messages and (line := await reader.readline()):
            latencies.append(time.time_ns() // 1000 - int(line.split(b" ", 1)[0]))
        done.set()

    async with await asyncio.start_server(take, "127.0.0.1", port):
        await done.wait()
    Path(out).write_text("\n".join(map(str, latencies)))


def producer(port: int, messages: int, rate: float) -> None:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        start = time.perf_counter()
        for i in range(messages):
            while (wait := start + i / rate - time.perf_counter()) > 0:
                time.sleep(wait)
            sock.sendall(b"%d " % (time.time_ns() // 1000) + b"x" * 100 + b"\n")


def _cpu(pid: int) -> float:
    """User + system seconds of a process."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _wait_listening(port: int) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.02)
    raise RuntimeError(f"nothing listens on {port}")


def run(messages: int, rate: float, use_redis: bool) -> None:
    me = [sys.executable, "-m", "bench.floor_bench"]
    with tempfile.TemporaryDirectory() as d, EmbeddedRedis(Path(d)) as redis:
        port, recipient_port, out = free_port(), free_port(), f"{d}/latencies"
        rec = subprocess.Popen(
            [*me, "--role", "recipient", str(recipient_port), str(messages), out]
        )
        where = [str(redis.socket_path), redis._password] if use_redis else ["", ""]
        rel = subprocess.Popen([*me, "--role", "relay", str(port), str(recipient_port), *where])
        try:
            _wait_listening(port)
            assert redis.proc is not None
            before = _cpu(rel.pid), _cpu(redis.proc.pid)
            producer(port, messages, rate)
            rec.wait(timeout=60)
            relay_cpu = (_cpu(rel.pid) - before[0]) / messages * 1e6
            redis_cpu = (_cpu(redis.proc.pid) - before[1]) / messages * 1e6
        finally:
            rel.kill()
            rec.kill()
        summary = latency_summary([int(x) for x in Path(out).read_text().split()])
    hop = "through Redis" if use_redis else "no Redis"
    print(
        f"floor, {hop}, {rate:,.0f} msg/s, {messages:,} messages: p50 {summary['p50']:.3f} "
        f"p95 {summary['p95']:.3f} p99 {summary['p99']:.3f} ms; relay CPU {relay_cpu:.1f} "
        f"µs/msg, Redis CPU {redis_cpu:.1f} µs/msg"
    )


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--role":
        role, args = sys.argv[2], sys.argv[3:]
        if role == "relay":
            uvloop.run(relay(int(args[0]), int(args[1]), args[2], args[3]))
        elif role == "recipient":
            uvloop.run(recipient(int(args[0]), int(args[1]), args[2]))
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", type=float, default=2000.0)
    p.add_argument("--messages", type=int, default=20000)
    p.add_argument("--no-redis", action="store_true")
    a = p.parse_args()
    run(a.messages, a.rate, not a.no_redis)


if __name__ == "__main__":
    main()
