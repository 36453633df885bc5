"""The new lines of a live log directory, handed over as files that are never appended.

A broker appends to its open ``delivery-<broker>-<n>.jsonl``, and when it rotates away
from it (or stops), skmq/logarchive.py writes ``<name>.gz`` (or, after a race,
``delivery-<broker>-<n>-<inode>.jsonl.gz``) and removes the ``.jsonl``.  Spark's file
source reads each file once, when it appears: it would read an open file half-written
and never again, and read a rotated file's lines a second time under its ``.gz`` name.

:class:`LogTail` follows the directory instead: each poll it reads the complete lines
appended to every open ``.jsonl`` since the last poll (from a descriptor it keeps open,
so the lines still to read of a file compressed and removed meanwhile are not lost),
and writes them into a *chunk*, a new file of ``chunks`` that is complete when it
appears (written under a hidden name, then renamed), which the streaming query reads
once.  A ``.gz`` that is a followed ``.jsonl`` compressed is not read again: the file is
only renamed.  A compressed file that appears otherwise (a log present when the audit
started, a file copied in) is linked (copied across file systems) as one chunk.

Each chunk is named ``c<serial>-s<source>.jsonl[.gz]``: ``source`` numbers the log
file it came from, so that a report names the file as it is called now, and leaves
out the lines of a file that is gone.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .inputs import AuditInputError, BadFile, check_files, resolve_log_paths

__all__ = ["CHUNK_NAME", "LogTail", "Source"]

CHUNK_NAME = re.compile(r"c(\d+)-s(\d+)\.jsonl(?:\.gz|\.bz2)?$")
_READ = 8 << 20  # bytes read at a time
_MAX_CHUNK = 256 << 20  # bytes of one file taken in one poll (the rest at the next)


@dataclass
class Source:
    """A log file followed: its current name, and for an open ``.jsonl`` the descriptor
    and the offset of the first byte not taken yet."""

    number: int
    name: str
    fd: int | None = None
    offset: int = 0
    gone: bool = False  # removed, and no compressed copy found

    def twin(self, compressed: str) -> bool:
        """``compressed`` is the name skmq/logarchive.py gives this ``.jsonl`` gzipped."""
        if not self.name.endswith(".jsonl"):
            return False
        stem = self.name.removesuffix(".jsonl")
        return compressed == self.name + ".gz" or (
            compressed.startswith(stem + "-")
            and compressed.endswith(".jsonl.gz")
            and compressed[len(stem) + 1 : -len(".jsonl.gz")].isdigit()
        )


class LogTail:
    """Chunks of the new lines of the log files at ``logs`` (as ``--logs`` names them)."""

    def __init__(self, logs: Sequence[str], chunks: Path, skip_bad_files: bool = False) -> None:
        self.logs = list(logs)
        self.chunks = chunks
        self.skip_bad_files = skip_bad_files
        self.sources: dict[int, Source] = {}  # by number, every file ever followed
        self.keys: dict[tuple[int, int], Source] = {}  # by (device, inode), those listed
        self.skipped: list[BadFile] = []
        self.serial = 0
        self.numbered = 0
        chunks.mkdir(parents=True, exist_ok=True)

    def _listed(self) -> list[str]:
        try:
            return resolve_log_paths(self.logs)
        except AuditInputError as exc:
            if str(exc).startswith(("no delivery log files", "no file matches")):
                return []  # nothing written yet
            raise

    def files(self) -> list[str]:
        """The current names of the files followed and still there."""
        return [s.name for s in self.sources.values() if not s.gone]

    def gone(self) -> list[int]:
        """The sources whose file is gone (removed, pruned): their lines are left out."""
        return [s.number for s in self.sources.values() if s.gone]

    def names(self) -> dict[int, str]:
        return {s.number: s.name for s in self.sources.values()}

    def _new(self, path: str, fd: int | None = None, gone: bool = False) -> Source:
        self.numbered += 1
        source = self.sources[self.numbered] = Source(self.numbered, path, fd, gone=gone)
        return source

    def poll(self, final: bool = False) -> int:
        """Take what is new; the number of chunks written.  ``final``: also a last line
        without its newline, and a ``.gz`` beside its ``.jsonl`` (a crash of the
        compression: a batch audit reads both too)."""
        written = 0
        listed: dict[tuple[int, int], str] = {}
        for path in self._listed():
            with contextlib.suppress(OSError):
                st = os.stat(path)
                listed[(st.st_dev, st.st_ino)] = path
        # A file no longer listed is forgotten by its inode, which a new file may reuse.
        self.keys = {key: s for key, s in self.keys.items() if key in listed}
        for key, path in listed.items():
            if key in self.keys:
                self.keys[key].name = path  # renamed
            elif path.endswith(".jsonl"):
                self._open(key, path)
        for key, path in listed.items():
            if key not in self.keys:
                written += self._compressed(key, path, final)
        present = {s.number for s in self.keys.values()}
        for source in list(self.sources.values()):
            if source.fd is not None:
                written += self._take(source, final)
            if source.fd is None and source.number not in present:
                source.gone = True
        return written

    def _open(self, key: tuple[int, int], path: str) -> None:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return  # gone meanwhile: its .gz is found at the next poll
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != key:
            os.close(fd)
            return
        self.keys[key] = self._new(path, fd)

    def _compressed(self, key: tuple[int, int], path: str, final: bool) -> int:
        name = os.path.basename(path)
        for source in self.sources.values():
            if source.twin(path):
                if source.fd is not None and os.fstat(source.fd).st_nlink > 0 and not final:
                    return 0  # the .jsonl is still there: compressed this very moment
                if source.fd is None or os.fstat(source.fd).st_nlink == 0:
                    written = self._take(source, True) if source.fd is not None else 0
                    source.name, source.gone = path, False
                    self.keys[key] = source
                    return written
        bad = check_files([path])
        if bad:
            if not self.skip_bad_files:
                raise AuditInputError(
                    f"cannot read {bad[0].line()} (--skip-bad-files to audit the others)"
                )
            self.skipped.extend(bad)
            self.keys[key] = self._new(path, gone=True)
            return 0
        source = self.keys[key] = self._new(path)
        suffix = name[name.index(".jsonl") :]
        target = self._chunk_path(source, suffix)
        hidden = target.with_name("." + target.name)
        try:
            os.link(path, hidden)
        except OSError:
            shutil.copyfile(path, hidden)
        os.replace(hidden, target)
        return 1

    def _chunk_path(self, source: Source, suffix: str = ".jsonl") -> Path:
        self.serial += 1
        return self.chunks / f"c{self.serial:08d}-s{source.number}{suffix}"

    def _take(self, source: Source, final: bool) -> int:
        """The complete lines added to an open ``.jsonl`` into one chunk; the file is
        done (its descriptor closed) once it is removed and read to its end."""
        assert source.fd is not None
        fd = source.fd
        removed = os.fstat(fd).st_nlink == 0
        end = os.fstat(fd).st_size
        last = min(end, source.offset + _MAX_CHUNK)
        upto = last
        if not ((removed or final) and last == end):
            # Up to the last newline: a line being written is taken when complete.
            upto = self._last_newline(fd, source.offset, last)
        written = 0
        if upto > source.offset:
            target = self._chunk_path(source)
            hidden = target.with_name("." + target.name)
            with open(hidden, "wb") as out:
                at = source.offset
                while at < upto:
                    data = os.pread(fd, min(_READ, upto - at), at)
                    if not data:
                        break
                    out.write(data)
                    at += len(data)
            os.replace(hidden, target)
            source.offset = at
            written = 1
        if removed and source.offset >= os.fstat(fd).st_size:
            os.close(fd)
            source.fd = None
        return written

    @staticmethod
    def _last_newline(fd: int, start: int, end: int) -> int:
        """The offset just past the last newline in [start, end), or start if none."""
        at = end
        while at > start:
            size = min(_READ, at - start)
            data = os.pread(fd, size, at - size)
            found = data.rfind(b"\n")
            if found >= 0:
                return at - size + found + 1
            at -= size
        return start

    def close(self) -> None:
        for source in self.sources.values():
            if source.fd is not None:
                os.close(source.fd)
                source.fd = None
