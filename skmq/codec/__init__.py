"""Sans-IO codec of the SKMQ wire protocol (SPEC section 1): bytes in, frames out; and
FrameProtocol, the asyncio protocol that feeds it a connection's bytes."""

from skmq.codec.decoder import Decoder
from skmq.codec.encoder import PING, PONG, encode_frame, encode_resp
from skmq.codec.errors import BareLineFeed, CodecError, FrameTooLarge, LineTooLong
from skmq.codec.frame import Frame, InvalidFrame
from skmq.codec.protocol import FrameProtocol
from skmq.codec.vocabulary import ANSWER_TYPES, PRODUCER_TYPES, FrameType, Status

__all__ = [
    "ANSWER_TYPES",
    "PING",
    "PONG",
    "PRODUCER_TYPES",
    "BareLineFeed",
    "CodecError",
    "Decoder",
    "Frame",
    "FrameProtocol",
    "FrameTooLarge",
    "FrameType",
    "InvalidFrame",
    "LineTooLong",
    "Status",
    "encode_frame",
    "encode_resp",
]
