"""Messages as an earlier SKMQ's store holds them (skmq/store/messages.py): 5-byte
compact headers or text ones, both read back alike."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from skmq.store.messages import DAY_MS, WRAP, header, read

APP = "heads"
NOW = 1_764_000_000_000  # 2025-11-24
KINDS = st.sampled_from(["queue", "topic"])


@given(KINDS, st.integers(0, 10**13 - 1), st.binary(max_size=64))
def test_a_text_header_reads_back(kind: str, ms: int, content: bytes) -> None:
    value = header(kind, ms, compact=False) + content
    assert value[:1] in (b"q", b"t") and len(value) == 14 + len(content)
    assert read(value, NOW) == (kind, ms, content)


@given(KINDS, st.integers(NOW - WRAP + DAY_MS + 1, NOW + DAY_MS), st.binary(max_size=64))
def test_a_compact_header_reads_back_within_its_span(kind: str, ms: int, content: bytes) -> None:
    value = header(kind, ms, compact=True) + content
    assert value[0] >= 128 and len(value) == 5 + len(content)
    assert read(value, NOW) == (kind, ms, content)


def test_a_compact_header_wraps_after_its_span() -> None:
    # 8.7 years: a message older than that reads as stored a span later
    old = NOW - WRAP + DAY_MS
    assert read(header("queue", old, compact=True), NOW)[1] == old + WRAP
    # a clock a day ahead of ours is still read right
    assert read(header("topic", NOW + DAY_MS, compact=True), NOW)[1:] == (NOW + DAY_MS, b"")
