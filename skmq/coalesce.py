"""One write an event-loop turn: the small pieces written during a turn (frames to a peer,
lines of the delivery log) reach their sink together, for one syscall instead of many.
Standard library only: the client uses it too."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Coalescer(Generic[T]):
    __slots__ = ("_items", "_scheduled", "_sink")

    def __init__(self, sink: Callable[[list[T]], None]) -> None:
        self._sink = sink
        self._items: list[T] = []
        self._scheduled = False

    def add(self, item: T) -> None:
        self._items.append(item)
        if not self._scheduled:
            self._scheduled = True
            try:
                asyncio.get_running_loop().call_soon(self.flush)
            except RuntimeError:  # no loop running (a command's last words): now
                self.flush()

    def flush(self) -> None:
        """Hand everything added so far to the sink now."""
        self._scheduled = False
        if self._items:
            items, self._items = self._items, []
            self._sink(items)

    def clear(self) -> None:
        """Drop what was not written yet (the connection it was for is gone)."""
        self._items.clear()


def transport_sink(transport: asyncio.WriteTransport) -> Callable[[list[bytes]], None]:
    """A sink writing joined bytes to a transport while it is open."""

    def write(chunks: list[bytes]) -> None:
        if not transport.is_closing():
            transport.write(chunks[0] if len(chunks) == 1 else b"".join(chunks))

    return write
