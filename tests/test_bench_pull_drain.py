"""`python -m bench.pull_drain` against a fresh `skmq serve` (its own embedded Redis; NATS
left out): each SKMQ consumer process drains the stored backlog and keeps up with a
producer, every message received once, and the figures come out."""

from __future__ import annotations

import json
from pathlib import Path

from bench.pull_drain import amain, parse_args


async def test_pull_drain_delivers_every_message_once(tmp_path: Path) -> None:
    out = tmp_path / "pull.json"
    flags = "--messages 300 --consumers 2 --batch 50 --drain-time 30 --systems skmq-tcp,skmq-http"
    argv = [*flags.split(), "--scenarios", "drain,drain-each,e2e", "--json", str(out)]
    assert await amain(parse_args(argv)) == 0
    rows = json.loads(out.read_text())["results"]
    ran = {(r["scenario"], r["system"]) for r in rows}
    assert ran == {
        (s, t) for s in ("drain", "drain-each", "e2e") for t in ("skmq-tcp", "skmq-http")
    }
    for r in rows:
        figures = (r["error"], r["stored"], r["delivered"], r["lost"], r["duplicates"])
        assert figures == (None, 300, 300, 0, 0), r
        assert r["rate"] > 0 and r["broker_cpu_us"] is not None
    assert all(r["receive_ms"] for r in rows if r["scenario"] == "drain")
    assert all(r["latency_ms"]["p99"] > 0 for r in rows if r["scenario"] == "e2e")
