"""The delivery log of SPEC section 7: one JSON line an event, rotated by size.

Files are `LOG_DIR/delivery-<broker>-<n>.jsonl`, one set a broker instance, so that
several brokers can log into one shared directory (a broker restarted with the same
BROKER_ID appends to its last file). The file being written is held with an exclusive
`flock`; one that nobody holds is closed, and skmq/logarchive.py compresses it.

Events are buffered and written with one `os.write` a batch (at the end of each
event-loop turn that produced any): no fsync, but nothing waits in user space, so a
`kill -9` of the broker loses no event already handed to the kernel. Lines are
formatted by hand: the log is on the hot path, and `json.dumps` of a dict costs
several times more.

A write error (a full disk) never blocks or fails delivery: unwritten lines are kept
in a bounded backlog (LOG_BACKLOG_BYTES) and retried; once the backlog is full the
oldest lines are dropped and counted (`skmq_delivery_log_dropped_lines_total`). A write
that failed (one batch of lines) is counted once in `errors`, however often it is retried.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections import deque
from collections.abc import Callable
from pathlib import Path

import structlog

from skmq.clock import now_ms
from skmq.coalesce import Coalescer
from skmq.events import DROPPED, EXPIRED_REASON, Event
from skmq.logarchive import try_lock

log = structlog.get_logger("skmq.deliverylog")

# While writes fail, how often the backlog is tried again (besides every new flush).
RETRY_INTERVAL = 1.0


def _q(value: str | None) -> str:
    """A JSON string literal (or null); the common plain-ASCII case costs three C calls."""
    if value is None:
        return "null"
    if value.isascii() and value.isprintable() and '"' not in value and "\\" not in value:
        return f'"{value}"'
    return json.dumps(value.encode("utf-8", "surrogateescape").decode("utf-8", "replace"))


# An event's field and the start of the next, formatted once (not by Enum.__format__).
_EVENTS = {e: f',"event":"{e.value}","msgid":' for e in Event}
# The (app, kind, recipient) parts of lines a log remembers.
MAX_NAMES = 4096


class DeliveryLog:
    def __init__(
        self,
        log_dir: Path,
        broker_id: str,
        rotate_bytes: int = 16 << 20,
        backlog_bytes: int = 64 << 20,
    ) -> None:
        self.dir = log_dir
        self._tail = f',"broker":{_q(broker_id)},"detail":'  # (a line's last fields)
        self.rotate_bytes = rotate_bytes
        self.dir.mkdir(parents=True, exist_ok=True)
        self._prefix = f"delivery-{broker_id}-"
        self._fd = -1
        self._size = 0
        self._lines: Coalescer[str] = Coalescer(self._take)
        # Lines not yet written (a write failed): bounded, oldest dropped first.
        self._backlog: deque[tuple[bytes, int]] = deque()
        self._backlog_size = 0
        self.backlog_bytes = backlog_bytes
        self._retry: asyncio.TimerHandle | None = None
        self.error: str | None = None
        # Writes (batches of lines) that failed, each once however often it is retried
        # (skmq_delivery_log_errors_total); the first `_counted` of the backlog are in it.
        self.errors = 0
        self._counted = 0
        self.dropped = 0
        self.listener: Callable[[str, str], None] | None = None
        self._middles: dict[tuple[str, str | None, str | None], str] = {}
        # Called when a file is closed for good (skmq/logarchive.py compresses it).
        self.on_rotate: Callable[[], None] | None = None
        # A broker with a fixed BROKER_ID goes on with its last file (rotating as usual).
        self._index = self._last_index()
        self._open(self._index)
        if self._size >= self.rotate_bytes:
            self._rotate()

    def _last_index(self) -> int:
        """This broker's last file if it is not compressed yet, else the one after it."""
        compressed: dict[int, bool] = {}
        for path in self.dir.glob(f"{self._prefix}*.jsonl*"):
            number, _, suffix = path.name.removeprefix(self._prefix).partition(".")
            if number.isascii() and number.isdigit() and suffix in ("jsonl", "jsonl.gz"):
                index = int(number)
                compressed[index] = compressed.get(index, False) or suffix == "jsonl.gz"
        if not compressed:
            return 0
        last = max(compressed)
        return last + 1 if compressed[last] else last

    def _open(self, index: int) -> None:
        """Write to file `index`, or the next one that no sweep holds or has compressed
        (a restart with the same BROKER_ID); the current file stays open until the new
        one is). The directory is made again if an operator removed it."""
        self.dir.mkdir(parents=True, exist_ok=True)
        while True:
            path = self.dir / f"{self._prefix}{index:06d}.jsonl"
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            compressed = path.with_name(path.name + ".gz").exists()
            if try_lock(fd) and os.fstat(fd).st_nlink > 0 and not compressed:
                break
            os.close(fd)
            index += 1
        self._index = index
        if self._fd >= 0:
            os.close(self._fd)
        self._fd = fd
        self._size = os.fstat(fd).st_size

    def _rotate(self) -> None:
        self._open(self._index + 1)
        if self.on_rotate is not None:
            self.on_rotate()

    def event(
        self,
        event: Event,
        msgid: str,
        appid: str,
        kind: str | None,
        recipient: str | None = None,
        attempt: int | None = None,
        detail: str | None = None,
        ts: int | None = None,
    ) -> None:
        middle = self._middles.get((appid, kind, recipient)) or self._middle(appid, kind, recipient)
        self._lines.add(
            f'{{"ts":{ts if ts is not None else now_ms()}{_EVENTS[event]}{_q(msgid)}{middle}'
            f"{'null' if attempt is None else attempt}{self._tail}"
            f"{_q(detail)}}}\n"
        )
        if self.listener is not None:
            self.listener(event, appid)

    def expired(
        self, msgid: str, appid: str, kind: str, recipient: str | None, attempt: int, dead: bool
    ) -> str:
        """Log a message whose TTL ran out: dead-lettered (reason `expired`) or dropped;
        its fate, in words. `attempt`: those made (0, never pushed: logged as none)."""
        fate = "dead-lettered" if dead else f"{DROPPED} (EXPIRED=drop)"
        made = attempt or None
        self.event(Event.EXPIRED, msgid, appid, kind, recipient, made, fate)
        if dead:
            self.event(Event.DEAD_LETTERED, msgid, appid, kind, recipient, made, EXPIRED_REASON)
        return fate

    def _middle(self, appid: str, kind: str | None, recipient: str | None) -> str:
        """A line's fields from appid to the name of attempt, remembered: the same app,
        kind and recipient recur in most lines."""
        if len(self._middles) >= MAX_NAMES:
            self._middles.clear()
        middle = self._middles[appid, kind, recipient] = (
            f',"appid":{_q(appid)},"kind":{_q(kind)},"recipient":{_q(recipient)},"attempt":'
        )
        return middle

    def flush(self) -> None:
        """Hand the buffered lines to the kernel. A write error (ENOSPC, EIO) never reaches
        the caller: the lines wait in a bounded backlog, retried every RETRY_INTERVAL and
        with every later flush; past `backlog_bytes` the oldest are dropped and counted."""
        self._lines.flush()
        self._write_backlog()

    def _take(self, lines: list[str]) -> None:
        data = "".join(lines).encode("utf-8", "replace")
        self._backlog.append((data, len(lines)))
        self._backlog_size += len(data)
        self._write_backlog()

    def _write_backlog(self) -> None:
        while self._backlog and self._fd >= 0:
            data, count = self._backlog[0]
            try:
                written = os.write(self._fd, data)
            except OSError as exc:
                self._write_failed(exc)
                return
            self._size += written
            if written < len(data):
                self._backlog[0] = (data[written:], count)
                self._backlog_size -= written
                continue
            self._backlog.popleft()
            self._backlog_size -= len(data)
            self._counted = max(0, self._counted - 1)
        if self.error is not None and not self._backlog:  # not when no file is open
            log.warning("delivery log writable again", dir=str(self.dir), was=self.error)
            self.error = None
        if self._size >= self.rotate_bytes:
            try:
                self._rotate()
            except OSError as exc:
                self._write_failed(exc)

    def _write_failed(self, exc: OSError) -> None:
        # Only batches that no earlier failure counted: a retry is not another failed
        # write (it used to count each retry, thousands during one full disk).
        self.errors += len(self._backlog) - self._counted
        self._counted = len(self._backlog)
        if self.error is None:
            log.error("delivery log write failed, keeping lines to retry", dir=str(self.dir),
                      error=exc.strerror or str(exc))  # fmt: skip
        self.error = exc.strerror or str(exc)
        while self._backlog_size > self.backlog_bytes and len(self._backlog) > 1:
            data, count = self._backlog.popleft()
            self._backlog_size -= len(data)
            self._counted -= 1
            self.dropped += count
        if self._retry is None:
            with contextlib.suppress(RuntimeError):
                loop = asyncio.get_running_loop()
                self._retry = loop.call_later(RETRY_INTERVAL, self._retry_flush)

    def _retry_flush(self) -> None:
        """Retry the backlog on the file opened again (the old descriptor may be what
        fails: a file removed or replaced by an operator making room)."""
        self._retry = None
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)
        try:
            self._open(self._index)
        except OSError as exc:
            self._write_failed(exc)
            return
        self.flush()

    @property
    def backlog_lines(self) -> int:
        return sum(count for _, count in self._backlog)

    def close(self) -> None:
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        self.flush()
        if self._backlog:
            log.error("delivery log closed with unwritten lines", lines=self.backlog_lines)
        if self._fd >= 0:
            if self._size == 0:  # nothing logged (a CLI command that changed nothing)
                with contextlib.suppress(OSError):
                    os.unlink(self.dir / f"{self._prefix}{self._index:06d}.jsonl")
            os.close(self._fd)
            self._fd = -1
