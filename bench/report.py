"""The result table (markdown), the target checks and the machine description."""

from __future__ import annotations

import argparse
import math
import os
import platform
from collections.abc import Callable
from dataclasses import asdict
from datetime import datetime
from pathlib import Path
from typing import Any

from bench.harness import LoadResult

# The targets of the owner-held-queues issue (37): e2e against each peer at its best
# honest setting; paced 1x1 runs; a 1,000,000-message backlog.
TARGET_RATIO = 8.0  # e2e against RabbitMQ
TARGET_NATS_RATIO = 1.5  # e2e against NATS JetStream
TARGET_INGEST = 50_000.0
# Paced runs: p99 bound (ms) by rate (msg/s); at CPU_RATE also no higher than NATS's p99
# in the same run, and SKMQ's broker + Redis CPU/msg against nats-server's.
TARGET_PACED_P99_MS = {1000.0: 1.0, 2000.0: 1.0, 10000.0: 5.0}
CPU_RATE = 2000.0
TARGET_CPU_RATIO = 0.8  # broker + Redis against nats-server, a delivered message
TARGET_REDIS_CPU_US = 15.0  # SKMQ's Redis, a delivered message at CPU_RATE
# Below this share of its target rate a paced run did not hold the rate: no verdict.
RATE_HELD = 0.95
TARGET_BYTES_PER_MSG = 120.0
TARGET_RSS_MIB = 250.0
TARGET_LOG_BYTES = 150.0


def machine() -> dict[str, Any]:
    model = "?"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "nproc": os.cpu_count(),
        "cpu_model": model,
        "kernel": platform.release(),
        "python": platform.python_version(),
    }


def add_json_flag(parser: argparse.ArgumentParser, stem: str) -> None:
    """A bench's `--json [PATH]`: also write the results (json_path says where)."""
    parser.add_argument(
        "--json",
        nargs="?",
        const="",
        default=None,
        metavar="PATH",
        help=f"also write the results as JSON (default path: bench/results/{stem}-<time>.json)",
    )


def json_path(given: str, stem: str, started: datetime) -> Path:
    """Where a run's --json goes: the path given, or bench/results/<stem>-<time>.json."""
    if given:
        return Path(given)
    return Path(__file__).resolve().parent / "results" / f"{stem}-{started:%Y%m%d-%H%M%S}.json"


def _mib(value: float | None) -> str:
    return _num(value / 2**20, 1) if value else "-"


def _num(value: float | None, digits: int = 0) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if digits == 0:
        return f"{value:,.0f}"
    return f"{value:,.{digits}f}"


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [
        max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)
    ]
    line = "| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    body = [
        "| " + " | ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in rows
    ]
    return "\n".join([line, sep, *body])


def paced_name(rate: float) -> str:
    """The paced run's scenario name: paced-1k, paced-2k, paced-10k, paced-2.5k, paced-500."""
    if rate >= 1000:
        return f"paced-{rate / 1000:g}k"
    return f"paced-{rate:g}"


def results_table(results: list[LoadResult]) -> str:
    """The throughput scenarios (the paced runs have their own table); "" if none."""
    results = [r for r in results if not r.target_rate]
    if not results:
        return ""
    headers = [
        "system",
        "scenario",
        "messages",
        "ingest msg/s",
        "e2e msg/s",
        "p50 ms",
        "p95 ms",
        "p99 ms",
        "max ms",
        "broker CPU µs/msg",
        "Redis CPU µs/msg",
        "clients CPU µs/msg",
        "lost",
        "dup",
        "other CPU %",
    ]
    rows: list[list[str]] = []
    for r in results:
        if r.error and not r.acked:
            rows.append([r.system, r.scenario, "FAILED", *["-"] * (len(headers) - 3)])
            continue
        # the backlog's late drain has its own table: here its ingest
        delivered = r.recipients > 0 and not r.recipients_late
        lat = r.latency_ms
        rows.append(
            [
                r.system,
                r.scenario + (" (error)" if r.error else ""),
                _num(r.unique if delivered else r.acked),
                _num(r.ingest_rate) if not delivered else "-",
                _num(r.e2e_rate) if delivered else "-",
                _num(lat.get("p50"), 2),
                _num(lat.get("p95"), 2),
                _num(lat.get("p99"), 2),
                _num(lat.get("max"), 2),
                _num(r.broker_cpu_us, 1),
                _num(r.redis_cpu_us, 1),
                _num(r.clients_cpu_us, 1),
                _num(r.lost) if delivered else "n/a",
                _num(r.duplicates) if delivered else "n/a",
                _num(r.extra.get("background_cpu_pct")),
            ]
        )
    return _table(headers, rows)


# Systems whose CPU a message is a process's and its Redis's: SKMQ, and the floors (the
# relay of bench/floor_bench.py in the broker's columns).
WITH_REDIS = ("skmq", "floor", "floor-bare-lifecycle")


def _sum(*values: float | None) -> float | None:
    return None if any(v is None for v in values) else sum(v or 0.0 for v in values)


def paced_table(results: list[LoadResult]) -> str:
    """The paced runs: rate held, latency, CPU per delivered message; "" if none."""
    headers = [
        "system",
        "scenario",
        "target msg/s",
        "achieved msg/s",
        "behind ms",
        "delivered",
        "p50 ms",
        "p99 ms",
        "max ms",
        "broker CPU µs/msg",
        "Redis CPU µs/msg",
        "B+R CPU µs/msg",
        "clients CPU µs/msg",
        "log B/msg",
        "lost",
        "dup",
        "other CPU %",
    ]
    rows: list[list[str]] = []
    for r in results:
        if not r.target_rate:
            continue
        if r.error and not r.acked:
            what = "skipped" if r.error.startswith("skipped") else "FAILED"
            rows.append([r.system, r.scenario, _num(r.target_rate), what,
                         *["-"] * (len(headers) - 4)])  # fmt: skip
            continue
        lat = r.latency_ms
        rows.append(
            [
                r.system,
                r.scenario + (" (error)" if r.error else ""),
                _num(r.target_rate),
                _num(r.achieved_rate),
                _num(r.lag_max_ms, 2),
                _num(r.unique),
                _num(lat.get("p50"), 2),
                _num(lat.get("p99"), 2),
                _num(lat.get("max"), 2),
                _num(r.broker_cpu_us, 1),
                _num(r.redis_cpu_us, 1),
                _num(_sum(r.broker_cpu_us, r.redis_cpu_us) if r.system in WITH_REDIS else None, 1),
                _num(r.clients_cpu_us, 1),
                _num(log_bytes_per_msg(r), 1),
                _num(r.lost),
                _num(r.duplicates),
                _num(r.extra.get("background_cpu_pct")),
            ]
        )
    return _table(headers, rows) if rows else ""


def log_bytes_per_msg(r: LoadResult) -> float | None:
    """SKMQ's delivery log on disk once the broker stopped, per delivered message."""
    stopped = r.extra.get("delivery_log_bytes_stopped")
    return stopped / r.unique if stopped and r.unique else None


def backlog_table(results: list[LoadResult]) -> str:
    rows = []
    for r in results:
        if r.scenario != "backlog" or not r.extra:
            continue
        x = r.extra
        drained = r.recipients_late and r.lost is not None
        rows.append(
            [
                r.system,
                _num(r.acked),
                _num(r.ingest_rate),
                _mib(x.get("broker_rss_before")),
                _mib(x.get("broker_rss_peak")),
                _mib(x.get("broker_rss_after")),
                _mib(x.get("redis_used_memory_delta")),
                _num(x.get("redis_bytes_per_msg"), 1),
                _num(x.get("redis_dbsize")),
                _mib(x.get("aof_bytes")),
                _num(x.get("drain_rate")) + (" (cap)" if x.get("drain_capped") else ""),
                _num(x.get("drain_seconds"), 1),
                _mib(x.get("drain_broker_rss_peak")),
                _num(r.lost) if drained else "-",
                _num(r.duplicates) if drained else "-",
            ]
        )
    if not rows:
        return ""
    headers = [
        "system",
        "backlog msgs",
        "ingest msg/s",
        "broker RSS before MiB",
        "peak MiB",
        "after MiB",
        "Redis used_memory +MiB",
        "Redis bytes/msg",
        "Redis keys",
        "AOF MiB",
        "drain msg/s",
        "drain s",
        "drain RSS peak MiB",
        "lost",
        "dup",
    ]
    note = (
        "Stored with no recipient; then the recipients start and drain it: drain msg/s = "
        "stored messages received / seconds from the recipients' start to the last receipt "
        "((cap): stopped at --drain-backlog-time); drain RSS peak: the broker's meanwhile; "
        "lost: stored (acked) but not received within the cap; dup: receipts beyond the first."
    )
    return _table(headers, rows) + "\n\n" + note


def _best(results: list[LoadResult], system: str, scenario: str) -> LoadResult | None:
    for r in results:
        if r.system == system and r.scenario == scenario and not r.error:
            return r
    return None


def targets(results: list[LoadResult]) -> tuple[list[str], dict[str, Any]]:
    """Lines checking the issue's targets, and the same as data."""
    lines: list[str] = []
    data: dict[str, Any] = {}

    def check(name: str, ok: bool | None, text: str) -> None:
        mark = "n/a " if ok is None else ("PASS" if ok else "FAIL")
        lines.append(f"- [{mark}] {name}: {text}")
        data[name] = {"ok": ok, "text": text}

    s_e2e, r_e2e = _best(results, "skmq", "e2e"), _best(results, "rabbitmq", "e2e")
    if s_e2e and r_e2e and s_e2e.e2e_rate and r_e2e.e2e_rate:
        ratio = s_e2e.e2e_rate / r_e2e.e2e_rate
        data["e2e_ratio"] = ratio
        bg = max(
            float(s_e2e.extra.get("background_cpu_pct", 0.0)),
            float(r_e2e.extra.get("background_cpu_pct", 0.0)),
        )
        caveat = f" (other processes used up to {bg:.0f}% CPU: unreliable)" if bg >= 10.0 else ""
        check(
            f"e2e >= {TARGET_RATIO:g}x RabbitMQ",
            ratio >= TARGET_RATIO,
            f"SKMQ {s_e2e.e2e_rate:,.0f} / RabbitMQ {r_e2e.e2e_rate:,.0f} msg/s = {ratio:.2f}x"
            + caveat,
        )
    else:
        check(f"e2e >= {TARGET_RATIO:g}x RabbitMQ", None, "needs both e2e runs")
    n_e2e = _best(results, "nats", "e2e")
    if s_e2e and n_e2e and s_e2e.e2e_rate and n_e2e.e2e_rate:
        ratio = s_e2e.e2e_rate / n_e2e.e2e_rate
        data["e2e_ratio_nats"] = ratio
        check(
            f"e2e >= {TARGET_NATS_RATIO:g}x NATS JetStream",
            ratio >= TARGET_NATS_RATIO,
            f"SKMQ {s_e2e.e2e_rate:,.0f} / NATS {n_e2e.e2e_rate:,.0f} msg/s = {ratio:.2f}x",
        )
    else:
        check(f"e2e >= {TARGET_NATS_RATIO:g}x NATS JetStream", None, "needs both e2e runs")
    ingest = _best(results, "skmq", "ingest")
    if ingest and ingest.ingest_rate:
        check(
            "ingest >= 50,000 msg/s",
            ingest.ingest_rate >= TARGET_INGEST,
            f"{ingest.ingest_rate:,.0f} msg/s",
        )
    else:
        check("ingest >= 50,000 msg/s", None, "not run")
    for rate, bound in TARGET_PACED_P99_MS.items():
        _paced_p99(results, rate, bound, check)
    _paced_cpu(results, CPU_RATE, check)
    _paced_redis_cpu(results, CPU_RATE, check)
    backlog = _best(results, "skmq", "backlog")
    memory = (
        f"Redis <= {TARGET_BYTES_PER_MSG:g} bytes/msg, broker RSS <= {TARGET_RSS_MIB:g} MiB "
        "(backlog)"
    )
    if backlog and backlog.extra.get("redis_bytes_per_msg") is not None:
        bpm = float(backlog.extra["redis_bytes_per_msg"])
        rss = backlog.extra.get("broker_rss_peak", 0) / 2**20
        drain_rss = (backlog.extra.get("drain_broker_rss_peak") or 0) / 2**20
        during = f", {drain_rss:,.1f} MiB draining it" if drain_rss else ""
        check(
            memory,
            bpm <= TARGET_BYTES_PER_MSG and max(rss, drain_rss) <= TARGET_RSS_MIB,
            f"{bpm:,.1f} bytes/msg over {backlog.acked:,} messages; broker RSS peak {rss:,.1f} "
            f"MiB storing{during}",
        )
    else:
        check(memory, None, "not run")
    drained = "backlog drained at >= the e2e rate"
    drain_rate = backlog.extra.get("drain_rate") if backlog else None
    if drain_rate and s_e2e and s_e2e.e2e_rate:
        check(
            drained,
            float(drain_rate) >= s_e2e.e2e_rate,
            f"{float(drain_rate):,.0f} against {s_e2e.e2e_rate:,.0f} msg/s",
        )
    else:
        check(drained, None, "needs the backlog's drain and the e2e run")
    if backlog and backlog.recipients_late and backlog.extra.get("drain_seconds"):
        x = backlog.extra
        capped = f", stopped at the {x['drain_cap_s']:.0f}s cap" if x.get("drain_capped") else ""
        lines.append(
            f"- backlog drain ({backlog.recipients} recipients): {_num(x.get('drain_rate'))} "
            f"msg/s, {_num(x.get('drain_delivered'))} of {backlog.acked:,} stored messages in "
            f"{x['drain_seconds']:.1f}s{capped}; lost {backlog.lost}, duplicated "
            f"{backlog.duplicates}"
        )
    logged = [r for r in results if r.system == "skmq" and log_bytes_per_msg(r) is not None]
    if logged:
        most = max(logged, key=lambda r: r.unique)
        bpm = log_bytes_per_msg(most) or 0.0
        check(
            "delivery log <= 150 B/msg on disk",
            bpm <= TARGET_LOG_BYTES,
            f"{bpm:,.1f} B/msg over {most.unique:,} messages ({most.scenario}, once stopped)",
        )
    else:
        check("delivery log <= 150 B/msg on disk", None, "no SKMQ delivery run")
    ordered = _best(results, "skmq", "ordered")
    if s_e2e and ordered and s_e2e.e2e_rate and ordered.e2e_rate:
        cost = 1 - ordered.e2e_rate / s_e2e.e2e_rate
        data["ordered_cost"] = cost
        lines.append(
            f"- ordered delivery (key=, {ordered.extra.get('keys', '?')} keys): "
            f"{ordered.e2e_rate:,.0f} msg/s against {s_e2e.e2e_rate:,.0f} unordered "
            f"({cost:+.0%} cost)"
        )
    base = _best(results, "skmq", "base")
    if s_e2e and base and s_e2e.e2e_rate and base.e2e_rate:
        data["base_ratio"] = base.e2e_rate / s_e2e.e2e_rate
        lines.append(
            f"- recipients without caps (one push a connection, as the original SKMQ's): "
            f"{base.e2e_rate:,.0f} msg/s against {s_e2e.e2e_rate:,.0f} with `pipeline` "
            f"({data['base_ratio']:.2f}x)"
        )
    skmq_runs = [
        r
        for r in results
        if r.system == "skmq" and r.recipients > 0 and r.lost is not None and not r.error
    ]
    if skmq_runs:
        # A backlog drain stopped at its cap: what it did not receive is no verdict on loss.
        at_cap = [r for r in skmq_runs if r.extra.get("drain_capped")]
        lost = sum(r.lost or 0 for r in skmq_runs if r not in at_cap)
        dup = sum(r.duplicates for r in skmq_runs)
        unreceived = sum(r.lost or 0 for r in at_cap)
        check(
            "no loss, no duplicate (SKMQ delivery runs)",
            lost == 0 and dup == 0,
            f"lost {lost}, duplicated {dup}"
            + (
                f" (the backlog drain stopped at its cap: its {unreceived:,} not received "
                "not counted)"
                if at_cap
                else ""
            ),
        )
    else:
        check("no loss, no duplicate (SKMQ delivery runs)", None, "no delivery run")
    return lines, data


def _paced(results: list[LoadResult], system: str, rate: float) -> LoadResult | None:
    """The system's paced run at `rate` msg/s (the last one, if several)."""
    found = [r for r in results if r.system == system and r.target_rate == rate]
    return found[-1] if found else None


def _no_verdict(r: LoadResult | None) -> tuple[bool | None, str] | None:
    """Why a paced run gives no figure to check, as (verdict, text): not run (None), failed
    (False), rate not held (None); None if it can be checked."""
    if r is None or (r.error or "").startswith("skipped"):
        return None, "not run"
    if r.error:
        return False, f"failed: {r.error.splitlines()[0]}"
    if not r.latency_ms:
        return False, "no message delivered"
    if r.achieved_rate is None or r.achieved_rate < RATE_HELD * r.target_rate:
        return None, (
            f"rate not held: the producer achieved {_num(r.achieved_rate)} of "
            f"{r.target_rate:,.0f} msg/s (p99 {r.latency_ms['p99']:.2f} ms)"
        )
    return None


def _caveat(*runs: LoadResult) -> str:
    bg = max(float(r.extra.get("background_cpu_pct", 0.0)) for r in runs)
    return f" (other processes used up to {bg:.0f}% CPU: unreliable)" if bg >= 10.0 else ""


def _paced_p99(
    results: list[LoadResult],
    rate: float,
    bound: float,
    check: Callable[[str, bool | None, str], None],
) -> None:
    """SKMQ's p99 at `rate` against `bound` ms, the other systems' beside it."""
    name = f"paced p99 <= {bound:g} ms at {rate:,.0f} msg/s"
    if rate == CPU_RATE:
        name = f"paced p99 <= {bound:g} ms and <= NATS's at {rate:,.0f} msg/s"
    r = _paced(results, "skmq", rate)
    blocked = _no_verdict(r)
    if blocked is not None or r is None:
        check(name, *(blocked or (None, "not run")))
        return
    p99 = r.latency_ms["p99"]
    others = []
    nats = _paced(results, "nats", rate)
    ok = p99 <= bound
    if rate == CPU_RATE:  # (NATS not run or failed: no verdict on that part)
        ok = ok and (nats is None or _no_verdict(nats) is not None or
                     p99 <= nats.latency_ms["p99"])  # fmt: skip
    for system, label in (
        ("nats", "NATS"),
        ("rabbitmq", "RabbitMQ"),
        ("floor", "floor"),
        ("floor-bare-lifecycle", "floor-bare"),
    ):
        o = _paced(results, system, rate)
        if o is not None and _no_verdict(o) is None:
            others.append(f"{label} {o.latency_ms['p99']:.2f} ms")
    beside = f" ({', '.join(others)})" if others else ""
    check(
        name,
        ok,
        f"SKMQ p99 {p99:.2f} ms{beside} at {_num(r.achieved_rate)} msg/s" + _caveat(r),
    )


def _paced_cpu(
    results: list[LoadResult], rate: float, check: Callable[[str, bool | None, str], None]
) -> None:
    """SKMQ's broker + Redis CPU per delivered message at `rate` against nats-server's."""
    name = f"broker+Redis CPU/msg <= {TARGET_CPU_RATIO:g}x nats-server's at {rate:,.0f} msg/s"
    s, n = _paced(results, "skmq", rate), _paced(results, "nats", rate)
    for label, r in (("SKMQ", s), ("NATS", n)):
        blocked = _no_verdict(r)
        if blocked is not None:
            ok, why = blocked
            # NATS failing is no verdict on SKMQ
            check(name, ok if label == "SKMQ" else None, f"{label}: {why}")
            return
    assert s is not None and n is not None
    ours = _sum(s.broker_cpu_us, s.redis_cpu_us)
    theirs = n.broker_cpu_us
    if ours is None or theirs is None:
        check(name, None, "CPU not measured (no broker, Redis or nats-server process seen)")
        return
    floors = []
    for system, what in (
        ("floor", "the protocol's steps through Redis, no broker logic"),
        ("floor-bare-lifecycle", "through a lifecycle cut to its bones"),
    ):
        f = _paced(results, system, rate)
        total = None if f is None or _no_verdict(f) else _sum(f.broker_cpu_us, f.redis_cpu_us)
        if f is not None and total is not None:
            floors.append(f"{system} ({what}) {total:,.1f} µs (relay {f.broker_cpu_us:,.1f} "
                          f"+ Redis {f.redis_cpu_us:,.1f})")  # fmt: skip
    beside = "".join(f"; {x}" for x in floors)
    check(
        name,
        ours <= TARGET_CPU_RATIO * theirs,
        f"SKMQ {ours:,.1f} µs (broker {s.broker_cpu_us:,.1f} + Redis {s.redis_cpu_us:,.1f}) "
        f"against nats-server {theirs:,.1f} µs a delivered message{beside}" + _caveat(s, n),
    )


def _paced_redis_cpu(
    results: list[LoadResult], rate: float, check: Callable[[str, bool | None, str], None]
) -> None:
    """SKMQ's Redis CPU per delivered message at `rate` against TARGET_REDIS_CPU_US."""
    name = f"Redis CPU/msg <= {TARGET_REDIS_CPU_US:g} µs at {rate:,.0f} msg/s"
    r = _paced(results, "skmq", rate)
    blocked = _no_verdict(r)
    if blocked is not None or r is None:
        check(name, *(blocked or (None, "not run")))
    elif r.redis_cpu_us is None:
        check(name, None, "CPU not measured (no Redis process seen)")
    else:
        text = f"SKMQ's Redis {r.redis_cpu_us:,.1f} µs a delivered message" + _caveat(r)
        check(name, r.redis_cpu_us <= TARGET_REDIS_CPU_US, text)


def as_json(results: list[LoadResult]) -> list[dict[str, Any]]:
    return [asdict(r) for r in results]
