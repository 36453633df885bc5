"""The operator's console, whichever way it is asked: `skmq apps`, `skmq peek` and `skmq
purge` (skmq/cli/) and the gateway's /v1/apps routes (skmq/http/console.py) answer with
the same calls and the same JSON. A purge is written to the delivery log (event
`purged`, detail `pending message purged by an operator`), so the audit counts it."""

from __future__ import annotations

import sys
from collections.abc import Collection
from typing import Any

from skmq.deliverylog import DeliveryLog
from skmq.events import PENDING_PURGED, Event
from skmq.pull.groups import Groups
from skmq.queue.owned_store import OwnedStore
from skmq.store import DeadLetter, Purged, Waiting
from skmq.store.store import PREVIEW_BYTES

PEEK_MAX = 1000  # messages a peek shows at most
PURGE_CHUNK = 1000  # messages a purge's script removes at most (Redis stays responsive)
# A broker note older than this is a stopped broker's (brokers note every second at most).
ALIVE_MS = 5000
MINUTE_S = 60.0


def minute_totals(brokers: dict[str, dict[str, Any]], now: int) -> dict[str, tuple[int, int]]:
    """Per app, messages in and out over the last minute, summed over the live brokers'
    notes (skmq/throughput.py)."""
    totals: dict[str, tuple[int, int]] = {}
    for note in brokers.values():
        if now - note.get("last_seen", 0) >= ALIVE_MS:
            continue
        for app, (n_in, n_out) in note.get("minute", {}).items():
            was_in, was_out = totals.get(app, (0, 0))
            totals[app] = (was_in + n_in, was_out + n_out)
    return totals


async def overview(
    store: OwnedStore, only: Collection[str] | None, now: int
) -> list[dict[str, Any]]:
    """Every app (with `only`, just those) as GET /v1/apps lists it."""
    apps = [app for app in await store.apps() if only is None or app in only]
    counts = await store.counts(apps, now)
    oldest = await store.oldest_pending(apps, now)
    recipients = await store.recipients(apps)
    groups = await Groups(store).describe_apps(apps)
    tallies = await store.tallies(apps)
    minute = minute_totals(await store.brokers(), now)
    out = []
    for app in apps:
        c, first = counts[app], oldest.get(app)
        alive = sum(1 for r in recipients[app] if r["alive"])
        n_in, n_out = minute.get(app, (0, 0))
        out.append(
            {
                "app": app,
                "pending": c.pending,
                "delayed": c.delayed,
                "in_flight": c.in_flight,
                "dead": c.dead,
                "oldest_pending_age_s": None if first is None else max(0, now - first) / 1000,
                "recipients": {"alive": alive, "lost": len(recipients[app]) - alive},
                "groups": len(groups.get(app, [])),
                "rate_in": n_in / MINUTE_S,
                "rate_out": n_out / MINUTE_S,
                "unroutable": tallies[app].unroutable,
            }
        )
    return out


def preview(content: bytes) -> str:
    """The first PREVIEW_BYTES of a content as one line of text, safe to show: UTF-8 kept,
    other bytes as \\xNN, controls and the backslash escaped."""
    shown = []
    for c in content[:PREVIEW_BYTES].decode("utf-8", "surrogateescape"):
        if "\udc80" <= c <= "\udcff":  # a byte that is no UTF-8
            shown.append(f"\\x{ord(c) - 0xDC00:02x}")
        elif c.isprintable() and c != "\\":
            shown.append(c)
        else:
            shown.append(c.encode("unicode_escape").decode("ascii"))
    return "".join(shown)


def waiting_json(w: Waiting, now: int) -> dict[str, Any]:
    return _message(w.msgid, now - w.stored_ms, w.attempts, w.key, w.size, w.preview)


def dead_json(d: DeadLetter, now: int) -> dict[str, Any]:
    return _message(d.msgid, now - d.stored_at, d.attempts, None, len(d.content), d.content)


def _message(
    msgid: str, age_ms: int, attempts: int, key: str | None, size: int, content: bytes
) -> dict[str, Any]:
    return {"msgid": msgid, "age_s": max(0, age_ms) / 1000, "attempts": attempts, "key": key,
            "size": size, "preview": preview(content)}  # fmt: skip


async def purge(
    store: OwnedStore,
    dlog: DeliveryLog,
    app: str,
    older_than_s: float | None,
    limit: int | None,
    dry_run: bool,
    who: str,
    now: int,
) -> list[Purged]:
    """Purge the messages of `app` waiting since `now` (stored `older_than_s` before it, or
    more), at most `limit`, oldest first, PURGE_CHUNK a script; each logged `purged`
    naming `who` (the token or the user). A dry run changes and logs nothing. An age or
    a limit past any store's (1e308 s, 2**64) means none stored so long ago, or all."""
    # (nothing stored after the purge began: it ends; older than 1970: nothing)
    older = 0 if older_than_s is None else int(min(older_than_s * 1000, now + 1))
    if limit is not None and limit >= sys.maxsize:
        limit = None
    if dry_run:
        return await store.purge_waiting(app, older, limit, True, now)
    detail = f"{PENDING_PURGED} by an operator ({who})"
    done: list[Purged] = []
    while limit is None or len(done) < limit:
        want = PURGE_CHUNK if limit is None else min(PURGE_CHUNK, limit - len(done))
        chunk = await store.purge_waiting(app, older, want, False, now)
        for p in chunk:
            dlog.event(Event.PURGED, p.msgid, app, p.kind, p.recipient, detail=detail)
        done += chunk
        if len(chunk) < want:
            break
    return done
