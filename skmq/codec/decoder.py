"""Incremental frame decoder (SPEC section 1), sans-IO: bytes in, frames out.

How it works. Unconsumed bytes live in a bytearray whose first byte is the start
of the next frame (blank lines before a frame are dropped as soon as they are
complete). ``feed()`` appends the new bytes and asks :meth:`Decoder._scan` whether
the first frame can now be complete. ``_scan`` is incremental: it remembers how
far it got (current line start, a pending ``length=``, the byte count a
``length=`` content needs), so a frame arriving one byte at a time costs O(1)
per byte; it also enforces the limits on the partial frame, so a peer sending
endless bytes cannot make the buffer grow past ``max_frame_bytes`` (or a header
line past ``max_line_bytes``); it also refuses a header line holding a bare LF (one
not after a CR) as soon as that LF arrives: a peer ending its lines with LF alone never
ends a frame (docs/PROTOCOL.md, section 1).

When a frame can complete, the buffer is turned into ``bytes`` once and
:meth:`Decoder._decode` takes every complete frame out of it. The hot path there
finds the terminator with ``bytes.find``, decodes the header lines with a single
``decode`` and builds the field dict with one ``split`` per line. Anything
unusual (a ``length=`` line, a line without ``=``, an empty key, fields after the
content, ``ping``...) goes to :meth:`Decoder._parse_slow`, a plain line-by-line
parser, which defines the semantics; the fast path only handles frames on which
both agree.

Both parsers and the scanner must agree on where a frame ends and on which
limits it breaks; the tests check this by feeding the same bytes whole, in
random chunks, one byte at a time and with the fast path disabled.
"""

from __future__ import annotations

from itertools import repeat

from skmq.codec.errors import BARE_LF, BareLineFeed, CodecError, FrameTooLarge, LineTooLong
from skmq.codec.frame import Frame, InvalidFrame

__all__ = ["Decoder"]

# A length with more digits than this is larger than any frame we could accept.
_MAX_LENGTH_DIGITS = 18
_HUGE = 1 << 62

# For the fast path: map(_split, lines, _EQUALS) splits every line on "=".
_split = str.split
_EQUALS = repeat("=")


def _parse_length(value: bytes | bytearray) -> int | None:
    """The value of a ``length=`` field, or ``None`` if it is not a decimal integer."""
    if not value.isdigit():  # ASCII digits only; rejects "", "-1", "+1", " 1"
        return None
    digits = value.lstrip(b"0")
    if len(digits) > _MAX_LENGTH_DIGITS:
        return _HUGE  # beyond int()'s digit limit for huge lines, and over any frame limit
    return int(digits or b"0")


def _too_large(length: int) -> FrameTooLarge:
    shown = (
        f"length={length}" if length < _HUGE else f"a length= of over {_MAX_LENGTH_DIGITS} digits"
    )
    return FrameTooLarge(f"{shown} makes the frame too large")


def _show(line: bytes | bytearray) -> str:
    """A short repr of an offending line, for InvalidFrame.reason."""
    if len(line) > 40:
        return f"{bytes(line[:40])!r}..."
    return repr(bytes(line))


class Decoder:
    """Turns a byte stream into :class:`Frame` and :class:`InvalidFrame` values.

    ``max_frame_bytes`` bounds a frame from its first byte to its terminator
    included; ``max_line_bytes`` bounds a header line (CRLF excluded; the content
    line is exempt). Breaking either raises :class:`FrameTooLarge` or
    :class:`LineTooLong`, and a bare LF in a header line :class:`BareLineFeed`; the
    decoder is then broken and every later ``feed()`` raises the same error again.
    """

    __slots__ = (
        "_buf",
        "_cur",
        "_error",
        "_fast",
        "_length",
        "_max_frame",
        "_max_line",
        "_need",
        "_resync",
    )

    def __init__(self, max_frame_bytes: int = 1 << 20, max_line_bytes: int = 4096) -> None:
        if max_frame_bytes < 1 or max_line_bytes < 1:
            raise ValueError("max_frame_bytes and max_line_bytes must be positive")
        self._max_frame = max_frame_bytes
        self._max_line = max_line_bytes
        self._buf = bytearray()
        self._error: CodecError | None = None
        # Tests turn this off to check the fast path against the slow parser.
        self._fast = True
        # State of _scan() over the partial first frame, offsets into _buf.
        self._cur = 0  # start of the first line not scanned yet
        self._length: int | None = None  # last length= seen in the partial frame
        self._need = 0  # with length=: bytes the frame needs (0: not in the content yet)
        self._resync = False  # the length= content was not followed by CRLF CRLF

    @property
    def buffered(self) -> int:
        """Bytes held waiting for the rest of a frame."""
        return len(self._buf)

    def feed(self, data: bytes | bytearray | memoryview) -> list[Frame | InvalidFrame]:
        """Add bytes from the peer; return every frame they complete, in order.

        Raises :class:`FrameTooLarge`, :class:`LineTooLong` or :class:`BareLineFeed`
        (with the frames completed before the error in ``exc.frames``).
        """
        if self._error is not None:
            raise type(self._error)(str(self._error))
        frames: list[Frame | InvalidFrame] = []
        if not data:
            return frames
        try:
            old = len(self._buf)
            self._buf += data
            while self._scan(old):
                consumed = self._decode(bytes(self._buf), frames)
                del self._buf[:consumed]  # cheap: bytearray just moves its start
                self._cur = 0
                self._length = None
                self._need = 0
                self._resync = False
                old = 0
                if not consumed:  # cannot happen; never loop forever
                    break
        except CodecError as exc:
            self._error = exc
            self._buf = bytearray()
            exc.frames = frames
            raise
        return frames

    def _scan(self, old: int) -> bool:
        """Check the partial frame at the start of the buffer.

        Returns True when a frame (or a blank line before one) may be complete,
        that is when :meth:`_decode` has work to do. ``old`` is how many bytes the
        buffer held when this was last called; bytes before it were scanned then.
        Raises when the partial frame already breaks a limit.
        """
        buf = self._buf
        n = len(buf)
        need = self._need
        if need:  # inside a length= content
            if n < need:
                return False
            if not self._resync:
                if buf.startswith(b"\r\n\r\n", need - 4):
                    return True
                self._resync = True
                old = 0
            if buf.find(b"\r\n\r\n", max(need - 4, old - 3)) >= 0:
                return True
            if n > self._max_frame:
                raise FrameTooLarge(f"frame over {self._max_frame} bytes")
            return False

        cur = self._cur
        length = self._length
        # Quick answer for the common case: a blank line arrived and no length= can
        # change where the frame ends. The limits are then checked by _decode.
        end = buf.find(b"\r\n\r\n", old - 3 if old > 3 else 0)
        if end >= 0 and length is None and buf.find(b"length=", cur, end) < 0:
            return True

        max_line = self._max_line
        start = cur if cur > old - 1 else old - 1
        while True:
            if length is not None and buf.startswith(b"content=", cur):
                need = cur + 12 + length  # "content=" + content + CRLF CRLF
                if need > self._max_frame:
                    raise _too_large(length)
                self._cur = cur
                self._need = need
                return self._scan(0)
            if buf.startswith(b"content=", cur):  # raw bytes up to CRLF: a LF is content
                eol = buf.find(b"\r\n", start)
            else:
                eol = buf.find(b"\n", start)
                if eol >= 0:
                    if eol == cur or buf[eol - 1] != 13:
                        raise BareLineFeed(BARE_LF)
                    eol -= 1
            if eol < 0:
                break
            if eol == cur:  # the blank line ending the frame (or one before it)
                return True
            if eol - cur > max_line and not buf.startswith(b"content=", cur):
                raise LineTooLong(f"header line over {max_line} bytes")
            if buf.startswith(b"length=", cur):
                length = self._length = _parse_length(buf[cur + 7 : eol])
            cur = start = eol + 2
        self._cur = cur
        # The line being received (a final CR may belong to its CRLF); a content line,
        # or what may still become one, is exempt.
        size = n - cur
        if size > max_line and buf[-1] == 13:
            size -= 1
        if size > max_line and not b"content=".startswith(buf[cur : cur + 8]):
            raise LineTooLong(f"header line over {max_line} bytes")
        if n > self._max_frame:
            raise FrameTooLarge(f"frame over {self._max_frame} bytes")
        return False

    def _decode(self, buf: bytes, frames: list[Frame | InvalidFrame]) -> int:
        """Append every complete frame of ``buf`` to ``frames``; return bytes consumed."""
        max_frame = self._max_frame
        max_line = self._max_line
        fast = self._fast
        find = buf.find
        append = frames.append
        pos = 0
        while True:
            end = find(b"\r\n\r\n", pos)
            if end < 0:
                while buf.startswith(b"\r\n", pos):  # blank lines before a partial frame
                    pos += 2
                return pos
            if end == pos:  # two blank lines
                pos += 4
                continue
            if buf[pos] == 13 and buf[pos + 1] == 10:  # one blank line
                pos += 2
                continue
            if end + 4 - pos > max_frame:
                # Also right for a length= frame: its end cannot come before `end`.
                raise FrameTooLarge(f"frame over {max_frame} bytes")
            block = buf[pos:end]
            if fast:
                # Content is usually the last line; the lines before it are decoded
                # in one go. A value holding "=" splits in three and a line without
                # "=" in one: dict() then raises and the slow parser takes over, as
                # it does for invalid UTF-8 (strict decode() is much faster than
                # surrogateescape, and gives the same result on valid input).
                ci = block.rfind(b"\r\ncontent=")
                if ci >= 0:
                    content: bytes | None = block[ci + 10 :]
                    head = block[:ci]
                else:
                    content = None
                    head = block
                if len(head) <= max_line:
                    try:
                        lines = head.decode().split("\r\n")
                        fields = dict(map(_split, lines, _EQUALS))
                    except ValueError:
                        pass
                    else:
                        if (
                            "" not in fields
                            and "content" not in fields
                            and "length" not in fields
                            # each LF ends a line (a bare one: the slow path raises)
                            and head.count(b"\n") < len(lines)
                            and (content is None or b"\r\n" not in content)
                        ):
                            append(Frame(fields.pop("type", ""), fields, content))
                            pos = end + 4
                            continue
            parsed = self._parse_slow(buf, pos)
            if parsed is None:
                return pos
            append(parsed[0])
            pos = parsed[1]

    def _parse_slow(self, buf: bytes, start: int) -> tuple[Frame | InvalidFrame, int] | None:
        """Parse the frame starting at ``start`` (not a blank line) line by line.

        This parser defines the decoding rules. Returns the frame and the offset
        just after it, or ``None`` when ``buf`` does not hold the whole frame yet
        (only possible with ``length=``).
        """
        max_line = self._max_line
        fields: dict[str, str] = {}
        content: bytes | None = None
        length: int | None = None
        reason: str | None = None
        bare: bytes | None = None  # a first line without "=" (ping/pong)
        nlines = 0
        pos = start
        while True:
            if length is not None and buf.startswith(b"content=", pos):
                # Binary-safe content: exactly `length` bytes, then CRLF CRLF.
                nlines += 1
                cend = pos + 8 + length
                end = cend + 4
                if end - start > self._max_frame:
                    raise _too_large(length)
                if len(buf) < end:
                    return None
                content = buf[pos + 8 : cend]
                if not buf.startswith(b"\r\n\r\n", cend):
                    # Resync: the frame goes on up to the next terminator.
                    found = buf.find(b"\r\n\r\n", cend)
                    if found < 0:
                        if len(buf) - start > self._max_frame:
                            raise FrameTooLarge(f"frame over {self._max_frame} bytes")
                        return None
                    end = found + 4
                    if reason is None:
                        reason = f"content of length={length} not followed by CRLF CRLF"
                break
            eol = buf.find(b"\r\n", pos)
            if eol < 0:
                return None
            if eol == pos:  # blank line: end of frame
                end = eol + 2
                break
            line = buf[pos:eol]
            pos = eol + 2
            nlines += 1
            key, sep, value = line.partition(b"=")
            if sep and key == b"content":  # old-style content: up to CRLF, no line limit
                content = value
                continue
            if b"\n" in line:
                raise BareLineFeed(BARE_LF)
            if len(line) > max_line:
                raise LineTooLong(f"header line over {max_line} bytes")
            if not sep:
                if nlines == 1 and (line == b"ping" or line == b"pong"):
                    bare = line
                elif reason is None:
                    reason = f"line without '=': {_show(line)}"
            elif not key:
                if reason is None:
                    reason = f"empty key: {_show(line)}"
            elif key == b"length":
                length = _parse_length(value)
                if length is None and reason is None:
                    reason = f"invalid length: {_show(value)}"
            else:
                fields[key.decode("utf-8", "surrogateescape")] = value.decode(
                    "utf-8", "surrogateescape"
                )
        if end - start > self._max_frame:
            raise FrameTooLarge(f"frame over {self._max_frame} bytes")
        if bare is not None:
            if nlines == 1:
                return Frame(bare.decode("ascii"), {}), end
            reason = f"line without '=': {_show(bare)}"
        if reason is not None:
            return InvalidFrame(reason, fields), end
        return Frame(fields.pop("type", ""), fields, content), end
