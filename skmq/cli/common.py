"""What operator commands share: the store found from their settings, the app they
act on, the delivery log they write to and the user they name."""

from __future__ import annotations

import asyncio
import contextlib
import getpass
import os
import socket
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

from redis.exceptions import BusyLoadingError
from rich.console import Console

from skmq.config import Settings
from skmq.deliverylog import DeliveryLog
from skmq.embedded import SECRET_FILE, EmbeddedRedis, redis_url_for
from skmq.errors import UsageError
from skmq.ids import bad_app
from skmq.queue.owned_store import OwnedStore
from skmq.store import connect_redis
from skmq.store.client import RedisClient
from skmq.store.engine_mark import claim_store
from skmq.store.wires import Wires

LOADING_POLL = 0.05  # how often a command asks a loading server again


@contextlib.asynccontextmanager
async def open_store(settings: Settings) -> AsyncIterator[OwnedStore]:
    """The broker's store: REDIS_URL, else the embedded server of a broker running with
    this DATA_DIR, else (no broker running) the embedded server started for this command."""
    embedded: EmbeddedRedis | None = None
    url = settings.redis_url or redis_url_for(settings.data_dir)
    if url is None:
        if not is_broker_data(settings.data_dir):
            raise UsageError(f"no broker data in {settings.data_dir} (set --data-dir or REDIS_URL)")
        embedded = EmbeddedRedis(
            settings.data_dir, settings.redis_appendfsync, settings.redis_allocator
        )
        embedded.start()
        url = embedded.url
    try:
        redis = connect_redis(url)
        try:
            await wait_loaded(redis, settings.redis_wait)
            await claim_store(redis, settings.key_prefix)  # (a new store: marked, as a broker does)
            store = OwnedStore.configured(settings, redis)
            # (an app no broker owns is read as its owner would)
            wires = store.wires = Wires.beside(url, redis, settings.store_timeout)
            try:
                yield store
            finally:
                wires.close()
        finally:
            await redis.aclose()
    finally:
        if embedded is not None:
            embedded.stop()


def is_broker_data(data_dir: Path) -> bool:
    """A DATA_DIR a broker ran with: files of SKMQ's own in it, not merely a `redis`
    directory (a command must never start a server in, and write to, /etc/redis)."""
    return (data_dir / SECRET_FILE).is_file() or (data_dir / "redis" / "skmq.conf").is_file()


async def wait_loaded(redis: RedisClient, timeout: float) -> None:
    """Wait up to `timeout` seconds (REDIS_WAIT) while the server loads its AOF, as `serve`
    does: a server just started (here, on a stopped broker's DATA_DIR, or by a broker
    restarting it) answers every command with LOADING until its dataset is in memory
    (a second or more for an AOF of a few MB). Other errors are the command's to report."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            await redis.ping()
            return
        except BusyLoadingError:
            if time.monotonic() >= deadline:
                raise RuntimeError(
                    f"Redis is still loading its dataset after {timeout:g}s (REDIS_WAIT)"
                ) from None
            await asyncio.sleep(LOADING_POLL)


def admin_app(app: str, only: frozenset[str] | None) -> str:
    """`--app`, checked: an app id the token (`only`: cli/tokens.py admin_apps) is admin of."""
    if (why := bad_app(app)) is not None:
        raise UsageError(f"--app {why}")
    if only is not None and app not in only:
        raise UsageError(f"this token has no admin role for app {app!r}")
    return app


def operator_log(settings: Settings) -> DeliveryLog:
    """The delivery log of one operator command (its own instance id), so that the audit
    sees what it changed."""
    return DeliveryLog(settings.delivery_log_dir, f"cli-{socket.gethostname()}-{os.getpid()}")


def operator() -> str:
    """Who runs the command, for the logs."""
    try:
        return getpass.getuser()
    except (OSError, KeyError):
        return str(os.getuid())


# The width of a table written to a pipe or a file: rich would cut its columns to 80
# characters there (`pen…` for `pending`); as wide as the table needs, up to this.
PIPED_WIDTH = 1_000


def table_console() -> Console:
    """rich's console for the operator commands' tables: a terminal's own width, and
    when piped the width the table needs (a script greps whole words)."""
    return Console(width=None if sys.stdout.isatty() else PIPED_WIDTH)
