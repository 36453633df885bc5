"""The lifecycle the floor's relay can run in Redis instead of plain commands
(bench/floor_bench.py): a lifecycle cut to its bones (`--bare-lifecycle`), about the
least a per-message lifecycle in Redis can do.

It takes a read's messages with a store and a claim in one write (the claim a store
carries: the broker's best case), pushes what the claim's reply holds, and finishes acked
messages. Msgids are 32 hex digits, as the benchmark's producers send (packed in 17 bytes,
as SKMQ's store holds them), the last 8 the floor's message number.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

from skmq.clock import now_ms
from skmq.store.client import hiredis_pack
from skmq.store.messages import header
from skmq.store.msgids import pack

BASE = "skmq:{floor}:"  # the app's keys (the floor's Redis is its own)
RID = "r1"
MSGID_HEAD = b"a1b2c3d4e5f6a7b8c9d0e1f2"
DEDUPE_MS = 600_000  # the dedupe window, DEDUPE_WINDOW's default
LEASE_MS = 30_000
HEADER = 5  # bytes before a stored message's content (skmq/store/messages.py)

# Bare bones: dedupe against the done sets, store and queue; pop, count the attempt and
# lease; finish only a leased message of the attempt named (0: any), and mark it done.
# No helpers, ordering keys, TTL, topics, groups, rate, windows or dead letters.
BARE = {
    "store": """
-- KEYS: msgs, ready, done:<current>, done:<previous>; ARGV: (msgid, message)*
local out = {}
for i = 1, #ARGV, 2 do
  local id = ARGV[i]
  if redis.call('SISMEMBER', KEYS[3], id) == 1 or redis.call('SISMEMBER', KEYS[4], id) == 1
     or redis.call('HSETNX', KEYS[1], id, ARGV[i + 1]) == 0 then
    out[#out + 1] = 0
  else
    redis.call('RPUSH', KEYS[2], id)
    out[#out + 1] = 1
  end
end
return out""",
    "claim": """
-- KEYS: ready, msgs, state, inflight; ARGV: n, lease ms
-- Returns (msgid, attempt, message)*, then two zeros (a claim's two last fields).
local ids = redis.call('LPOP', KEYS[1], ARGV[1])
local out = {}
for _, id in ipairs(ids or {}) do
  local m = redis.call('HGET', KEYS[2], id)
  local a = redis.call('HINCRBY', KEYS[3], id, 1)
  redis.call('ZADD', KEYS[4], ARGV[2], id)
  out[#out + 1] = id; out[#out + 1] = a; out[#out + 1] = m
end
out[#out + 1] = 0; out[#out + 1] = 0
return out""",
    "finish": """
-- KEYS: inflight, msgs, state, done:<current>; ARGV: dedupe ms, (msgid, attempt or 0)*
local out = {}
for i = 2, #ARGV, 2 do
  local id = ARGV[i]
  local a = redis.call('HGET', KEYS[3], id)
  if redis.call('ZREM', KEYS[1], id) == 1 and (ARGV[i + 1] == '0' or a == ARGV[i + 1]) then
    redis.call('HDEL', KEYS[2], id)
    redis.call('HDEL', KEYS[3], id)
    redis.call('SADD', KEYS[4], id)
    out[#out + 1] = 1
  else
    out[#out + 1] = 0
  end
end
redis.call('PEXPIRE', KEYS[4], ARGV[1])
return out""",
}


def held(msgid: bytes) -> bytes:
    """The floor's msgid (`m` and 8 hex digits) as the store holds it: 32 hex digits,
    packed."""
    return pack((MSGID_HEAD + msgid[1:]).decode())


class Lifecycle(ABC):
    """Store and claim, push, finish: the calls, once `shas` holds the loaded scripts'."""

    name: ClassVar[str] = ""  # in words

    def __init__(self, base: str = BASE) -> None:
        self.base = base  # the app's keys start so
        self.shas: dict[str, str] = {}

    @abstractmethod
    def sources(self) -> dict[str, str]:
        """The Lua source of each script (store, claim, finish), to load."""

    @abstractmethod
    def store_and_claim(self, msgids: list[bytes], lines: list[bytes]) -> list[bytes]:
        """The packed calls storing `lines` (their msgids) and claiming as many."""

    @abstractmethod
    def finish(self, msgids: list[bytes]) -> bytes:
        """The packed call finishing the acked `msgids`."""

    @abstractmethod
    def contents(self, claim_reply: list[Any]) -> list[bytes]:
        """The messages a claim's reply hands out, to push."""

    def _call(self, script: str, keys: list[str], args: list[Any]) -> bytes:
        return hiredis_pack(("EVALSHA", self.shas[script], len(keys), *keys, *args))


class BareLifecycle(Lifecycle):
    """The three scripts of `BARE`."""

    name = "a lifecycle cut to its bones"

    def sources(self) -> dict[str, str]:
        return dict(BARE)

    def _keys(self, *names: str) -> list[str]:
        return [self.base + name for name in names]

    def store_and_claim(self, msgids: list[bytes], lines: list[bytes]) -> list[bytes]:
        now = now_ms()
        bucket = now // DEDUPE_MS
        head = header("queue", now, True)
        args = [x for msgid, line in zip(msgids, lines, strict=True)
                for x in (held(msgid), head + line)]  # fmt: skip
        keys = self._keys("msgs", "ready", f"done:{bucket}", f"done:{bucket - 1}")
        claim_keys = self._keys("ready", "msgs", "state", "inflight")
        return [
            self._call("store", keys, args),
            self._call("claim", claim_keys, [len(lines), now + LEASE_MS]),
        ]

    def finish(self, msgids: list[bytes]) -> bytes:
        now = now_ms()
        keys = self._keys("inflight", "msgs", "state", f"done:{now // DEDUPE_MS}")
        args = [DEDUPE_MS, *(x for msgid in msgids for x in (held(msgid), 0))]
        return self._call("finish", keys, args)

    def contents(self, claim_reply: list[Any]) -> list[bytes]:
        # (msgid, attempt, message)*, then 2
        return [message[HEADER:] for message in claim_reply[2:-2:3]]


LIFECYCLES: dict[str, type[Lifecycle]] = {"bare": BareLifecycle}
