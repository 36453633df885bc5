"""The codec on an asyncio connection: the client's connections and the broker's push
connections read frames the same way. Standard library only: the client uses it too."""

from __future__ import annotations

import asyncio

from skmq.codec.decoder import Decoder
from skmq.codec.errors import CodecError
from skmq.codec.frame import Frame, InvalidFrame


class FrameProtocol(asyncio.Protocol):
    """Decodes what the peer sends: every item one read completes goes to
    `frames_received`, in order; a stream that cannot be decoded (the decoder is then
    broken for good: the connection must end) goes to `stream_broken` instead."""

    def __init__(self, max_frame_bytes: int) -> None:
        self._decoder = Decoder(max_frame_bytes=max_frame_bytes)

    def data_received(self, data: bytes) -> None:
        try:
            frames = self._decoder.feed(data)
        except CodecError as exc:
            self.stream_broken(exc)
            return
        self.frames_received(frames)

    def frames_received(self, frames: list[Frame | InvalidFrame]) -> None:
        raise NotImplementedError

    def stream_broken(self, exc: CodecError) -> None:
        raise NotImplementedError
