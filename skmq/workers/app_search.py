"""Which apps hold a msgid, for an answer that names no app (the original's late `ack`)
for a push this broker did not make.

Such a search looks in every app. One runs at a time and takes every msgid waiting for
it (one script call an app a round, however many answers wait), so a flood of answers
for unknown msgids costs a round at a time and an answer waits for at most the round
running and its own. A source host may have MAX_SEARCHES_PER_HOST answers waiting for a
search; more are refused at once (they may name their app, `appid=`, and need none).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence

Find = Callable[[Sequence[str]], Awaitable[dict[str, list[str]]]]


class AppSearch:
    def __init__(self, find: Find, per_host: int) -> None:
        self._find = find
        self.per_host = per_host
        self._waiting: dict[str, list[asyncio.Future[list[str]]]] = {}
        self._hosts: Counter[str] = Counter()
        self._task: asyncio.Task[None] | None = None

    async def apps_of(self, msgid: str, host: str) -> list[str] | None:
        """The apps holding msgid; None when `host` has MAX_SEARCHES_PER_HOST waiting."""
        if self._hosts[host] >= self.per_host:
            return None
        future: asyncio.Future[list[str]] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(msgid, []).append(future)
        self._hosts[host] += 1
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())
        try:
            return await future
        finally:
            self._hosts[host] -= 1
            if not self._hosts[host]:
                del self._hosts[host]

    async def _run(self) -> None:
        round_: dict[str, list[asyncio.Future[list[str]]]] = {}
        try:
            while self._waiting:
                round_, self._waiting = self._waiting, {}
                try:
                    found = await self._find(list(round_))
                except Exception as exc:  # each waiting answer hears it (a store error)
                    for f in _waiting(round_):
                        f.set_exception(exc)
                    continue
                for msgid, futures in round_.items():
                    for f in futures:
                        if not f.done():
                            f.set_result(found.get(msgid, []))
        finally:
            self._task = None
            for f in _waiting(round_):  # cancelled mid-round: nobody waits forever
                f.cancel()


def _waiting(
    round_: dict[str, list[asyncio.Future[list[str]]]],
) -> list[asyncio.Future[list[str]]]:
    return [f for futures in round_.values() for f in futures if not f.done()]
