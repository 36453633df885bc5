"""A fixed share of a growing collection, in turn: how the engine's periodic rounds
(recipient refresh, lease reaping) visit every app without a round's work growing with
the number of apps."""

from __future__ import annotations

from collections.abc import Sequence

# Apps a refresh or reap round visits in turn (besides those it must see now: new apps,
# apps claimed for lately), so that a round's work does not grow with the number of apps.
APPS_A_ROUND = 500


class Rotation:
    """Each `take()` returns the next `size` items of the sequence it is given (all of
    them when there are no more than `size`), wrapping around at the end."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._next = 0

    def take(self, items: Sequence[str]) -> list[str]:
        if len(items) <= self.size:
            return list(items)
        start = self._next % len(items)
        self._next = start + self.size
        out = list(items[start : start + self.size])
        return out + list(items[: self.size - len(out)])
