"""The floor's lifecycles (bench/floor_lifecycles.py) against a real Redis: what the
benchmark's `floor-lifecycle` measures must be SKMQ's lifecycle working, not scripts
refusing arguments they no longer take."""

from __future__ import annotations

import asyncio
from typing import Any
from urllib.parse import unquote, urlsplit

import hiredis
import pytest

from bench.floor_lifecycles import BareLifecycle, Lifecycle, SkmqLifecycle
from skmq.embedded import EmbeddedRedis
from skmq.store.client import hiredis_pack


class RawRedis:
    """Packed commands in, replies out: the relay's way of talking to Redis."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.parser = hiredis.Reader()

    @classmethod
    async def connect(cls, url: str) -> RawRedis:
        where = urlsplit(url)
        raw = cls(*await asyncio.open_connection(where.hostname, where.port))
        if where.password:
            assert await raw.call(hiredis_pack(("AUTH", unquote(where.password)))) == b"OK"
        return raw

    async def call(self, packed: bytes) -> Any:
        self.writer.write(packed)
        while (reply := self.parser.gets()) is False:
            self.parser.feed(await asyncio.wait_for(self.reader.read(65536), 10))
        assert not isinstance(reply, hiredis.ReplyError), reply
        return reply

    def close(self) -> None:
        self.writer.close()


@pytest.mark.parametrize("kind", [SkmqLifecycle, BareLifecycle])
async def test_a_floor_lifecycle_stores_claims_finishes_and_dedupes(
    kind: type[Lifecycle], redis_server: EmbeddedRedis, prefix: str
) -> None:
    lifecycle = kind(base=f"{prefix}:{{floor}}:")
    redis = await RawRedis.connect(redis_server.tcp_url)
    try:
        lifecycle.shas = {
            name: (await redis.call(hiredis_pack(("SCRIPT", "LOAD", source)))).decode()
            for name, source in lifecycle.sources().items()
        }
        msgids = [b"m%08x" % n for n in range(3)]
        lines = [b"%d %s ...." % (n, m) for n, m in enumerate(msgids)]
        store, claim = lifecycle.store_and_claim(msgids, lines)
        stored = await redis.call(store)
        assert stored[-3:] == [1, 1, 1]
        assert lifecycle.contents(await redis.call(claim)) == lines
        again, claim_again = lifecycle.store_and_claim(msgids, lines)
        assert (await redis.call(again))[-3:] == [0, 0, 0]  # duplicates
        assert lifecycle.contents(await redis.call(claim_again)) == []
        # (each msgid's answer starts with 1 if it was finished: SKMQ's with 4 more fields)
        finished = await redis.call(lifecycle.finish(msgids))
        assert finished[:: len(finished) // len(msgids)] == [1, 1, 1]
        refinished = await redis.call(lifecycle.finish(msgids))
        assert refinished[:: len(refinished) // len(msgids)] == [0, 0, 0]  # not in flight
        after, _ = lifecycle.store_and_claim(msgids, lines)
        assert (await redis.call(after))[-3:] == [0, 0, 0]  # acked: still duplicates
    finally:
        redis.close()
