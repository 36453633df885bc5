"""Signed pushes (issue 11 item 4): a broker with SIGNING_SECRET signs every push; the
Python Consumer given the secret handles only authentic, fresh pushes and rejects the
rest, whoever sends them to its port."""

from __future__ import annotations

import asyncio
import base64
import time

import pytest

from skmq.client import Consumer, Message, Producer
from skmq.codec import Decoder, Frame, encode_frame
from skmq.signing import PushSigner, PushVerifier, secret_key, signature
from tests.conftest import BrokerFactory
from tests.peers import FakeRecipient

SECRET = "whsec_" + base64.b64encode(b"k" * 32).decode()
OTHER = "whsec_" + base64.b64encode(b"x" * 32).decode()


def test_signature_round_trip_and_standard_webhooks_secret_format() -> None:
    assert secret_key(SECRET) == b"k" * 32
    assert secret_key("plain secret") == b"plain secret"
    with pytest.raises(ValueError, match="base64"):
        secret_key("whsec_!!!")
    now = 1_700_000_000.0
    fields = dict(PushSigner(SECRET, clock=lambda: now).fields("app", "m1", b"body\r\n"))
    assert fields["timestamp"] == "1700000000"
    assert fields["signature"].startswith("v1,")
    verifier = PushVerifier(SECRET, clock=lambda: now + 299)
    pushed = {"appid": "app", "msgid": "m1", **fields}
    assert verifier.refusal(pushed, b"body\r\n") is None
    # Key rotation: several signatures, one match is enough.
    rotated = {**pushed, "signature": f"v1,AAAA {fields['signature']}"}
    assert verifier.refusal(rotated, b"body\r\n") is None
    assert verifier.refusal({**pushed, "appid": "app2"}, b"body\r\n") == "bad push signature"
    assert verifier.refusal({**pushed, "msgid": "m2"}, b"body\r\n") == "bad push signature"
    assert verifier.refusal(pushed, b"body") == "bad push signature"
    assert PushVerifier(OTHER, clock=lambda: now).refusal(pushed, b"body\r\n") == (
        "bad push signature"
    )
    stale = PushVerifier(SECRET, clock=lambda: now + 301).refusal(pushed, b"body\r\n")
    assert stale is not None and stale.startswith("stale push")
    assert verifier.refusal({"appid": "app", "msgid": "m1"}, b"") == "unsigned push"
    assert verifier.refusal({**pushed, "timestamp": "-5"}, b"") == "invalid push timestamp"


def test_fields_cannot_be_resplit() -> None:
    """With '.' separators msgid "m.T.a.x" + content "y" would sign the same bytes as msgid
    "m" + content "x.T.a.y"; LF separators make each split distinct."""
    key = secret_key(SECRET)
    assert signature(key, "m", "5", "a", b"x.6.a.y") != signature(key, "m.5.a.x", "6", "a", b"y")


async def test_broker_signs_every_push_and_plain_peers_ignore_it(
    make_broker: BrokerFactory,
) -> None:
    broker = await make_broker(signing_secret=SECRET)
    rec = await FakeRecipient("app", "r1").start()
    assert (await rec.register(broker.server.port))["status"] == "ack"
    async with Producer("127.0.0.1", broker.server.port) as producer:
        assert (await producer.send("app", b"q", msgid="q1")).ok
        assert (await producer.send("app", b"t", msgid="t1", topic=True)).ok
    pushes = [await rec.next_push(), await rec.next_push()]
    verifier = PushVerifier(SECRET)
    for push in pushes:
        assert push.fields["signature"].startswith("v1,")
        assert abs(int(push.fields["timestamp"]) - time.time()) < 60
        assert verifier.refusal(push.fields, push.content or b"") is None
    await rec.stop()


async def test_consumer_verifies_signed_pushes_from_the_broker(make_broker: BrokerFactory) -> None:
    broker = await make_broker(signing_secret=SECRET)
    got: asyncio.Queue[Message] = asyncio.Queue()

    async def handle(msg: Message) -> None:
        got.put_nowait(msg)

    port = broker.server.port
    async with Consumer("app", "c1", handle, broker_port=port, signing_secret=SECRET) as consumer:
        async with Producer("127.0.0.1", port) as producer:
            assert (await producer.send("app", b"line1\nline2", msgid="s1")).ok
        msg = await asyncio.wait_for(got.get(), 10)
        assert (msg.msgid, msg.content) == ("s1", b"line1\nline2")
        assert consumer.stats["rejected"] == 0


class PushSender:
    """Someone other than the broker, writing pushes straight to a consumer's port."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.decoder = Decoder()

    async def push(self, msgid: str, content: bytes, extra: dict[str, str]) -> Frame:
        fields = {"appid": "app", "msgid": msgid, **extra}
        self.writer.write(encode_frame("push", fields, content))
        async with asyncio.timeout(10):
            while True:
                frames = self.decoder.feed(await self.reader.read(65536))
                for frame in frames:
                    if isinstance(frame, Frame):
                        return frame


async def test_consumer_rejects_forged_stale_and_unsigned_pushes(
    make_broker: BrokerFactory,
) -> None:
    broker = await make_broker()
    handled: list[str] = []

    async def handle(msg: Message) -> None:
        handled.append(msg.msgid)

    port = broker.server.port
    async with Consumer("app", "c1", handle, broker_port=port, signing_secret=SECRET) as consumer:
        sender = PushSender(*await asyncio.open_connection("127.0.0.1", consumer.port))
        forged = dict(PushSigner(OTHER).fields("app", "f1", b"x"))
        answer = await sender.push("f1", b"x", forged)
        assert (answer.type, answer.fields["msgid"], answer.content) == (
            "reject", "f1", b"bad push signature",
        )  # fmt: skip
        stale = dict(PushSigner(SECRET, clock=lambda: time.time() - 600).fields("app", "s1", b"x"))
        answer = await sender.push("s1", b"x", stale)
        assert answer.type == "reject" and (answer.content or b"").startswith(b"stale push")
        answer = await sender.push("u1", b"x", {})
        assert (answer.type, answer.content) == ("reject", b"unsigned push")
        # A signature over other content does not carry over.
        tampered = dict(PushSigner(SECRET).fields("app", "t1", b"original"))
        answer = await sender.push("t1", b"changed", tampered)
        assert (answer.type, answer.content) == ("reject", b"bad push signature")
        good = dict(PushSigner(SECRET).fields("app", "g1", b"x"))
        answer = await sender.push("g1", b"x", good)
        assert (answer.type, answer.fields["msgid"]) == ("ack", "g1")
        assert handled == ["g1"] and consumer.stats["rejected"] == 4
        sender.writer.close()
