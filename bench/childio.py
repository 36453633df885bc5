"""Control channel of a load process (child side).

A load process talks to the harness with one JSON object a line on stdout
(`{"event": "ready", ...}`, `{"event": "progress", ...}`, `{"event": "done"}`)
and reads one command a line on stdin (`go`, `stop`). End of stdin means the
harness is gone: the process exits at once. Every process also has a hard
deadline (unix seconds) after which it exits by itself, so nothing outlives a
benchmark run.

This module imports nothing from `skmq`: load processes stay cheap and
independent of the broker's code.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from typing import Any


def msgid(prefix: str, seq: int) -> str:
    """Message `seq` of the producer with `prefix` (hex digits): a msgid of hex digits, the
    last 8 the sequence number; at 32 characters it looks like a uuid4 in hex, the msgid
    real producers send (SKMQ's client, the original SKMQ's)."""
    return f"{prefix}{seq:08x}"


def emit(event: str, **fields: Any) -> None:
    """Write one event line to the harness."""
    sys.stdout.write(json.dumps({"event": event, **fields}, separators=(",", ":")) + "\n")
    sys.stdout.flush()


def write_result(path: str, result: dict[str, Any]) -> None:
    """Write the result file (atomically), then tell the harness it is there."""
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(result, fh, separators=(",", ":"))
    os.replace(tmp, path)
    emit("done", result=path)


def cpu_seconds() -> float:
    """User + system CPU seconds used by this process so far."""
    t = os.times()
    return t.user + t.system


def _hard_exit(code: int, reason: str) -> None:
    try:
        emit("error", reason=reason)
    finally:
        os._exit(code)


class Control:
    """Commands from the harness on stdin; a hard deadline."""

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        self._commands: asyncio.Queue[str] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        remaining = self.deadline - time.time()
        loop.call_later(max(remaining, 0.0), _hard_exit, 4, "hard deadline reached")
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        self._task = asyncio.create_task(self._read(reader))

    async def _read(self, reader: asyncio.StreamReader) -> None:
        while True:
            line = await reader.readline()
            if not line:
                # The harness closed our stdin or died: nobody will read a result.
                os._exit(3)
            await self._commands.put(line.decode().strip())

    async def wait_for(self, command: str) -> None:
        """Wait until the harness sends `command` (other commands are dropped)."""
        while True:
            got = await self._commands.get()
            if got == command:
                return

    def pending(self, command: str) -> bool:
        """True if `command` arrived (consumes it and everything before it)."""
        while not self._commands.empty():
            if self._commands.get_nowait() == command:
                return True
        return False
