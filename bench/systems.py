"""The systems under test: the SKMQ broker (started here) and a local RabbitMQ."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shlex
import shutil
import signal
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from bench.harness import BenchError

RABBIT_URL = "amqp://guest:guest@127.0.0.1:5672/"
NATS_URL = "nats://127.0.0.1:4222"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def port_open(host: str, port: int, timeout: float = 1.0) -> bool:
    try:
        async with asyncio.timeout(timeout):
            _, writer = await asyncio.open_connection(host, port)
    except (OSError, TimeoutError):
        return False
    writer.close()
    with contextlib.suppress(Exception):
        await writer.wait_closed()
    return True


RSS_TREE_REFRESH = 5.0


def schedstat(pid: int) -> tuple[float, float] | None:
    """Seconds the process's main thread (an event loop, Redis's) has run on a CPU, and
    waited runnable for one (Linux's /proc/PID/schedstat); None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/schedstat") as f:
            ran, waited, _ = f.read().split()
    except (OSError, ValueError):
        return None
    return int(ran) / 1e9, int(waited) / 1e9


def _cpu_of(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return float(t.user + t.system)


def _tree(proc: psutil.Process, exclude: psutil.Process | None) -> list[psutil.Process]:
    """`proc` and its descendants, less `exclude` and its own descendants.

    Each descendant's ancestry is checked after it was listed: a fork of `exclude`
    (Redis's AOF rewrite) made meanwhile is never counted as `proc`'s (a list of
    `exclude`'s children taken first would miss it, and its copy-on-write RSS and
    CPU would count as the broker's)."""
    procs = [proc]
    children: list[psutil.Process] = []
    with contextlib.suppress(psutil.Error):
        children = proc.children(recursive=True)
    for child in children:
        if exclude is not None:
            try:
                if child.pid == exclude.pid or any(a.pid == exclude.pid for a in child.parents()):
                    continue
            except psutil.Error:  # gone meanwhile: nothing to count
                continue
        procs.append(child)
    return procs


# --------------------------------------------------------------------------- SKMQ


class SkmqBroker:
    """One `skmq serve` with a fresh DATA_DIR (embedded Redis with AOF)."""

    def __init__(self, cmd: str, extra_env: dict[str, str], appid: str, keep: bool = False) -> None:
        self.cmd = shlex.split(cmd)
        self.keep = keep
        self.extra_env = extra_env
        self.appid = appid
        self.name = "skmq"
        self.host = "127.0.0.1"
        self.port = 0
        self.data_dir: Path | None = None
        self.log_bytes_stopped = 0  # the delivery log on disk once the broker stopped
        self.log_path: Path | None = None
        self.proc: asyncio.subprocess.Process | None = None
        self.ps: psutil.Process | None = None
        self.redis_info: dict[str, Any] = {}
        self.redis_ps: psutil.Process | None = None
        # The broker's process tree as rss() last listed it, and when (monotonic).
        self._rss_tree: list[psutil.Process] = []
        self._rss_tree_at = float("-inf")

    # -- System protocol -------------------------------------------------------

    def producer_cmd(
        self, index: int, count: int, rate: float, prefix: str
    ) -> tuple[str, list[str]]:
        args = ["producer", "--host", self.host, "--port", str(self.port)]
        args += ["--appid", self.appid, "--count", str(count), "--rate", f"{rate:.3f}"]
        args += ["--prefix", prefix]
        return "bench.skmq_load", args

    def recipient_cmd(self, index: int) -> tuple[str, list[str]]:
        args = ["recipient", "--host", self.host, "--port", str(self.port)]
        args += ["--appid", self.appid, "--rid", f"r{index + 1}"]
        return "bench.skmq_load", args

    def cpu(self) -> dict[str, float | None]:
        out: dict[str, float | None] = {"broker": None, "redis": None}
        if self.ps is not None and self.alive():
            with contextlib.suppress(psutil.Error):
                total = _cpu_of(self.ps)  # gone: no figure rather than a wrong one
                for p in _tree(self.ps, self.redis_ps)[1:]:
                    with contextlib.suppress(psutil.Error):
                        total += _cpu_of(p)
                out["broker"] = total
        if self.redis_ps is not None:
            # Redis and its forks (AOF rewrite): the live ones and the reaped ones.
            with contextlib.suppress(psutil.Error):
                t = self.redis_ps.cpu_times()
                total = float(t.user + t.system + t.children_user + t.children_system)
                for p in _tree(self.redis_ps, None)[1:]:
                    with contextlib.suppress(psutil.Error):
                        total += _cpu_of(p)
                out["redis"] = total
        return out

    def sched(self) -> dict[str, tuple[float, float] | None]:
        """schedstat() of the broker's and its embedded Redis's main threads."""
        out: dict[str, tuple[float, float] | None] = {"broker": None, "redis": None}
        for key, proc in (("broker", self.ps), ("redis", self.redis_ps)):
            if proc is not None:
                out[key] = schedstat(proc.pid)
        return out

    # -- lifecycle ---------------------------------------------------------------

    async def start(self, timeout: float = 60.0) -> None:
        self.data_dir = Path(tempfile.mkdtemp(prefix="skmq-bench-"))
        self.log_path = self.data_dir.with_name(self.data_dir.name + ".log")
        self.port = free_port()
        env = dict(os.environ)
        env.update(
            {
                "SKMQ_DATA_DIR": str(self.data_dir),
                "SKMQ_PORT": str(self.port),
                "SKMQ_HTTP_PORT": "0",
                "SKMQ_HOST": self.host,
                "SKMQ_LOG_LEVEL": "warning",
                "SKMQ_REDIS_URL": "",
            }
        )
        env.update(self.extra_env)
        with open(self.log_path, "wb") as log:
            try:
                self.proc = await asyncio.create_subprocess_exec(
                    *self.cmd,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=log,
                    stderr=log,
                    env=env,
                    start_new_session=True,
                )
            except OSError as exc:
                raise BenchError(f"cannot start broker {self.cmd}: {exc}") from exc
        self.ps = psutil.Process(self.proc.pid)
        deadline = time.monotonic() + timeout
        while not await port_open(self.host, self.port, 0.5):
            if self.proc.returncode is not None:
                raise BenchError(
                    f"broker exited with {self.proc.returncode} before listening:\n"
                    + self.log_tail()
                )
            if time.monotonic() > deadline:
                raise BenchError(f"broker not listening after {timeout:.0f}s:\n{self.log_tail()}")
            await asyncio.sleep(0.1)
        redis_json = self.data_dir / "redis.json"
        while not redis_json.exists() and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        if redis_json.exists():
            with contextlib.suppress(ValueError, OSError):
                self.redis_info = json.loads(redis_json.read_text())
            pid = self.redis_info.get("pid")
            if isinstance(pid, int):
                with contextlib.suppress(psutil.Error):
                    self.redis_ps = psutil.Process(pid)

    def log_tail(self, n: int = 20) -> str:
        if self.log_path is None:
            return ""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def redis_log_tail(self, n: int = 8) -> str:
        """The end of the embedded Redis's own log, if the broker keeps one in DATA_DIR."""
        if self.data_dir is None:
            return ""
        for path in sorted(self.data_dir.rglob("*.log")):
            with contextlib.suppress(OSError):
                return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
        return ""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    def rss(self) -> int:
        """Resident memory of the broker (its process tree, Redis excluded). The harness
        samples it 4 times a second during a run: the tree is listed again only every
        RSS_TREE_REFRESH s, since listing it reads every process's /proc entry (a few ms
        of CPU in the harness each time, which on a 2-core machine stalled the broker's
        or the load processes' deliveries every 0.25 s in the paced runs)."""
        if self.ps is None:
            return 0
        now = time.monotonic()
        if now - self._rss_tree_at >= RSS_TREE_REFRESH:
            self._rss_tree, self._rss_tree_at = _tree(self.ps, self.redis_ps), now
        total = 0
        for p in self._rss_tree:
            with contextlib.suppress(psutil.Error):
                total += int(p.memory_info().rss)
        return total

    async def redis_memory(self) -> dict[str, int]:
        """`INFO memory` figures of the broker's Redis (empty if unknown)."""
        if not self.redis_info or "url" not in self.redis_info:
            return {}
        import redis.asyncio as aioredis

        # redis.json's URL carries the embedded server's password.
        client = aioredis.Redis.from_url(str(self.redis_info["url"]), socket_timeout=10)
        try:
            info = await client.info("memory")
            keyspace = await client.dbsize()
        finally:
            await client.aclose()
        out: dict[str, int] = {
            k: int(info[k]) for k in ("used_memory", "used_memory_rss") if k in info
        }
        out["dbsize"] = int(keyspace)
        return out

    def aof_bytes(self) -> int:
        if self.data_dir is None:
            return 0
        total = 0
        for path in self.data_dir.rglob("*"):
            if path.is_file() and (".aof" in path.name or "appendonly" in str(path)):
                with contextlib.suppress(OSError):
                    total += path.stat().st_size
        return total

    def delivery_log_bytes(self) -> int:
        if self.data_dir is None:
            return 0
        total = 0
        for path in (self.data_dir / "delivery-log").rglob("*"):
            if path.is_file():
                with contextlib.suppress(OSError):
                    total += path.stat().st_size
        return total

    async def stop(self) -> None:
        proc = self.proc
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                async with asyncio.timeout(15):
                    await proc.wait()
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(5):
                        await proc.wait()
        if proc is not None:
            # Anything left in the broker's session (its own workers).
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        if self.redis_ps is not None:
            # The embedded Redis should stop with the broker; make sure it did.
            deadline = time.monotonic() + 5
            while self.redis_ps.is_running() and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            with contextlib.suppress(psutil.Error):
                if self.redis_ps.is_running():  # is_running() also checks the pid's start time
                    self.redis_ps.kill()
        self.log_bytes_stopped = self.delivery_log_bytes()
        if self.keep:
            return
        if self.data_dir is not None:
            shutil.rmtree(self.data_dir, ignore_errors=True)
        if self.log_path is not None:
            with contextlib.suppress(OSError):
                self.log_path.unlink()


# ------------------------------------------------------------------ RabbitMQ and NATS


class ExternalSystem:
    """A broker the benchmark does not start (RabbitMQ, NATS): found on the machine, its
    processes' CPU measured, its queue or stream made before a scenario and dropped after."""

    name = "?"
    label = "?"
    process_name = "?"

    def __init__(self) -> None:
        self.version = "?"
        self.procs = [
            p for p in psutil.process_iter(["name"]) if p.info.get("name") == self.process_name
        ]

    def alive(self) -> bool:
        return True

    def cpu(self) -> dict[str, float | None]:
        if not self.procs:
            return {"broker": None, "redis": None}
        total = 0.0
        for p in self.procs:
            with contextlib.suppress(psutil.Error):
                total += _cpu_of(p)
        return {"broker": total, "redis": None}

    module = "?"  # its load process (bench.confirmed's flags, plus its target's)

    def target(self) -> list[str]:
        """The load process's flags naming the server and the queue or stream."""
        raise NotImplementedError

    def consumer_flags(self) -> list[str]:
        return []

    def producer_cmd(
        self, index: int, count: int, rate: float, prefix: str
    ) -> tuple[str, list[str]]:
        args = ["producer", *self.target(), "--count", str(count)]
        return self.module, [*args, "--rate", f"{rate:.3f}", "--prefix", prefix]

    def recipient_cmd(self, index: int) -> tuple[str, list[str]]:
        args = ["consumer", *self.target(), *self.consumer_flags(), "--rid", f"c{index + 1}"]
        return self.module, args

    async def reset(self, delete: bool = False) -> None:
        """Make the scenario's queue or stream empty (`delete`: drop it)."""
        raise NotImplementedError


PREFETCH = 100  # unacknowledged messages a consumer process of RabbitMQ or NATS may hold


class RabbitSystem(ExternalSystem):
    """A RabbitMQ already listening on 127.0.0.1:5672, driven with aio-pika."""

    name = "rabbitmq"
    label = "RabbitMQ"
    process_name = "beam.smp"
    module = "bench.rabbit_load"

    def __init__(self, url: str, queue: str) -> None:
        super().__init__()
        self.url = url
        self.queue = queue

    def target(self) -> list[str]:
        return ["--url", self.url, "--queue", self.queue]

    def consumer_flags(self) -> list[str]:
        return ["--prefetch", str(PREFETCH)]

    async def reset(self, delete: bool = False) -> None:
        """Declare the durable queue and purge it (or delete it)."""
        import aio_pika

        async with asyncio.timeout(20):
            connection = await aio_pika.connect(self.url, timeout=10)
            try:
                underlay = connection.transport
                raw = getattr(underlay.connection, "server_properties", None) if underlay else None
                props: dict[str, Any] = dict(raw or {})
                version = props.get("version")
                if version:
                    self.version = version.decode() if isinstance(version, bytes) else str(version)
                channel = await connection.channel()
                queue = await channel.declare_queue(self.queue, durable=True)
                if delete:
                    await queue.delete(if_unused=False, if_empty=False)
                else:
                    await queue.purge()
            finally:
                await connection.close()


class NatsSystem(ExternalSystem):
    """A NATS server with JetStream already listening (127.0.0.1:4222), driven with nats-py:
    a file-stored stream of its own for each scenario, deleted afterwards."""

    name = "nats"
    label = "NATS"
    process_name = "nats-server"
    module = "bench.nats_load"

    def __init__(self, url: str, stream: str, consumers: int = 1) -> None:
        super().__init__()
        self.url = url
        self.stream = stream
        self.subject = f"{stream}.msgs"
        self.consumers = consumers

    def target(self) -> list[str]:
        return ["--url", self.url, "--subject", self.subject]

    def consumer_flags(self) -> list[str]:
        # The consumer processes share one durable consumer, and its max_ack_pending bounds
        # them all together: PREFETCH a process, as RabbitMQ's prefetch is a consumer's (100
        # in all left the e2e's 4 consumers a quarter of what RabbitMQ's hold).
        return ["--durable", self.stream, "--max-pending", str(PREFETCH * self.consumers)]

    async def reset(self, delete: bool = False) -> None:
        """Delete the scenario's stream if it is there; then (unless `delete`) create it."""
        import nats
        from nats.js.api import StorageType
        from nats.js.errors import NotFoundError

        async with asyncio.timeout(20):
            nc = await nats.connect(self.url, connect_timeout=10)
            try:
                server = nc.connected_server_version  # printed as <nats server v2.9.10>
                self.version = f"{server.major}.{server.minor}.{server.patch}"
                js = nc.jetstream(timeout=10)
                with contextlib.suppress(NotFoundError):
                    await js.delete_stream(self.stream)
                if not delete:
                    await js.add_stream(
                        name=self.stream, subjects=[self.subject], storage=StorageType.FILE
                    )
            finally:
                await nc.close()
