"""This broker's view of the recipients kept in Redis, refreshed from it regularly so that
several brokers on one Redis agree; state changes are logged once, by the broker that
made them."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import structlog

from skmq.clock import now_ms
from skmq.deliverylog import DeliveryLog
from skmq.events import Event
from skmq.registry.registration import KNOWN_CAPS, Registration, RegistrationRefused
from skmq.store import Store

log = structlog.get_logger("skmq.registry")


@dataclass(slots=True)
class Recipient:
    app: str
    id: str
    host: str
    port: int
    weight: int
    alive: bool
    last_heartbeat: int
    caps: frozenset[str] = frozenset()


def _caps(value: Any) -> frozenset[str]:
    """The capabilities a stored record declares (none, as an original peer, if odd)."""
    if not isinstance(value, list):
        return frozenset()
    return KNOWN_CAPS.intersection(c for c in value if isinstance(c, str))


class Registry:
    def __init__(
        self,
        store: Store,
        dlog: DeliveryLog,
        on_change: Callable[[str], None],
        max_recipients: int,
    ) -> None:
        self.store = store
        self.max_recipients = max_recipients  # an app's, MAX_RECIPIENTS_PER_APP
        self.dlog = dlog
        self.on_change = on_change
        self._apps: dict[str, dict[str, Recipient]] = {}
        # Bumped by every local change, as it starts and once it is in Redis: a refresh
        # whose read raced one (even one whose write was already on the way when the read
        # began) keeps the newer view.
        self._changes: dict[str, int] = {}
        self._reported: set[tuple[str, str]] = set()

    def alive(self, app: str) -> list[Recipient]:
        return [r for r in self._apps.get(app, {}).values() if r.alive]

    def all(self, app: str) -> list[Recipient]:
        return list(self._apps.get(app, {}).values())

    def get(self, app: str, rid: str) -> Recipient | None:
        return self._apps.get(app, {}).get(rid)

    def apps(self) -> list[str]:
        return list(self._apps)

    async def refresh(self, apps: list[str]) -> None:
        before = {app: self._changes.get(app, 0) for app in apps}
        found = await self.store.recipients(apps)
        for app, recs in found.items():
            if self._changes.get(app, 0) != before[app]:
                continue
            old = self._apps.get(app, {})
            new = {}
            for r in recs:
                rec = self._parse(app, r)
                if rec is not None:
                    new[rec.id] = rec
            self._apps[app] = new
            # (one gone too: its topic copies no longer wait for it, its dispatcher fails
            # them now rather than at its next idle poll)
            if old.keys() - new.keys() or any(
                rid not in old
                or old[rid].alive != r.alive
                or old[rid].port != r.port
                or old[rid].host != r.host
                or old[rid].weight != r.weight
                or old[rid].caps != r.caps
                for rid, r in new.items()
            ):
                self.on_change(app)

    def _parse(self, app: str, record: dict[str, Any]) -> Recipient | None:
        """A record as this release writes it, else None (reported once: one record of
        another shape, by hand or an older release, must not take delivery down)."""
        try:
            return Recipient(
                app,
                str(record["id"]),
                str(record["host"]),
                int(record["port"]),
                int(record.get("weight", 0)),
                bool(record["alive"]),
                int(record["last_heartbeat"]),
                _caps(record.get("caps")),
            )
        except (KeyError, TypeError, ValueError) as exc:
            key = (app, repr(sorted(record.items())))
            if key not in self._reported:
                self._reported.add(key)
                log.error(
                    "recipient record skipped: not in the expected shape",
                    app=app,
                    record=record,
                    problem=f"no field {exc}" if isinstance(exc, KeyError) else str(exc),
                )
            return None

    def _changed(self, app: str) -> None:
        self._changes[app] = self._changes.get(app, 0) + 1

    async def register(self, reg: Registration) -> str:
        """Returns the address (host:port) the id was alive at when this registration, at
        another address, took it over (logged as a takeover), else ""."""
        now = now_ms()
        self._changed(reg.app)
        answer = await self.store.register(reg.app, reg.id, reg.as_json(), now, self.max_recipients)
        if not answer:
            raise RegistrationRefused(
                f"app {reg.app!r} has {self.max_recipients} recipients already "
                "(MAX_RECIPIENTS_PER_APP)"
            )
        self._changed(reg.app)
        self._apps.setdefault(reg.app, {})[reg.id] = Recipient(
            reg.app, reg.id, reg.host, reg.port, reg.weight, True, now, reg.caps
        )
        self.dlog.event(
            Event.RECIPIENT_REGISTERED,
            "",
            reg.app,
            None,
            reg.id,
            detail=f"{reg.host}:{reg.port} weight={reg.weight}",
        )
        taken = answer if isinstance(answer, str) else ""
        if taken:
            detail = f"from {taken} to {reg.host}:{reg.port}"
            self.dlog.event(Event.RECIPIENT_TAKEN_OVER, "", reg.app, None, reg.id, detail=detail)
            log.warning("recipient id taken over: a second consumer registered it alive "
                        "elsewhere", app=reg.app, recipient=reg.id, was=taken,
                        now=f"{reg.host}:{reg.port}")  # fmt: skip
        self.on_change(reg.app)
        return taken

    async def unregister(self, app: str, rid: str) -> bool:
        self._changed(app)
        removed = await self.store.unregister(app, rid)
        self._changed(app)
        self._apps.get(app, {}).pop(rid, None)
        self.on_change(app)
        return removed

    def forget(self, app: str) -> None:
        """The app was forgotten (no recipient, no message): hold nothing more for it."""
        self._apps.pop(app, None)
        self._changes.pop(app, None)

    async def mark(self, app: str, rid: str, alive: bool, detail: str = "") -> None:
        """Record a heartbeat or connection outcome; log only real state changes. (One that
        leaves this view as it is, as every heartbeat does, does not count as a local
        change: a refresh racing it reads the same, and is not held back by it, so that
        a recipient removed meanwhile, probed as lost each heartbeat, is seen gone.)"""
        rec = self._apps.get(app, {}).get(rid)
        changing = rec is None or rec.alive != alive
        if changing:
            self._changed(app)
        previous = await self.store.set_state(app, rid, alive, now_ms())
        if changing:
            self._changed(app)
        rec = self._apps.get(app, {}).get(rid)
        if rec is not None:
            rec.alive = alive
        if previous == -1 or bool(previous) == alive:
            return
        event = Event.RECIPIENT_ALIVE if alive else Event.RECIPIENT_LOST
        self.dlog.event(event, "", app, None, rid, detail=detail or None)
        log.info(event, app=app, recipient=rid, detail=detail)
        self.on_change(app)


async def remove_recipient(
    unregister: Callable[[str, str], Awaitable[bool]],
    dlog: DeliveryLog,
    app: str,
    rid: str,
    by: str,
) -> bool:
    """An operator's removal of a recipient gone for good: an `unregister` (`unregister`:
    Registry.unregister on a broker, Store.unregister elsewhere), so its topic copies
    fail as undeliverable (dead-lettered after RETRY_TIMES) and nothing waits for it, and
    its pushes in flight end as an unregistered recipient's do. Logged (`recipient_removed`,
    naming `by`: the token's name or the user) when it was registered."""
    removed = await unregister(app, rid)
    if removed:
        dlog.event(Event.RECIPIENT_REMOVED, "", app, None, rid, detail=f"by {by}")
    log.info("operator action", action="recipients remove", app=app, recipient=rid,
             principal=by, removed=removed)  # fmt: skip
    return removed


def recipient_rows(found: dict[str, list[dict[str, Any]]], now: int) -> list[dict[str, Any]]:
    """Store.recipients' records as the console lists them: {app, id, address, weight,
    state (alive or lost), last_seen_age_s (None: never heard of)}. A record of another
    shape (by hand, an older release) shows as what it has."""
    rows = []
    for app, records in sorted(found.items()):
        for r in records:
            beat = r["last_heartbeat"]
            rows.append(
                {
                    "app": app,
                    "id": str(r.get("id", "")),
                    "address": f"{r.get('host', '')}:{r.get('port', '')}",
                    "weight": r.get("weight", 0),
                    "state": "alive" if r["alive"] else "lost",
                    "last_seen_age_s": round(max(0, now - beat) / 1000, 1) if beat else None,
                }
            )
    return rows
