"""A recipient's answer on a broker that does not own its app (SPEC 3: after
`arrived` it may answer on a connection of its own, to any broker) goes to the owner,
which alone knows what is in flight. The broker it reached checks what it can of the
sender (its registered address, or its authentication for the app) and appends the
answer to the app's inbox as a question; the owner answers it through its own router,
as if it had come on the push connection of a recipient so vouched for, and publishes the
verdict on the asking broker's reply channel. The asker waits STORE_TIMEOUT at most."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from skmq.codec import Frame, Status
from skmq.queue.journal import AppKeys, run_script
from skmq.store.wires import Wires
from skmq.workers.link import Verdict


@dataclass(frozen=True, slots=True)
class Question:
    frame: Frame
    vouched: tuple[str, ...] | None  # the recipients the sender may be; None: any
    reply: str  # the asker's channel
    ident: str

    def encode(self) -> bytes:
        f = self.frame
        body = {
            "t": f.type,
            "f": f.fields,
            "c": None if f.content is None else f.content.decode("latin-1"),
            "v": self.vouched,
            "r": self.reply,
            "i": self.ident,
        }
        return json.dumps(body).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Question:
        body = json.loads(raw)
        content = None if body["c"] is None else body["c"].encode("latin-1")
        frame = Frame(body["t"], body["f"], content)
        vouched = None if body["v"] is None else tuple(body["v"])
        return cls(frame, vouched, body["r"], body["i"])


@dataclass
class Forwarder:
    wires: Wires
    prefix: str
    broker_id: str
    timeout: float
    waiting: dict[str, asyncio.Future[Verdict]] = field(default_factory=dict)

    @property
    def channel(self) -> str:
        return f"{self.prefix}:replies:{self.broker_id}"

    async def ask(self, app: str, frame: Frame, vouched: Sequence[str] | None) -> Verdict:
        """The owner's verdict on an answer for `app`."""
        ident = uuid.uuid4().hex
        question = Question(frame, None if vouched is None else tuple(vouched), self.channel, ident)
        verdict = asyncio.get_running_loop().create_future()
        self.waiting[ident] = verdict
        keys = AppKeys.of(self.prefix, app)
        try:
            async with asyncio.timeout(self.timeout):
                wire = await self.wires.of(keys.inbox)
                await run_script(wire, "ask", (keys.inbox,), (keys.wakeup, question.encode()))
                status, text = await verdict
                return (status, text)
        except TimeoutError:
            return (Status.ERROR, f"the owner of app {app!r} did not answer in time: send it again")
        finally:
            self.waiting.pop(ident, None)

    def replied(self, raw: bytes) -> None:
        ident, status, text = json.loads(raw)
        verdict = self.waiting.get(ident)
        if verdict is not None and not verdict.done():
            verdict.set_result((status, text))


Answer = Callable[[Frame, "tuple[str, ...] | None"], Awaitable[Verdict]]


async def answer_question(wires: Wires, answer: Answer, raw: bytes) -> None:
    """At the owner: the question answered and the verdict published."""
    question = Question.decode(raw)
    status, text = await answer(question.frame, question.vouched)
    reply: list[Any] = [question.ident, str(status), text]
    await (await wires.any()).call("PUBLISH", question.reply, json.dumps(reply))
