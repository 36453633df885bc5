"""Small file systems to fill: a tmpfs mounted for one test (root only; where the mount
is refused, the test is skipped with the reason)."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def small_disk(path: Path, size: str = "8m") -> Iterator[Path]:
    """A tmpfs of `size` at `path`, unmounted afterwards."""
    path.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs: {mounted.stderr.strip() or 'not root'}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30)


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def fill(disk: Path, leave: int = 0) -> Path:
    """Grow a file on `disk` until `leave` bytes are free (0: until it is full); remove
    the file to make room again."""
    filler = disk / "filler"
    with filler.open("ab", buffering=0) as f:
        try:
            while (room := free_bytes(disk) - leave) > 0 or not leave:
                f.write(b"\0" * min(max(room, 4096), 65536))
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
    return filler
