"""Point-to-point load balance: smooth weighted round robin over weight + 1.

Over any run of picks each recipient's share is (w+1)/sum(w+1), whatever the order of
registration, and picks interleave instead of coming in bursts.
"""

from __future__ import annotations

from collections.abc import Mapping


class Balancer:
    def __init__(self) -> None:
        self._current: dict[str, int] = {}

    def pick(self, weights: Mapping[str, int], free: Mapping[str, int], n: int) -> list[str]:
        """n recipients in turn, among those with free slots; fewer when slots run out."""
        slots = {rid: s for rid, s in free.items() if s > 0 and rid in weights}
        current = self._current
        for rid in list(current):
            if rid not in weights:
                del current[rid]
        out: list[str] = []
        while len(out) < n and slots:
            total = 0
            best = ""
            best_value = 0
            for rid in slots:
                value = current.get(rid, 0) + weights[rid] + 1
                current[rid] = value
                total += weights[rid] + 1
                if not best or value > best_value:
                    best, best_value = rid, value
            current[best] -= total
            out.append(best)
            slots[best] -= 1
            if slots[best] == 0:
                del slots[best]
        return out
