"""A stateful property test (hypothesis) of at-least-once delivery over a real broker
process and a real Redis: random interleavings of producers, recipients that ack, reject,
error, fall silent, drop the connection, vanish and come back, late answers, and broker
kills (SIGKILL) and restarts (SIGTERM).

After every step: every message the broker answered `ack` to its producer is pending,
delayed, in flight, dead or done (never gone, never in two places at once), and the
broker's own bookkeeping acked each message at most once (one `acked` event in the
delivery log, and a message with one is done). At the end, with every recipient back
and acking, every message ends acked or dead.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import tempfile
import uuid
from collections import Counter
from pathlib import Path
from typing import Any, ClassVar

import pytest
import redis.asyncio as aioredis
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from tests.conftest import free_port
from tests.peers import RawClient
from tests.test_reliability import APP, Holder, Serve, log_events, queue_frames, where

POLICIES = ["ack", "ack", "reject", "error", "hold", "arrived", "close"]
RECIPIENTS = 2


class BrokerMachine(RuleBasedStateMachine):
    env: ClassVar[dict[str, str]] = {}

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.dir = Path(tempfile.mkdtemp(prefix="skmq-stateful-"))
        self.prefix = f"st{uuid.uuid4().hex[:10]}"
        env = dict(self.env)
        env.update(
            SKMQ_PORT=str(free_port()),
            SKMQ_DATA_DIR=str(self.dir / "data"),
            SKMQ_KEY_PREFIX=self.prefix,
            SKMQ_SHUTDOWN_TIMEOUT="0.5",
        )
        self.broker = Serve(env, self.dir / "broker.log")
        self.redis: aioredis.Redis = aioredis.Redis.from_url(env["SKMQ_REDIS_URL"])
        self.recipients = [Holder(APP, f"r{i}") for i in range(RECIPIENTS)]
        self.up = [False] * RECIPIENTS
        self.acked: list[str] = []
        self.sent = 0

    def run(self, coro: Any, timeout: float = 30.0) -> Any:
        try:
            return self.loop.run_until_complete(asyncio.wait_for(coro, timeout))
        except BaseException as exc:
            self.report(f"step failed: {exc!r}")
            raise

    def check(self, ok: bool, message: str) -> None:
        if not ok:
            self.report(message)
            raise AssertionError(message)

    def report(self, message: str) -> None:
        """Print what went wrong now: a timing-dependent failure may not recur when
        hypothesis replays the example (it then reports the replay, not this)."""
        log = self.dir / "broker.log"
        tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
        print(f"STATEFUL FAILURE: {message}\n--- broker log tail ---\n{tail}", file=sys.stderr)

    @initialize()
    def start(self) -> None:
        self.run(self.broker.up())
        for i in range(RECIPIENTS):
            self.come_back(i)

    # -- producers ------------------------------------------------------------
    @rule(n=st.integers(1, 6))
    def produce(self, n: int) -> None:
        ids = [f"m{self.sent + i}" for i in range(n)]
        self.sent += n

        async def send() -> list[str]:
            client = await RawClient.connect(self.broker.port)
            try:
                client.send_raw(queue_frames(ids))
                return [
                    r["msgid"] for r in [await client.resp() for _ in ids] if r["status"] == "ack"
                ]
            finally:
                await client.close()

        acked = self.run(send())
        self.check(acked == ids, f"a healthy broker stores every message: {acked} != {ids}")
        self.acked += acked

    # -- recipients -------------------------------------------------------------
    @rule(i=st.integers(0, RECIPIENTS - 1), policy=st.sampled_from(POLICIES))
    def set_policy(self, i: int, policy: str) -> None:
        self.recipients[i].mode = policy

    @rule(i=st.integers(0, RECIPIENTS - 1), action=st.sampled_from(["ack", "reject", "error"]))
    def answer_late(self, i: int, action: str) -> None:
        """Answer what was held, whatever became of it meanwhile (timed out, redelivered)."""
        self.recipients[i].answer_held(action)

    @precondition(lambda self: any(self.up))
    @rule(data=st.data())
    def vanish(self, data: st.DataObject) -> None:
        i = data.draw(st.sampled_from([i for i, up in enumerate(self.up) if up]))
        self.run(self.recipients[i].stop())
        self.up[i] = False

    @precondition(lambda self: not all(self.up))
    @rule(data=st.data())
    def come_back_one(self, data: st.DataObject) -> None:
        self.come_back(data.draw(st.sampled_from([i for i, up in enumerate(self.up) if not up])))

    def come_back(self, i: int) -> None:
        recipient = self.recipients[i]

        async def start() -> None:
            await recipient.start()
            resp = await recipient.register(self.broker.port)
            self.check(resp["status"] == "ack", f"register: {resp}")

        self.run(start())
        self.up[i] = True

    # -- the broker and time ------------------------------------------------------
    @rule()
    def kill_broker(self) -> None:
        self.run(self.broker.sigkill())
        self.run(self.broker.up())

    @rule()
    def restart_broker(self) -> None:
        async def restart() -> None:
            assert self.broker.proc is not None
            self.broker.proc.terminate()
            try:
                rc = await self.broker.exited(10)
            except TimeoutError:
                rc = None
            self.check(rc == 0, f"SIGTERM: the broker exited with {rc} (None: not in 10 s)")
            await self.broker.up()

        self.run(restart())

    @rule(seconds=st.sampled_from([0.05, 0.3, 1.0]))
    def let_time_pass(self, seconds: float) -> None:
        self.run(asyncio.sleep(seconds))

    # -- what must hold after every step ---------------------------------------------
    @invariant()
    def no_acknowledged_message_is_gone(self) -> None:
        states = self.run(where(self.redis, self.prefix, self.acked))
        bad = {m: s for m, s in states.items() if s.startswith(("LOST", "CORRUPT"))}
        self.check(not bad, f"acknowledged messages gone or in two places: {bad}")

    @invariant()
    def acked_at_most_once_and_then_done(self) -> None:
        events = log_events(self.dir)
        acks = Counter(e["msgid"] for e in events if e["event"] == "acked")
        twice = {m: n for m, n in acks.items() if n > 1}
        self.check(not twice, f"acked more than once by the broker: {twice}")
        states = self.run(where(self.redis, self.prefix, list(acks)))
        undone = {m: s for m, s in states.items() if s != "done"}
        self.check(not undone, f"logged as acked but not done: {undone}")

    def teardown(self) -> None:
        try:
            if self.broker.alive:
                self.finish()
        finally:
            for i, recipient in enumerate(self.recipients):
                if self.up[i]:
                    self.run(recipient.stop())
            if self.broker.proc is not None and self.broker.alive:
                self.broker.proc.kill()
                self.broker.proc.wait(10)
            self.run(self.redis.aclose())
            self.loop.close()
            shutil.rmtree(self.dir, ignore_errors=True)

    def finish(self) -> None:
        """Liveness: once every recipient is back and acks, every message ends acked or dead."""
        for i in range(RECIPIENTS):
            if not self.up[i]:
                self.come_back(i)
            self.recipients[i].mode = "ack"
            self.recipients[i].answer_held("ack")
        last: dict[str, str] = {}

        async def settled() -> bool:
            nonlocal last
            last = await where(self.redis, self.prefix, self.acked)
            return all(s in ("done", "dead") for s in last.values())

        async def wait() -> None:
            while not await settled():
                await asyncio.sleep(0.05)

        try:
            self.run(wait(), timeout=20)
        except TimeoutError:
            self.report(f"not settled in 20 s: {Counter(last.values())}")
            pytest.fail(f"not settled: {Counter(last.values())}")


def test_at_least_once_under_random_faults(redis_url: str, broker_env: dict[str, str]) -> None:
    BrokerMachine.env = {**broker_env, "SKMQ_REDIS_URL": redis_url}
    run_state_machine_as_test(
        BrokerMachine,
        settings=settings(
            max_examples=int(os.environ.get("SKMQ_STATEFUL_EXAMPLES", "4")),
            stateful_step_count=12,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        ),
    )
