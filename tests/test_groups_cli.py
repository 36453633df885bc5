"""`skmq groups`: consumer groups for operators, over the session Redis."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import redis.asyncio as aioredis

from skmq.store import NewMessage
from skmq.store.wire import Wire
from tests.test_pull_store import pull_store


def groups_cmd(
    redis_url: str, prefix: str, *args: str, command: str = "groups"
) -> tuple[int, str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SKMQ_")}
    done = subprocess.run(
        [sys.executable, "-m", "skmq.cli", command, *args, "--redis-url", redis_url,
         "--key-prefix", prefix],
        env=env, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    return done.returncode, done.stdout, done.stderr


async def test_create_list_reset_delete_from_the_command_line(
    redis_url: str, prefix: str, redis: aioredis.Redis, wire: Wire
) -> None:
    assert groups_cmd(redis_url, prefix, "create", "--app", "shop", "billing")[1] == (
        "billing: created\n"
    )
    assert groups_cmd(redis_url, prefix, "create", "--app", "shop", "billing")[1] == (
        "billing: exists already\n"
    )
    store = await pull_store(redis, wire, prefix)
    await store.store(
        {"shop": [NewMessage("m1", "queue", b"x"), NewMessage("m2", "queue", b"y")]}, 1
    )
    code, out, _ = groups_cmd(redis_url, prefix, "list", "--app", "shop", "--json")
    assert code == 0
    [listed] = json.loads(out)
    assert 0 <= listed.pop("oldest_age_s") < 60  # (m1, stored just now)
    assert listed == {"group": "billing", "backlog": 2, "in_flight": 0, "delayed": 0, "dead": 0}
    code, out, _ = groups_cmd(
        redis_url, prefix, "reset", "--app", "shop", "billing", "--to", "latest"
    )
    assert (code, out) == (0, "billing: reset to latest\n")
    code, out, _ = groups_cmd(redis_url, prefix, "list", "--app", "shop")
    assert out.splitlines() == [
        "group=billing backlog=0 in_flight=0 delayed=0 dead=0 oldest_age_s=None",
        "1 group(s) of app 'shop'",
    ]
    assert groups_cmd(redis_url, prefix, "delete", "--app", "shop", "billing")[:2] == (
        0,
        "billing: deleted\n",
    )
    code, _, err = groups_cmd(redis_url, prefix, "delete", "--app", "shop", "billing")
    assert (code, err) == (1, "skmq groups: no group 'billing' for app 'shop': nothing done\n")
    code, _, err = groups_cmd(redis_url, prefix, "create", "--app", "shop", "no spaces")
    assert code == 2 and err.startswith("skmq groups: group must be 1 to 64 letters")


async def test_create_and_reset_at_a_position_from_the_command_line(
    redis_url: str, prefix: str, redis: aioredis.Redis, wire: Wire
) -> None:
    assert groups_cmd(redis_url, prefix, "create", "--app", "shop", "first")[0] == 0
    store = await pull_store(redis, wire, prefix)
    await store.store({"shop": [NewMessage("m1", "queue", b"x")]}, 1)
    for group, position in (("e", "earliest"), ("t", "0"), ("iso", "1970-01-01T00:00Z")):
        code, out, _ = groups_cmd(redis_url, prefix, "create", "--app", "shop", group,
                                  "--from", position)  # fmt: skip
        assert (code, out) == (0, f"{group}: created\n")
    code, out, _ = groups_cmd(redis_url, prefix, "list", "--app", "shop", "--json")
    assert {g["group"]: g["backlog"] for g in json.loads(out)} == {
        "first": 1, "e": 1, "t": 1, "iso": 1,
    }  # fmt: skip
    code, out, _ = groups_cmd(redis_url, prefix, "reset", "--app", "shop", "e", "--to", "0")
    assert (code, out) == (0, "e: reset to 0\n")
    code, _, err = groups_cmd(redis_url, prefix, "create", "--app", "shop", "x", "--from", "now")
    assert code == 2 and "argument --from: 'now' is not one of latest" in err
    code, _, err = groups_cmd(
        redis_url, prefix, "reset", "--app", "shop", "e", "--to", "253402300799999"
    )
    assert (code, err) == (
        2,
        "skmq groups: position: 253402300799999 (unix ms) is after the store's clock; "
        "latest is what is stored from now on\n",
    )
