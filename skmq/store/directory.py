"""The apps directory: which apps a store holds, for the brokers to find them.

It is sharded: app `a` is listed in the set `<prefix>:apps:{<shard>}`, shard a stable
hash of `a` (CRC-32 modulo APP_SHARDS), so that in a Redis Cluster the directory is
spread over the nodes like the apps themselves and no node holds every app.

A shard set lives in another slot than the app's own keys, so no script can change
both. Instead each app has a `listed` mark among its own keys, set in the same step as
every store and registration (the owners' flush.lua and append.lua, register.lua) and
dropped with the app by forget.lua. The rule "an app with a mark is in the directory" holds because:
- a store or a registration lists the app after its script whenever the mark was new
  (a registration always);
- a forget takes the app out of its shard set, THEN looks at the mark again, and lists
  the app again if a store or a registration set it meanwhile. Whatever the order of a
  concurrent store's SADD and the forget's SREM, the app ends up listed: either the SADD
  comes last, or the mark was set before the SREM and the forget sees it afterwards.
(tests/test_cluster.py::test_a_store_racing_a_forget_keeps_the_app)
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Sequence

from skmq.store.client import ENC, RedisClient, text

APP_SHARDS = 16


def shard_key(prefix: str, app: str, shards: int = APP_SHARDS) -> str:
    """The shard set that lists `app`."""
    return f"{prefix}:apps:{{{zlib.crc32(app.encode('utf-8', ENC)) % shards}}}"


class AppDirectory:
    def __init__(self, redis: RedisClient, prefix: str, shards: int = APP_SHARDS) -> None:
        self.redis = redis
        self.prefix = prefix
        self.shards = shards
        self.keys = [f"{prefix}:apps:{{{i}}}" for i in range(shards)]

    def key_of(self, app: str) -> str:
        """The shard set that lists `app`."""
        return shard_key(self.prefix, app, self.shards)

    def by_shard(self, apps: Iterable[str]) -> dict[str, list[str]]:
        """`apps` by the shard set that lists them."""
        shards: dict[str, list[str]] = {}
        for app in apps:
            shards.setdefault(self.key_of(app), []).append(app)
        return shards

    async def add(self, apps: Iterable[str]) -> None:
        await self._each_shard("SADD", apps)

    async def remove(self, apps: Sequence[str]) -> None:
        await self._each_shard("SREM", apps)

    async def _each_shard(self, command: str, apps: Iterable[str]) -> None:
        """`command shard-key app...` for each shard holding some of `apps`: one command
        when one shard (a lone command is retried on a connection that died with a
        restarted Redis; a pipeline is not), else one pipeline."""
        shards = self.by_shard(apps)
        if len(shards) == 1:
            ((key, members),) = shards.items()
            await self.redis.execute_command(command, key, *members)
        elif shards:
            pipe = self.redis.pipeline(transaction=False)
            for key, members in shards.items():
                pipe.execute_command(command, key, *members)
            await pipe.execute()

    async def holds(self, app: str) -> bool:
        """Whether `app` is listed."""
        return bool(await self.redis.sismember(self.key_of(app), app))

    async def members(self) -> list[str]:
        pipe = self.redis.pipeline(transaction=False)
        for key in self.keys:
            pipe.smembers(key)
        return sorted(text(app) for shard in await pipe.execute() for app in shard)
