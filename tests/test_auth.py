"""Authentication and authorization (issue 11 item 3, docs/SECURITY.md), attacked over
real TCP sockets on a real broker: nothing before `auth`, nothing beyond a token's grant."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from skmq.broker import Broker
from skmq.client import AuthenticationError, Consumer, Message, Producer, RegistrationError
from tests.conftest import BrokerFactory, BrokerProcess, eventually
from tests.peers import FakeRecipient, RawClient

TOKEN = "single-token-0123456789abcdef"
TENANT_A = "tenant-a-token-0123456789abcdef"
TENANT_B = "tenant-b-token-0123456789abcdef"
OPS_A = "ops-a-admin-token-0123456789abcd"
WRONG = "not-the-token-0123456789abcdef"

AUTH_FILE = f"""
[[tokens]]
name = "tenant-a"
token = "{TENANT_A}"
apps = ["a"]
roles = ["produce", "consume"]

[[tokens]]
name = "tenant-b"
token = "{TENANT_B}"
apps = ["b"]
roles = ["produce", "consume"]

[[tokens]]
name = "ops-a"
token = "{OPS_A}"
apps = ["a"]
roles = ["admin"]
"""


@pytest.fixture
def auth_file(tmp_path: Path) -> Path:
    path = tmp_path / "tokens.toml"
    path.write_text(AUTH_FILE)
    return path


async def stored_keys(redis: aioredis.Redis, broker: Broker, app: str) -> list[bytes]:
    return [k async for k in redis.scan_iter(match=broker.store.base(app) + "*")]


async def authed(port: int, token: str) -> RawClient:
    client = await RawClient.connect(port)
    resp = await client.request("auth", token.encode(), msgid="login")
    assert (resp["status"], resp["content"], resp["msgid"]) == ("ack", "authenticated", "login")
    return client


async def test_frames_before_auth_are_refused_and_change_nothing(
    make_broker: BrokerFactory, redis: aioredis.Redis
) -> None:
    broker = await make_broker(auth_token=TOKEN)
    rec = await FakeRecipient("a", "r1").start()
    client = await RawClient.connect(broker.server.port)
    refused = [
        await client.request("queue", b"x", appid="a", msgid="m1"),
        await client.request("topic", b"x", appid="a", msgid="m2"),
        await client.request("register", rec.registration(), msgid="reg"),
        await client.request("unregister", b'{"id":"r1","app_id":"a"}', msgid="unreg"),
        await client.request("ack", appid="a", msgid="m1"),
        await client.request("arrived", appid="a", msgid="m1"),
        await client.request("nonsense", msgid="n"),
    ]
    for resp in refused:
        assert resp["status"] == "reject"
        assert resp["content"] == "authentication required: send auth first"
    assert [r["msgid"] for r in refused] == ["m1", "m2", "reg", "unreg", "m1", "m1", "n"]
    client.send_raw(b"not a field line\r\n\r\n")  # an invalid frame is refused the same way
    assert (await client.resp())["content"] == "authentication required: send auth first"
    client.send_raw(b"ping\r\n\r\n")
    assert (await client.recv()).type == "pong"
    assert await stored_keys(redis, broker, "a") == []
    assert await broker.store.apps() == []
    # The same connection, once authenticated, may do everything (one token: all apps).
    await client.request("auth", TOKEN.encode())
    ok = await client.request("queue", b"x", appid="a", msgid="m1")
    assert (ok["status"], ok["content"]) == ("ack", "stored")
    assert (await client.request("register", rec.registration()))["status"] == "ack"
    again = await client.request("auth", TOKEN.encode())
    assert (again["status"], again["content"]) == ("reject", "already authenticated")
    await client.close()
    await rec.stop()


async def test_wrong_token_is_rejected_and_the_connection_closed(
    make_broker: BrokerFactory, redis: aioredis.Redis
) -> None:
    broker = await make_broker(auth_token=TOKEN)
    client = await RawClient.connect(broker.server.port)
    # A frame pipelined right behind the wrong token must not slip through either.
    client.send("auth", WRONG.encode(), msgid="login")
    client.send("queue", b"x", appid="a", msgid="sneak")
    resp = await client.resp()
    assert (resp["status"], resp["content"]) == ("reject", "authentication failed")
    assert await client.closed()
    assert await stored_keys(redis, broker, "a") == []
    # An empty token is just as wrong.
    client = await RawClient.connect(broker.server.port)
    assert (await client.request("auth"))["status"] == "reject"
    assert await client.closed()


async def test_tenant_cannot_produce_register_or_unregister_for_another_app(
    make_broker: BrokerFactory, redis: aioredis.Redis, auth_file: Path
) -> None:
    broker = await make_broker(auth_file=auth_file)
    rec_b = await FakeRecipient("b", "rb", policy=lambda f: "silent").start()
    b = await authed(broker.server.port, TENANT_B)
    assert (await b.request("register", rec_b.registration()))["status"] == "ack"
    a = await authed(broker.server.port, TENANT_A)
    produce = await a.request("queue", b"x", appid="b", msgid="intruder")
    assert produce["status"] == "reject"
    assert produce["content"] == (
        "not allowed: this connection's token lacks the produce role for app 'b'"
    )
    hijack = await a.request("register", rec_b.registration(id="evil"))
    assert hijack["status"] == "reject" and "consume role for app 'b'" in hijack["content"]
    evict = await a.request("unregister", b'{"id":"rb","app_id":"b"}')
    assert evict["status"] == "reject" and "consume role for app 'b'" in evict["content"]
    # Nothing changed: b has its one recipient and no message; a's own app works.
    assert [r["id"] for r in (await broker.store.recipients(["b"]))["b"]] == ["rb"]
    assert not await broker.store.redis.hexists(broker.store.base("b") + "msgs", "intruder")
    assert (await a.request("queue", b"x", appid="a", msgid="own"))["content"] == "stored"
    await a.close()
    await b.close()
    await rec_b.stop()


async def test_tenant_cannot_answer_for_another_app(
    make_broker: BrokerFactory, redis: aioredis.Redis, auth_file: Path
) -> None:
    broker = await make_broker(auth_file=auth_file, ack_timeout=30.0)
    rec_b = await FakeRecipient("b", "rb", policy=lambda f: "silent").start()
    b = await authed(broker.server.port, TENANT_B)
    assert (await b.request("register", rec_b.registration()))["status"] == "ack"
    assert (await b.request("queue", b"secret", appid="b", msgid="mb"))["content"] == "stored"
    await rec_b.next_push()
    a = await authed(broker.server.port, TENANT_A)
    for kind in ("ack", "reject", "error", "arrived"):
        named = await a.request(kind, appid="b", msgid="mb")
        assert named["status"] == "reject" and "consume role for app 'b'" in named["content"]
        # Without appid the broker would search every app: a limited token must name it.
        unnamed = await a.request(kind, msgid="mb")
        assert unnamed["status"] == "reject" and unnamed["content"].startswith("appid required")
        # Naming its own app scopes the answer to that app: b's message is not found there.
        own = await a.request(kind, appid="a", msgid="mb")
        assert own["status"] != "ack" or kind == "arrived"
    counts = (await broker.store.counts(["b"], 0))["b"]
    assert counts.in_flight == 1
    # The rightful tenant still can.
    assert (await b.request("ack", appid="b", msgid="mb"))["status"] == "ack"
    await eventually(lambda: _in_flight_is(broker, "b", 0))
    await a.close()
    await b.close()
    await rec_b.stop()


async def _in_flight_is(broker: Broker, app: str, n: int) -> bool:
    return (await broker.store.counts([app], 0))[app].in_flight == n


async def test_python_clients_authenticate_with_token(
    make_broker: BrokerFactory, auth_file: Path
) -> None:
    broker = await make_broker(auth_file=auth_file)
    port = broker.server.port
    got: asyncio.Queue[Message] = asyncio.Queue()

    async def handle(msg: Message) -> None:
        got.put_nowait(msg)

    with pytest.raises(AuthenticationError, match="authentication failed"):
        await Producer("127.0.0.1", port, token=WRONG).connect()
    async with Consumer("a", "c1", handle, broker_port=port, token=TENANT_A):
        async with Producer("127.0.0.1", port, token=TENANT_A) as producer:
            assert (await producer.send("a", b"hello", msgid="p1")).ok
            refused = await producer.send("b", b"hello")
            assert refused.status == "reject"
        msg = await asyncio.wait_for(got.get(), 10)
        assert (msg.appid, msg.msgid, msg.content) == ("a", "p1", b"hello")
    # Without a token a consumer cannot even register.
    with pytest.raises(RegistrationError, match="authentication required"):
        async with Consumer("a", "c2", handle, broker_port=port):
            pass


async def test_auth_frame_is_accepted_when_auth_is_off(broker: Broker) -> None:
    async with Producer("127.0.0.1", broker.server.port, token=TOKEN) as producer:
        assert (await producer.send("a", b"x")).ok


def _serve(env: dict[str, str], tmp_path: Path, **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "skmq.cli", "serve"],
        env={**env, **extra}, capture_output=True, text=True, timeout=30,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip


def test_public_address_without_auth_refuses_to_start(
    broker_env: dict[str, str], tmp_path: Path
) -> None:
    done = _serve(broker_env, tmp_path, SKMQ_HOST="0.0.0.0")
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("skmq serve: refusing to listen on 0.0.0.0 without authentication")
    assert "ALLOW_UNAUTHENTICATED" in lines[0]
    assert not (tmp_path / "data" / "redis").exists()  # refused before anything started


def test_public_address_starts_with_auth_or_explicit_opt_out(
    broker_env: dict[str, str], tmp_path: Path
) -> None:
    for extra in ({"SKMQ_AUTH_TOKEN": TOKEN}, {"SKMQ_ALLOW_UNAUTHENTICATED": "true"}):
        env = {**broker_env, "SKMQ_HOST": "0.0.0.0", **extra}
        proc = BrokerProcess(env, tmp_path / "broker.log").start()
        assert proc.terminate() == 0


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (None, "cannot read it"),
        ("tokens = [", "not valid TOML"),
        ("[other]\nx = 1\n", "needs at least one [[tokens]] table"),
        (f'[[tokens]]\ntoken = "{TOKEN}"\napps = ["a"]\nroles = ["root"]\n', "tokens[0].roles"),
        ('[[tokens]]\ntoken = "short"\napps = ["a"]\nroles = ["admin"]\n', "tokens[0].token"),
        (f'[[tokens]]\ntoken = "{TOKEN}"\napps = []\nroles = ["admin"]\n', "tokens[0].apps"),
        (f'[[tokens]]\ntoken = "{TOKEN}"\napps = ["a"]\nroles = ["admin"]\nrole = 1\n', "unknown"),
        (
            f'[[tokens]]\ntoken = "{TOKEN}"\napps = ["a"]\nroles = ["admin"]\n' * 2,
            "one token is given twice",
        ),
    ],
)
def test_bad_auth_file_is_one_clear_startup_error(
    broker_env: dict[str, str], tmp_path: Path, content: str | None, expected: str
) -> None:
    path = tmp_path / "tokens.toml"
    if content is not None:
        path.write_text(content)
    done = _serve(broker_env, tmp_path, SKMQ_AUTH_FILE=str(path))
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"skmq serve: AUTH_FILE {path}: "), done.stderr
    assert expected in lines[0]
    assert TOKEN not in done.stderr


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"SKMQ_AUTH_TOKEN": "short-secret"}, "AUTH_TOKEN must be at least 16 characters"),
        ({"SKMQ_SIGNING_SECRET": "whsec_short-secret!"}, "SIGNING_SECRET: a whsec_ signing"),
    ],
)
def test_unusable_secret_is_one_clear_startup_error(
    broker_env: dict[str, str], tmp_path: Path, env: dict[str, str], expected: str
) -> None:
    done = _serve(broker_env, tmp_path, **env)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"skmq serve: {expected}"), done.stderr
    assert "short-secret" not in done.stderr


async def test_tokens_never_reach_the_log(
    broker_env: dict[str, str], tmp_path: Path, auth_file: Path
) -> None:
    env = {**broker_env, "SKMQ_AUTH_TOKEN": TOKEN, "SKMQ_AUTH_FILE": str(auth_file),
           "SKMQ_LOG_LEVEL": "debug"}  # fmt: skip
    proc = BrokerProcess(env, tmp_path / "broker.log").start()
    try:
        good = await authed(proc.port, TENANT_A)
        assert (await good.request("queue", b"x", appid="a"))["status"] == "ack"
        assert (await good.request("queue", b"x", appid="b"))["status"] == "reject"
        await good.close()
        bad = await RawClient.connect(proc.port)
        bad.send("auth", WRONG.encode())
        assert (await bad.resp())["status"] == "reject"
        assert await bad.closed()
    finally:
        assert proc.terminate() == 0
    log = (tmp_path / "broker.log").read_text()
    assert "authentication failed" in log and "tenant-a" in log  # the events are logged
    for secret in (TOKEN, TENANT_A, TENANT_B, OPS_A, WRONG):
        assert secret not in log


async def _status(env: dict[str, str], *args: str) -> tuple[int, Any, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "skmq.cli", *args, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode is not None
    body = json.loads(out) if proc.returncode == 0 else None
    return proc.returncode, body, err.decode()


async def test_operator_commands_need_an_admin_token_and_see_only_its_apps(
    make_broker: BrokerFactory,
    broker_env: dict[str, str],
    auth_file: Path,
    redis_url: str,
    prefix: str,
) -> None:
    broker = await make_broker(auth_file=auth_file)
    for token, app in ((TENANT_A, "a"), (TENANT_B, "b")):
        client = await authed(broker.server.port, token)
        assert (await client.request("queue", b"x", appid=app))["status"] == "ack"
        await client.close()
    env = {**broker_env, "SKMQ_REDIS_URL": redis_url, "SKMQ_KEY_PREFIX": prefix,
           "SKMQ_AUTH_FILE": str(auth_file)}  # fmt: skip
    code, _, err = await _status(env, "status", "--json")
    assert code == 2 and err.strip().splitlines() == [
        "skmq status: auth is configured (AUTH_TOKEN/AUTH_FILE): give an admin token, --token or "
        "SKMQ_TOKEN"
    ]
    code, _, err = await _status({**env, "SKMQ_TOKEN": TENANT_A}, "status", "--json")
    assert code == 2 and "no admin role" in err  # produce/consume is not admin
    code, snap, _ = await _status(env, "status", "--json", "--token", OPS_A)
    assert code == 0 and [a["appid"] for a in snap["apps"]] == ["a"]
    code, _, err = await _status({**env, "SKMQ_TOKEN": OPS_A}, "dlq", "purge", "--app", "b")
    assert code == 2 and "no admin role for app 'b'" in err
    code, listed, _ = await _status({**env, "SKMQ_TOKEN": OPS_A}, "dlq", "list", "--json")
    assert code == 0 and listed == []
    # Without auth in the settings, the commands work as before (every app).
    del env["SKMQ_AUTH_FILE"]
    code, snap, _ = await _status(env, "status", "--json")
    assert code == 0 and sorted(a["appid"] for a in snap["apps"]) == ["a", "b"]


@pytest.mark.parametrize(
    ("fields", "content", "accepted"),
    [
        ({"token": TOKEN}, None, True),  # docs/PROTOCOL.md's form
        ({"token": TOKEN}, TOKEN.encode(), True),  # both, the same
        ({"token": WRONG}, TOKEN.encode(), False),  # both, differing
        ({"token": TOKEN}, WRONG.encode(), False),
        ({"token": ""}, TOKEN.encode(), False),
    ],
)
async def test_the_token_may_come_as_a_token_field(
    make_broker: BrokerFactory, fields: dict[str, str], content: bytes | None, accepted: bool
) -> None:
    broker = await make_broker(auth_token=TOKEN)
    client = await RawClient.connect(broker.server.port)
    resp = await client.request("auth", content, msgid="login", **fields)
    if accepted:
        assert (resp["status"], resp["content"]) == ("ack", "authenticated")
        sent = await client.request("queue", b"x", appid="a", msgid="m1")
        assert (sent["status"], sent["content"]) == ("ack", "stored")
    else:
        assert (resp["status"], resp["content"]) == ("reject", "authentication failed")
        assert await client.closed()
    await client.close()
