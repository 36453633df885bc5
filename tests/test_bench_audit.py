"""bench/audit_bench.py's --events: the sizes its help names (1M, 10M) and plain counts."""

from __future__ import annotations

import pytest

from bench.audit_bench import event_counts, main


def test_event_sizes_take_a_unit_or_a_plain_count() -> None:
    assert event_counts("1M,5M,10M") == [1_000_000, 5_000_000, 10_000_000]
    assert event_counts("1000000, 500k,2m") == [1_000_000, 500_000, 2_000_000]


@pytest.mark.parametrize("bad", ["1.5M", "x", "", "1M,", "0", "-1", "1G"])
def test_a_bad_size_is_one_line_and_status_2(bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        main(["--events", bad])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not a number of events" in err
