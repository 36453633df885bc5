"""What survives an app's owner, in Redis: the ownership lease and its epoch, the log of
stored messages, the journal of the owner's transitions, and its checkpoint.

Every write of the owner is one script that first checks the epoch (Kafka's leader
epoch, BookKeeper's fencing): an owner that stalled past its lease (a pause, SIGSTOP)
while another broker took the queue over writes nothing, whatever it still believes.
The keys of one app share its hash tag, so each script runs on one node of a cluster.
The scripts are in skmq/queue/lua/, one file each, their keys and arguments at the top.
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

import structlog
from redis.exceptions import RedisError

from skmq.store.scripts import lib_for
from skmq.store.store import escape_tag
from skmq.store.wire import ReplyError, Wire

# Lists an app in the apps directory (skmq/store/directory.py), after a store set its mark
Lister = Callable[[str], Awaitable[None]]

log = structlog.get_logger("skmq.queue.journal")


_PRELUDES = {"flush": "feed", "append": "feed"}  # the consumer groups' feed


def _read(name: str) -> str:
    return (resources.files("skmq.queue") / "lua" / f"{name}.lua").read_text("utf-8")


@cache
def script_source(name: str) -> bytes:
    """Script `name`: its prelude (skmq/queue/lua/), the store's lib.lua helpers it uses
    (skmq/store/scripts.py) and those of skmq/queue/lua/lib.lua, then its own file."""
    own = "\n".join([*((_read(_PRELUDES[name]),) if name in _PRELUDES else ()), _read(name)])
    return (lib_for(own) + lib_for(own, _read("lib")) + "\n" + own).encode()


@cache
def _sha(name: str) -> str:
    return hashlib.sha1(script_source(name)).hexdigest()


async def run_script(wire: Wire, name: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
    """EVALSHA, loading the script once where the server does not know it yet."""
    try:
        return await wire.call("EVALSHA", _sha(name), len(keys), *keys, *args)
    except ReplyError as err:
        if err.code != "NOSCRIPT":
            raise
    return await wire.call("EVAL", script_source(name), len(keys), *keys, *args)


@dataclass(frozen=True, slots=True)
class AppKeys:
    """The Redis keys of one app's queue (docs/ARCHITECTURE.md has the layout)."""

    base: str
    app: str = ""

    @classmethod
    def of(cls, prefix: str, app: str) -> AppKeys:
        return cls(f"{prefix}:{{{escape_tag(app)}}}:", app)

    @property
    def listed(self) -> str:
        """The app's mark (skmq/store/directory.py): set by a store, listing it anew."""
        return self.base + "listed"

    @property
    def owner(self) -> str:
        return self.base + "owner"

    @property
    def epoch(self) -> str:
        return self.base + "epoch"

    @property
    def log(self) -> str:
        return self.base + "log"

    @property
    def inbox(self) -> str:
        """Messages stored through other brokers (the owner alone writes the log)."""
        return self.base + "inbox"

    @property
    def journal(self) -> str:
        return self.base + "jr"

    @property
    def checkpoint(self) -> str:
        return self.base + "ckpt"

    @property
    def wakeup(self) -> str:
        """The channel an append to the inbox tells the owner on."""
        return self.base + "inbox"

    @property
    def stats(self) -> str:
        """What its owner last counted (skmq/queue/runtime.py), for status."""
        return self.base + "stats"

    @property
    def dead(self) -> str:
        """The app's dead letters (skmq/queue/dead.py)."""
        return self.base + "dl"

    @property
    def dead_order(self) -> str:
        """The app's dead letters by the time they died (the key the DLQ always had)."""
        return self.base + "dead"

    @property
    def dead_copies(self) -> str:
        """How many copies of each topic message its dead letters hold, by msgid: with
        `dead`, what makes a msgid held as a dead letter a duplicate (lua/lib.lua)."""
        return self.base + "dlt"

    @property
    def groups(self) -> tuple[str, ...]:
        """What feeds the app's consumer groups (skmq/queue/lua/feed.lua): its groups, its
        recipients (none: pull only), the group log, its msgids and its count."""
        return tuple(self.base + n for n in ("groups", "recipients", "glog", "gseen", "gadded"))

    def done(self, bucket: int) -> str:
        return f"{self.base}done:{bucket}"

    def dedupe(self, now: int, window_ms: int) -> tuple[str, str]:
        """The dedupe window's sets at `now`: the current bucket's and the one before."""
        bucket = now // window_ms
        return self.done(bucket), self.done(bucket - 1)


class Fenced(RedisError):  # type: ignore[misc]
    """The queue was taken over: this owner's epoch is no longer the current one. (A
    RedisError: what the write was for is answered as the store's trouble, and the
    ownership round lets the app go.)"""

    def __init__(self, mine: int, current: int) -> None:
        super().__init__(f"fenced: epoch {mine} is over, the queue is at epoch {current}")
        self.mine = mine
        self.current = current


@dataclass(frozen=True, slots=True)
class Lease:
    broker: str
    epoch: int

    @property
    def holder(self) -> str:
        return f"{self.broker}:{self.epoch}"


@dataclass(frozen=True, slots=True)
class HeldBy:
    """Another broker's lease on a queue: its holder, and the ms it has left (-1: no
    end, a key set by hand)."""

    broker: str
    ms_left: int


async def try_acquire(wire: Wire, keys: AppKeys, broker: str, lease_ms: int) -> Lease | HeldBy:
    """The queue's lease and a new epoch, or who holds it and for how long yet."""
    reply = await run_script(wire, "acquire", (keys.owner, keys.epoch), (broker, lease_ms))
    if reply[0] == 1:
        return Lease(broker, int(reply[1]))
    return HeldBy(reply[1].decode().rpartition(":")[0], int(reply[2]))


async def acquire(wire: Wire, keys: AppKeys, broker: str, lease_ms: int) -> Lease | None:
    """The queue's lease and a new epoch, or None while another broker holds it."""
    won = await try_acquire(wire, keys, broker, lease_ms)
    return won if isinstance(won, Lease) else None


async def renew(wire: Wire, keys: AppKeys, lease: Lease, lease_ms: int) -> bool:
    """Whether the lease still holds (now for lease_ms more); False: taken over."""
    args = (lease.holder, lease.epoch, lease_ms)
    return bool(await run_script(wire, "renew", (keys.owner, keys.epoch), args))


async def release(wire: Wire, keys: AppKeys, lease: Lease) -> None:
    await run_script(wire, "release", (keys.owner,), (lease.holder,))


@dataclass(frozen=True, slots=True)
class Appended:
    """A message for the log: its header is empty for a plain queue message."""

    msgid: bytes
    content: bytes
    header: bytes = b""


def _fenced(reply: Any, lease: Lease, keys: AppKeys) -> None:
    if isinstance(reply, list) and reply and reply[0] == b"fenced":
        log.warning("owner write fenced: nothing of it landed", app=keys.app,
                    epoch=lease.epoch, current=int(reply[1]))  # fmt: skip
        raise Fenced(lease.epoch, int(reply[1]))


GROUPS_ONLY = b"-"  # a message stored for the app's consumer groups alone (pull only)


@dataclass(frozen=True, slots=True)
class Flushed:
    ids: list[bytes | None]  # each message's log entry (GROUPS_ONLY: none), None: a duplicate
    inbox: list[tuple[bytes, list[bytes]]]  # the inbox entries read first (XRANGE's)
    journaled: bytes = b""  # the journal entry written (b"": no records)
    listed: bool = False  # it set the app's `listed` mark anew: `Journal.list_app` it


class Journal:
    """The fenced writes of one app's owner (a holder of `lease`)."""

    def __init__(
        self,
        wire: Wire,
        keys: AppKeys,
        lease: Lease,
        dedupe_ms: int,
        lister: Lister | None = None,
    ) -> None:
        self.wire = wire
        self.keys = keys
        self.lease = lease
        self.dedupe_ms = dedupe_ms
        self.lister = lister  # lists the app in the apps directory when its mark is new

    async def flush(
        self,
        now: int,
        messages: Sequence[Appended] = (),
        records: bytes = b"",
        settled: Sequence[bytes] = (),
        dead: Sequence[Any] = (0,),
        inbox_after: bytes = b"",
    ) -> Flushed:
        """Append `messages` to the log, `records` to the journal, the dead letters
        (`dead`: dead.flush_args) to the app's, `settled` to the dedupe window, in one
        fenced script. Each message's log entry id, or None where its msgid was settled
        within the dedupe window or is held as a dead letter (a duplicate); with
        `inbox_after`, the inbox's entries after it, read first. Raises Fenced."""
        cur, prev = self.keys.dedupe(now, self.dedupe_ms)
        args: list[Any] = [self.lease.epoch, 2 * self.dedupe_ms, inbox_after, len(messages)]
        for m in messages:
            args += (m.msgid, m.content, m.header)
        args.append(records)
        args.extend(dead)
        args.extend(settled)
        k = self.keys
        keys = [k.epoch, k.log, k.journal, cur, prev, k.inbox, k.dead, k.dead_order, k.listed]
        keys += (*k.groups, k.dead_copies)
        reply = await run_script(self.wire, "flush", keys, args)
        _fenced(reply, self.lease, self.keys)
        ids = [entry or None for entry in reply[1:-2]]
        return Flushed(ids, reply[0], reply[-2], bool(reply[-1]))

    async def list_app(self, flushed: Flushed) -> None:
        """The app in the apps directory, where `flushed` set its mark anew. (Apart from
        `flush`, so that its caller takes the reply in before it waits again: the log's
        entries are taken in the order written.)"""
        if flushed.listed and self.lister is not None:
            await self.lister(self.keys.app)

    async def read_inbox(
        self, now: int, start: bytes, count: int
    ) -> list[tuple[bytes, list[bytes]]]:
        """Up to `count` inbox entries from `start` (XRANGE's), those of a msgid that has
        ended marked (lua/lib.lua: mark_seen)."""
        k = self.keys
        keys = (k.inbox, *k.dedupe(now, self.dedupe_ms), k.dead, k.dead_copies)
        reply: list[tuple[bytes, list[bytes]]] = await run_script(
            self.wire, "inbox", keys, (start, count)
        )
        return reply

    async def checkpoint(
        self, state: bytes, journal_id: bytes, oldest_needed: bytes, oldest_inbox: bytes
    ) -> None:
        """Keep `state` as of journal entry `journal_id`; drop the journal up to it, the
        log below `oldest_needed` and the inbox below `oldest_inbox`. Raises Fenced."""
        k = self.keys
        keys = (k.epoch, k.checkpoint, k.journal, k.log, k.inbox)
        args = (self.lease.epoch, state, journal_id, oldest_needed, oldest_inbox)
        _fenced(await run_script(self.wire, "checkpoint", keys, args), self.lease, self.keys)


class NotAtRest(Exception):
    """A mover's append (lua/append.lua): the app is owned now (`owned`), or another
    epoch began since the mover read its stored state."""

    def __init__(self, owned: bool) -> None:
        super().__init__("owned" if owned else "taken over since it was read")
        self.owned = owned


async def append(
    wire: Wire,
    keys: AppKeys,
    now: int,
    dedupe_ms: int,
    messages: Sequence[Appended],
    lister: Lister | None = None,
    at_rest: tuple[bytes, bytes] | None = None,
) -> list[bytes | None]:
    """A store by a broker that does not own the queue: appended to the inbox, and the
    owner told; the app listed by `lister` when its mark is new or no broker owns it
    (lua/append.lua: why). None where a message is a duplicate (settled within the dedupe
    window, held as a dead letter, twice in `messages`). `at_rest`: a mover's, the epoch
    and the last inbox entry of the state it read (NotAtRest where the app is owned now,
    or was taken since)."""
    args: list[Any] = [keys.wakeup, *(at_rest or ())]
    for m in messages:
        args += (m.msgid, m.content, m.header)
    touched = (keys.inbox, *keys.dedupe(now, dedupe_ms), keys.listed, *keys.groups)
    state = (keys.owner, *((keys.epoch,) if at_rest is not None else ()))
    reply = await run_script(wire, "append", (*touched, keys.dead, keys.dead_copies, *state), args)
    if reply in ([b"owned"], [b"changed"]):
        raise NotAtRest(reply == [b"owned"])
    if reply[-1] and lister is not None:
        await lister(keys.app)
    return [entry or None for entry in reply[:-1]]
