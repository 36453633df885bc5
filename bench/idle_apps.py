"""Idle CPU of a broker that has seen many apps (issue 11: 20k app ids made an idle broker
burn 93% CPU). N apps each get one message; then the broker is left alone and the CPU
of the broker process and of its embedded Redis is sampled with psutil over
`--measure` seconds.

- `--recipients leave` (default): in waves of `--wave` apps, a recipient registers for
  each app, acks its one message, and unregisters (the apps are then forgotten).
- `--recipients none`: nobody ever registers; each app keeps its one waiting message.

    python -m bench.idle_apps --apps 20000 --measure 10
    python -m bench.idle_apps --apps 20000 --measure 10 --recipients none
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import redis.asyncio as aioredis

from skmq.codec import PONG, Decoder, Frame, encode_frame
from skmq.embedded import free_port, read_info

APP = "idle{}"


class AckingRecipient:
    """Answers `ping` with `pong` and every push with `ack`; counts the pushes."""

    def __init__(self) -> None:
        self.pushes = 0
        self.port = 0
        self.all_pushed = asyncio.Event()
        self.expected = 0

    async def start(self) -> asyncio.Server:
        server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = server.sockets[0].getsockname()[1]
        return server

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        decoder = Decoder()
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(65536):
                for frame in decoder.feed(data):
                    if isinstance(frame, Frame):
                        self._answer(writer, frame)
        writer.close()

    def _answer(self, writer: asyncio.StreamWriter, frame: Frame) -> None:
        if frame.type == "ping":
            writer.write(PONG)
        elif frame.type == "push":
            fields = {"msgid": frame.fields["msgid"], "appid": frame.fields["appid"]}
            writer.write(encode_frame("ack", fields))
            self.pushes += 1
            if self.pushes >= self.expected:
                self.all_pushed.set()


def app_frame(kind: str, i: int, **extra: object) -> bytes:
    """A register/unregister frame of recipient `r` for app number i."""
    content = {"id": "r", "app_id": APP.format(i), "host": "127.0.0.1", **extra}
    return encode_frame(kind, {}, json.dumps(content).encode())


async def exchange(port: int, frames: list[bytes]) -> list[Frame]:
    """Send the frames pipelined on one connection; return one answer a frame."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"".join(frames))
    decoder = Decoder()
    answers: list[Frame] = []
    async with asyncio.timeout(300):
        while len(answers) < len(frames):
            data = await reader.read(1 << 20)
            if not data:
                raise ConnectionError("broker closed the connection")
            answers += [f for f in decoder.feed(data) if isinstance(f, Frame)]
    writer.close()
    return answers


async def wait_listening(port: int, timeout: float = 30.0) -> None:
    async with asyncio.timeout(timeout):
        while True:
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.close()
                return
            except OSError:
                await asyncio.sleep(0.05)


def cpu_percent(procs: list[psutil.Process], seconds: float) -> list[float]:
    for p in procs:
        p.cpu_percent(None)
    time.sleep(seconds)
    return [p.cpu_percent(None) for p in procs]


async def deliver_in_waves(port: int, apps: int, wave: int) -> int:
    """Each app: register a recipient, store one message, wait for its push, unregister."""
    recipient = AckingRecipient()
    server = await recipient.start()
    for first in range(0, apps, wave):
        batch = range(first, min(apps, first + wave))
        recipient.expected = batch.stop
        recipient.all_pushed.clear()
        await exchange(port, [app_frame("register", i, port=recipient.port) for i in batch])
        await exchange(port, [message(i) for i in batch])
        async with asyncio.timeout(120):
            await recipient.all_pushed.wait()
        await exchange(port, [app_frame("unregister", i) for i in batch])
    server.close()
    return recipient.pushes


def message(i: int) -> bytes:
    return encode_frame("queue", {"appid": APP.format(i), "msgid": f"m{i}"}, b"x")


async def run(args: argparse.Namespace) -> dict[str, object]:
    data_dir = Path(tempfile.mkdtemp(prefix="skmq-idle-"))
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SKMQ_")}
    env.update(
        SKMQ_PORT=str(port),
        SKMQ_HTTP_PORT="0",
        SKMQ_DATA_DIR=str(data_dir),
        SKMQ_LOG_LEVEL="warning",
    )
    broker = subprocess.Popen([sys.executable, "-m", "skmq.cli", "serve"], env=env)
    try:
        await wait_listening(port)
        pushes = 0
        if args.recipients == "leave":
            pushes = await deliver_in_waves(port, args.apps, args.wave)
        else:
            await exchange(port, [message(i) for i in range(args.apps)])
        info = read_info(data_dir)
        assert info is not None
        await asyncio.sleep(args.settle)  # idle from here on (acks settle, apps forgotten)
        redis = aioredis.Redis.from_url(str(info["url"]))
        apps_left = await redis.scard("skmq:apps")
        await redis.aclose()
        procs = [psutil.Process(broker.pid), psutil.Process(int(info["pid"]))]
        broker_cpu, redis_cpu = await asyncio.to_thread(cpu_percent, procs, args.measure)
        return {
            "apps": args.apps,
            "recipients": args.recipients,
            "pushes_acked": pushes,
            "apps_in_set_while_idle": apps_left,
            "idle_cpu_percent_broker": broker_cpu,
            "idle_cpu_percent_redis": redis_cpu,
            "measured_seconds": args.measure,
        }
    finally:
        broker.terminate()
        try:
            broker.wait(60)
        except subprocess.TimeoutExpired:
            broker.kill()
            broker.wait(10)
        shutil.rmtree(data_dir, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--apps", type=int, default=20_000)
    parser.add_argument("--measure", type=float, default=10.0, help="seconds of CPU sampling")
    parser.add_argument("--settle", type=float, default=5.0, help="seconds idle before it")
    parser.add_argument("--recipients", choices=["leave", "none"], default="leave")
    parser.add_argument("--wave", type=int, default=500, help="apps delivered at once")
    print(json.dumps(asyncio.run(run(parser.parse_args())), indent=2))


if __name__ == "__main__":
    main()
