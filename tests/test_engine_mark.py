"""Every broker of a store runs the engine that wrote its data (skmq/store/engine_mark.py),
and operator commands read the store by it."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis

from skmq.errors import Misconfigured
from skmq.store.engine_mark import engine_of
from tests.conftest import BrokerFactory
from tests.test_delivery import produce


async def test_a_store_keeps_the_engine_its_first_broker_ran(
    make_broker: BrokerFactory, redis: aioredis.Redis, prefix: str
) -> None:
    first = await make_broker(engine="scripts")
    await produce(first.server.port, "a", ["m1"])
    assert await engine_of(redis, prefix, "owner") == "scripts"
    with pytest.raises(Misconfigured, match="ENGINE=scripts; this broker runs ENGINE=owner"):
        await make_broker(engine="owner")


async def test_a_store_without_the_mark_but_with_apps_is_the_scripts_engines(
    make_broker: BrokerFactory, redis: aioredis.Redis, prefix: str
) -> None:
    first = await make_broker(engine="scripts")
    await produce(first.server.port, "a", ["m1"])
    await redis.delete(f"{prefix}:engine")  # (as a store of an earlier version)
    with pytest.raises(Misconfigured, match="ENGINE=scripts"):
        await make_broker(engine="owner")
    assert await engine_of(redis, prefix, "owner") == "scripts"


async def test_a_new_store_takes_the_owner_engine(
    make_broker: BrokerFactory, redis: aioredis.Redis, prefix: str
) -> None:
    await make_broker(engine="owner")
    assert await engine_of(redis, prefix, "owner") == "owner"
    await make_broker(engine="owner")  # a second broker of the same engine is welcome


async def test_a_broker_with_engine_unset_runs_its_stores_engine_else_the_owner_engine(
    make_broker: BrokerFactory, redis: aioredis.Redis, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An upgrade: a store an earlier version wrote (the scripts engine's) is served as
    it was by a broker left at the default; a new store takes the owner engine."""
    monkeypatch.delenv("SKMQ_ENGINE", raising=False)
    first = await make_broker(engine="scripts")
    await produce(first.server.port, "a", ["m1"])
    await redis.delete(f"{prefix}:engine")  # (as a store of an earlier version)
    second = await make_broker()
    assert second.settings.engine == "scripts"
    assert await engine_of(redis, prefix, "owner") == "scripts"
    third = await make_broker(key_prefix=prefix + "-new")
    assert third.settings.engine == "owner"
    assert await engine_of(redis, prefix + "-new", "scripts") == "owner"
