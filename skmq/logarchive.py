"""The delivery log's closed files: compressed, then kept within a retention bound.

A broker holds an exclusive `flock` on the file it writes (skmq/deliverylog.py), so a
`delivery-*.jsonl` file nobody holds is closed for good: rotated away from, or left by a
broker that stopped or died. A sweep, in a worker thread, gzips every such file of the
directory (any broker's: brokers may share one directory, and a broker killed with -9
is not there to finish its own) and then prunes the compressed files: those older than
LOG_RETENTION_AGE, then the oldest until the log takes at most LOG_RETENTION_BYTES.
Files still being written are never compressed nor pruned.

Compression is gzip level 1, which the audit (and Spark, by the `.gz` suffix) reads as
is: about 0.8 us of CPU and 25-40 bytes on disk for a message's ~680 bytes of lines.
The `.gz` is written as `<name>.gz.part`, synced and renamed, and only then is the
`.jsonl` removed: a crash at any point leaves the lines in a complete file; a crash
between the rename and the removal leaves them twice, and the next sweep, finding the
`.gz` holds the same lines, removes the `.jsonl` (the audit counts identical lines once
meanwhile).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import gzip
import os
import shutil
import stat
import threading
import time
import zlib
from pathlib import Path

import structlog

log = structlog.get_logger("skmq.logarchive")

# Between sweeps when no rotation asks for one (the age bound, files of dead brokers).
SWEEP_INTERVAL = 300.0
LEVEL = 1
_CHUNK = 1 << 20


def try_lock(fd: int) -> bool:
    """An exclusive lock on an open log file, without waiting. True also where the file
    system has no locks (nothing to coordinate with then); False: another holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return False
        return exc.errno in (errno.ENOLCK, errno.EINVAL, errno.EOPNOTSUPP)
    return True


class LogArchive:
    def __init__(self, directory: Path, retention_bytes: int, retention_age: float) -> None:
        self.dir = directory
        self.retention_bytes = retention_bytes  # 0: no size bound
        self.retention_age = retention_age  # 0: no age bound
        self.compressed = 0
        self.pruned = 0
        self.errors = 0
        self._wake = asyncio.Event()
        # One sweep at a time: a cancelled task's sweep goes on in its thread, and the
        # broker's last sweep at stop must come after it (else it skips the file that
        # sweep holds, and returns while that file is half compressed).
        self._sweeping = threading.Lock()

    def wake(self) -> None:
        """A file was closed (a rotation): sweep soon."""
        self._wake.set()

    async def run(self) -> None:
        """The supervised task: a sweep when woken, or every SWEEP_INTERVAL."""
        while True:
            await asyncio.to_thread(self.sweep)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), SWEEP_INTERVAL)
            self._wake.clear()

    def sweep(self) -> None:
        """Compress every closed log file, then prune (blocking: a worker thread's)."""
        with self._sweeping:
            for path in sorted(self.dir.glob("delivery-*.jsonl")):
                self._compress(path)
            self._prune()

    def _compress(self, path: Path) -> None:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return  # gone meanwhile: another broker compressed it
        try:
            # Held, unlinked since it was listed (compressed by another), or not a plain
            # file (a link to a device: /dev/full in a test): not ours.
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_nlink == 0 or not try_lock(fd):
                return
            part = path.with_name(path.name + ".gz.part")
            target = path.with_name(path.name + ".gz")
            if target.exists():
                if _same_lines(fd, target):  # a crash between the rename and the unlink
                    path.unlink()
                    log.info("delivery log file already compressed", file=path.name)
                    return
                # Its index was written again after a race: keep both.
                target = path.with_name(f"{path.stem}-{st.st_ino}.jsonl.gz")
            with open(fd, "rb", closefd=False) as src, open(part, "wb") as raw:
                with gzip.GzipFile(path.name, "wb", LEVEL, raw, mtime=0) as gz:
                    shutil.copyfileobj(src, gz, _CHUNK)
                raw.flush()
                os.fsync(raw.fileno())
            os.replace(part, target)
            path.unlink()
            self.compressed += 1
        except OSError as exc:  # a full disk: the .jsonl stays, tried again next sweep
            self.errors += 1
            log.warning("delivery log file not compressed", file=path.name, error=str(exc))
            with contextlib.suppress(OSError):
                path.with_name(path.name + ".gz.part").unlink()
        finally:
            os.close(fd)  # releases the lock

    def _prune(self) -> None:
        files: list[tuple[float, int, Path]] = []
        total = 0
        for path in self.dir.glob("delivery-*.jsonl*"):
            with contextlib.suppress(OSError):
                st = path.stat()
                total += st.st_size
                if path.name.endswith(".gz"):
                    files.append((st.st_mtime, st.st_size, path))
        files.sort()
        oldest_kept = time.time() - self.retention_age
        for mtime, size, path in files:
            too_old = self.retention_age > 0 and mtime < oldest_kept
            too_big = self.retention_bytes > 0 and total > self.retention_bytes
            if not (too_old or too_big):
                break
            with contextlib.suppress(FileNotFoundError):  # another broker pruned it
                path.unlink()
                self.pruned += 1
                log.info("delivery log file pruned", file=path.name, bytes=size,
                         why="age" if too_old else "size")  # fmt: skip
            total -= size


def _same_lines(fd: int, compressed: Path) -> bool:
    """The open file ``fd`` holds exactly what the gzip file ``compressed`` does."""
    try:
        with open(fd, "rb", closefd=False) as plain, gzip.open(compressed, "rb") as packed:
            while True:
                chunk = plain.read(_CHUNK)
                if packed.read(len(chunk) or 1) != chunk:
                    return False
                if not chunk:
                    return True
    except (OSError, EOFError, zlib.error):
        return False  # not a complete gzip file: compress again beside it
    finally:
        os.lseek(fd, 0, os.SEEK_SET)


def log_files(directory: Path) -> list[Path]:
    """The delivery-log files under `directory` (at any depth), compressed or not."""
    return sorted(
        path
        for path in directory.glob("**/delivery-*.jsonl*")
        if path.name.endswith((".jsonl", ".jsonl.gz"))
    )


def read_lines(path: Path) -> list[str]:
    """The non-blank lines of a delivery-log file, compressed or not."""
    with (gzip.open if path.name.endswith(".gz") else open)(
        path, "rt", encoding="utf-8", errors="replace"
    ) as f:
        return [line for line in f.read().splitlines() if line.strip()]
