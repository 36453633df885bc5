"""The store calls of consumer groups and pull consumption (the `pull_*` and `group_*`
Lua scripts; keys in skmq/store/lua/pull_lib.lua). Each consumer group holds its own
copy of a delivery's states (skmq/lifecycle.py) for every message stored after it
subscribed; the scripts are its transitions:

    pending | delayed | waiting_retry --pull_receive--> in_flight(n + 1)
    pending | delayed | waiting_retry --pull_receive--> dead | gone (TTL ran out: expired)
    pending --pull_receive--> waiting_key              (an earlier entry of its key not over)
    waiting_key --pull_ack | pull_nack | pull_receive--> delayed (due now: the entry
                                                        before it acked or dead)
    in_flight(n) --pull_receive--> waiting_retry | dead (its lease ran out)
    in_flight(n) --pull_ack--> acked                   (only attempt n, lease running)
    in_flight(n) --pull_nack--> waiting_retry | dead   (only attempt n, lease running)
    in_flight(n) --pull_extend--> in_flight(n)         (only attempt n, lease running)
    dead --pull_replay--> delayed (due now, attempts reset, TTL lifted) (not dead: refused)
    dead --pull_purge--> gone                          (not dead: refused)

A receipt handle is `<entry id>.<n>.<generation>`, n counting the entry's attempts in
the group, replays or not (`attempt` counts since the last replay): it settles only
that attempt of the group as it is now (not after a reset, or a delete and create),
while its lease runs. A group made before generations has generation 0, its receipts
no third part."""

from __future__ import annotations

import re
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from skmq.clock import now_ms
from skmq.deliverylog import DeliveryLog
from skmq.events import GENERATION, GROUP_FROM, GROUP_PREFIX, Event
from skmq.pull.position import FuturePosition, Position, position_arg
from skmq.store import DeadLetter, Store
from skmq.store.msgids import unpack

GROUP_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_RECEIPT = re.compile(r"(\d{1,20}-\d{1,20})\.(\d{1,9})(?:\.(\d{1,24}))?", re.ASCII)
GROUP_KEYS = ("inflight", "delayed", "held", "gstate", "dead", "kq")
_KINDS = {b"q": "queue", b"t": "topic"}
# A settled batch's msgids are read in one XRANGE over its span, of this many entries a
# receipt at most (its consumers' receives interleave: the span holds their entries too).
SPAN_READ = 8
# Entries whose msgid and kind a Groups remembers from its receives (Groups.handed):
# some 11 MiB at most; a settle of one it forgot reads the log, as another broker's does.
HANDED_MAX = 32_768


class NoSuchGroup(LookupError):
    pass


def bad_group(name: str) -> str | None:
    """Why `name` cannot be a group name, or None."""
    if GROUP_NAME.fullmatch(name) is None:
        return "must be 1 to 64 letters, digits, '_', '.' or '-'"
    return None


Receipt = tuple[str, int, str]  # entry id, attempt, generation


def parse_receipt(receipt: str) -> Receipt | None:
    """(entry id, attempt, generation) of a receipt handle, None if it is not one."""
    m = _RECEIPT.fullmatch(receipt)
    return (m.group(1), int(m.group(2)), m.group(3) or "0") if m else None


def _stream_order(entry: str) -> tuple[int, int]:
    ms, _, seq = entry.partition("-")
    return int(ms), int(seq or 0)


def make_receipt(entry: str, attempt: int, generation: str) -> str:
    tail = "" if generation == "0" else f".{generation}"
    return f"{entry}.{attempt}{tail}"


@dataclass(slots=True)
class Pulled:
    receipt: str
    msgid: str
    kind: str
    content: bytes
    attempt: int
    trace: str = ""  # the traceparent it was stored with


@dataclass(slots=True)
class Received:
    messages: list[Pulled]
    next_due: int | None  # unix ms at which a delay or a lease of the group runs out
    more: bool  # the receive read as much of the log as one call may: call again at once
    # TTL ran out before they were handed out: receipt "", content b"dead" (dead-lettered
    # for the group) or b"drop" (EXPIRED=drop), attempt: those made before
    expired: list[Pulled] = field(default_factory=list)
    # Leases that ran out (a failed attempt, the broker logs it): receipt: the attempt's,
    # content b"dead" (it was the last attempt) or the ms its retry falls due
    ran_out: list[Pulled] = field(default_factory=list)
    unread: int = -1  # log entries the group has not read yet (-1: not known)


# s: a group received from within this long is being consumed (ReceivePace)
ACTIVE = 0.25


class ReceivePace:
    """What each consumer group of an app had not read yet at its last receive, while
    its consumers go on receiving: a line the store hold looks at
    (skmq/workers/store_hold.py), as it looks at a push app's due messages."""

    def __init__(self) -> None:
        self._unread: dict[str, dict[str, tuple[float, int]]] = {}

    def received(self, app: str, group: str, unread: int) -> None:
        self._unread.setdefault(app, {})[group] = (time.monotonic(), unread)

    def behind(self, app: str, limit: int) -> int:
        """The most a group of the app received from within ACTIVE had not read, if
        more than `limit`; else 0."""
        groups = self._unread.get(app)
        if not groups:
            return 0
        now = time.monotonic()
        recent = {g: v for g, v in groups.items() if now - v[0] < ACTIVE}
        if len(recent) < len(groups):  # (groups no longer received from: forgotten)
            if recent:
                self._unread[app] = recent
            else:
                del self._unread[app]
        line = max((unread for _, unread in recent.values()), default=0)
        return line if line > limit else 0


OLDEST_LOOK = 100  # held entries a group's oldest is looked for among


@dataclass(slots=True)
class GroupInfo:
    name: str
    cursor: str
    in_flight: int
    delayed: int
    dead: int
    backlog: int  # log entries after the cursor (messages not received yet)
    # when the oldest message the group has not settled was stored (unix ms; its dead
    # letters aside), None: none
    oldest: int | None = None

    def oldest_age_s(self, now: int) -> float | None:
        return None if self.oldest is None else max(0, now - self.oldest) / 1000


class Groups:
    def __init__(
        self, store: Store, dlog: DeliveryLog | None = None, handed_max: int = HANDED_MAX
    ) -> None:
        """`dlog`: where a group's making, reset and deletion are logged (the audit counts
        a group's copy of each message stored from its start: docs/AUDIT.md)."""
        self.store = store
        self.dlog = dlog
        self.pace = ReceivePace()
        # (app, group, entry) -> (msgid, kind) of what this broker's receives handed out
        # and no settle has asked for yet, oldest first: a settled batch's delivery-log
        # lines need its msgids, which would otherwise be read back from the log (an
        # XRANGE of the entries, contents and all). An entry's msgid and kind never
        # change: a remembered one is never stale.
        self.handed: OrderedDict[tuple[str, str, str], tuple[str, str]] = OrderedDict()
        self.handed_max = handed_max

    @staticmethod
    def _group_keys(group: str) -> tuple[str, ...]:
        """The group's own keys, under the app's key base (as a script's extra keys)."""
        return tuple(f"g:{group}:{name}" for name in GROUP_KEYS)

    def log_key(self, app: str) -> str:
        """The app's group log; also the channel its stores and due retries are told on."""
        return self.store.base(app) + "glog"

    def _retry_args(self) -> list[Any]:
        return [self.store.retries.times, *self.store.retries.backoff_args()]

    async def _pull(self, name: str, app: str, group: str, now: int, args: Sequence[Any]) -> Any:
        keys = self._group_keys(group)
        return await self.store._call(name, app, [now, *self._retry_args(), *args], *keys)

    async def _start(self, script: str, app: str, group: str, position: Position) -> bool:
        """group_create or group_reset (group_position.lua), logged with the time the
        group gets the messages stored from; FuturePosition for a time after Redis's
        clock."""
        keys = (*self._group_keys(group), "gadded", "gsince")
        done = await self.store._call(script, app, [group, position_arg(position)], *keys)
        if done == -1:
            raise FuturePosition(
                f"{position} (unix ms) is after the store's clock; "
                "latest is what is stored from now on"
            )
        if not done:
            return False
        start, generation = int(done[0]), done[1].decode()
        if self.dlog is not None:
            verb = "made" if script == "group_create" else "reset"
            detail = f"consumer group {verb} at {position}; {GROUP_FROM}{start}; "
            self.dlog.event(Event.RECIPIENT_REGISTERED, "", app, None, GROUP_PREFIX + group,
                            detail=detail + GENERATION + generation)  # fmt: skip
        return True

    # -- groups -------------------------------------------------------------
    async def create(self, app: str, group: str, position: Position = "latest") -> bool:
        """Whether the group was made (False: it exists, left as it is), reading from
        `position` (skmq/pull/position.py)."""
        created = await self._start("group_create", app, group, position)
        await self.store.add_apps([app])
        return created

    async def reset(self, app: str, group: str, position: Position) -> bool:
        return await self._start("group_reset", app, group, position)

    async def delete(self, app: str, group: str) -> bool:
        keys = (*self._group_keys(group), "gseen", "gadded", "gsince")
        deleted = bool(await self.store._call("group_delete", app, [group], *keys))
        if deleted and self.dlog is not None:
            self.dlog.event(Event.RECIPIENT_REMOVED, "", app, None, GROUP_PREFIX + group,
                            detail="consumer group deleted")  # fmt: skip
        return deleted

    async def trim(self, app: str, limit: int = 1000) -> int:
        """Drop the group-log entries no group of `app` needs any more; how many went."""
        names = sorted(
            k.decode() for k in await self.store.redis.hkeys(self.store.base(app) + "groups")
        )
        held = [f"g:{name}:held" for name in names]
        return int(await self.store._call("group_trim", app, [limit, *names], *held))

    async def with_log(self, apps: Sequence[str]) -> list[str]:
        """The apps that have a group log (one round trip)."""
        pipe = self.store.redis.pipeline(transaction=False)
        for app in apps:
            pipe.exists(self.log_key(app))
        return [app for app, n in zip(apps, await pipe.execute(), strict=True) if n]

    async def describe_apps(self, apps: Sequence[str]) -> dict[str, list[GroupInfo]]:
        """The groups of each app that has any (one round trip to find them)."""
        pipe = self.store.redis.pipeline(transaction=False)
        for app in apps:
            pipe.hlen(self.store.base(app) + "groups")
        counts = await pipe.execute()
        return {app: await self.describe(app) for app, n in zip(apps, counts, strict=True) if n}

    async def describe(self, app: str, now: int | None = None) -> list[GroupInfo]:
        """The app's groups, in two round trips whatever their backlogs: a backlog is
        the entries ever added to the log (`gadded`) less those up to the group's
        cursor (gstate's r, group_position.lua), as no entry after a cursor is trimmed,
        and those due again by `now` (a retry whose wait ran out, a replayed dead letter:
        a receive takes them at once); delayed, those due later.
        The log's count is read last: a message stored meanwhile counts in."""
        now = now_ms() if now is None else now
        redis, base = self.store.redis, self.store.base(app)
        cursors = await redis.hgetall(base + "groups")
        names = sorted(k.decode() for k in cursors)
        pipe = redis.pipeline(transaction=False)
        for name in names:
            inflight, delayed, _, gstate, dead, _ = (base + k for k in self._group_keys(name))
            pipe.zcard(inflight)
            pipe.zcard(delayed)
            pipe.zcount(delayed, "-inf", now)
            pipe.zcard(dead)
            pipe.hget(gstate, "\x1fr")
        pipe.get(base + "gadded")
        *res, added = await pipe.execute()
        out = []
        for i, name in enumerate(names):
            cursor = cursors[name.encode()].decode()
            in_flight, delayed, due, dead, read = res[5 * i : 5 * i + 5]
            if read is None:  # a group made before the count: read what is after it
                backlog = await self._count_after(app, cursor)
            else:
                backlog = max(0, int(added or 0) - int(read))
            later = int(delayed) - int(due)
            out.append(
                GroupInfo(name, cursor, int(in_flight), later, int(dead), backlog + int(due))
            )
        await self._oldest(app, out)
        return out

    async def _oldest(self, app: str, infos: list[GroupInfo]) -> None:
        """Each group's oldest message not settled: the oldest it holds (in flight or
        delayed: the first OLDEST_LOOK of `held` that are not dead letters), else the
        first after its cursor. Two round trips whatever the groups."""
        redis, base = self.store.redis, self.store.base(app)
        pipe = redis.pipeline(transaction=False)
        for info in infos:
            pipe.zrange(base + self._group_keys(info.name)[2], 0, OLDEST_LOOK - 1)
            pipe.xrange(self.log_key(app), "(" + info.cursor, "+", count=1)
        found = await pipe.execute()
        pipe = redis.pipeline(transaction=False)
        for i, info in enumerate(infos):
            held = found[2 * i]
            if held:
                pipe.zmscore(base + self._group_keys(info.name)[4], held)
            else:
                pipe.echo("")
        dead = await pipe.execute()
        for i, info in enumerate(infos):
            held, unread = found[2 * i], found[2 * i + 1]
            alive = [e for e, d in zip(held, dead[i] or (), strict=False) if d is None]
            first = alive[0] if alive else unread[0][0] if unread else None
            info.oldest = None if first is None else int(first.split(b"-", 1)[0])

    async def _count_after(self, app: str, cursor: str) -> int:
        """The log entries after `cursor`, read page by page (a group made before the
        log counted its entries, until it reads one that has its count, or is reset)."""
        count, page = 0, 1000
        while True:
            got = await self.store.redis.xrange(self.log_key(app), "(" + cursor, "+", count=page)
            count += len(got)
            if len(got) < page:
                return count
            cursor = got[-1][0].decode()

    # -- pull ---------------------------------------------------------------
    async def receive(
        self, app: str, group: str, now: int, max_messages: int, visibility_ms: int
    ) -> Received:
        drop = 1 if self.store.expired_drop else 0
        res = await self._pull(
            "pull_receive", app, group, now, [group, max_messages, visibility_ms, drop]
        )
        if res == [b"no group"]:
            raise NoSuchGroup(group)
        generation = res[-3].decode()
        nxt = int(res[-2])
        got = Received([], None if nxt < 0 else nxt, res[-1] == 1, unread=int(res[-4]))
        self.pace.received(app, group, got.unread)
        lists = {b"x": got.expired, b"r": got.ran_out}
        for i in range(0, len(res) - 4, 7):
            entry, msgid, kind, content, n, attempt, trace = res[i : i + 7]
            expired = kind[:1] == b"x"
            receipt = "" if expired else make_receipt(entry.decode(), int(n), generation)
            pulled = Pulled(
                receipt, unpack(msgid), _KINDS.get(kind[-1:], "queue"), content, int(attempt),
                trace.decode(),
            )  # fmt: skip
            lists.get(kind[:1], got.messages).append(pulled)
            if receipt:
                self._remember((app, group, entry.decode()), pulled)
        return got

    def _remember(self, key: tuple[str, str, str], pulled: Pulled) -> None:
        handed = self.handed
        handed[key] = (pulled.msgid, pulled.kind)
        handed.move_to_end(key)
        if len(handed) > self.handed_max:
            handed.popitem(last=False)

    async def settled_entries(
        self, app: str, group: str, ids: Sequence[str]
    ) -> list[tuple[str, str]]:
        """(msgid, kind) of group-log entries of `group` a settle names (for the delivery
        log); ("", "queue") for one the log no longer holds. Those this broker handed out
        are remembered (`handed`, forgotten now: a redelivery is handed out again); the
        others are read from the log (`entries`)."""
        handed = self.handed
        known = [handed.pop((app, group, entry), None) for entry in ids]
        missing = [entry for entry, got in zip(ids, known, strict=True) if got is None]
        read = iter(await self.entries(app, missing))
        return [got if got is not None else next(read) for got in known]

    async def entries(self, app: str, ids: Sequence[str]) -> list[tuple[str, str]]:
        """(msgid, kind) of group-log entries, read from the log; ("", "queue") for one
        it no longer holds. A batch's entries are mostly neighbours in the log (one
        receive took them in order): one XRANGE over their span (SPAN_READ times their
        number at most), then one a round trip for those it did not reach."""
        if not ids:
            return []
        key = self.log_key(app)
        order = sorted(ids, key=_stream_order)
        span = await self.store.redis.xrange(key, order[0], order[-1], count=SPAN_READ * len(ids))
        found: dict[str, dict[bytes, bytes]] = {e.decode(): f for e, f in span}
        missing = [e for e in ids if e not in found]
        if missing:
            pipe = self.store.redis.pipeline(transaction=False)
            for entry in missing:
                pipe.xrange(key, entry, entry)
            for entry, got in zip(missing, await pipe.execute(), strict=True):
                if got:
                    found[entry] = got[0][1]
        out = []
        for entry in ids:
            fields = found.get(entry, {})
            msgid = unpack(fields.get(b"m", b""))
            out.append((msgid, _KINDS.get(fields.get(b"k", b"q"), "queue")))
        return out

    async def _no_group_if_all_refused(self, app: str, group: str, settled: Sequence[int]) -> None:
        """Raise NoSuchGroup when no receipt settled (each 0) and the group does not
        exist: the settling scripts refuse every receipt of a group that is not there,
        which its consumer must hear as such (404), not as `stale`. Asked only then, so
        a settle that did something costs no second round trip."""
        if any(settled):
            return
        if not await self.store.redis.hexists(self.store.base(app) + "groups", group):
            raise NoSuchGroup(group)

    async def ack(self, app: str, group: str, receipts: Sequence[Receipt], now: int) -> list[int]:
        """The attempt each receipt acked (counted since its entry's last replay; 0:
        refused, stale). NoSuchGroup if the group does not exist."""
        args = [x for r in receipts for x in r]
        done = [int(x) for x in await self._pull("pull_ack", app, group, now, args)]
        await self._no_group_if_all_refused(app, group, done)
        return done

    async def nack(
        self, app: str, group: str, receipts: Sequence[tuple[str, int, str, int]], now: int
    ) -> list[tuple[int, int, int]]:
        """receipts: (entry id, n, generation, wait ms or -1 for the backoff); (code 0
        refused | 1 retry | 2 dead, due ms, the attempt that failed) each. NoSuchGroup if
        the group does not exist."""
        args = [x for r in receipts for x in r]
        res = await self._pull("pull_nack", app, group, now, args)
        codes = [(int(res[i]), int(res[i + 1]), int(res[i + 2])) for i in range(0, len(res), 3)]
        await self._no_group_if_all_refused(app, group, [code for code, _, _ in codes])
        return codes

    async def extend(
        self, app: str, group: str, receipts: Sequence[tuple[str, int, str, int]], now: int
    ) -> list[int]:
        """The attempt each receipt extended (0: refused, stale). NoSuchGroup if the group
        does not exist."""
        args = [x for r in receipts for x in r]
        done = [int(x) for x in await self._pull("pull_extend", app, group, now, args)]
        await self._no_group_if_all_refused(app, group, done)
        return done

    # -- dead letters (skmq/dlq.py through GroupDeadLetters) ----------------
    async def dead_letters(
        self, app: str, group: str, limit: int | None = None
    ) -> list[DeadLetter]:
        """The group's dead letters, oldest first (two round trips)."""
        base = self.store.base(app)
        _, _, _, gstate, dead_key, _ = (base + k for k in self._group_keys(group))
        stop = -1 if limit is None else limit - 1
        dead = await self.store.redis.zrange(dead_key, 0, stop, withscores=True)
        ids = [member.decode() for member, _ in dead]
        pipe = self.store.redis.pipeline(transaction=False)
        for entry in ids:
            pipe.xrange(self.log_key(app), entry, entry)
            # attempts (all, and before the last replay), last error
            pipe.hmget(gstate, f"{entry}\x1fn", f"{entry}\x1fb", f"{entry}\x1fe")
        res = await pipe.execute()
        out = []
        for i, (entry, (_, died)) in enumerate(zip(ids, dead, strict=True)):
            found, (n, replayed, error) = res[2 * i], res[2 * i + 1]
            fields = found[0][1] if found else {}
            out.append(
                DeadLetter(
                    app,
                    entry,
                    unpack(fields.get(b"m", b"")),
                    _KINDS.get(fields.get(b"k", b"q"), "queue"),
                    GROUP_PREFIX + group,
                    fields.get(b"c", b""),
                    int(n or 0) - int(replayed or 0),
                    (error or b"").decode("utf-8", "replace"),
                    [],
                    int(died),
                    int(entry.split("-")[0]),
                )
            )
        return out

    async def replay(self, app: str, group: str, ids: Sequence[str], now: int) -> list[bool]:
        """Dead letters of the group due again now, attempts reset, TTL lifted."""
        if not ids:
            return []
        return [bool(x) for x in await self._pull("pull_replay", app, group, now, ids)]

    async def purge(self, app: str, group: str, ids: Sequence[str]) -> list[bool]:
        if not ids:
            return []
        return [bool(x) for x in await self._pull("pull_purge", app, group, now_ms(), ids)]


@dataclass(slots=True)
class GroupDeadLetters:
    """One consumer group's dead letters, with the calls skmq/dlq.py makes of a Store."""

    groups: Groups
    group: str

    async def dead_letters(self, app: str, limit: int | None = None) -> list[DeadLetter]:
        return await self.groups.dead_letters(app, self.group, limit)

    async def replay(self, app: str, ids: Sequence[str], now: int) -> list[bool]:
        return await self.groups.replay(app, self.group, ids, now)

    async def purge(self, app: str, ids: Sequence[str]) -> list[bool]:
        return await self.groups.purge(app, self.group, ids)
