"""Answers that did not come with their push: on the broker's port (SPEC 3: after
`arrived` a recipient may answer on a connection of its own, perhaps to another broker),
or on a push connection that did not carry that push. They are fenced (docs/SECURITY.md):
an answer changes a delivery only while it is in flight, and only from the recipient it
was pushed to, or with its delivery token. An answer that fits no delivery in flight, or
several (but for the one rule of docs/PROTOCOL.md 7: the copy whose recipient sent
`arrived`), is refused. Whatever it settles goes the one way every answer goes, through
the answer batcher."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from skmq.codec import Frame, Status
from skmq.events import Event
from skmq.peer import Peer
from skmq.queue.owned_store import OwnedStore
from skmq.registry.own_addresses import same_host
from skmq.registry.recipients import Registry
from skmq.workers.answers import AnswerBatcher
from skmq.workers.app_search import AppSearch
from skmq.workers.link import DETAILS, OUTCOMES, Verdict
from skmq.workers.pusher import Pusher

InFlight = tuple[str, str, int]  # delivery id, recipient, attempt
# The owner's verdict on an answer for an app this broker does not own,
# with the recipients the sender was found to be (None: any: its token or its
# authentication decides) (skmq/queue/forward.py)
Forward = Callable[[str, Frame, "Sequence[str] | None"], Awaitable[Verdict]]


@dataclass(frozen=True, slots=True)
class Vouched:
    """A forwarded answer: the broker it reached found its sender to be one of these
    recipients (None: any; its token decides)."""

    recipients: tuple[str, ...] | None


@dataclass(eq=False)
class AnswerRouter:
    store: OwnedStore
    registry: Registry
    pusher: Pusher
    answers: AnswerBatcher
    # The apps holding a msgid, for an answer naming no app for a push this broker did
    # not make (a look in every app).
    search: AppSearch
    forward: Forward | None = None
    owns: Callable[[str], bool] = lambda app: True

    async def apps_of(
        self, frame: Frame, peer: Peer | None = None, sender: tuple[str, str] | None = None
    ) -> list[str] | str:
        """The apps the answer may be for (the one it names, or those holding its msgid),
        or why none: a search of every app waits for its turn (skmq/workers/app_search.py),
        taking none of MAX_PEER_STORE_CALLS from the answers that need no search."""
        msgid = frame.fields.get("msgid")
        app = sender[0] if sender else frame.fields.get("appid")
        if app or not msgid:  # (no msgid: answer() says so)
            return [app] if app else []
        apps = self.pusher.apps_of(msgid) or await self.search.apps_of(
            msgid, peer.host if peer is not None else ""
        )
        if apps is None:
            return (
                f"over MAX_SEARCHES_PER_HOST ({self.search.per_host}) answers naming no app "
                "wait for a search from your address: name the app (appid=)"
            )
        return apps

    async def answer(
        self,
        frame: Frame,
        peer: Peer | None = None,
        sender: tuple[str, str] | None = None,
        apps: list[str] | str | None = None,
        vouched: Vouched | None = None,
    ) -> Verdict:
        """`sender`: the (app, recipient) whose push connection it came on; else `peer`
        must be that recipient (its registered host, or a connection authenticated for
        the app), or the frame must echo the push's delivery token, or another broker
        vouched for it (`vouched`, a forwarded answer). `apps`: apps_of's answer, when
        the caller asked already."""
        msgid = frame.fields.get("msgid")
        if not msgid:
            return (Status.ERROR, "msgid required")
        if apps is None:
            apps = await self.apps_of(frame, peer, sender)
        if isinstance(apps, str):
            return (Status.REJECT, apps)
        remote: list[str] = []  # apps owned by other brokers the answer may be for
        if self.forward is not None and sender is None and vouched is None:
            if len(apps) == 1 and not self.owns(apps[0]):
                return await self._forward(frame, apps[0], peer)
            # (a search's apps: those of other owners whose recipient the sender may be)
            remote = [a for a in apps if not self.owns(a) and self._vouch(frame, a, peer) != []]
            apps = [a for a in apps if self.owns(a)]
        matches: list[tuple[str, InFlight]] = []
        why = f"message {msgid!r} is not in flight"
        for candidate in apps:
            found = await self._delivery(frame, msgid, candidate, peer, sender, vouched)
            if isinstance(found, str):
                why = found if len(apps) == 1 else why
            else:
                matches.append((candidate, found))
        if remote and not matches and len(remote) == 1:
            return await self._forward(frame, remote[0], peer)
        if not matches and not remote:
            return (Status.REJECT, why)
        if len(matches) + len(remote) > 1:
            names = ", ".join(repr(a) for a in [*(a for a, _ in matches), *remote])
            return (Status.REJECT, f"ambiguous: {msgid!r} is in flight to you in apps {names}; "
                    "name one (appid=)")  # fmt: skip
        app, (delivery_id, rid, attempt) = matches[0]
        pushed = self.pusher.pushed(app, rid, msgid)
        if frame.type == "extend" or (
            frame.type == "arrived" and (pushed is None or pushed.arrived_at)
        ):  # still working (an `arrived` for a push this broker does not hold may be the
            # first: it extends the lease all the same)
            resp = await self.answers.extend(app, delivery_id, rid, attempt)
            if resp[0] == "ack" and pushed is not None:
                pushed.pushed_at = time.monotonic()
            return resp
        if frame.type == "arrived":
            if pushed is not None:
                pushed.arrived_at = time.monotonic()
                self.pusher.dlog.event(Event.ARRIVED, msgid, app, pushed.kind, rid, attempt)
            return (Status.ACK, "arrived")
        if pushed is not None:
            self.pusher.settled(app, rid, msgid)
        outcome = OUTCOMES[frame.type]
        detail = (frame.content or b"").decode("utf-8", "replace") or DETAILS[frame.type]
        verdict: asyncio.Future[Verdict] = asyncio.get_running_loop().create_future()
        self.answers.submit(app, delivery_id, outcome, detail, rid, attempt, verdict.set_result)
        return await verdict

    def _vouch(self, frame: Frame, app: str, peer: Peer | None) -> list[str] | None:
        """Which of the app's recipients the sender may be (None: any: its token or its
        authentication for the app decides)."""
        if frame.fields.get("token") is not None or (
            peer is not None and peer.authenticated_for(app)
        ):
            return None
        return [r.id for r in self.registry.all(app) if self._sent_by(peer, app, r.id)]

    async def _forward(self, frame: Frame, app: str, peer: Peer | None) -> Verdict:
        """To the app's owner, with who the sender may be."""
        assert self.forward is not None
        may_be = self._vouch(frame, app, peer)
        if may_be == []:
            msgid = frame.fields.get("msgid")
            return (Status.REJECT, f"message {msgid!r} is not in flight to a recipient you are")
        named = Frame(frame.type, {**frame.fields, "appid": app}, frame.content)
        return await self.forward(app, named, may_be)

    async def _delivery(
        self,
        frame: Frame,
        msgid: str,
        app: str,
        peer: Peer | None,
        sender: tuple[str, str] | None,
        vouched: Vouched | None = None,
    ) -> InFlight | str:
        """The one delivery in flight the answer is for, or why there is none."""
        named = sender[1] if sender else frame.fields.get("recipient") or None
        found = await self.store.in_flight_of(app, msgid)
        if not found:
            return f"message {msgid!r} is not in flight"
        if named is not None:
            found = [f for f in found if f[1] == named]
            if not found:
                return f"message {msgid!r} is not in flight to recipient {named!r}"
        token = frame.fields.get("token")
        if token is not None:
            tokens = self.pusher.tokens
            found = [f for f in found if tokens.attempt_of(token, app, f[0], f[1]) == f[2]]
            if not found:
                return "delivery token does not match a delivery in flight"
        elif vouched is not None:
            if vouched.recipients is not None:
                found = [f for f in found if f[1] in vouched.recipients]
            if not found:
                return f"message {msgid!r} is not in flight to a recipient you are"
        elif sender is None:
            found = [f for f in found if self._sent_by(peer, app, f[1])]
            if not found:
                return f"message {msgid!r} is not in flight to a recipient you are"
        if len(found) > 1:
            found = [f for f in found if self._arrived(app, f[1], msgid)] or found
        if len(found) > 1:
            return (
                f"ambiguous: {len(found)} copies of {msgid!r} are in flight to recipients at "
                "your address; name one (recipient=) or echo the push's token"
            )
        return found[0]

    def _sent_by(self, peer: Peer | None, app: str, rid: str) -> bool:
        """True when peer is the recipient rid of app: authenticated for the app, or
        connecting from the host it registered."""
        if peer is None:
            return False
        if peer.authenticated_for(app):
            return True
        r = self.registry.get(app, rid)
        return r is not None and same_host(r.host, peer.host)

    def _arrived(self, app: str, rid: str, msgid: str) -> bool:
        d = self.pusher.pushed(app, rid, msgid)
        return d is not None and d.arrived_at > 0
