"""Which SKMQ wrote a store's data. The first broker of a new store marks it
`<prefix>:engine` = `owner`; a store marked `scripts`, or without the mark while it lists
apps (in its apps directory, or in the one set of the versions before the directory was
sharded, `<prefix>:apps`: every version before the mark), was written by an earlier SKMQ
(the per-transition scripts engine), whose keys this one does not read: a broker or an
operator command refuses it, pointing at `skmq migrate`."""

from __future__ import annotations

from skmq.errors import Misconfigured
from skmq.store.client import RedisClient, text
from skmq.store.directory import AppDirectory

OWNER = "owner"  # the mark of a store this SKMQ writes


def mark_key(prefix: str) -> str:
    return f"{prefix}:engine"


async def refuse_legacy(redis: RedisClient, prefix: str) -> None:
    """Misconfigured when an earlier SKMQ wrote the store's data."""
    mark = await redis.get(mark_key(prefix))
    if mark:
        legacy = text(mark) != OWNER
    else:
        unsharded = await redis.exists(f"{prefix}:apps")
        legacy = bool(unsharded or await AppDirectory(redis, prefix).members())
    if legacy:
        raise Misconfigured(
            f"the store (KEY_PREFIX {prefix!r}) holds data of an earlier SKMQ (the "
            "per-transition scripts engine): `skmq migrate` converts it"
        )


async def claim_store(redis: RedisClient, prefix: str) -> None:
    """Refuse a store an earlier SKMQ wrote; mark a new one `owner`."""
    await refuse_legacy(redis, prefix)
    await redis.set(mark_key(prefix), OWNER, nx=True)
