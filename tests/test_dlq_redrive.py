"""`skmq dlq replay|purge` filters, pace, dry run and `--to-app`, as an operator runs
them (the CLI as a process) against a real Redis; `move` (the --to-app script) on its own;
the same over the HTTP gateway. The dead letters are buried through an app's owner in
the test's process, what waits is read through the store's API."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis

from skmq.broker import Broker
from skmq.clock import now_ms
from skmq.pull.groups import Groups, parse_receipt
from skmq.queue.deliveries import Policy
from skmq.queue.journal import AppKeys, acquire, release
from skmq.queue.owned_store import OwnedStore
from skmq.queue.owners import Owners
from skmq.store import AliveRecipient, NewMessage, Retries
from skmq.store.engine_mark import claim_store
from skmq.store.wire import Wire
from skmq.store.wires import Wires
from tests.conftest import BrokerFactory, eventually, free_port
from tests.test_cli_ops import one_line, skmq
from tests.test_delivery import log_events, produce

T0 = 1_700_000_000_000
MIN = 60_000


@pytest.fixture
async def store(redis: aioredis.Redis, prefix: str, wire: Wire) -> AsyncIterator[OwnedStore]:
    """A broker's store (RETRY_TIMES 1), marked as a broker marks a new store (the CLI
    refuses a store with apps and no mark: an earlier SKMQ's)."""
    client = aioredis.Redis(connection_pool=redis.connection_pool)
    await claim_store(client, prefix)
    owned = OwnedStore(client, prefix, retries=Retries(times=1))
    policy = Policy(retry_times=1, jitter=0.0)
    owned.owners = Owners(
        Wires.over(wire),
        prefix,
        policy,
        owned.dedupe_ms,
        lambda app: ["r"],
        lister=lambda app: owned.directory.add([app]),
    )
    yield owned


@contextlib.asynccontextmanager
async def owning(store: OwnedStore, app: str, now: int) -> AsyncIterator[None]:
    """This process owns `app` meanwhile, as a broker would (its state read from Redis,
    the engine's calls answered from its memory), then hands it over, its state in
    Redis, as a stopping broker does: to the brokers and commands that follow."""
    owners = store.owners
    assert owners is not None
    keys = AppKeys.of(store.prefix, app)
    wire = await owners.wires.of(keys.epoch)
    lease = await acquire(wire, keys, "test", 60_000)
    assert lease is not None, f"{app} is owned by a broker"
    owner = await owners.gained(app, lease, now)
    try:
        yield
    finally:
        await owner.checkpoint(now)
        await release(wire, keys, lease)
        owners.lost(app)


async def bury(
    store: OwnedStore, app: str, msgid: str, error: str, died: int, content: bytes = b""
) -> None:
    """A dead letter of `app` (dated by its owner's flush: now, not `died`), its last
    error `error`, its content `content` (or its msgid)."""
    async with owning(store, app, died):
        message = NewMessage(msgid, "queue", content or msgid.encode())
        assert (await store.store({app: [message]}, died))[app]
        got, _, _ = await store.claim(app, died, 1, [_alive()], ["r"])
        assert [c.msgid for c in got] == [msgid]
        (f,) = await store.fail(app, [(msgid, "errored", error, "r", 1)], died)
        assert f.code == f.DEAD


async def waiting(store: OwnedStore, app: str) -> list[str]:
    """The msgids waiting in `app` (pending or delayed), oldest first, as its owner has
    them (read from Redis by taking the app, as its next owner would)."""
    now = now_ms()
    async with owning(store, app, now):
        return [w.msgid for w in await store.peek(app, 100, now)]


def _alive() -> AliveRecipient:
    return AliveRecipient("r", 10, True)


Cli = Callable[..., Awaitable[tuple[int, str, str]]]


@pytest.fixture
def cli(redis_url: str, prefix: str, tmp_path: Path) -> Cli:
    env = {"SKMQ_REDIS_URL": redis_url, "SKMQ_KEY_PREFIX": prefix,
           "SKMQ_DATA_DIR": str(tmp_path / "cli")}  # fmt: skip

    async def run(*args: str) -> tuple[int, str, str]:
        return await asyncio.to_thread(skmq, "dlq", *args, env=env)

    return run


async def dead_ids(store: OwnedStore, app: str) -> list[str]:
    return [d.msgid for d in await store.dead_letters(app)]


async def test_filters_pick_by_reason_time_and_count(
    store: OwnedStore, cli: Cli, tmp_path: Path
) -> None:
    for i, error in enumerate(["timeout A", "db down", "timeout B", "timeout C", "bad json"]):
        await bury(store, "f", f"m{i}", error, T0 + i * MIN)
        # (each one dies in a ms of its own, in order)
        await eventually(functools.partial(_after, now_ms()))
    died = {d.msgid: d.died_at for d in await store.dead_letters("f")}
    since, until = str(died["m1"]), str(died["m4"])
    code, out, err = await cli("purge", "--app", "f", "--reason", "TIMEOUT", "--since", since,
                               "--until", until, "--json")  # fmt: skip
    assert code == 0, err
    assert json.loads(out) == {"purge": 2, "selected": 2}  # m2 and m3: m0 is before since
    assert await dead_ids(store, "f") == ["m0", "m1", "m4"]
    assert logged(tmp_path) == [("purged", "f", "m2"), ("purged", "f", "m3")]  # for the audit
    code, out, err = await cli("replay", "--all", "--max", "2")
    assert (code, out.strip()) == (0, "replay: 2 of 2 dead letter(s)"), err
    assert await dead_ids(store, "f") == ["m4"]
    assert await waiting(store, "f") == ["m0", "m1"]  # the oldest two went back to pending


async def test_dry_run_says_what_and_changes_nothing(store: OwnedStore, cli: Cli) -> None:
    await bury(store, "d", "x1", "expired", T0)
    await bury(store, "d", "x2", "db down", T0)
    code, out, err = await cli("purge", "--app", "d", "--reason", "expired", "--dry-run")
    assert code == 0, err
    assert out.splitlines() == [
        "would purge: d x1 recipient=r error=errored: expired",
        "dry run: would purge 1 dead letter(s); nothing done",
    ]
    code, out, err = await cli("replay", "--all", "--to-app", "e", "--dry-run", "--json")
    assert code == 0, err
    assert [s["msgid"] for s in json.loads(out)["selected"]] == ["x1", "x2"]
    assert json.loads(out)["dry_run"] == "replay into e"
    assert await dead_ids(store, "d") == ["x1", "x2"]
    assert await waiting(store, "e") == []


async def test_a_dead_letters_content_that_is_not_text_is_listed_in_base64(
    store: OwnedStore, cli: Cli, make_broker: BrokerFactory
) -> None:
    """No byte lost: `content` in base64 where it is not UTF-8 (`encoding`, as a receive
    says it), from the CLI (--json) and over HTTP."""
    await bury(store, "d", "bin", "boom", T0, b"\xff\xfe\x00raw")
    await bury(store, "d", "txt", "boom", T0, "café".encode())
    expected = [("bin", "//4AcmF3", "base64"), ("txt", "café", "text")]
    code, out, err = await cli("list", "--app", "d", "--json")
    assert code == 0, err
    assert [(d["msgid"], d["content"], d["encoding"]) for d in json.loads(out)] == expected
    broker = await make_broker(http_port=free_port())
    url = f"http://127.0.0.1:{broker.gateway.port}/v1/apps/d/dlq"
    async with aiohttp.ClientSession() as http, http.get(url) as response:
        listed = (await response.json())["dead_letters"]
    assert [(d["msgid"], d["content"], d["encoding"]) for d in listed] == expected


async def test_replay_to_another_app(store: OwnedStore, cli: Cli, tmp_path: Path) -> None:
    await bury(store, "src", "a", "boom", T0)
    code, out, err = await cli("replay", "--app", "src", "--to-app", "dst")
    assert (code, out.strip()) == (0, "replay into dst: 1 of 1 dead letter(s)"), err
    assert await dead_ids(store, "src") == []
    assert await waiting(store, "src") == []
    assert await waiting(store, "dst") == ["a"]
    assert "dst" in await store.apps()
    now = now_ms()
    async with owning(store, "dst", now):
        got, _, _ = await store.claim("dst", now, 5, [_alive()], ["r"] * 5)
    assert [(c.msgid, c.content, c.attempt) for c in got] == [("a", b"a", 1)]
    assert logged(tmp_path) == [("purged", "src", "a"), ("stored", "dst", "a")]


async def test_replay_to_another_app_refuses_a_msgid_held_there(
    store: OwnedStore, cli: Cli
) -> None:
    await bury(store, "src", "a", "boom", T0)
    await bury(store, "src", "b", "boom", T0)
    await bury(store, "dst", "b", "elsewhere", T0)  # b is already held by the target app
    code, out, err = await cli("replay", "--app", "src", "--to-app", "dst")
    assert (code, out.strip()) == (1, "replay into dst: 1 of 2 dead letter(s)"), err
    assert await dead_ids(store, "src") == ["b"]  # a duplicate there: left dead here
    assert await dead_ids(store, "dst") == ["b"]
    assert await waiting(store, "dst") == ["a"]


async def test_a_move_with_no_broker_keeps_a_letter_whose_msgid_waits_in_the_target(
    store: OwnedStore, cli: Cli
) -> None:
    """No broker runs: the target's stored state is read as its next owner would read
    it, and another message "a" waiting there makes the letter "a" a duplicate."""
    await bury(store, "src", "a", "boom", T0)
    now = now_ms()
    async with owning(store, "dst", now):
        assert await store.store({"dst": [NewMessage("a", "queue", b"dst's own a")]}, now)
    code, out, err = await cli("replay", "--app", "src", "--to-app", "dst")
    assert (code, out.strip()) == (1, "replay into dst: 0 of 1 dead letter(s)"), err
    assert await dead_ids(store, "src") == ["a"]
    now = now_ms()
    async with owning(store, "dst", now):
        held = await store.peek("dst", 10, now)
    assert [(w.msgid, w.preview) for w in held] == [("a", b"dst's own a")]


async def test_two_moves_of_one_msgid_into_a_new_app_keep_the_second_letter(
    store: OwnedStore, cli: Cli
) -> None:
    """No broker runs: the first move into a new app waits in its inbox, the second
    letter of the same msgid (from another app) is a duplicate of it and stays dead."""
    await bury(store, "s1", "m", "boom", T0)
    await bury(store, "s2", "m", "boom", T0)
    code, out, err = await cli("replay", "--app", "s1", "--to-app", "new")
    assert (code, out.strip()) == (0, "replay into new: 1 of 1 dead letter(s)"), err
    code, out, err = await cli("replay", "--app", "s2", "--to-app", "new")
    assert (code, out.strip()) == (1, "replay into new: 0 of 1 dead letter(s)"), err
    assert (await dead_ids(store, "s1"), await dead_ids(store, "s2")) == ([], ["m"])
    assert await waiting(store, "new") == ["m"]


async def test_a_move_keeps_a_letter_whose_msgid_is_live_in_the_target(
    store: OwnedStore, cli: Cli, make_broker: BrokerFactory
) -> None:
    """Another message "a" waits in the target app (no recipient yet): the letter "a" is
    a duplicate there and stays dead in its own app, whether the CLI asks the target's
    owner (a broker) or the owner moves it itself (its HTTP gateway's path); "b" moves."""
    await bury(store, "src", "a", "boom", T0)
    await bury(store, "src", "b", "boom", T0)
    broker = await make_broker()
    await produce(broker.server.port, "dst", ["a"], content=b"dst's own a")
    code, out, err = await cli("replay", "--app", "src", "--to-app", "dst")
    assert (code, out.strip()) == (1, "replay into dst: 1 of 2 dead letter(s)"), err
    assert await dead_ids(store, "src") == ["a"]
    assert await broker.store.move("src", "dst", ["a"], now_ms()) == [-1]
    assert await dead_ids(store, "src") == ["a"]
    held = await broker.store.peek("dst", 10, now_ms())
    assert sorted((w.msgid, w.preview) for w in held) == [("a", b"dst's own a"), ("b", b"b")]


async def test_a_producers_store_of_a_dead_letters_msgid_is_a_duplicate_until_purged(
    store: OwnedStore,
) -> None:
    await bury(store, "d", "b", "boom", T0)
    again = {"d": [NewMessage("b", "queue", b"again")]}
    now = now_ms()
    async with owning(store, "d", now):
        assert await store.store(again, now) == {"d": [False]}
        assert await store.purge("d", ["b"]) == [True]
        assert await store.store(again, now) == {"d": [True]}
    assert await waiting(store, "d") == ["b"]


async def _after(ms: int) -> bool:
    return now_ms() > ms


def logged(tmp_path: Path) -> list[tuple[str, str, str]]:
    """(event, appid, msgid) of each line the `cli` fixture's commands logged."""
    return [
        (e["event"], e["appid"], e["msgid"])
        for path in sorted((tmp_path / "cli" / "delivery-log").glob("delivery-*.jsonl"))
        for e in map(json.loads, path.read_text().splitlines())
    ]


async def test_rate_paces_the_redrive(store: OwnedStore, cli: Cli) -> None:
    for i in range(25):
        await bury(store, "r", f"m{i}", "x", T0)
    started = time.monotonic()
    code, out, err = await cli("purge", "--app", "r", "--rate", "10/s")
    took = time.monotonic() - started
    assert (code, out.strip()) == (0, "purge: 25 of 25 dead letter(s)"), err
    assert took >= 1.4  # 10 at once (the burst), 10 a second later, 5 half a second later
    assert await dead_ids(store, "r") == []


async def test_move_refuses_what_is_not_dead(store: OwnedStore) -> None:
    assert await store.store({"s": [NewMessage("p", "queue", b"x")]}, T0)
    assert await store.move("s", "t", ["p", "nope"], T0) == [0, 0]
    assert await waiting(store, "s") == ["p"]


async def test_bad_filter_values_are_one_line_errors(cli: Cli) -> None:
    for flag, value in (("--since", "yesterday"), ("--max", "0"), ("--rate", "fast")):
        code, _, err = await cli("purge", "--all", flag, value)
        assert code == 2, err
        assert flag in one_line(err), err


# -- the same over HTTP -------------------------------------------------------------
DLQ_ADMIN = "dlq-admin-token-0123456789abcdef"
DLQ_CONSUMER = "dlq-consumer-token-0123456789abcd"


async def test_list_replay_and_purge_over_http(
    store: OwnedStore, make_broker: BrokerFactory, tmp_path: Path
) -> None:
    """The gateway's DLQ routes, as an operator with curl would use them: list, a dry run,
    replay by reason and count, purge by msgid, replay into another app; admin only."""
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(
        f'[[tokens]]\nname = "ops"\ntoken = "{DLQ_ADMIN}"\napps = ["d"]\nroles = ["admin"]\n'
        f'[[tokens]]\nname = "c"\ntoken = "{DLQ_CONSUMER}"\napps = ["d"]\nroles = ["consume"]\n'
    )
    for i, error in enumerate(["boom", "timeout", "boom", "boom"], start=1):
        await bury(store, "d", f"m{i}", error, T0 + i * MIN)
    broker = await make_broker(http_port=free_port(), auth_file=tokens)  # (it takes app d)
    base = f"http://127.0.0.1:{broker.gateway.port}/v1/apps"
    admin = {"Authorization": f"Bearer {DLQ_ADMIN}"}
    async with aiohttp.ClientSession(headers=admin) as http:

        async def call(method: str, path: str, body: object = None) -> tuple[int, Any]:
            async with http.request(method, f"{base}/{path}", json=body) as response:
                return response.status, await response.json()

        status, listed = await call("GET", "d/dlq")
        assert status == 200
        assert [d["msgid"] for d in listed["dead_letters"]] == ["m1", "m2", "m3", "m4"]
        assert listed["dead_letters"][0]["last_error"] == "errored: boom"
        for limit in ("0", "x", "%C2%B2", "%D9%A1"):  # digits to str.isdigit, not ASCII
            status, error = await call("GET", f"d/dlq?limit={limit}")
            assert (status, "limit" in error["error"]) == (400, True), limit
        dry = {"reason": "BOOM", "max": 2, "dry_run": True}
        assert await call("POST", "d/dlq/replay", dry) == (
            200, {"action": "replay", "dry_run": True, "selected": ["m1", "m3"], "done": 0}
        )  # fmt: skip
        assert await dead_ids(store, "d") == ["m1", "m2", "m3", "m4"]
        status, result = await call("POST", "d/dlq/replay", {"reason": "boom", "max": 2})
        assert (status, result["done"]) == (200, 2)
        assert await dead_ids(store, "d") == ["m2", "m4"]
        await eventually(lambda: _waiting_in(broker, "d", ["m1", "m3"]))
        status, error = await call("POST", "d/dlq/purge", {"msgids": ["nope"]})
        assert status == 404 and "nope" in error["error"]
        assert (await call("POST", "d/dlq/purge", {"msgids": ["m2"]}))[1]["done"] == 1
        assert (await call("POST", "d/dlq/purge", {"to_app": "e"}))[0] == 400
        assert (await call("POST", "d/dlq/replay", {"to_app": "e"}))[0] == 403  # not its app
        assert (await call("POST", "d/dlq/replay", {"since": "yesterday"}))[0] == 400
        assert await dead_ids(store, "d") == ["m4"]
    async with aiohttp.ClientSession() as anonymous:
        async with anonymous.get(f"{base}/d/dlq") as response:
            assert response.status == 401
        consumer = {"Authorization": f"Bearer {DLQ_CONSUMER}"}
        async with anonymous.post(f"{base}/d/dlq/purge", json={}, headers=consumer) as response:
            assert response.status == 403
    assert await dead_ids(store, "d") == ["m4"]
    replayed = [e for e in log_events(broker, event="replayed") if e["appid"] == "d"]
    assert sorted(e["msgid"] for e in replayed) == ["m1", "m3"]


async def _waiting_in(broker: Broker, app: str, msgids: list[str]) -> bool:
    """Whether the broker has these waiting in `app` (once its owner read
    the replays from the app's inbox)."""
    return [w.msgid for w in await broker.store.peek(app, 100, now_ms())] == msgids


# -- a consumer group's dead letters -------------------------------------------------
async def bury_in_group(store: OwnedStore, app: str, group: str, *msgids: str) -> Groups:
    """Dead letters of consumer group `group` (RETRY_TIMES 1: a nack is its end)."""
    groups = Groups(store)
    await groups.create(app, group)
    await store.store({app: [NewMessage(m, "queue", m.encode()) for m in msgids]}, T0)
    got = (await groups.receive(app, group, T0, 100, 1000)).messages
    receipts = [r for p in got if (r := parse_receipt(p.receipt)) is not None]
    assert await groups.nack(app, group, [(*r, -1) for r in receipts], T0) == [(2, T0, 1)] * len(
        msgids
    )
    return groups


async def test_a_groups_dead_letters_over_http_and_the_cli(
    store: OwnedStore, make_broker: BrokerFactory, cli: Cli
) -> None:
    groups = await bury_in_group(store, "d", "g", "g1", "g2", "g3")
    broker = await make_broker(http_port=free_port())
    base = f"http://127.0.0.1:{broker.gateway.port}/v1/apps/d/dlq"
    async with aiohttp.ClientSession() as http:

        async def call(method: str, path: str, body: object = None) -> tuple[int, Any]:
            async with http.request(method, f"{base}{path}", json=body) as response:
                return response.status, await response.json()

        status, listed = await call("GET", "?group=g")
        assert status == 200
        assert [(d["msgid"], d["recipient"], d["last_error"]) for d in listed["dead_letters"]] == [
            (m, "group:g", "nack") for m in ("g1", "g2", "g3")
        ]
        assert (await call("GET", ""))[1] == {"dead_letters": []}  # the pushes' own
        replay = {"group": "g", "msgids": ["g1"]}
        assert (await call("POST", "/replay", replay))[1]["done"] == 1
        assert (await call("POST", "/replay", {"group": "g", "to_app": "e"}))[0] == 400
        assert (await call("GET", "?group=no%20such"))[0] == 400
    (again,) = (await groups.receive("d", "g", int(time.time() * 1000), 10, 1000)).messages
    assert (again.msgid, again.attempt) == ("g1", 1)
    code, out, err = await cli("list", "--app", "d", "--group", "g", "--json")
    assert code == 0, err
    assert [d["msgid"] for d in json.loads(out)] == ["g2", "g3"]
    code, out, err = await cli("purge", "--app", "d", "--group", "g", "g2")
    assert (code, out.strip()) == (0, "purge: 1 of 1 dead letter(s)"), err
    assert [d.msgid for d in await groups.dead_letters("d", "g")] == ["g3"]
    code, _, err = await cli("list", "--group", "g")
    assert code == 2 and "--group needs --app" in one_line(err)
