"""Which delivery engine (ENGINE) wrote a store's data: every broker of the store must run
it, and an operator command reads the store by it. The first broker of a new store marks
it (`<prefix>:engine`); a store without the mark that lists apps was written by the
per-transition scripts (every version before ENGINE)."""

from __future__ import annotations

from skmq.errors import Misconfigured
from skmq.store.client import RedisClient, text
from skmq.store.directory import AppDirectory

LEGACY = "scripts"  # the engine of a store written before the mark (every version before)


def mark_key(prefix: str) -> str:
    return f"{prefix}:engine"


async def written_by(redis: RedisClient, prefix: str) -> str | None:
    """The engine the store's data is written by; None: a new store (no mark, no app)."""
    mark = await redis.get(mark_key(prefix))
    if mark:
        return text(mark)
    return LEGACY if await AppDirectory(redis, prefix).members() else None


async def engine_of(redis: RedisClient, prefix: str, new: str) -> str:
    """The engine to run on the store: the one its data is written by, or `new`."""
    return await written_by(redis, prefix) or new


async def claim_engine(redis: RedisClient, prefix: str, engine: str) -> None:
    """Mark a new store with `engine`; refuse one whose data another engine wrote."""
    # (a store of an earlier version marked as what it is; two new brokers: the first)
    await redis.set(mark_key(prefix), await written_by(redis, prefix) or engine, nx=True)
    written = text(await redis.get(mark_key(prefix)))
    if written != engine:
        raise Misconfigured(
            f"the store (KEY_PREFIX {prefix!r}) holds data of ENGINE={written}; this "
            f"broker runs ENGINE={engine}: run every broker of a store with one engine"
        )
