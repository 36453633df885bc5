"""Fixtures: a real embedded Redis on a free port for the whole session (never the
machine's own servers), and brokers on it, each test under its own KEY_PREFIX."""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import functools
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TextIO

import aiohttp
import pytest
import redis.asyncio as aioredis
import uvloop

from skmq.broker import Broker
from skmq.codec import PONG, encode_frame
from skmq.config import Settings
from skmq.embedded import EmbeddedRedis
from skmq.errors import Misconfigured
from skmq.store.wire import Wire

os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> dict[str, Any]:
    """Every async test runs on uvloop, the loop the broker runs on."""
    return {"uvloop": uvloop.new_event_loop}


# -- a worker that dies says where ----------------------------------------------------
# xdist reports a worker killed by a signal (a crash in a C extension) or by
# pytest-timeout's last resort only as "worker 'gw0' crashed": each worker writes its
# threads' stacks to a file of its own, on a fatal signal and shortly before
# pytest-timeout would end it, and the run's report of the crash carries that file.
STACKS_KEY = "skmq_stacks_file"  # workerinput: the file's path
STACKS = pytest.StashKey[TextIO]()  # a worker's config.stash: the file, open


def stacks_directory() -> Path:
    """The controller's folder of its workers' stack files."""
    return Path(tempfile.gettempdir()) / f"skmq-pytest-{os.getpid()}"


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """Controller: the file a worker writes its stacks to."""
    stacks_directory().mkdir(exist_ok=True)
    node.workerinput[STACKS_KEY] = str(stacks_directory() / f"{node.gateway.id}.txt")


def pytest_unconfigure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):
        shutil.rmtree(stacks_directory(), ignore_errors=True)


@pytest.hookimpl(trylast=True)
def pytest_configure(config: pytest.Config) -> None:
    """Worker: fatal signals dump every thread's stack to that file (after pytest's own
    faulthandler, whose stderr an xdist worker does not show)."""
    path = getattr(config, "workerinput", {}).get(STACKS_KEY)
    if path is not None:
        config.stash[STACKS] = stacks = open(path, "w")  # open for the worker's life
        faulthandler.enable(file=stacks, all_threads=True)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Any:
    """Worker: the stacks too if the test is still running just before pytest-timeout
    ends the worker (it dumps them to a terminal nobody sees)."""
    stacks = item.config.stash.get(STACKS, None)
    if stacks is None:
        return (yield)
    stacks.write(f"running {item.nodeid}\n")
    stacks.flush()
    faulthandler.dump_traceback_later(0.95 * test_timeout(item), file=stacks)
    try:
        return (yield)
    finally:
        faulthandler.cancel_dump_traceback_later()


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem: str, report: pytest.TestReport, sched: Any) -> None:
    """Controller: the crashed worker's stacks, in the report of its test."""
    path = report.node.workerinput.get(STACKS_KEY)  # type: ignore[attr-defined]
    with contextlib.suppress(OSError):
        report.longrepr = f"{report.longrepr}\n{Path(path).read_text()[-20_000:]}"


def test_timeout(item: pytest.Item) -> float:
    """The test's `timeout` mark, else the ini's (pytest-timeout's own setting)."""
    mark = item.get_closest_marker("timeout")
    if mark is not None and mark.args:
        return float(mark.args[0])
    return float(item.config.getini("timeout"))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Bound every async test inside its own loop. pytest-timeout's SIGALRM cannot stop
    a test on uvloop (the loop's signal handling swallows the exception it raises, and
    the test runs on), so a hung test is cancelled here, fails, and the session goes on;
    pytest-timeout's thread method stays as the last resort for a hung teardown (it ends
    the session, with every thread's stack)."""
    function = getattr(item, "obj", None)
    if not isinstance(item, pytest.Function) or not asyncio.iscoroutinefunction(function):
        return
    seconds = 0.8 * test_timeout(item)

    @functools.wraps(function)
    async def bounded(*args: Any, **kwargs: Any) -> Any:
        deadline = asyncio.timeout(seconds)
        try:
            async with deadline:
                return await function(*args, **kwargs)
        except TimeoutError:
            if deadline.expired():
                pytest.fail(f"the test ran past its {seconds:.0f} s and was cancelled")
            raise

    item.obj = bounded


# Short timings, so that no test waits for seconds (the held-out suite uses the same).
FAST: dict[str, Any] = {
    "ack_timeout": 1.5,
    "ack_wait": 0.5,
    "retry_backoff": [0.2],
    "retry_times": 3,
    "heartbeat_interval": 0.5,
    "heartbeat_timeout": 1.0,  # a loaded machine (CI) lags the loop past 0.3 s
    "max_frame_bytes": 65536,
    "shutdown_timeout": 1.0,
    "http_port": 0,
    "owner_lease": 1.5,  # (a dead broker's apps taken over within it)
}


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    server = EmbeddedRedis(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    """One local Spark session for every audit test (a JVM start costs seconds)."""
    from skmq.audit_job.audit import build_spark

    session = build_spark("local[2]")
    yield session
    session.stop()


@pytest.fixture
def redis_url(redis_server: EmbeddedRedis) -> str:
    return redis_server.url


@pytest.fixture
async def wire(redis_server: EmbeddedRedis) -> AsyncIterator[Wire]:
    """A lean connection (skmq/store/wire.py) to the session's Redis."""
    w = await Wire.connect(redis_server.url)
    yield w
    w.close()


@pytest.fixture
def prefix() -> str:
    return f"t{uuid.uuid4().hex[:10]}"


BrokerFactory = Callable[..., Awaitable[Broker]]


@pytest.fixture
async def make_broker(redis_url: str, prefix: str, tmp_path: Path) -> AsyncIterator[BrokerFactory]:
    """Start in-process brokers on the session Redis: `await make_broker(**settings)`."""
    brokers: list[Broker] = []

    async def factory(**overrides: Any) -> Broker:
        values: dict[str, Any] = {
            "host": "127.0.0.1",
            "port": 0,
            "redis_url": redis_url,
            "key_prefix": prefix,
            "data_dir": tmp_path / "data",
            **FAST,
        }
        values.update(overrides)
        for attempt in range(3):
            broker = Broker(Settings(**values))
            try:
                await broker.start()
            except Misconfigured as exc:
                # A free port the test picked (HTTP_PORT, METRICS_PORT) was taken meanwhile
                # by another process of this machine, or by this broker's own PORT 0 (the
                # kernel hands a closed port out again): stop what started, pick others.
                # The test reads the port the broker got from broker.settings / .gateway.
                taken = ("address already in use", "an address the broker uses already")
                if not any(t in str(exc) for t in taken) or attempt == 2:
                    raise
                if hasattr(broker, "server"):
                    broker.stopping.set()
                    await broker.stop()
                values.update(
                    {k: free_port() for k in ("http_port", "metrics_port") if values.get(k)}
                )
                continue
            brokers.append(broker)
            return broker
        raise AssertionError("unreachable")

    yield factory
    for broker in brokers:
        if not broker.stopping.is_set():
            broker.stopping.set()
            await broker.stop()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    """A real HTTP client for the gateway tests; it checks every answer against the
    gateway's OpenAPI document (tests/openapi_check.py)."""
    from tests.openapi_check import check_against_openapi

    async with aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=15), middlewares=(check_against_openapi,)
    ) as session:
        yield session


@pytest.fixture
async def broker(make_broker: BrokerFactory) -> Broker:
    return await make_broker()


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_url)
    yield client
    await client.aclose()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def answers_ping(port: int) -> bool:
    """A broker listens on the port (not some other process of this busy machine that
    took it meanwhile): it answers `ping` with `pong`."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0) as sock:
            sock.sendall(encode_frame("ping", {}, None))
            return sock.recv(64).startswith(PONG)
    except OSError:
        return False


def port_was_taken(log_path: Path) -> bool:
    """The broker exited because another process took its port (a free port picked by a
    test is only free until someone else binds it)."""
    return log_path.exists() and "address already in use" in log_path.read_text()[-500:]


def wait_listening(
    port: int,
    proc: subprocess.Popen[bytes],
    timeout: float = 20.0,
    ready: Callable[[int], bool] | None = None,
) -> None:
    """Until the process listens on the port (or, with `ready`, until ready(port))."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode}")
        if ready is not None:
            if ready(port):
                return
        else:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
                return
        time.sleep(0.02)
    raise TimeoutError(f"nothing listens on {port}")


class BrokerProcess:
    """`skmq serve` as a real child process, for kill -9, SIGTERM and CLI tests."""

    def __init__(
        self, env: dict[str, str], log_path: Path, command: list[str] | None = None
    ) -> None:
        self.env = env
        self.port = int(env["SKMQ_PORT"])
        self.log_path = log_path
        self.command = command or [sys.executable, "-m", "skmq.cli", "serve"]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> BrokerProcess:
        for _ in range(3):
            log = self.log_path.open("ab")
            self.proc = subprocess.Popen(
                self.command,
                env=self.env, stdout=log, stderr=log, stdin=subprocess.DEVNULL,
            )  # fmt: skip
            log.close()
            try:
                wait_listening(self.port, self.proc, ready=answers_ping)
                # The protocol port answers first; the HTTP gateway and /metrics follow.
                for other in ("SKMQ_HTTP_PORT", "SKMQ_METRICS_PORT"):
                    if port := int(self.env.get(other) or 0):
                        wait_listening(port, self.proc)
                return self
            except RuntimeError:
                if not port_was_taken(self.log_path):
                    raise
            self.port = free_port()
            self.env["SKMQ_PORT"] = str(self.port)
        raise RuntimeError("no free port for the broker")

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def terminate(self, timeout: float = 15.0) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)


@pytest.fixture
def broker_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SKMQ_")}
    env.update(
        SKMQ_HOST="127.0.0.1",
        SKMQ_PORT=str(free_port()),
        SKMQ_DATA_DIR=str(tmp_path / "data"),
        SKMQ_ACK_TIMEOUT="1.5",
        SKMQ_ACK_WAIT="0.5",
        SKMQ_RETRY_BACKOFF="0.2",
        SKMQ_RETRY_TIMES="3",
        SKMQ_HEARTBEAT_INTERVAL="0.5",
        SKMQ_HEARTBEAT_TIMEOUT="1.0",
        SKMQ_MAX_FRAME_BYTES="65536",
        SKMQ_LOG_LEVEL="warning",
        SKMQ_HTTP_PORT="0",
        SKMQ_OWNER_LEASE="1.5",
    )
    return env


@pytest.fixture
def broker_process(broker_env: dict[str, str], tmp_path: Path) -> Iterator[BrokerProcess]:
    proc = BrokerProcess(broker_env, tmp_path / "broker.log")
    yield proc
    if proc.proc is not None and proc.proc.poll() is None:
        proc.proc.kill()
        proc.proc.wait(10)


async def eventually(check: Callable[[], Awaitable[bool]], timeout: float = 10.0) -> None:
    """Await a condition that only Redis or the log can tell (no event to wait on), bounded.
    The deadline is also checked by hand: a cancellation swallowed inside `check` (a
    client library's cleanup) must not turn the bound into a hang."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    async with asyncio.timeout(timeout):
        while not await check():
            if loop.time() > deadline:
                raise TimeoutError(f"not within {timeout} s")
            await asyncio.sleep(0.02)
