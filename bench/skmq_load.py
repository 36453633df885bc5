"""SKMQ load processes: a pipelined producer and a push recipient, on raw sockets.

Run by the harness as `python -m bench.skmq_load producer|recipient ...`. These
processes speak the wire protocol directly (SPEC.md sections 1-3) with a tiny
frame splitter and import nothing from `skmq`, so they cost little CPU and do
not depend on the broker's code.

Message content: `<send time.time_ns()>|` padded with `.` to `--size` bytes,
so a recipient in another process computes the send-to-receipt latency.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import socket
import time
from typing import Any, cast

import uvloop

from bench.childio import Control, cpu_seconds, emit, write_result
from bench.confirmed import Tally, report_until_stopped
from bench.pacing import Pacer

SEP = b"\r\n\r\n"
# With the broker's auth on (SKMQ_AUTH_TOKEN), the harness gives the load the token.
TOKEN = os.environ.get("SKMQ_TOKEN", "")
AUTH = b"type=auth\r\ncontent=" + TOKEN.encode() + SEP
ACK_RE = re.compile(rb'"[sS]tatus"\s*:\s*"ack"')


def split_frames(buf: bytes) -> tuple[list[bytes], bytes]:
    """Split a byte buffer into complete frames and the unfinished rest.

    Empty frames (the original's doubled terminator) are dropped; CR/LF left
    over in front of a frame are stripped.
    """
    if SEP not in buf:
        return [], buf
    parts = buf.split(SEP)
    rest = parts.pop()
    frames = []
    for part in parts:
        if part[:1] in (b"\r", b"\n"):
            part = part.lstrip(b"\r\n")
        if part:
            frames.append(part)
    return frames, rest


def frame_field(frame: bytes, key: bytes) -> bytes | None:
    """The value of `key` in a frame (content: up to the end of its line)."""
    for line in frame.split(b"\r\n"):
        k, eq, v = line.partition(b"=")
        if eq and k == key:
            return v
    return None


# --------------------------------------------------------------------------- producer


class ProducerProtocol(asyncio.Protocol):
    """Counts `resp` frames; answers in order, one per frame sent."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = b""
        self.responses = 0
        self.acked = 0
        self.failed: list[str] = []
        self.failed_samples: list[str] = []
        self.t_last_resp = 0
        self.progress = asyncio.Event()
        self.writable = asyncio.Event()
        self.writable.set()
        self.closed = asyncio.Event()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses: cast, don't check.
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError, AttributeError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        frames, self.buf = split_frames(self.buf + data)
        if not frames:
            return
        for frame in frames:
            if frame == b"ping":
                if self.transport is not None:
                    self.transport.write(b"pong\r\n\r\n")
                continue
            if frame == b"pong":
                continue
            self.responses += 1
            if ACK_RE.search(frame):
                self.acked += 1
            else:
                msgid = frame_field(frame, b"msgid")
                self.failed.append(msgid.decode(errors="replace") if msgid else "?")
                if len(self.failed_samples) < 5:
                    self.failed_samples.append(frame.decode(errors="replace")[:300])
        self.t_last_resp = time.time_ns()
        self.progress.set()

    def pause_writing(self) -> None:
        self.writable.clear()

    def resume_writing(self) -> None:
        self.writable.set()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed.set()
        self.progress.set()
        self.writable.set()


def make_content(ts: int, size: int) -> bytes:
    head = b"%d|" % ts
    return head + b"." * max(size - len(head), 0)


async def producer_main(args: argparse.Namespace) -> None:
    control = Control(args.deadline)
    await control.start()
    loop = asyncio.get_running_loop()
    proto = ProducerProtocol()
    await loop.create_connection(lambda: proto, args.host, args.port)
    if TOKEN:
        await authenticate(proto)
    emit("ready")
    await control.wait_for("go")

    cpu0 = cpu_seconds()
    appid = args.appid.encode()
    prefix = args.prefix.encode()
    count: int = args.count
    window: int = args.window
    stop_at = time.monotonic() + args.send_time
    head = b"appid=" + appid + b"\r\nmsgid=" + prefix  # then 8 hex digits: childio.msgid
    tail_type = b"\r\ntype=queue\r\ncontent="
    keys: int = args.keys
    pacer = Pacer(args.rate, count)
    t_start = time.time_ns()
    pacer.start()
    transport = proto.transport
    assert transport is not None
    while not proto.closed.is_set() and (due := await pacer.next_batch(stop_at)):
        seq = pacer.sent
        room = window - (seq - proto.responses)
        if room <= 0:
            proto.progress.clear()
            try:
                async with asyncio.timeout(max(stop_at - time.monotonic(), 0.01)):
                    await proto.progress.wait()
            except TimeoutError:
                pass
            continue
        # Everything due (up to the window and 500 a write), stamped now, in one write.
        n = min(room, due, 500)
        content = make_content(time.time_ns(), args.size)
        tail = tail_type + content + SEP
        if keys:
            frames = [head + b"%08x\r\nkey=k%d" % (i, i % keys) + tail for i in range(seq, seq + n)]
        else:
            frames = [head + b"%08x" % i + tail for i in range(seq, seq + n)]
        transport.write(b"".join(frames))
        pacer.record(n)
        if not proto.writable.is_set():
            await proto.writable.wait()
        else:
            await asyncio.sleep(0)
    seq = pacer.sent
    t_sent = time.time_ns()
    # Wait for the answers to everything sent (bounded).
    ack_deadline = time.monotonic() + args.ack_wait
    while proto.responses < seq and not proto.closed.is_set():
        remaining = ack_deadline - time.monotonic()
        if remaining <= 0:
            break
        proto.progress.clear()
        try:
            async with asyncio.timeout(remaining):
                await proto.progress.wait()
        except TimeoutError:
            break
    result: dict[str, Any] = {
        "role": "producer",
        "prefix": args.prefix,
        "sent": seq,
        "responses": proto.responses,
        "acked": proto.acked,
        "failed": proto.failed,
        "failed_samples": proto.failed_samples,
        "t_start": t_start,
        "t_sent": t_sent,
        "t_end": proto.t_last_resp or t_sent,
        "stopped_early": pacer.capped,
        **pacer.summary(),
        "connection_lost": proto.closed.is_set(),
        "cpu_s": cpu_seconds() - cpu0,
    }
    transport.close()
    write_result(args.result, result)


# --------------------------------------------------------------------------- recipient


class RecipientState(Tally):
    """The tally of bench.confirmed's consumers, and what only SKMQ's protocol has."""

    def __init__(self, appid: bytes) -> None:
        super().__init__()
        self.appid = appid
        self.pings = 0
        self.connections = 0
        self.other_frames = 0
        self.other_samples: list[str] = []


class RecipientProtocol(asyncio.Protocol):
    """One connection opened by the broker: acks every push, answers pings."""

    def __init__(self, state: RecipientState) -> None:
        self.state = state
        self.transport: asyncio.Transport | None = None
        self.buf = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses: cast, don't check.
        self.transport = cast(asyncio.Transport, transport)
        self.state.connections += 1
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError, AttributeError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        frames, self.buf = split_frames(self.buf + data)
        if not frames:
            return
        st = self.state
        out: list[bytes] = []
        for frame in frames:
            if frame == b"ping":
                st.pings += 1
                out.append(b"pong\r\n\r\n")
                continue
            msgid = b""
            content = b""
            ftype = b""
            appid = b""
            for line in frame.split(b"\r\n"):
                k, _, v = line.partition(b"=")
                if k == b"msgid":
                    msgid = v
                elif k == b"type":
                    ftype = v
                elif k == b"content":
                    content = v
                elif k == b"appid":
                    appid = v
            if ftype != b"push":
                if ftype != b"resp":
                    st.other_frames += 1
                    if len(st.other_samples) < 5:
                        st.other_samples.append(frame.decode(errors="replace")[:300])
                continue
            st.note(msgid.decode(errors="replace"), content)
            out.append(
                b"msgid=" + msgid + b"\r\nappid=" + (appid or st.appid) + b"\r\ntype=ack" + SEP
            )
        if out and self.transport is not None:
            self.transport.write(b"".join(out))

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None


async def authenticate(proto: ProducerProtocol) -> None:
    """Send `auth` first (SKMQ_TOKEN) and wait for its answer; it counts as no message."""
    assert proto.transport is not None
    proto.transport.write(AUTH)
    async with asyncio.timeout(10):
        while proto.responses < 1:
            proto.progress.clear()
            await proto.progress.wait()
    if proto.acked != 1:
        raise SystemExit(f"auth refused: {proto.failed_samples}")
    proto.responses = proto.acked = 0


async def register(args: argparse.Namespace, port: int) -> str:
    """Register this recipient with the broker (declaring the capabilities these
    recipients have: pipelined pushes, `length=`; none with --no-caps); return the
    broker's answer."""
    caps = {} if args.no_caps else {"caps": ["pipeline", "length"]}
    body = json.dumps(
        {"id": args.rid, "app_id": args.appid, "host": "127.0.0.1", "port": port, "weight": 0,
         **caps},
        separators=(",", ":"),
    )  # fmt: skip
    reader, writer = await asyncio.open_connection(args.host, args.port)
    try:
        if TOKEN:
            writer.write(AUTH)
        writer.write(b"type=register\r\ncontent=" + body.encode() + SEP)
        await writer.drain()
        async with asyncio.timeout(10):
            while True:
                raw = await reader.readuntil(SEP)
                frame = raw[: -len(SEP)].strip(b"\r\n")
                if frame and frame not in (b"ping", b"pong") and b"authenticated" not in frame:
                    return frame.decode(errors="replace")
    finally:
        writer.close()


async def recipient_main(args: argparse.Namespace) -> None:
    control = Control(args.deadline)
    await control.start()
    loop = asyncio.get_running_loop()
    state = RecipientState(args.appid.encode())
    server = await loop.create_server(
        lambda: RecipientProtocol(state), "127.0.0.1", 0, backlog=1024, reuse_address=True
    )
    port = server.sockets[0].getsockname()[1]
    answer = await register(args, port)
    ok = ACK_RE.search(answer.encode()) is not None
    emit("ready", port=port, registered=ok, answer=answer[:300])
    cpu_s = await report_until_stopped(control, args.progress_interval, state)
    server.close()
    result: dict[str, Any] = {
        **state.result(args.rid, cpu_s),
        "port": port,
        "pings": state.pings,
        "connections": state.connections,
        "other_frames": state.other_frames,
        "other_samples": state.other_samples,
    }
    write_result(args.result, result)


# --------------------------------------------------------------------------- entry


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.skmq_load")
    p.add_argument("role", choices=["producer", "recipient"])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--appid", default="bench")
    p.add_argument("--result", required=True)
    p.add_argument("--deadline", type=float, required=True, help="unix time: hard exit")
    # producer
    p.add_argument("--prefix", default="m")
    p.add_argument("--count", type=int, default=0)
    p.add_argument("--window", type=int, default=1000)
    p.add_argument("--rate", type=float, default=0.0, help="messages/s, 0: as fast as possible")
    p.add_argument("--size", type=int, default=100)
    p.add_argument("--keys", type=int, default=0, help="key=k<n %% keys> on message n; 0: none")
    p.add_argument("--send-time", type=float, default=60.0)
    p.add_argument("--ack-wait", type=float, default=30.0)
    # recipient
    p.add_argument("--rid", default="r1")
    p.add_argument(
        "--no-caps", action="store_true", help="register as an original peer: one push a connection"
    )
    p.add_argument("--progress-interval", type=float, default=0.2)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.role == "producer":
        uvloop.run(producer_main(args))
    else:
        uvloop.run(recipient_main(args))


if __name__ == "__main__":
    main()
