"""Sans-IO codec of the SKMQ wire protocol (SPEC section 1): bytes in, frames out."""

from skmq.codec.decoder import Decoder
from skmq.codec.encoder import PING, PONG, encode_frame, encode_resp
from skmq.codec.errors import CodecError, FrameTooLarge, LineTooLong
from skmq.codec.frame import Frame, InvalidFrame

__all__ = [
    "PING",
    "PONG",
    "CodecError",
    "Decoder",
    "Frame",
    "FrameTooLarge",
    "InvalidFrame",
    "LineTooLong",
    "encode_frame",
    "encode_resp",
]
