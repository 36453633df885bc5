"""The delivery log on disk (issue 19): closed files compressed, held files left alone,
retention by size and by age, a crash's leftovers finished, indexes never reused."""

from __future__ import annotations

import fcntl
import gzip
import json
import os
import time
from pathlib import Path

from skmq.deliverylog import DeliveryLog
from skmq.events import Event
from skmq.logarchive import LogArchive, log_files, read_lines


def _write(dlog: DeliveryLog, n: int, start: int = 0) -> None:
    for i in range(start, start + n):
        dlog.event(Event.STORED, f"m{i}", "shop", "queue")
    dlog.flush()


def _msgids(directory: Path) -> list[str]:
    return [json.loads(line)["msgid"] for p in log_files(directory) for line in read_lines(p)]


def _names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_closed_files_are_compressed_and_the_held_one_is_not(tmp_path: Path) -> None:
    dlog = DeliveryLog(tmp_path, "b1", rotate_bytes=4096)
    archive = LogArchive(tmp_path, retention_bytes=0, retention_age=0)
    _write(dlog, 300)  # about 160 B a line: a dozen files
    archive.sweep()
    names = _names(tmp_path)
    assert len(names) > 5
    # Every file but the one being written (held by the log's lock) is compressed.
    assert [n for n in names if not n.endswith(".jsonl.gz")] == [
        f"delivery-b1-{len(names) - 1:06d}.jsonl"
    ]
    assert archive.compressed == len(names) - 1
    assert _msgids(tmp_path) == [f"m{i}" for i in range(300)]  # all, in order
    with gzip.open(tmp_path / names[0], "rt") as f:  # a complete, plain gzip file
        assert json.loads(f.readline())["msgid"] == "m0"

    dlog.close()  # released: the next sweep takes its last file too
    archive.sweep()
    assert all(n.endswith(".jsonl.gz") for n in _names(tmp_path))
    assert _msgids(tmp_path) == [f"m{i}" for i in range(300)]


def test_a_file_another_broker_holds_is_left_alone(tmp_path: Path) -> None:
    other = tmp_path / "delivery-b2-000000.jsonl"
    other.write_text('{"ts":1}\n')
    with open(other, "rb") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # a live broker writing it
        # Neither compressed nor pruned, whatever the bounds.
        LogArchive(tmp_path, retention_bytes=1, retention_age=1e-9).sweep()
        assert _names(tmp_path) == [other.name]
    LogArchive(tmp_path, 0, 0).sweep()  # that broker is gone: its file is compressed
    assert _names(tmp_path) == [other.name + ".gz"]


def test_retention_by_size_removes_the_oldest_compressed_files(tmp_path: Path) -> None:
    dlog = DeliveryLog(tmp_path, "b1", rotate_bytes=4096)
    _write(dlog, 300)
    LogArchive(tmp_path, 0, 0).sweep()
    gz = sorted(tmp_path.glob("*.gz"))
    for age, path in enumerate(reversed(gz)):  # file n is older than file n + 1
        os.utime(path, (time.time() - 60 - age, time.time() - 60 - age))
    current = tmp_path / f"delivery-b1-{len(gz):06d}.jsonl"
    bound = sum(p.stat().st_size for p in gz[-3:]) + current.stat().st_size
    archive = LogArchive(tmp_path, retention_bytes=bound, retention_age=0)
    archive.sweep()
    assert sorted(tmp_path.glob("*.gz")) == gz[-3:]  # the three newest fit the bound
    assert archive.pruned == len(gz) - 3
    assert current.exists()  # never the file being written
    dlog.close()


def test_retention_by_age_removes_old_files_only(tmp_path: Path) -> None:
    old, new = tmp_path / "delivery-a-000000.jsonl.gz", tmp_path / "delivery-a-000001.jsonl.gz"
    for path in (old, new):
        path.write_bytes(gzip.compress(b'{"ts":1}\n'))
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    archive = LogArchive(tmp_path, retention_bytes=0, retention_age=3600)
    archive.sweep()
    assert _names(tmp_path) == [new.name]
    assert archive.pruned == 1


def test_a_crash_mid_compression_leaves_the_lines_once(tmp_path: Path) -> None:
    lines = "".join(f'{{"msgid":"m{i}"}}\n' for i in range(100))
    (tmp_path / "delivery-b1-000000.jsonl").write_text(lines)
    # Killed while writing the .gz: a partial .part beside the intact .jsonl.
    (tmp_path / "delivery-b1-000000.jsonl.gz.part").write_bytes(gzip.compress(b"x" * 99)[:20])
    LogArchive(tmp_path, 0, 0).sweep()
    assert _names(tmp_path) == ["delivery-b1-000000.jsonl.gz"]
    assert _msgids(tmp_path) == [f"m{i}" for i in range(100)]


def test_a_restart_with_the_same_broker_id_never_reuses_a_compressed_index(
    tmp_path: Path,
) -> None:
    first = DeliveryLog(tmp_path, "b1", rotate_bytes=1 << 20)
    _write(first, 10)
    first.close()
    LogArchive(tmp_path, 0, 0).sweep()
    # The compressed index's plain name is back (an operator, a race): not reused either.
    (tmp_path / "delivery-b1-000000.jsonl").touch()
    again = DeliveryLog(tmp_path, "b1", rotate_bytes=1 << 20)
    _write(again, 10, start=10)
    again.close()
    assert (tmp_path / "delivery-b1-000001.jsonl").exists()
    LogArchive(tmp_path, 0, 0).sweep()
    assert sorted(_msgids(tmp_path)) == sorted(f"m{i}" for i in range(20))


def test_a_log_that_logged_nothing_leaves_no_file(tmp_path: Path) -> None:
    DeliveryLog(tmp_path, "cli-1").close()  # (a `dlq purge` that selected nothing)
    assert _names(tmp_path) == []
    dlog = DeliveryLog(tmp_path, "cli-2")
    _write(dlog, 1)
    dlog.close()
    assert _names(tmp_path) == ["delivery-cli-2-000000.jsonl"]


def test_a_restart_goes_on_with_an_uncompressed_last_file(tmp_path: Path) -> None:
    first = DeliveryLog(tmp_path, "b1", rotate_bytes=1 << 20)
    _write(first, 5)
    first.close()
    again = DeliveryLog(tmp_path, "b1", rotate_bytes=1 << 20)
    _write(again, 5, start=5)
    again.close()
    assert _names(tmp_path) == ["delivery-b1-000000.jsonl"]
    assert _msgids(tmp_path) == [f"m{i}" for i in range(10)]


def test_a_crash_between_rename_and_unlink_leaves_the_lines_once(tmp_path: Path) -> None:
    """Killed after the .gz was renamed into place, before the .jsonl was removed: both
    hold the same lines. The next sweep removes the .jsonl (it wrote a third copy,
    `-<inode>.jsonl.gz`, before); a .gz with other lines is still kept beside."""
    lines = "".join(f'{{"msgid":"m{i}"}}\n' for i in range(100))
    (tmp_path / "delivery-b1-000000.jsonl").write_text(lines)
    (tmp_path / "delivery-b1-000000.jsonl.gz").write_bytes(gzip.compress(lines.encode()))
    (tmp_path / "delivery-b1-000001.jsonl").write_text('{"msgid":"new"}\n')
    (tmp_path / "delivery-b1-000001.jsonl.gz").write_bytes(gzip.compress(b'{"msgid":"old"}\n'))
    archive = LogArchive(tmp_path, 0, 0)
    archive.sweep()
    names = set(_names(tmp_path))
    kept = {"delivery-b1-000000.jsonl.gz", "delivery-b1-000001.jsonl.gz"}
    assert kept < names and len(names) == 3
    assert next(iter(names - kept)).startswith("delivery-b1-000001-")
    assert sorted(_msgids(tmp_path)) == sorted([f"m{i}" for i in range(100)] + ["new", "old"])
