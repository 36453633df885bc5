"""The audit's ``report.html``: one self-contained page, inline CSS and SVG, no script.

Everything is drawn here in Python from the collected report (no external JS, CSS,
fonts or CDN).  Used by ``spark/audit.py``; imports nothing from ``skmq`` or pyspark.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from datetime import datetime, timezone
from html import escape
from typing import Any

# timezone.utc, not datetime.UTC: the official Spark images run Python 3.10.
UTC = timezone.utc  # noqa: UP017

__all__ = ["render_html"]

COLORS = {
    "stored": "#1565c0",
    "pushed": "#8e24aa",
    "acked": "#2e7d32",
    "dead_lettered": "#c62828",
    "dropped": "#6d4c41",
    "unresolved": "#f9a825",
    "bar": "#1565c0",
}
LABELS = {
    "stored": "stored",
    "pushed": "pushed",
    "acked": "acked",
    "dead_lettered": "dead-lettered",
    "dropped": "dropped",
    "unresolved": "unresolved",
}
# The report's outcome rows (docs/AUDIT.md), in words.
OUTCOME_LABELS = {
    "acked": "acked",
    "dead_lettered_attempts": "dead-lettered after its attempts (last: errored, timeout...)",
    "dead_lettered_rejected": "dead-lettered after its attempts, the last rejected",
    "dead_lettered_undeliverable": "dead-lettered as undeliverable",
    "dead_lettered_expired": "dead-lettered: its TTL ran out",
    "dead_lettered_unnamed": "dead-lettered, no reason named",
    "dead_letter_purged": "dead letter purged by an operator",
    "dead_letter_moved": "dead letter moved to another app",
    "expired_dropped": "TTL ran out, dropped (EXPIRED=drop)",
    "purged_pending": "purged while pending",
    "not_yet_due": "open: not yet due (delayed, or waiting for a retry)",
    "waiting_for_recipient": "open: due, never pushed (waiting for a recipient)",
    "in_flight": "open: in flight (an event within the stuck-after period)",
    "stuck": "open: stuck (pushed, no event for the stuck-after period)",
}
_GROUPS = ("acked", "dead_lettered", "dropped", "unresolved")
DASH = "\u2013"  # en dash
FONT = "font-family:system-ui,-apple-system,'Segoe UI',sans-serif"

CSS = """
body{font-family:system-ui,-apple-system,'Segoe UI',Roboto,sans-serif;margin:0;color:#1d2330;
background:#f5f6f8}
main{max-width:1180px;margin:0 auto;padding:24px}
h1{font-size:1.6rem;margin:0 0 4px}h2{font-size:1.2rem;margin:32px 0 10px}
.meta{color:#5b6475;font-size:.9rem}
.cards{display:flex;flex-wrap:wrap;gap:12px;margin-top:18px}
.card{background:#fff;border-radius:8px;padding:12px 16px;min-width:130px;
box-shadow:0 1px 2px rgba(0,0,0,.08)}
.card .v{font-size:1.5rem;font-weight:600}.card .k{color:#5b6475;font-size:.85rem}
.panel{background:#fff;border-radius:8px;padding:14px 16px;box-shadow:0 1px 2px rgba(0,0,0,.08);
margin-bottom:16px;overflow-x:auto}
.grid{display:grid;grid-template-columns:repeat(auto-fit,minmax(520px,1fr));gap:16px}
table{border-collapse:collapse;width:100%;font-size:.9rem}
th,td{padding:5px 10px;border-bottom:1px solid #e6e8ec;text-align:right;white-space:nowrap}
th{background:#f0f2f5;position:sticky;top:0}
td.l,th.l{text-align:left}
tr.warn td{background:#fff4f4}
.legend span{display:inline-block;margin-right:14px;font-size:.85rem}
.legend i{display:inline-block;width:11px;height:11px;margin-right:5px;border-radius:2px;
vertical-align:-1px}
code{background:#f0f2f5;padding:1px 4px;border-radius:3px}
.note{color:#5b6475;font-size:.85rem}
svg{display:block;max-width:100%;height:auto}
"""


# ----------------------------------------------------------------------------- format


def _num(value: Any) -> str:
    if value is None:
        return DASH
    if isinstance(value, float) and not value.is_integer():
        return f"{value:,.1f}"
    return f"{int(value):,}"


def _ms(value: Any) -> str:
    if value is None:
        return DASH
    v = float(value)
    a = abs(v)
    if a < 1000:
        return f"{v:,.1f} ms" if not v.is_integer() else f"{int(v):,} ms"
    if a < 60_000:
        return f"{v / 1000:.2f} s"
    if a < 3_600_000:
        return f"{v / 60_000:.1f} min"
    if a < 86_400_000:
        return f"{v / 3_600_000:.1f} h"
    return f"{v / 86_400_000:.1f} d"


def _ms_short(value: float) -> str:
    for unit, size in (("d", 86_400_000), ("h", 3_600_000), ("min", 60_000), ("s", 1000)):
        if value >= size:
            q = value / size
            return f"{q:g}{unit}" if q == int(q) else f"{q:.1f}{unit}"
    return f"{value:g}ms"


def _pct(part: int, whole: int) -> str:
    return DASH if whole == 0 else f"{100.0 * part / whole:.1f}%"


def _esc(value: Any) -> str:
    return escape("" if value is None else str(value))


def _nice_ticks(top: float, count: int = 5) -> list[float]:
    """Round tick values from 0 to at least ``top``."""
    if top <= 0:
        return [0.0, 1.0]
    raw = top / count
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    ticks = [0.0]
    while ticks[-1] < top:
        ticks.append(round(ticks[-1] + step, 10))
    return ticks


def _short(value: float) -> str:
    a = abs(value)
    for suffix, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if a >= size:
            q = value / size
            return f"{q:.0f}{suffix}" if q == int(q) else f"{q:.1f}{suffix}"
    return f"{value:.0f}" if value == int(value) else f"{value:.1f}"


# ----------------------------------------------------------------------------- charts


def _svg_open(width: int, height: int, label: str) -> str:
    return (
        f'<svg viewBox="0 0 {width} {height}" '
        f'width="{width}" height="{height}" role="img" aria-label="{_esc(label)}" '
        f'style="{FONT};font-size:11px"><title>{_esc(label)}</title>'
    )


def _legend(names: Sequence[str]) -> str:
    items = "".join(
        f'<span><i style="background:{COLORS[n]}"></i>{_esc(LABELS.get(n, n))}</span>'
        for n in names
    )
    return f'<div class="legend">{items}</div>'


def _empty_chart(label: str, width: int = 560, height: int = 120) -> str:
    return (
        _svg_open(width, height, label)
        + f'<text x="{width / 2}" y="{height / 2}" text-anchor="middle" fill="#5b6475">'
        + "no data</text></svg>"
    )


def _y_axis(ticks: Sequence[float], x0: float, x1: float, y_of: Any) -> list[str]:
    parts: list[str] = []
    for tick in ticks:
        y = y_of(tick)
        parts.append(
            f'<line x1="{x0}" y1="{y:.1f}" x2="{x1}" y2="{y:.1f}" stroke="#e6e8ec"/>'
            f'<text x="{x0 - 6}" y="{y + 4:.1f}" text-anchor="end" fill="#5b6475">'
            f"{_short(tick)}</text>"
        )
    return parts


def bar_chart(
    labels: Sequence[str],
    values: Sequence[int],
    title: str,
    color: str = COLORS["bar"],
    width: int = 560,
    height: int = 260,
    markers: Sequence[tuple[float, str]] = (),
) -> str:
    """Vertical bars with value labels; ``markers`` are (position in bars, text) lines."""
    if not values:
        return _empty_chart(title, width)
    rotate = len(values) > 8
    left, right, top, bottom = 64, 12, 34, (70 if rotate else 30)
    height += bottom - 30
    plot_w, plot_h = width - left - right, height - top - bottom
    ticks = _nice_ticks(max(values))
    y_max = ticks[-1]

    def y_of(v: float) -> float:
        return top + plot_h - plot_h * v / y_max

    slot = plot_w / len(values)
    bar_w = max(1.0, slot * 0.72)
    parts = [_svg_open(width, height, title)]
    parts.extend(_y_axis(ticks, left, width - right, y_of))
    for i, (label, value) in enumerate(zip(labels, values, strict=True)):
        x = left + i * slot + (slot - bar_w) / 2
        y = y_of(value)
        parts.append(
            f'<rect x="{x:.1f}" y="{y:.1f}" width="{bar_w:.1f}" height="{top + plot_h - y:.1f}" '
            f'fill="{color}"><title>{_esc(label)}: {value:,}</title></rect>'
        )
        if len(values) <= 16 and value:
            parts.append(
                f'<text x="{x + bar_w / 2:.1f}" y="{y - 4:.1f}" text-anchor="middle" '
                f'fill="#1d2330">{_short(value)}</text>'
            )
        cx = x + bar_w / 2
        ly = top + plot_h + 14
        if rotate:
            parts.append(
                f'<text x="{cx:.1f}" y="{ly:.1f}" text-anchor="end" fill="#5b6475" '
                f'transform="rotate(-40 {cx:.1f} {ly:.1f})">{_esc(label)}</text>'
            )
        else:
            parts.append(
                f'<text x="{cx:.1f}" y="{ly:.1f}" text-anchor="middle" fill="#5b6475">'
                f"{_esc(label)}</text>"
            )
    for position, text in markers:
        x = left + position * slot
        parts.append(
            f'<line x1="{x:.1f}" y1="4" x2="{x:.1f}" y2="{top + plot_h}" '
            f'stroke="#c62828" stroke-dasharray="4 3"/>'
            f'<text x="{x + 3 if x < width - 40 else x - 3:.1f}" y="13" fill="#c62828" '
            f'text-anchor="{"start" if x < width - 40 else "end"}">{_esc(text)}</text>'
        )
    parts.append(
        f'<line x1="{left}" y1="{top + plot_h}" x2="{width - right}" y2="{top + plot_h}" '
        'stroke="#9aa1ad"/></svg>'
    )
    return "".join(parts)


def line_chart(
    xs: Sequence[int],
    series: Sequence[tuple[str, Sequence[int]]],
    title: str,
    bucket_ms: int,
    width: int = 1100,
    height: int = 300,
) -> str:
    """Time series (x in unix ms, one point per bucket) as lines with a time axis."""
    if not xs:
        return _empty_chart(title, width)
    left, right, top, bottom = 56, 16, 14, 40
    plot_w, plot_h = width - left - right, height - top - bottom
    ticks = _nice_ticks(max(max(values) for _, values in series) or 1)
    y_max = ticks[-1]
    x_min, x_max = xs[0], xs[-1] + bucket_ms
    span = max(1, x_max - x_min)

    def x_of(t: float) -> float:
        return left + plot_w * (t - x_min) / span

    def y_of(v: float) -> float:
        return top + plot_h - plot_h * v / y_max

    parts = [_svg_open(width, height, title)]
    parts.extend(_y_axis(ticks, left, width - right, y_of))
    fmt = "%H:%M:%S" if span <= 2 * 3_600_000 else "%H:%M" if span <= 2 * 86_400_000 else "%m-%d"
    for k in range(6):
        t = x_min + span * k / 5
        label = datetime.fromtimestamp(t / 1000, UTC).strftime(fmt)
        anchor = "start" if k == 0 else "end" if k == 5 else "middle"
        parts.append(
            f'<text x="{x_of(t):.1f}" y="{top + plot_h + 16}" text-anchor="{anchor}" '
            f'fill="#5b6475">{label}</text>'
        )
    first = datetime.fromtimestamp(x_min / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    parts.append(
        f'<text x="{left}" y="{height - 4}" fill="#5b6475">from {first}, '
        f"events per {_ms_short(bucket_ms)} bucket</text>"
    )
    for name, values in series:
        points = " ".join(
            f"{x_of(t + bucket_ms / 2):.1f},{y_of(v):.1f}" for t, v in zip(xs, values, strict=True)
        )
        if len(xs) == 1:
            x, y = points.split(",")
            parts.append(f'<circle cx="{x}" cy="{y}" r="3" fill="{COLORS[name]}"/>')
        else:
            parts.append(
                f'<polyline points="{points}" fill="none" stroke="{COLORS[name]}" '
                'stroke-width="1.8" stroke-linejoin="round"/>'
            )
    parts.append(
        f'<line x1="{left}" y1="{top + plot_h}" x2="{width - right}" y2="{top + plot_h}" '
        'stroke="#9aa1ad"/></svg>'
    )
    return "".join(parts)


def stacked_bars(
    rows: Sequence[tuple[str, Sequence[tuple[str, int]]]],
    title: str,
    width: int = 560,
) -> str:
    """Horizontal stacked bars, one per row label, parts coloured by name."""
    if not rows:
        return _empty_chart(title, width)
    left, right, top, row_h = 130, 90, 8, 26
    height = top + row_h * len(rows) + 10
    plot_w = width - left - right
    biggest = max(sum(v for _, v in parts) for _, parts in rows) or 1
    out = [_svg_open(width, height, title)]
    for i, (label, parts) in enumerate(rows):
        y = top + i * row_h
        x = float(left)
        shown = label if len(label) <= 20 else label[:19] + "…"
        out.append(
            f'<text x="{left - 8}" y="{y + 15}" text-anchor="end" fill="#1d2330">'
            f"{_esc(shown)}<title>{_esc(label)}</title></text>"
        )
        for name, value in parts:
            w = plot_w * value / biggest
            if w > 0:
                out.append(
                    f'<rect x="{x:.1f}" y="{y + 3}" width="{w:.1f}" height="{row_h - 8}" '
                    f'fill="{COLORS[name]}"><title>{_esc(label)} {LABELS[name]}: {value:,}'
                    "</title></rect>"
                )
            x += w
        dead = dict(parts).get("dead_lettered", 0)
        out.append(
            f'<text x="{x + 6:.1f}" y="{y + 15}" fill="#5b6475">'
            f"{_short(sum(v for _, v in parts))} · {dead:,} dead</text>"
        )
    out.append("</svg>")
    return "".join(out)


# ----------------------------------------------------------------------------- tables


def _table(
    headers: Sequence[str], rows: Sequence[Sequence[Any]], left: int = 1, warn: Any = None
) -> str:
    head = "".join(
        f'<th class="l">{_esc(h)}</th>' if i < left else f"<th>{_esc(h)}</th>"
        for i, h in enumerate(headers)
    )
    body = []
    for row in rows:
        cells = "".join(
            f'<td class="l">{_esc(c)}</td>' if i < left else f"<td>{_esc(c)}</td>"
            for i, c in enumerate(row)
        )
        cls = ' class="warn"' if warn is not None and warn(row) else ""
        body.append(f"<tr{cls}>{cells}</tr>")
    if not rows:
        body.append(f'<tr><td class="l" colspan="{len(headers)}">none</td></tr>')
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _card(value: str, label: str) -> str:
    return (
        f'<div class="card"><div class="v">{_esc(value)}</div>'
        f'<div class="k">{_esc(label)}</div></div>'
    )


def _hist_label(row: dict[str, Any]) -> str:
    lo, hi = row["lo"], row["hi"]
    if lo is None:
        return "<0"
    if hi is None:
        return f"≥{_ms_short(lo)}"
    if lo == 0:
        return f"<{_ms_short(hi)}"
    low, high = _ms_short(lo), _ms_short(hi)
    unit_low, unit_high = low.lstrip("0123456789."), high.lstrip("0123456789.")
    if unit_low == unit_high:
        return f"{low[: len(low) - len(unit_low)]}{DASH}{high}"
    return f"{low}{DASH}{high}"


def _marker_position(rows: Sequence[dict[str, Any]], value: float) -> float | None:
    """Where ``value`` falls in the histogram's bars (bar index + fraction)."""
    for i, row in enumerate(rows):
        lo = row["lo"] if row["lo"] is not None else -math.inf
        hi = row["hi"] if row["hi"] is not None else math.inf
        if lo <= value < hi:
            if math.isinf(lo) or math.isinf(hi) or hi == lo:
                return i + 0.5
            return i + (value - lo) / (hi - lo)
    return None


# ------------------------------------------------------------------------------- page


def render_html(report: dict[str, Any], extras: dict[str, Any], meta: dict[str, Any]) -> str:
    """The whole page as a string."""
    totals = report["totals"]
    latency = report["latency_ms"]
    anomalies = report["anomalies"]
    messages = int(totals["messages"])
    sections: list[str] = []

    # header and totals
    first_ts, last_ts = extras.get("first_ts"), extras.get("last_ts")
    span = ""
    if first_ts is not None and last_ts is not None:
        start = datetime.fromtimestamp(first_ts / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S")
        end = datetime.fromtimestamp(last_ts / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S")
        span = f"events from {start} to {end} UTC ({_ms(last_ts - first_ts)}); "
    logs = ", ".join(str(p) for p in meta.get("logs", []))
    events = report["input"]["events"]
    sections.append(
        "<h1>SKMQ delivery audit</h1>"
        f'<div class="meta">{_esc(span)}{_num(events)} events in '
        f"{_num(meta.get('files'))} file(s) from <code>{_esc(logs)}</code>; "
        f"generated {_esc(meta.get('generated', ''))} on Spark <code>"
        f"{_esc(meta.get('master', ''))}</code> in {_esc(meta.get('elapsed_s', '?'))} s.</div>"
    )
    cards = [
        _card(_num(messages), "messages stored"),
        _card(f"{_num(totals['acked'])} ({_pct(totals['acked'], messages)})", "acked"),
        _card(
            f"{_num(totals['dead_lettered'])} ({_pct(totals['dead_lettered'], messages)})",
            "dead-lettered",
        ),
        _card(
            f"{_num(totals['dropped'])} ({_pct(totals['dropped'], messages)})",
            "dropped (expired or purged)",
        ),
        _card(
            f"{_num(totals['unresolved'])} ({_pct(totals['unresolved'], messages)})",
            "unresolved",
        ),
        _card(_num(totals["dead_letter_entries"]), "dead-letter entries"),
        _card(_num(report["input"]["bad_lines"]["total"]), "bad lines skipped"),
        _card(_num(totals["duplicates"]), "duplicates"),
        _card(_num(totals["pushes"]), "pushes"),
        _card(_ms(latency["p50"]), "latency p50"),
        _card(_ms(latency["p99"]), "latency p99"),
    ]
    sections.append(f'<div class="cards">{"".join(cards)}</div>')
    sections.append(_outcome_section(report["outcomes"], totals))

    # throughput
    series = extras.get("throughput", {"bucket_ms": 1000, "rows": []})
    rows = series["rows"]
    names = ("stored", "pushed", "acked", "dead_lettered")
    chart = line_chart(
        [r["t"] for r in rows],
        [(n, [r[n] for r in rows]) for n in names],
        "Throughput over time",
        int(series["bucket_ms"]),
    )
    sections.append(
        f'<h2>Throughput over time</h2><div class="panel">{_legend(names)}{chart}</div>'
    )

    # latency and attempts
    hist = extras.get("latency_histogram", [])
    markers = []
    for key in ("p50", "p95", "p99"):
        if latency.get(key) is not None:
            position = _marker_position(hist, float(latency[key]))
            if position is not None:
                markers.append((position, key))
    latency_chart = bar_chart(
        [_hist_label(r) for r in hist],
        [r["count"] for r in hist],
        "Latency from due to first ack, time in the DLQ excluded (acked deliveries per bucket)",
        COLORS["acked"],
        markers=markers,
    )
    latency_table = _table(
        ["", "p50", "p95", "p99", "max"],
        [
            ["due → first ack", *(_ms(latency[k]) for k in ("p50", "p95", "p99", "max"))],
            [
                "due → first push",
                *(_ms(report["first_push_ms"][k]) for k in ("p50", "p95", "p99", "max")),
            ],
        ],
    )
    attempts = report["attempts"]
    attempts_chart = bar_chart(
        [f"#{k}" if k != "unknown" else "?" for k in attempts],
        [int(v) for v in attempts.values()],
        "Acked deliveries by attempt of the first ack (replays count as new attempts)",
    )
    sections.append(
        '<div class="grid">'
        f'<div><h2>Latency distribution</h2><div class="panel">{latency_table}'
        f'<p class="note">Exact percentiles (linear interpolation); log-scale buckets; '
        f"dashed lines mark the percentiles.</p>{latency_chart}</div></div>"
        f'<div><h2>Attempts</h2><div class="panel">{attempts_chart}'
        f'<p class="note">Attempt number of the first <code>acked</code> event of each acked '
        f"delivery, after the attempts of every replayed dead letter.</p></div></div></div>"
    )

    # per app
    by_app = report["by_app"]
    topics = extras.get("topic_deliveries", {})
    app_chart = stacked_bars(
        [
            (
                a["appid"],
                [
                    ("acked", a["acked"]),
                    ("dead_lettered", a["dead_lettered"]),
                    ("dropped", a["dropped"]),
                    ("unresolved", a["unresolved"]),
                ],
            )
            for a in by_app
        ],
        "Messages per app: acked, dead-lettered, dropped, unresolved",
    )
    app_table = _table(
        [
            "app",
            "messages",
            "topic copies",
            "acked",
            "dead-lettered",
            "DLQ entries",
            "dropped",
            "unresolved",
            "acked %",
            "p99",
        ],
        [
            [
                a["appid"],
                _num(a["messages"]),
                _num(topics.get(a["appid"], 0)),
                _num(a["acked"]),
                _num(a["dead_lettered"]),
                _num(a["dead_letter_entries"]),
                _num(a["dropped"]),
                _num(a["unresolved"]),
                _pct(a["acked"], a["messages"]),
                _ms(a["p99_ms"]),
            ]
            for a in by_app
        ],
    )
    sections.append(
        "<h2>Per app: outcomes and dead letters</h2>"
        f'<div class="panel">{_legend(_GROUPS)}{app_chart}'
        f'</div><div class="panel">{app_table}</div>'
    )

    # per recipient
    extra = {(r["appid"], r["recipient"]): r for r in extras.get("recipients", [])}
    recipient_rows = []
    for r in report["by_recipient"]:
        more = extra.get((r["appid"], r["recipient"]), {})
        recipient_rows.append(
            [
                r["appid"],
                r["recipient"],
                _num(r["pushes"]),
                _num(r["acked"]),
                _num(r["rejected"]),
                _num(r["errored"]),
                _num(r["timeouts"]),
                _pct(r["acked"], r["pushes"]),
                _num(more.get("unreachable", 0)),
                _num(more.get("lost", 0)),
            ]
        )
    sections.append(
        '<h2>Per recipient</h2><div class="panel">'
        + _table(
            [
                "app",
                "recipient",
                "pushes",
                "acked",
                "rejected",
                "errored",
                "timeouts",
                "acked/push",
                "unreachable",
                "lost",
            ],
            recipient_rows,
            left=2,
        )
        + "</div>"
    )

    sections.append(_dead_letter_section(report["dead_letters"]))
    sections.append(_unresolved_section(report["unresolved"]))
    sections.append(_anomaly_section(anomalies))
    sections.append(_bad_line_section(report["input"]))

    body = "".join(sections)
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>SKMQ delivery audit</title><style>{CSS}</style></head>"
        f"<body><main>{body}</main></body></html>\n"
    )


def _panels(*panels: str) -> str:
    """Panels side by side."""
    inner = "".join(f'<div class="panel">{p}</div>' for p in panels)
    return f'<div class="grid">{inner}</div>'


def _samples(samples: Iterable[tuple[str, Sequence[dict[str, Any]]]]) -> str:
    """A table of sample deliveries: (what they are a sample of, the deliveries) in turn."""
    rows = [
        [title, r["appid"], r["msgid"], r["recipient"] if r["recipient"] is not None else DASH]
        for title, refs in samples
        for r in refs
    ]
    return _table(["sample of", "app", "msgid", "recipient"], rows, left=4)


def _when(ts: Any) -> str:
    if ts is None:
        return DASH
    return datetime.fromtimestamp(int(ts) / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S")


def _history(entry: dict[str, Any]) -> str:
    return " → ".join(
        f"{h['event']}" + (f"#{h['attempt']}" if h["attempt"] is not None else "")
        for h in entry["history"]
    )


def _dead_letter_section(dead: dict[str, Any]) -> str:
    reasons = _table(
        ["app", "last failure", "entries"],
        [[r["appid"], r["reason"], _num(r["entries"])] for r in dead["by_app_reason"]],
        left=2,
    )
    headers = ["app", "msgid", "last recipient", "reason", "attempts", "dead since", "history"]

    def rows(entries: Sequence[dict[str, Any]]) -> list[list[Any]]:
        return [
            [
                e["appid"],
                e["msgid"],
                e.get("last_recipient") or e["recipient"] or DASH,
                e["reason"],
                _num(e["attempts"]),
                _when(e["dead_since"]),
                _history(e),
            ]
            for e in entries
        ]

    return (
        f"<h2>Dead-letter queue: {_num(dead['entries'])} entries of "
        f"{_num(dead['messages'])} messages</h2>"
        '<p class="note">An entry is one dead delivery: a topic message dead for two '
        "recipients is two entries. The last recipient is the one its last event names (a "
        "consumer group's: <code>group:&lt;name&gt;/&lt;consumer&gt;</code>). The history "
        "is the delivery's events in the log.</p>"
        f'<div class="panel">{reasons}</div>'
        f'<h3>Oldest</h3><div class="panel">{_table(headers, rows(dead["oldest"]), left=4)}</div>'
        f'<h3>Most tried</h3><div class="panel">'
        f"{_table(headers, rows(dead['most_tried']), left=4)}</div>"
    )


def _outcome_section(outcomes: dict[str, Any], totals: dict[str, Any]) -> str:
    """Every way a message ended or waits: one row each, and the check that they add up."""
    messages = int(totals["messages"])
    rows = [
        [
            OUTCOME_LABELS.get(r["outcome"], r["outcome"]),
            LABELS.get(r["group"], r["group"]),
            _num(r["messages"]),
            _pct(r["messages"], messages),
            _num(r["deliveries"]),
        ]
        for r in outcomes["rows"]
    ]
    rows.append(["total", "", _num(messages), "", _num(totals["deliveries"])])
    table = _table(["outcome", "counted as", "messages", "%", "deliveries"], rows, left=2)
    verdict = "holds" if outcomes["holds"] else "DOES NOT HOLD (an audit error)"
    style = "" if outcomes["holds"] else ' style="color:#c62828;font-weight:600"'
    return (
        "<h2>Outcomes: how every message ended, or waits</h2>"
        f'<div class="panel">{table}<p class="note"{style}>{_esc(outcomes["invariant"])}: '
        f"{verdict}. A message with several deliveries (a topic's recipients, consumer "
        "groups) is in the row of the first, in precedence order (dead letters, drops, "
        "stuck, in flight, waiting, not yet due, acked), that one of them has.</p></div>"
    )


def _unresolved_section(unresolved: dict[str, Any]) -> str:
    described = [
        ("not_yet_due", "not yet due (delayed, or waiting for a retry) at the end of the log"),
        ("waiting_for_recipient", "due, never pushed: waiting for a recipient"),
        ("in_flight", "pushed, with an event in the last stuck-after period"),
        ("stuck", f"pushed, no event for {_ms(unresolved['stuck_after_ms'])} or more"),
    ]
    counts = _table(
        ["unresolved deliveries", "count"],
        [[text, _num(unresolved[key])] for key, text in described],
        warn=lambda row: row[0].startswith("pushed, no event") and row[1] != "0",
    )
    sample = _samples([("stuck", unresolved["stuck_sample"])])
    heading = f"<h2>Unresolved at {_esc(_when(unresolved['as_of']))} UTC</h2>"
    return heading + _panels(counts, sample)


def _anomaly_section(anomalies: dict[str, Any]) -> str:
    described = [
        ("acked_more_than_once", "deliveries acked more than once"),
        ("pushed_after_ack", "deliveries pushed again after their first ack"),
        ("acked_after_dead_letter", "deliveries acked after a dead letter, without a replay"),
        ("acked_before_stored", "deliveries whose first ack precedes their due time"),
        ("unstored_messages", "message ids with events but no stored event"),
    ]
    rows = [[text, _num(anomalies.get(key, 0))] for key, text in described]
    counts = _table(["", "count"], rows, warn=lambda row: row[1] not in ("0", DASH))
    note = (
        '<p class="note">A queue message is one delivery; a topic message one delivery per '
        "recipient.</p>"
    )
    samples = _samples((key, anomalies.get("samples", {}).get(key, [])) for key, _ in described)
    return "<h2>Anomalies</h2>" + _panels(counts + note, samples)


def _bad_line_section(source: dict[str, Any]) -> str:
    bad = source["bad_lines"]
    counts = _table(
        ["reason", "lines"],
        [[reason, _num(n)] for reason, n in bad["by_reason"].items()],
        warn=lambda row: True,
    )
    samples = _table(
        ["reason", "file", "line"],
        [[s["reason"], s["file"], s["line"]] for s in bad["samples"]],
        left=3,
    )
    skipped = _table(
        ["skipped file", "problem"],
        [[f["path"], f["problem"]] for f in source.get("skipped_files", [])],
        left=2,
    )
    return (
        f"<h2>Bad lines: {_num(bad['total'])} (not counted anywhere above)</h2>"
        + _panels(counts, skipped)
        + f'<div class="panel">{samples}</div>'
    )
