"""What operator commands share: settings from flags, and a store found from them."""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import AsyncIterator

from pydantic import ValidationError

from skmq.broker import make_store
from skmq.config import Settings, settings_from_args
from skmq.embedded import EmbeddedRedis, redis_url_for
from skmq.store import Store, connect_redis


def load_settings(args: argparse.Namespace) -> Settings:
    try:
        return settings_from_args(args)
    except ValidationError as exc:
        sys.stderr.write(f"skmq: invalid settings:\n{exc}\n")
        raise SystemExit(2) from None


@contextlib.asynccontextmanager
async def open_store(settings: Settings) -> AsyncIterator[Store]:
    """The broker's store: REDIS_URL, else the embedded server of a broker running with
    this DATA_DIR, else (no broker running) the embedded server started for this command."""
    embedded: EmbeddedRedis | None = None
    url = settings.redis_url or redis_url_for(settings.data_dir)
    if url is None:
        if not (settings.data_dir / "redis").is_dir():
            sys.stderr.write(
                f"skmq: no broker data in {settings.data_dir} (set --data-dir or REDIS_URL)\n"
            )
            raise SystemExit(2)
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
