"""What operator commands share: the store found from their settings."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from skmq.broker import make_store
from skmq.config import Settings
from skmq.embedded import EmbeddedRedis, redis_url_for
from skmq.errors import UsageError
from skmq.store import Store, connect_redis


@contextlib.asynccontextmanager
async def open_store(settings: Settings) -> AsyncIterator[Store]:
    """The broker's store: REDIS_URL, else the embedded server of a broker running with
    this DATA_DIR, else (no broker running) the embedded server started for this command."""
    embedded: EmbeddedRedis | None = None
    url = settings.redis_url or redis_url_for(settings.data_dir)
    if url is None:
        if not (settings.data_dir / "redis").is_dir():
            raise UsageError(f"no broker data in {settings.data_dir} (set --data-dir or REDIS_URL)")
        embedded = EmbeddedRedis(settings.data_dir, settings.redis_appendfsync)
        embedded.start()
        url = embedded.url
    redis = connect_redis(url)
    try:
        yield make_store(settings, redis)
    finally:
        await redis.aclose()
        if embedded is not None:
            embedded.stop()
