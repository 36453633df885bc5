"""Redriving the dead-letter queue, for operators, whichever way they ask: `skmq dlq`
(skmq/cli/dlq.py) and the HTTP gateway (skmq/http/dlq.py) select and redrive with the
same two calls. A replay or a move is written to the delivery log, so the audit sees it."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from skmq.clock import now_ms
from skmq.deliverylog import DeliveryLog
from skmq.events import MOVED_TO_APP, Event
from skmq.pull.groups import GroupDeadLetters, Groups
from skmq.queue.owned_store import OwnedStore
from skmq.ratelimit import TokenBucket
from skmq.store import DeadLetter

CHUNK = 500
Verb = Literal["replay", "purge"]


class DeadLetters(Protocol):
    """Where dead letters are: an app's (Store), or one consumer group's
    (skmq/pull/groups.py's GroupDeadLetters)."""

    async def dead_letters(self, app: str, limit: int | None = None) -> list[DeadLetter]: ...

    async def replay(self, app: str, ids: Sequence[str], now: int) -> list[bool]: ...

    async def purge(self, app: str, ids: Sequence[str]) -> list[bool]: ...


def dead_letters_of(store: OwnedStore, group: str | None) -> DeadLetters:
    """The pushes' dead letters, or those of consumer group `group`."""
    return store if group is None else GroupDeadLetters(Groups(store), group)


@dataclass(slots=True, frozen=True)
class Filters:
    """Which dead letters: `reason` a text of the last error (any case), died in
    [since, until) (unix ms), at most `max_count` of them, oldest first."""

    reason: str | None = None
    since: int | None = None
    until: int | None = None
    max_count: int | None = None

    @property
    def any(self) -> bool:
        return any(v is not None for v in (self.reason, self.since, self.until, self.max_count))


class UnknownDeadLetter(LookupError):
    """A msgid given that is not a dead letter (nothing is done)."""


def choose(
    letters: list[DeadLetter], msgids: Collection[str], filters: Filters, app: str | None = None
) -> list[DeadLetter]:
    """The dead letters of `msgids` (none given: all of `letters`) that pass the filters,
    oldest first. A msgid that is no dead letter, with no filter given, is an error: the
    operator named something that is not there (UnknownDeadLetter)."""
    if msgids:
        wanted = set(msgids)
        letters = [d for d in letters if d.msgid in wanted]
        unknown = sorted(wanted - {d.msgid for d in letters})
        if unknown and not filters.any:
            raise UnknownDeadLetter(
                f"no dead letter with msgid {', '.join(map(repr, unknown))}"
                f"{' in app ' + repr(app) if app else ''}: nothing done"
            )
    return select(letters, filters)


def select(letters: list[DeadLetter], filters: Filters) -> list[DeadLetter]:
    """The dead letters that pass the filters, oldest first."""
    reason = filters.reason.lower() if filters.reason else None
    kept = [
        d
        for d in letters
        if (reason is None or reason in d.last_error.lower())
        and (filters.since is None or d.died_at >= filters.since)
        and (filters.until is None or d.died_at < filters.until)
    ]
    kept.sort(key=lambda d: d.died_at)
    return kept[: filters.max_count] if filters.max_count else kept


async def redrive(
    store: DeadLetters,
    dlog: DeliveryLog,
    verb: Verb,
    letters: list[DeadLetter],
    to_app: str | None = None,
    pace: TokenBucket | None = None,
    progress: Callable[[int], None] | None = None,
) -> int:
    """Replay (into `to_app`: move) or purge `letters`, CHUNK at a time, at most `pace`'s
    rate; returns how many were done (one that stopped being dead meanwhile is not)."""
    done = 0
    size = CHUNK if pace is None else max(1, min(CHUNK, int(pace.rate)))
    for i in range(0, len(letters), size):
        chunk = letters[i : i + size]
        if pace is not None:
            await pace.acquire(len(chunk))
        by_app: dict[str, list[DeadLetter]] = {}
        for d in chunk:
            by_app.setdefault(d.appid, []).append(d)
        for app, items in by_app.items():
            done += await _redrive_app(store, dlog, verb, app, items, to_app)
        if progress is not None:
            progress(len(chunk))
    return done


async def _redrive_app(
    store: DeadLetters,
    dlog: DeliveryLog,
    verb: Verb,
    app: str,
    items: list[DeadLetter],
    to_app: str | None,
) -> int:
    ids = [d.delivery_id for d in items]
    if to_app is not None:
        if not isinstance(store, OwnedStore):
            raise ValueError("a group's dead letters are replayed into their group only")
        moved = await store.move(app, to_app, ids, now_ms())
        results = [x == 1 for x in moved]
        for d, ok in zip(items, results, strict=True):
            if ok:
                dlog.event(Event.PURGED, d.msgid, app, d.kind, d.recipient,
                           detail=f"{MOVED_TO_APP} {to_app}")  # fmt: skip
                detail = f"moved from the dead letters of app {app}"
                dlog.event(Event.STORED, d.msgid, to_app, d.kind, detail=detail)
        return sum(results)
    if verb == "replay":
        results = await store.replay(app, ids, now_ms())
        event, detail = Event.REPLAYED, "dead letter replayed by an operator"
    else:
        results = await store.purge(app, ids)
        event, detail = Event.PURGED, "dead letter purged by an operator"
    for d, ok in zip(items, results, strict=True):
        if ok:
            dlog.event(event, d.msgid, app, d.kind, d.recipient, detail=detail)
    return sum(results)
