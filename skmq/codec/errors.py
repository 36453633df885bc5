"""Errors raised by the decoder. Every one of them is fatal for the connection."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from skmq.codec.frame import Frame, InvalidFrame

__all__ = ["BareLineFeed", "CodecError", "FrameTooLarge", "LineTooLong"]


class CodecError(Exception):
    """Base of everything :meth:`Decoder.feed` may raise.

    ``frames`` holds the frames that the failing ``feed()`` call completed before it
    hit the error (they precede the bad frame on the wire, so a server may still
    answer them before it closes the connection).
    """

    frames: list[Frame | InvalidFrame]

    def __init__(self, message: str, frames: list[Frame | InvalidFrame] | None = None) -> None:
        super().__init__(message)
        self.frames = [] if frames is None else frames


class FrameTooLarge(CodecError):
    """A frame is over ``max_frame_bytes``: the stream cannot be resynced."""


class LineTooLong(CodecError):
    """A header line is over ``max_line_bytes``: the stream cannot be resynced."""


class BareLineFeed(CodecError):
    """A header line holds a LF not preceded by CR: the peer ends its lines with LF
    alone. Its frames would never end (a frame ends at CRLF CRLF), so the stream cannot
    be resynced. Raised with BARE_LF as its message."""


BARE_LF = "bare LF in a header line: lines end with CRLF, a frame with CRLF CRLF"
