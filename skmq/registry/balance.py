"""Point-to-point load balance: smooth weighted round robin over weight + 1.

Picks follow one strict sequence in which each recipient's share is (w+1)/sum(w+1),
whatever the order of registration. When the next recipient in the sequence has no
free window slot the batch stops there (its turn is kept for the next call) rather
than handing its turn to another: that is what keeps the shares exact. Recipients
that are stalled are left out by the caller, so they cannot hold up their app.
Picks are proposals: after a claim the caller commits only as many as were used.
"""

from __future__ import annotations

from collections.abc import Mapping


class Balancer:
    def __init__(self) -> None:
        self._current: dict[str, int] = {}
        self._owed: str | None = None
        self._saved: tuple[dict[str, int], str | None] = ({}, None)
        self._last: tuple[Mapping[str, int], Mapping[str, int]] = ({}, {})
        self._picked = 0  # how many the last `pick` returned

    def _next(self, weights: Mapping[str, int]) -> str:
        current = self._current
        total = 0
        best = ""
        best_value = 0
        for rid, weight in weights.items():
            value = current.get(rid, 0) + weight + 1
            current[rid] = value
            total += weight + 1
            if not best or value > best_value:
                best, best_value = rid, value
        current[best] -= total
        return best

    def pick(self, weights: Mapping[str, int], free: Mapping[str, int], n: int) -> list[str]:
        """Up to n recipients in weighted turn; stops at the first one with no free slot."""
        self._saved = (dict(self._current), self._owed)
        self._last = (weights, free)
        for rid in [r for r in self._current if r not in weights]:
            del self._current[rid]
        if self._owed is not None and self._owed not in weights:
            self._owed = None
        slots = dict(free)
        out: list[str] = []
        while len(out) < n and weights:
            rid = self._owed if self._owed is not None else self._next(weights)
            if slots.get(rid, 0) <= 0:
                self._owed = rid
                break
            self._owed = None
            slots[rid] -= 1
            out.append(rid)
        self._picked = len(out)
        return out

    def commit(self, used: int) -> None:
        """Keep only the first `used` picks of the last `pick` (the others go unused).
        All of them used (the common case): the state `pick` left is already that."""
        if used == self._picked:
            return
        self._current, self._owed = self._saved
        weights, free = self._last
        if used:
            self.pick(weights, free, used)
