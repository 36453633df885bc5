"""Original Go SKMQ recipients (and producer) against our broker, default settings.

    python -m bench.legacy_check --bin-dir DIR [--recipients 2] [--messages 300]
        [--crlf 0] [--producer skmq|original] [--timeout 120]

DIR holds already-built original programs; this script builds nothing. It runs them
through command templates (placeholders {bin} {id} {port} {app} {broker} {n} {prefix}),
by default a `sikong-demo` binary: a `main` (built outside this repository) around the
original demo/recipient_demo.go and the original client code, with these flags:

    {bin}/sikong-demo -mode recipient -id {id} -app {app} -port {port} -broker {broker}
    {bin}/sikong-demo -mode send -n {n} -prefix {prefix} -app {app} -broker {broker}

It starts `skmq serve` (embedded Redis, a fresh data directory, only HOST/PORT/DATA_DIR
set), the recipients, sends `--messages` plain messages (with our Producer, or the
original sender) and `--crlf` messages whose content holds CR LF (our Producer: the
original client cannot send them), then reads the broker's delivery log until every
message is acked or dead, or `--timeout` passes. It prints one JSON object: messages
acked (in all and by recipient), dead-lettered (with the reasons), missing; exit
status 0 when every plain message was acked.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from skmq.client import Producer
from skmq.logarchive import log_files, read_lines

RECIPIENT_CMD = (
    "{bin}/sikong-demo -mode recipient -id {id} -app {app} -port {port} -broker {broker}"
)
SENDER_CMD = "{bin}/sikong-demo -mode send -n {n} -prefix {prefix} -app {app} -broker {broker}"
APP = "legacy-check"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def wait_listening(port: int, proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listens on {port}")


def read_log(log_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for path in log_files(log_dir) for line in read_lines(path)]


def summarize(events: list[dict[str, Any]], plain: set[str], crlf: set[str]) -> dict[str, Any]:
    acked = {e["msgid"]: e.get("recipient") for e in events if e.get("event") == "acked"}
    dead = {e["msgid"]: e.get("detail") for e in events if e.get("event") == "dead_lettered"}
    return {
        "plain_acked": len(plain & acked.keys()),
        "plain_sent": len(plain),
        "crlf_acked": len(crlf & acked.keys()),
        "crlf_dead": len(crlf & dead.keys()),
        "crlf_sent": len(crlf),
        "acked_by_recipient": dict(Counter(acked[m] for m in plain & acked.keys())),
        "dead_reasons": sorted({str(dead[m]) for m in (plain | crlf) & dead.keys()}),
        "missing": sorted((plain | crlf) - acked.keys() - dead.keys())[:10],
    }


async def send_ours(port: int, plain: list[str], crlf: list[str]) -> None:
    async with Producer("127.0.0.1", port) as producer:
        sends = [producer.send(APP, f"plain {m}", msgid=m) for m in plain]
        sends += [producer.send(APP, f"two\r\nlines {m}", msgid=m) for m in crlf]
        for resp in await asyncio.wait_for(asyncio.gather(*sends), 60):
            if not resp.ok:
                raise RuntimeError(f"broker refused {resp.msgid}: {resp.content}")


def start(cmd: str, log: Path, **values: object) -> subprocess.Popen[bytes]:
    out = log.open("ab")
    return subprocess.Popen(
        shlex.split(cmd.format(**values)), stdout=out, stderr=out, stdin=subprocess.DEVNULL
    )


def run(args: argparse.Namespace) -> int:
    bin_dir = Path(args.bin_dir).resolve()
    work = Path(tempfile.mkdtemp(prefix="legacy-check-"))
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SKMQ_")}
    env.update(
        SKMQ_HOST="127.0.0.1",
        SKMQ_PORT=str(port),
        SKMQ_HTTP_PORT="0",
        SKMQ_DATA_DIR=str(work / "data"),
    )
    env.setdefault("SKMQ_LOG_LEVEL", "warning")
    procs: list[subprocess.Popen[bytes]] = []
    broker_log = (work / "broker.log").open("ab")
    broker = subprocess.Popen(
        [sys.executable, "-m", "skmq.cli", "serve"],
        env=env, stdout=broker_log, stderr=broker_log, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    procs.append(broker)
    try:
        wait_listening(port, broker)
        address = f"127.0.0.1:{port}"
        for i in range(args.recipients):
            rport = free_port()
            rec = start(args.recipient_cmd, work / f"recipient{i}.log", bin=bin_dir,
                        id=f"orig{i}", app=APP, port=rport, broker=address)  # fmt: skip
            procs.append(rec)
            wait_listening(rport, rec)  # it registers before it listens
        plain = [f"plain-{i}" for i in range(args.messages)]
        crlf = [f"crlf-{i}" for i in range(args.crlf)]
        started = time.monotonic()
        if args.producer == "original":
            sender = start(args.sender_cmd, work / "sender.log", bin=bin_dir, n=args.messages,
                           prefix="plain", app=APP, broker=address)  # fmt: skip
            procs.append(sender)
            asyncio.run(send_ours(port, [], crlf))
        else:
            asyncio.run(send_ours(port, plain, crlf))
        log_dir = work / "data" / "delivery-log"
        deadline = started + args.timeout
        while True:
            result = summarize(read_log(log_dir), set(plain), set(crlf))
            done = result["plain_acked"] == len(plain)
            done = done and result["crlf_acked"] + result["crlf_dead"] == len(crlf)
            if done or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        result["seconds"] = round(time.monotonic() - started, 1)
        result["workdir"] = str(work)
        print(json.dumps(result, indent=2))
        return 0 if result["plain_acked"] == len(plain) else 1
    finally:
        for proc in reversed(procs):
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.legacy_check", description=__doc__)
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("--bin-dir", required=True, help="directory of the built original programs")
    p.add_argument("--recipients", type=int, default=2)
    p.add_argument("--messages", type=int, default=300, help="plain messages")
    p.add_argument("--crlf", type=int, default=0, help="messages whose content holds CR LF")
    p.add_argument("--producer", choices=("skmq", "original"), default="skmq")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for acks")
    p.add_argument("--recipient-cmd", default=RECIPIENT_CMD)
    p.add_argument("--sender-cmd", default=SENDER_CMD)
    args = p.parse_args(argv)
    try:
        return run(args)
    except (OSError, RuntimeError, TimeoutError) as exc:
        print(f"legacy_check: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
