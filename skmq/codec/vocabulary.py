"""The protocol's vocabulary (docs/PROTOCOL.md): frame types and the statuses of a `resp`.
Members are `str`s, so they go on the wire and compare with decoded fields as they are."""

from __future__ import annotations

import enum


class FrameType(enum.StrEnum):
    # producers
    QUEUE = "queue"
    TOPIC = "topic"
    # recipients' answers
    ARRIVED = "arrived"
    ACK = "ack"
    REJECT = "reject"
    ERROR = "error"
    EXTEND = "extend"  # extension: a lease extension
    # recipients
    REGISTER = "register"
    UNREGISTER = "unregister"
    # the broker's
    PUSH = "push"
    RESP = "resp"
    # anyone
    PING = "ping"
    PONG = "pong"
    HELLO = "hello"  # extension
    AUTH = "auth"  # extension
    # consumers that pull (extension)
    PULL = "pull"


class Status(enum.StrEnum):
    """The `status` of a `resp`."""

    ACK = "ack"
    REJECT = "reject"
    ERROR = "error"


PRODUCER_TYPES = frozenset({FrameType.QUEUE, FrameType.TOPIC})
ANSWER_TYPES = frozenset(
    {FrameType.ARRIVED, FrameType.ACK, FrameType.REJECT, FrameType.ERROR, FrameType.EXTEND}
)
