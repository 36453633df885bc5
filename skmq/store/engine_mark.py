"""Which SKMQ wrote a store's data. The first broker of a new store marks it
`<prefix>:engine` = `owner`; a store marked `scripts`, or without the mark while it lists
apps (in its apps directory, or in the one set of the versions before the directory was
sharded, `<prefix>:apps`: every version before the mark), was written by an earlier SKMQ
(the per-transition scripts engine), whose keys this one does not read. A broker
converts such a store when it starts (skmq/queue/migrate.py); an operator command
refuses it until then."""

from __future__ import annotations

from skmq.errors import Misconfigured
from skmq.store.client import RedisClient, text
from skmq.store.directory import AppDirectory

OWNER = "owner"  # the mark of a store this SKMQ writes
UNSHARDED = "apps"  # the apps set of the versions before the directory was sharded


def mark_key(prefix: str) -> str:
    return f"{prefix}:engine"


async def is_legacy(redis: RedisClient, prefix: str) -> bool:
    """Whether an earlier SKMQ wrote the store's data."""
    mark = await redis.get(mark_key(prefix))
    if mark:
        return text(mark) != OWNER
    unsharded = await redis.exists(f"{prefix}:{UNSHARDED}")
    return bool(unsharded or await AppDirectory(redis, prefix).members())


async def claim_store(redis: RedisClient, prefix: str) -> None:
    """Refuse a store an earlier SKMQ wrote (Misconfigured); mark a new one `owner`."""
    if await is_legacy(redis, prefix):
        raise Misconfigured(
            f"the store (KEY_PREFIX {prefix!r}) holds data of an earlier SKMQ (the "
            "per-transition scripts engine): start a broker of this version "
            "(`skmq serve`), which converts it"
        )
    await redis.set(mark_key(prefix), OWNER, nx=True)
