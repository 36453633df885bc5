"""Server logging through structlog: console by default, JSON lines with LOG_FORMAT=json."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable

import structlog


def configure_logging(level: str = "info", fmt: str = "console") -> None:
    numeric = logging.getLevelNamesMapping().get(level.upper(), logging.INFO)
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer()
        if fmt == "json"
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )


class Throttled:
    """A warning that a fault repeats each batch (a Redis down: every loop turn's store
    fails) said at most once an `interval` seconds; the next one says how many were held
    back (`repeated`). A line per batch would bury the log: thousands a second."""

    def __init__(
        self,
        logger: structlog.typing.FilteringBoundLogger,
        interval: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self.interval = interval
        self.clock = clock
        self._said: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def warning(self, event: str, **fields: object) -> None:
        now = self.clock()
        if now - self._said.get(event, -self.interval) < self.interval:
            self._held[event] = self._held.get(event, 0) + 1
            return
        self._said[event] = now
        if held := self._held.pop(event, 0):
            fields["repeated"] = held
        self.logger.warning(event, **fields)
