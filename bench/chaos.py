"""Chaos benchmark: at-least-once delivery while brokers are killed with SIGKILL.

    python -m bench.chaos [--brokers 2] [--messages 2000] [--kill-every 2.0] [--time-limit 120]

Starts its own embedded Redis (valkey, AOF) in a temporary directory and `--brokers`
`skmq serve` processes on it (SKMQ_REDIS_URL, one KEY_PREFIX, distinct ports and
DATA_DIRs, a short ACK_TIMEOUT). Recipients run in a separate process (this module with
`--recipient`, skmq.client.Consumer) and report each push they get on their stdout.
Producers send `--messages` messages with unique msgids, paced at `--rate`, spread over
the brokers; a producer whose broker dies reconnects to another one (or the restarted
one) and sends again every message not yet acknowledged: at-least-once on the producer
side too. Meanwhile one broker is killed with SIGKILL every `--kill-every` seconds and
restarted at once.

Once every message is acknowledged, the run waits (bounded by `--drain-time`) until the
recipients have got every acknowledged message, then prints:

    sent, acked by broker, received (distinct), lost (acked but never received),
    duplicated deliveries (receipts beyond the first), kills, elapsed

and exits 1 if anything was lost (2 on a setup error). It stops by itself within
`--time-limit` seconds, and every child goes with it: brokers, recipients and Redis are
stopped at the end, on Ctrl-C, on SIGTERM and on errors (and die with it even if it is
killed, through PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, deque
from collections.abc import Sequence
from pathlib import Path

from skmq.client import Consumer, Message, Producer, RegistrationError
from skmq.embedded import EmbeddedRedis, free_port
from skmq.embedded_cluster import LocalCluster
from skmq.store import connect_redis

APP = "chaos"
PREFIX = "chaos"
PR_SET_PDEATHSIG = 1
ROOT = Path(__file__).resolve().parent.parent


def _die_with_parent() -> None:
    """In a child, before exec: get SIGKILL when the process that started it dies."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def log(message: str) -> None:
    print(f"[chaos {time.strftime('%H:%M:%S')}] {message}", flush=True)


# -- brokers ---------------------------------------------------------------------------


class Broker:
    """One `skmq serve` child; killed and restarted on the same port and DATA_DIR."""

    def __init__(self, index: int, workdir: Path, redis_url: str, args: argparse.Namespace) -> None:
        self.name = f"broker{index}"
        self.port = free_port()
        self.log_path = workdir / f"{self.name}.log"
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("SKMQ_")}
        self.env.update(
            SKMQ_HOST="127.0.0.1",
            SKMQ_PORT=str(self.port),
            SKMQ_HTTP_PORT="0",
            SKMQ_REDIS_URL=redis_url,
            SKMQ_KEY_PREFIX=PREFIX,
            SKMQ_DATA_DIR=str(workdir / self.name),
            SKMQ_ACK_TIMEOUT=str(args.ack_timeout),
            SKMQ_ACK_WAIT=str(min(1.0, args.ack_timeout / 2)),
            SKMQ_RETRY_TIMES=str(args.retry_times),
            SKMQ_RETRY_BACKOFF="0.2,0.5,1",
            SKMQ_HEARTBEAT_INTERVAL="1.0",
            SKMQ_HEARTBEAT_TIMEOUT="0.5",
            SKMQ_SHUTDOWN_TIMEOUT="1.0",
            SKMQ_LOG_LEVEL="warning",
        )
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    async def start(self, timeout: float = 20.0) -> None:
        with self.log_path.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "skmq.cli", "serve"],
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                preexec_fn=_die_with_parent,
            )
        self.starts += 1
        async with asyncio.timeout(timeout):
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.name} exited at start, see {self.log_path}")
                try:
                    _, writer = await asyncio.open_connection("127.0.0.1", self.port)
                except OSError:
                    await asyncio.sleep(0.02)
                    continue
                writer.close()
                return

    async def wait_exit(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while self.proc is not None and self.proc.poll() is None:
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.01)
        return True

    async def kill(self) -> None:
        if self.alive:
            assert self.proc is not None
            self.proc.send_signal(signal.SIGKILL)
            await self.wait_exit(10)

    async def stop(self) -> None:
        """SIGTERM, then SIGKILL if it does not exit in time."""
        if self.alive:
            assert self.proc is not None
            self.proc.send_signal(signal.SIGTERM)
            if not await self.wait_exit(10):
                log(f"{self.name} ignored SIGTERM for 10 s: SIGKILL")
                await self.kill()

    def force_stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(5)


# -- recipients (a process of their own) -----------------------------------------------


class Recipients:
    """The recipients' process: one line on its stdout a push it got (`R <msgid>`)."""

    def __init__(self, args: argparse.Namespace, ports: Sequence[int], workdir: Path) -> None:
        self.args = args
        self.ports = ports
        self.log_path = workdir / "recipients.log"
        self.proc: asyncio.subprocess.Process | None = None
        self.receipts: Counter[str] = Counter()
        self.changed = asyncio.Event()
        self._ready = asyncio.Event()
        self._reader: asyncio.Task[None] | None = None

    async def start(self, deadline: float) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
        with self.log_path.open("ab") as err:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "bench.chaos",
                "--recipient",
                "--ports",
                ",".join(map(str, self.ports)),
                "--recipients",
                str(self.args.recipients),
                "--work-ms",
                str(self.args.work_ms),
                "--deadline",
                str(deadline),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=err,
                env=env,
                preexec_fn=_die_with_parent,
            )
        self._reader = asyncio.create_task(self._read())
        async with asyncio.timeout(30):
            await self._ready.wait()

    async def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        while line := await self.proc.stdout.readline():
            if line.startswith(b"R "):
                self.receipts[line[2:].strip().decode()] += 1
                self.changed.set()
            elif line.strip() == b"READY":
                self._ready.set()
        self.changed.set()

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    async def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.stdin is not None:
            self.proc.stdin.close()  # end of stdin: the process exits
        try:
            await asyncio.wait_for(self.proc.wait(), 5)
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()
        if self._reader is not None:
            with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(self._reader, 2)

    def force_stop(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()


async def recipient_main(args: argparse.Namespace) -> int:
    """The recipients' process: `--recipients` consumers registered with any live broker."""
    loop = asyncio.get_running_loop()
    loop.call_later(max(0.0, args.deadline - time.time()), os._exit, 3)
    out = sys.stdout.buffer
    lines: list[bytes] = []

    def flush() -> None:
        out.write(b"".join(lines))
        out.flush()
        lines.clear()

    async def handler(msg: Message) -> None:
        if not lines:
            loop.call_soon(flush)
        lines.append(b"R " + msg.msgid.encode() + b"\n")
        if args.work_ms:
            await asyncio.sleep(args.work_ms / 1000 * random.uniform(0.5, 1.5))

    ports = [int(p) for p in args.ports.split(",")]
    consumers = []
    for i in range(args.recipients):
        consumer = Consumer(APP, f"r{i}", handler, concurrency=64)
        for attempt in range(200):
            consumer.broker_port = ports[attempt % len(ports)]
            try:
                await consumer.start()
                break
            except (OSError, RegistrationError, TimeoutError):
                await asyncio.sleep(0.1)
        else:
            sys.stderr.write(f"recipient r{i} could not register\n")
            return 2
        consumers.append(consumer)
    out.write(b"READY\n")
    out.flush()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while await reader.readline():
        pass  # nothing is sent on stdin: its end means the harness is done (or gone)
    flush()
    for consumer in consumers:
        await consumer.stop(grace=0.5)
    return 0


# -- producers ---------------------------------------------------------------------------


class Producers:
    """Send every msgid until the broker acknowledges it; resend after any failure."""

    def __init__(self, args: argparse.Namespace, brokers: Sequence[Broker]) -> None:
        self.args = args
        self.brokers = brokers
        self.acked: set[str] = set()
        self.sent: set[str] = set()
        self.frames = 0
        self.reconnects = 0

    async def run(self) -> None:
        n = len(self.brokers)
        ids = [f"msg-{i:07d}" for i in range(self.args.messages)]
        await asyncio.gather(*(self._producer(k, ids[k::n]) for k in range(n)))

    async def _producer(self, home: int, msgids: list[str]) -> None:
        todo: deque[str] = deque(msgids)
        mine = set(msgids)
        interval = len(self.brokers) / self.args.rate if self.args.rate > 0 else 0.0
        window = asyncio.Semaphore(self.args.window)
        tasks: set[asyncio.Task[None]] = set()
        turn = home
        while not mine <= self.acked:
            producer = Producer("127.0.0.1", self.brokers[turn % len(self.brokers)].port)
            turn += 1
            try:
                await asyncio.wait_for(producer.connect(), 2)
            except (OSError, TimeoutError):
                await asyncio.sleep(0.05)
                continue
            self.reconnects += 1
            try:
                while producer.connected and not mine <= self.acked:
                    if not todo:
                        await asyncio.sleep(0.01)  # answers still on their way
                        continue
                    msgid = todo.popleft()
                    if msgid in self.acked:
                        continue
                    await window.acquire()
                    task = asyncio.create_task(self._send(producer, msgid, todo, window))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                    if interval and msgid not in self.sent:
                        await asyncio.sleep(interval)
                    self.sent.add(msgid)
            finally:
                await producer.close()
                # Answers still awaited fail now; their msgids go back to `todo`.
                if tasks:
                    await asyncio.wait(set(tasks), timeout=5)

    async def _send(
        self, producer: Producer, msgid: str, todo: deque[str], window: asyncio.Semaphore
    ) -> None:
        try:
            self.frames += 1
            resp = await asyncio.wait_for(producer.send(APP, msgid, msgid=msgid), 10)
            if resp.ok:
                self.acked.add(msgid)
            else:
                todo.append(msgid)  # e.g. Redis busy: send it again
        except (OSError, TimeoutError):
            todo.append(msgid)
        finally:
            window.release()


# -- the run ---------------------------------------------------------------------------------

WHERE = """
local base = KEYS[1]
local done = redis.call('KEYS', base .. 'done:*')
local out = {}
for i, id in ipairs(ARGV) do
  local w = 'gone'
  if redis.call('HEXISTS', base .. 'msgs', id) == 1 then
    w = 'stored'
    if redis.call('LPOS', base .. 'ready', id) then w = 'pending' end
    for _, z in ipairs({'delayed', 'inflight', 'dead'}) do
      if redis.call('ZSCORE', base .. z, id) then w = z end
    end
  else
    for _, d in ipairs(done) do
      if redis.call('SISMEMBER', d, id) == 1 then w = 'done' end
    end
  end
  out[i] = w
end
return out
"""


async def where(redis_url: str, msgids: list[str]) -> Counter[str]:
    """Where the given messages are in Redis (to explain a loss)."""
    client = connect_redis(redis_url)
    try:
        states = await client.eval(WHERE, 1, f"{PREFIX}:{{{APP}}}:", *msgids)
    finally:
        await client.aclose()
    return Counter(s.decode() if isinstance(s, bytes) else str(s) for s in states)


async def killer(brokers: Sequence[Broker], every: float, stop: asyncio.Event) -> int:
    """Kill one broker with SIGKILL every `every` seconds (in turn) and restart it."""
    kills = 0
    while True:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every)
        if stop.is_set():
            return kills
        victim = brokers[kills % len(brokers)]
        await victim.kill()
        kills += 1
        log(f"killed {victim.name} (kill {kills}), restarting it")
        await victim.start()


async def run(args: argparse.Namespace, workdir: Path) -> int:
    started = time.monotonic()
    deadline = time.time() + args.time_limit
    redis = LocalCluster(workdir / "cluster") if args.cluster else EmbeddedRedis(workdir / "redis")
    brokers: list[Broker] = []
    recipients: Recipients | None = None
    try:
        redis.start()
        log(f"redis {redis.url} (AOF) in {workdir}")
        brokers = [Broker(i, workdir, redis.url, args) for i in range(args.brokers)]
        await asyncio.gather(*(b.start() for b in brokers))
        log("brokers on ports " + ", ".join(str(b.port) for b in brokers))
        recipients = Recipients(args, [b.port for b in brokers], workdir)
        await recipients.start(deadline + 30)
        log(f"{args.recipients} recipients ready")

        producers = Producers(args, brokers)
        stop_killing = asyncio.Event()
        kill_task = asyncio.create_task(killer(brokers, args.kill_every, stop_killing))
        send_task = asyncio.create_task(producers.run())
        timed_out = False

        async def progress() -> None:
            while True:
                await asyncio.sleep(2)
                got = recipients.receipts if recipients else Counter()
                log(f"acked {len(producers.acked)}/{args.messages}, received {len(got)}")

        reporter = asyncio.create_task(progress())
        try:
            async with asyncio.timeout(max(1.0, deadline - time.time() - args.drain_time)):
                await send_task
        except TimeoutError:
            timed_out = True
            send_task.cancel()
            log("time limit: stopped sending")
        stop_killing.set()
        kills = await kill_task
        log(f"sending done ({producers.frames} frames for {len(producers.sent)} msgids)")

        # Drain: every acked message should reach a recipient, bounded.
        drain_until = min(deadline, time.time() + args.drain_time)
        while not producers.acked <= set(recipients.receipts) and time.time() < drain_until:
            recipients.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(recipients.changed.wait(), 0.5)
        reporter.cancel()

        receipts = Counter(recipients.receipts)
        received = set(receipts)
        lost = sorted(producers.acked - received)
        duplicated = sum(n - 1 for n in receipts.values())
        elapsed = time.monotonic() - started
        print(
            f"sent={len(producers.sent)} acked={len(producers.acked)} "
            f"received={len(received & producers.acked)} lost={len(lost)} "
            f"duplicated={duplicated} kills={kills} elapsed={elapsed:.1f}s"
            + (" (time limit reached)" if timed_out else ""),
            flush=True,
        )
        if lost:
            places = await where(redis.url, lost)
            log(f"lost messages are now: {dict(places)}; e.g. {lost[:5]}")
        return 1 if lost or timed_out else 0
    finally:
        log("stopping brokers, recipients and redis")
        for broker in brokers:
            with contextlib.suppress(Exception):
                await broker.stop()
        if recipients is not None:
            with contextlib.suppress(Exception):
                await recipients.stop()
        for broker in brokers:
            broker.force_stop()
        if recipients is not None:
            recipients.force_stop()
        redis.stop()


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.chaos", description=__doc__.split("\n\n")[0] if __doc__ else ""
    )
    parser.add_argument("--brokers", type=int, default=2)
    parser.add_argument("--messages", type=int, default=2000)
    parser.add_argument("--cluster", action="store_true", help="on a local 3-master cluster")
    parser.add_argument("--kill-every", type=float, default=2.0, help="seconds between kills")
    parser.add_argument("--time-limit", type=float, default=120.0, help="whole run, seconds")
    parser.add_argument("--rate", type=float, default=200.0, help="messages a second, all told")
    parser.add_argument("--window", type=int, default=50, help="unanswered sends a producer")
    parser.add_argument("--recipients", type=int, default=2)
    parser.add_argument("--work-ms", type=float, default=20.0, help="recipient time a message")
    parser.add_argument("--ack-timeout", type=float, default=2.0)
    parser.add_argument("--retry-times", type=int, default=20)
    parser.add_argument("--drain-time", type=float, default=30.0, help="wait for deliveries")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    # The recipients' process (internal).
    parser.add_argument("--recipient", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--ports", default="", help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, default=0.0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.brokers < 1 or args.messages < 1 or args.kill_every <= 0 or args.recipients < 1:
        parser.error("--brokers, --messages, --recipients >= 1 and --kill-every > 0")
    return args


async def main_async(args: argparse.Namespace) -> int:
    if args.recipient:
        return await recipient_main(args)
    task = asyncio.current_task()
    assert task is not None
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, task.cancel)
    workdir = Path(tempfile.mkdtemp(prefix="skmq-chaos-"))
    try:
        return await run(args, workdir)
    finally:
        if args.keep:
            log(f"work directory kept: {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return asyncio.run(main_async(args))
    except (KeyboardInterrupt, asyncio.CancelledError):
        log("interrupted")
        return 130
    except Exception as exc:  # a setup failure: report it, children are already gone
        log(f"error: {exc!r}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
