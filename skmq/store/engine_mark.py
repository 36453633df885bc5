"""Which delivery engine (ENGINE) wrote a store's data: every broker of the store must run
it, and an operator command reads the store by it. The first broker of a new store marks
it (`<prefix>:engine`); a store without the mark that lists apps was written by the
per-transition scripts (every version before ENGINE)."""

from __future__ import annotations

from skmq.errors import Misconfigured
from skmq.store.client import RedisClient, text
from skmq.store.directory import AppDirectory

DEFAULT = "scripts"


def mark_key(prefix: str) -> str:
    return f"{prefix}:engine"


async def engine_of(redis: RedisClient, prefix: str) -> str:
    """The engine the store's data is written by."""
    mark = await redis.get(mark_key(prefix))
    return text(mark) if mark else DEFAULT


async def claim_engine(redis: RedisClient, prefix: str, engine: str) -> None:
    """Mark a new store with `engine`; refuse one whose data another engine wrote."""
    mark = await redis.get(mark_key(prefix))
    if mark is None:
        held = bool(await AppDirectory(redis, prefix).members())
        await redis.set(mark_key(prefix), DEFAULT if held else engine, nx=True)
        mark = await redis.get(mark_key(prefix))
    if text(mark) != engine:
        raise Misconfigured(
            f"the store (KEY_PREFIX {prefix!r}) holds data of ENGINE={text(mark)}; this "
            f"broker runs ENGINE={engine}: run every broker of a store with one engine"
        )
