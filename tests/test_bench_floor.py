"""The floor's lifecycle (bench/floor_lifecycles.py) against a real Redis: what the
benchmark's `floor-bare-lifecycle` measures must be the lifecycle working, not scripts
refusing arguments they no longer take."""

from __future__ import annotations

from typing import Any

import pytest
import redis.asyncio as aioredis

from bench.floor_lifecycles import BareLifecycle, Lifecycle
from skmq.store.client import hiredis_pack


@pytest.mark.parametrize("kind", [BareLifecycle])
async def test_a_floor_lifecycle_stores_claims_finishes_and_dedupes(
    kind: type[Lifecycle], redis: aioredis.Redis, prefix: str
) -> None:
    lifecycle = kind(base=f"{prefix}:{{floor}}:")
    connection = await redis.connection_pool.get_connection()

    async def call(packed: bytes) -> Any:
        """The reply to a packed command, as the relay sends them (an error raises)."""
        await connection.send_packed_command(packed)
        return await connection.read_response()

    try:
        lifecycle.shas = {
            name: (await call(hiredis_pack(("SCRIPT", "LOAD", source)))).decode()
            for name, source in lifecycle.sources().items()
        }
        msgids = [b"m%08x" % n for n in range(3)]
        lines = [b"%d %s ...." % (n, m) for n, m in enumerate(msgids)]
        store, claim = lifecycle.store_and_claim(msgids, lines)
        assert (await call(store))[-3:] == [1, 1, 1]
        assert lifecycle.contents(await call(claim)) == lines
        again, claim_again = lifecycle.store_and_claim(msgids, lines)
        assert (await call(again))[-3:] == [0, 0, 0]  # duplicates
        assert lifecycle.contents(await call(claim_again)) == []
        # (each msgid's answer starts with 1 if it was finished: SKMQ's with 4 more fields)
        finished = await call(lifecycle.finish(msgids))
        assert finished[:: len(finished) // len(msgids)] == [1, 1, 1]
        refinished = await call(lifecycle.finish(msgids))
        assert refinished[:: len(refinished) // len(msgids)] == [0, 0, 0]  # not in flight
        after, _ = lifecycle.store_and_claim(msgids, lines)
        assert (await call(after))[-3:] == [0, 0, 0]  # acked: still duplicates
    finally:
        await redis.connection_pool.release(connection)
