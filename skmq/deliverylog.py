"""The delivery log of SPEC section 7: one JSON line an event, rotated by size.

Files are `LOG_DIR/delivery-<broker>-<n>.jsonl`, one set a broker instance, so that
several brokers can log into one shared directory. Events are buffered and written
with one `os.write` a batch (at the end of each event-loop turn that produced any):
no fsync, but nothing waits in user space, so a `kill -9` of the broker loses no
event already handed to the kernel. Lines are formatted by hand: the log is on the
hot path, and `json.dumps` of a dict costs several times more.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Callable
from pathlib import Path


def _q(value: str | None) -> str:
    """A JSON string literal (or null); the common plain-ASCII case costs three C calls."""
    if value is None:
        return "null"
    if value.isascii() and value.isprintable() and '"' not in value and "\\" not in value:
        return f'"{value}"'
    return json.dumps(value.encode("utf-8", "surrogateescape").decode("utf-8", "replace"))


def now_ms() -> int:
    return time.time_ns() // 1_000_000


class DeliveryLog:
    def __init__(self, log_dir: Path, broker_id: str, rotate_bytes: int = 64 << 20) -> None:
        self.dir = log_dir
        self.broker = _q(broker_id)
        self.rotate_bytes = rotate_bytes
        self.dir.mkdir(parents=True, exist_ok=True)
        existing = sorted(self.dir.glob(f"delivery-{broker_id}-*.jsonl"))
        self._index = len(existing)
        self._prefix = f"delivery-{broker_id}-"
        self._fd = -1
        self._size = 0
        self._lines: list[str] = []
        self._scheduled = False
        self.listener: Callable[[str, str], None] | None = None
        self._open_next()

    def _open_next(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
        path = self.dir / f"{self._prefix}{self._index:06d}.jsonl"
        self._index += 1
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._size = os.fstat(self._fd).st_size

    def event(
        self,
        event: str,
        msgid: str,
        appid: str,
        kind: str | None,
        recipient: str | None = None,
        attempt: int | None = None,
        detail: str | None = None,
        ts: int | None = None,
    ) -> None:
        self._lines.append(
            f'{{"ts":{ts if ts is not None else now_ms()},"event":"{event}","msgid":{_q(msgid)},'
            f'"appid":{_q(appid)},"kind":{_q(kind)},"recipient":{_q(recipient)},'
            f'"attempt":{"null" if attempt is None else attempt},"broker":{self.broker},'
            f'"detail":{_q(detail)}}}\n'
        )
        if self.listener is not None:
            self.listener(event, appid)
        if not self._scheduled:
            self._scheduled = True
            try:
                asyncio.get_running_loop().call_soon(self.flush)
            except RuntimeError:
                self.flush()

    def flush(self) -> None:
        self._scheduled = False
        if not self._lines or self._fd < 0:
            return
        data = "".join(self._lines).encode("utf-8", "replace")
        self._lines.clear()
        view = memoryview(data)
        while view:
            written = os.write(self._fd, view)
            view = view[written:]
        self._size += len(data)
        if self._size >= self.rotate_bytes:
            self._open_next()

    def close(self) -> None:
        self.flush()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
