"""The floor under a paced run on this machine: what the protocol's steps cost a message
in one Python process on uvloop with Redis, with no broker logic at all.

A producer process, paced as the benchmark's are (`bench/pacing.py`: bursts of what is
due, at least 1 ms apart), sends 100-byte messages to a relay process. The relay does
what any broker of SKMQ's shape must do for each, and nothing else:

1. store it in the embedded Redis (the broker's: AOF, `appendfsync everysec`, by its
   unix socket) with one plain command, `SET <msgid> <content> NX` (the store and the
   duplicate check), pipelined as the messages come;
2. on its reply, answer the producer (`ok <msgid>`) and push the message to the
   recipient process, on one connection the relay opened;
3. on the recipient's `ack <msgid>`, drop the message with `DEL <msgid>`, lingering up to
   2 ms to ride with the next store's write (as SKMQ's ACK_LINGER), and answer the
   recipient (`ok`) on its reply.

Plain commands are a lower bound: a lifecycle in Redis also queues, leases and dedupes
over time. `--bare-lifecycle` (system `floor-bare-lifecycle` in the benchmark) runs a
lifecycle cut to its bones (bench/floor_lifecycles.py) instead, with the relay's steps
unchanged: each read's messages stored and claimed in the same write, pushed on the
claim's reply, finished on the ack: what such a lifecycle in Redis costs under a broker
that does nothing else. `--no-redis` drops the
store: the relay pushes at once and answers acks at once (the process hops alone). The
recipient takes send-to-receipt latency.

Prints p50/p99 and the relay's and Redis's CPU a delivered message, to set beside
`python -m bench --scenarios latency`, which runs it as system `floor` at each paced
rate (`--systems ...,floor`) beside SKMQ and NATS JetStream in the same run.

Usage: python -m bench.floor_bench [--rate 2000] [--messages 20000]
       [--no-redis | --bare-lifecycle]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import hiredis
import uvloop

from bench.floor_lifecycles import LIFECYCLES, Lifecycle
from bench.harness import LoadResult, latency_summary
from bench.pacing import Pacer
from skmq.embedded import EmbeddedRedis, free_port
from skmq.errors import UsageError
from skmq.store.client import hiredis_pack

LINGER = 0.002  # an ack's DEL waits this long for the next store's write (ACK_LINGER)
PROCESS_WAIT = 60.0  # bound on each wait for a process of the run


class _Awaited(NamedTuple):
    """What a Redis reply releases: the producer's answers, pushes (`claim`: those of the
    claim's reply), and how many acks to answer."""

    answers: bytes = b""
    pushes: bytes = b""
    acks: int = 0
    claim: bool = False


class _Relay:
    """The three connections of the relay, and what each Redis reply awaited releases, in
    order. `lifecycle`: the scripts it stores, claims and finishes with (else plain
    commands)."""

    def __init__(self, use_redis: bool, lifecycle: Lifecycle | None = None) -> None:
        self.use_redis = use_redis
        self.lifecycle = lifecycle
        self.producer: asyncio.Transport | None = None
        self.recipient: asyncio.Transport | None = None
        self.redis: asyncio.Transport | None = None
        self.parser = hiredis.Reader()
        self.awaited: deque[_Awaited] = deque()
        self.finishes: list[tuple[bytes, _Awaited]] = []
        self.timer: asyncio.TimerHandle | None = None

    def messages(self, lines: list[bytes]) -> None:
        """A producer's messages (`<send µs> <msgid> <padding>`): stored, then pushed."""
        if not self.use_redis:
            assert self.producer is not None and self.recipient is not None
            self.producer.write(b"".join(b"ok " + x.split(b" ", 2)[1] + b"\n" for x in lines))
            self.recipient.write(b"".join(line + b"\n" for line in lines))
            return
        calls = self._take_finishes()
        if self.lifecycle is not None:
            msgids = [line.split(b" ", 2)[1] for line in lines]
            calls += self.lifecycle.store_and_claim(msgids, lines)
            answers = b"".join(b"ok " + msgid + b"\n" for msgid in msgids)
            self.awaited += (_Awaited(answers), _Awaited(claim=True))
        else:
            for line in lines:
                msgid = line.split(b" ", 2)[1]
                calls.append(hiredis_pack(("SET", msgid, line, "NX")))
                self.awaited.append(_Awaited(b"ok " + msgid + b"\n", line + b"\n"))
        assert self.redis is not None
        self.redis.write(b"".join(calls))

    def acks(self, msgids: list[bytes]) -> None:
        """The recipient's acks: each message dropped, the ack answered once it is."""
        if not self.use_redis:
            assert self.recipient is not None
            self.recipient.write(b"ok\n" * len(msgids))
            return
        if self.lifecycle is not None:
            self.finishes.append((self.lifecycle.finish(msgids), _Awaited(acks=len(msgids))))
        else:
            self.finishes += [(hiredis_pack(("DEL", m)), _Awaited(acks=1)) for m in msgids]
        if self.timer is None:
            self.timer = asyncio.get_running_loop().call_later(LINGER, self._flush_finishes)

    def _take_finishes(self) -> list[bytes]:
        taken, self.finishes = self.finishes, []
        self.awaited.extend(awaited for _, awaited in taken)
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        return [call for call, _ in taken]

    def _flush_finishes(self) -> None:
        self.timer = None
        calls = self._take_finishes()
        if calls and self.redis is not None:
            self.redis.write(b"".join(calls))

    def replies(self, data: bytes) -> None:
        """Redis's replies, in the order of the calls."""
        self.parser.feed(data)
        answers, pushes, acks = [], [], 0
        while (reply := self.parser.gets()) is not False:
            awaited = self.awaited.popleft()
            if isinstance(reply, hiredis.ReplyError):
                raise SystemExit(f"Redis: {reply}")
            answers.append(awaited.answers)
            pushes.append(awaited.pushes)
            acks += awaited.acks
            if awaited.claim:
                assert self.lifecycle is not None
                pushes += [content + b"\n" for content in self.lifecycle.contents(reply)]
        assert self.producer is not None and self.recipient is not None
        if any(answers) and not self.producer.is_closing():  # (the producer may be gone)
            self.producer.write(b"".join(answers))
        out = b"".join(pushes) + b"ok\n" * acks
        if out:
            self.recipient.write(out)


class _Lines(asyncio.Protocol):
    """A connection read as newline-ended lines, handed on a read at a time."""

    def __init__(
        self,
        on_lines: Callable[[list[bytes]], None],
        on_connect: Callable[[asyncio.Transport], None] = lambda _: None,
    ) -> None:
        self.on_lines = on_lines
        self.on_connect = on_connect
        self.buffer = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.on_connect(transport)  # type: ignore[arg-type]

    def data_received(self, data: bytes) -> None:
        *lines, self.buffer = (self.buffer + data).split(b"\n")
        if lines:
            self.on_lines(lines)


class _RedisSide(asyncio.Protocol):
    def __init__(self, relay: _Relay) -> None:
        self.relay = relay

    def data_received(self, data: bytes) -> None:
        self.relay.replies(data)


async def relay(
    port: int, recipient_port: int, redis_socket: str, password: str, store: str
) -> None:
    loop = asyncio.get_running_loop()
    lifecycle = LIFECYCLES[store]() if store in LIFECYCLES else None
    r = _Relay(use_redis=bool(redis_socket), lifecycle=lifecycle)
    if redis_socket:
        sources = lifecycle.sources() if lifecycle is not None else {}
        setup: list[tuple[str, ...]] = [("AUTH", password)]
        setup += [("SCRIPT", "LOAD", source) for source in sources.values()]
        answered = loop.create_future()
        reader = hiredis.Reader()
        replies: list[bytes] = []

        class _Setup(asyncio.Protocol):
            def data_received(self, data: bytes) -> None:
                reader.feed(data)
                while (reply := reader.gets()) is not False:
                    replies.append(reply)
                if len(replies) == len(setup) and not answered.done():
                    answered.set_result(None)

        transport, _ = await loop.create_unix_connection(_Setup, redis_socket)
        transport.write(b"".join(hiredis_pack(c) for c in setup))
        await asyncio.wait_for(answered, PROCESS_WAIT)
        if lifecycle is not None:
            lifecycle.shas = {name: sha.decode()
                              for name, sha in zip(sources, replies[1:], strict=True)}  # fmt: skip
        transport.set_protocol(_RedisSide(r))
        r.redis = transport
    rec_transport, _ = await loop.create_connection(
        lambda: _Lines(lambda lines: r.acks([x.split(b" ", 1)[1] for x in lines if x])),
        "127.0.0.1",
        recipient_port,
    )
    r.recipient = rec_transport

    def producer_side() -> _Lines:
        return _Lines(lambda lines: r.messages([x for x in lines if x]),
                      lambda transport: setattr(r, "producer", transport))  # fmt: skip

    server = await loop.create_server(producer_side, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


async def recipient(port: int, messages: int, out: str) -> None:
    """Take `messages` pushes on the relay's connection, ack each; write their latencies
    (µs) and when the last came."""
    latencies: list[int] = []
    done = asyncio.Event()

    def connection() -> _Lines:
        transport: list[asyncio.Transport] = []

        def take(lines: list[bytes]) -> None:
            acks = []
            now = time.time_ns() // 1000
            for line in lines:
                parts = line.split(b" ", 2)
                if len(parts) == 3:  # a push (the relay's `ok` lines have one word)
                    latencies.append(now - int(parts[0]))
                    acks.append(b"ack " + parts[1] + b"\n")
            if acks:
                transport[0].write(b"".join(acks))
            if len(latencies) >= messages:
                done.set()

        return _Lines(take, transport.append)

    server = await asyncio.get_running_loop().create_server(connection, "127.0.0.1", port)
    async with server:
        await asyncio.wait_for(done.wait(), messages / 100 + PROCESS_WAIT)
    Path(out).write_text(json.dumps({"latencies": latencies, "last_ns": time.time_ns()}))


async def producer(port: int, messages: int, rate: float, out: str) -> None:
    """Send `messages` at `rate`, paced as the benchmark's producers are; read the answers;
    write the pacer's summary."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    async def drain_answers() -> None:
        while await reader.read(1 << 16):
            pass

    answers = asyncio.create_task(drain_answers())
    pacer = Pacer(rate, messages)
    pacer.start()
    start_ns = time.time_ns()
    pad = b"." * 80
    stop_at = time.monotonic() + messages / rate + PROCESS_WAIT
    while due := await pacer.next_batch(stop_at):
        stamp = b"%d " % (time.time_ns() // 1000)
        writer.write(b"".join(stamp + b"m%08x " % (pacer.sent + i) + pad + b"\n"
                              for i in range(due)))  # fmt: skip
        pacer.record(due)
    Path(out).write_text(json.dumps({**pacer.summary(), "start_ns": start_ns}))
    answers.cancel()
    writer.close()


def _cpu(pid: int) -> float:
    """User + system seconds of a process."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _listening(port: int) -> None:
    for _ in range(500):
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            return
        except OSError:
            await asyncio.sleep(0.02)
    raise RuntimeError(f"nothing listens on {port}")


# How the relay stores (plain commands, a bare-bones lifecycle, nothing), and the system
# name of its runs.
SYSTEMS = {
    "plain": "floor",
    "bare": "floor-bare-lifecycle",
    "none": "floor-no-redis",
}


async def run_floor(messages: int, rate: float, store: str = "plain") -> LoadResult:
    """One paced run of the floor, as a LoadResult of system `floor` (`SYSTEMS[store]`):
    broker CPU is the relay's, Redis CPU the embedded Redis's, a delivered message each.
    A run that fails says why in `error` (the last line a process of it wrote)."""
    result = LoadResult(system=SYSTEMS[store],
                        scenario="", producers=1, recipients=1, planned=messages,
                        target_rate=rate)  # fmt: skip
    with tempfile.TemporaryDirectory() as d:
        try:
            async with asyncio.timeout(messages / rate + 3 * PROCESS_WAIT):
                await _run(Path(d), messages, rate, store, result)
        except (TimeoutError, RuntimeError, OSError, UsageError) as exc:
            errs = [Path(d, f"{role}.err") for role in ("recipient", "relay", "producer")]
            said = [e.read_text(errors="replace").strip() for e in errs if e.exists()]
            last = next((x.splitlines()[-1] for x in said if x), "")
            result.error = f"floor run failed: {exc or type(exc).__name__}" + (
                f" ({last})" if last else ""
            )
    return result


async def _run(d: Path, messages: int, rate: float, store: str, result: LoadResult) -> None:
    procs: list[asyncio.subprocess.Process] = []

    async def start(role: str, *args: str) -> asyncio.subprocess.Process:
        with open(d / f"{role}.err", "wb") as err:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "bench.floor_bench", "--role", role, *args,
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
            )  # fmt: skip
        procs.append(proc)
        return proc

    with contextlib.ExitStack() as stack:
        # (--no-redis: no Redis at all, so none of its CPU is counted)
        redis = None if store == "none" else stack.enter_context(EmbeddedRedis(d))
        where = ["", ""] if redis is None else [str(redis.socket_path), redis._password]
        port, recipient_port = free_port(), free_port()
        try:
            rec = await start("recipient", str(recipient_port), str(messages), str(d / "latencies"))
            await _listening(recipient_port)
            rel = await start("relay", str(port), str(recipient_port), *where, store)
            await _listening(port)
            redis_pid = None if redis is None or redis.proc is None else redis.proc.pid
            before = _cpu(rel.pid), _cpu(redis_pid) if redis_pid else 0.0
            prod = await start("producer", str(port), str(messages), str(rate), str(d / "pacer"))
            if await rec.wait() or await prod.wait():
                raise RuntimeError("a process of the run failed")
            relay_cpu = _cpu(rel.pid) - before[0]
            redis_cpu = _cpu(redis_pid) - before[1] if redis_pid else None
        finally:
            for proc in procs:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
    received = json.loads((d / "latencies").read_text())
    latencies: list[int] = received["latencies"]
    pacer = json.loads((d / "pacer").read_text())
    delivered = max(1, len(latencies))
    result.broker_cpu_us = relay_cpu / delivered * 1e6
    result.redis_cpu_us = None if redis_cpu is None else redis_cpu / delivered * 1e6
    result.sent = result.acked = result.received = result.unique = len(latencies)
    result.lost = messages - len(latencies)
    result.latency_ms = latency_summary(latencies)
    result.achieved_rate = result.ingest_rate = pacer["achieved_rate"]
    result.lag_max_ms = pacer["lag_max_ms"]
    span = (received["last_ns"] - pacer["start_ns"]) / 1e9
    result.e2e_rate = len(latencies) / span if span > 0 else None


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--role":
        role, args = sys.argv[2], sys.argv[3:]
        if role == "relay":
            uvloop.run(relay(int(args[0]), int(args[1]), args[2], args[3], args[4]))
        elif role == "recipient":
            uvloop.run(recipient(int(args[0]), int(args[1]), args[2]))
        elif role == "producer":
            uvloop.run(producer(int(args[0]), int(args[1]), float(args[2]), args[3]))
        return
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--rate", type=float, default=2000.0)
    p.add_argument("--messages", type=int, default=20000)
    how = p.add_mutually_exclusive_group()
    how.add_argument("--no-redis", dest="store", action="store_const", const="none")
    how.add_argument("--bare-lifecycle", dest="store", action="store_const", const="bare")
    a = p.parse_args()
    if a.messages < 1 or a.rate <= 0:
        p.error("--messages needs at least 1 and --rate more than 0")
    store = a.store or "plain"
    r = uvloop.run(run_floor(a.messages, a.rate, store))
    if r.error:
        raise SystemExit(r.error)
    lifecycle = LIFECYCLES.get(store)
    hop = (
        lifecycle.name
        if lifecycle
        else {"plain": "store and finish in Redis", "none": "no Redis"}[store]
    )
    lat = r.latency_ms
    print(
        f"floor, {hop}, {a.rate:,.0f} msg/s, {r.unique:,} of {a.messages:,} delivered: "
        f"p50 {lat['p50']:.3f} p99 {lat['p99']:.3f} max {lat['max']:.3f} ms; relay CPU "
        f"{r.broker_cpu_us:.1f} µs/msg"
        + ("" if r.redis_cpu_us is None else f", Redis CPU {r.redis_cpu_us:.1f} µs/msg")
    )


if __name__ == "__main__":
    main()
