"""The delivery log's vocabulary (SPEC section 7): event names, kinds and line fields.

One place for the names the broker writes and the Spark audit reads
(``skmq.audit_job``).  Members are ``str`` subclasses, so ``Event.ACKED == "acked"``
and a member can be passed wherever a plain string is expected.  This module imports
nothing from the broker: the audit imports it on a Spark driver.
"""

from __future__ import annotations

from enum import Enum

__all__ = [
    "DROPPED",
    "EXPIRED_REASON",
    "GENERATION",
    "GROUP_FROM",
    "GROUP_PREFIX",
    "LOG_FIELDS",
    "MESSAGE_EVENTS",
    "MOVED_TO_APP",
    "PENDING_PURGED",
    "RECIPIENT_EVENTS",
    "RECOVERED_ACK",
    "UNDELIVERABLE",
    "Event",
    "Kind",
]


# str + Enum, not StrEnum: the official Spark images run the audit on Python 3.10.
class Event(str, Enum):  # noqa: UP042
    """The ``event`` field of a delivery-log line."""

    RECEIVED = "received"
    DUPLICATE = "duplicate"
    STORED = "stored"
    PUSHED = "pushed"
    ARRIVED = "arrived"
    ACKED = "acked"
    REJECTED = "rejected"
    ERRORED = "errored"
    TIMEOUT = "timeout"
    UNREACHABLE = "unreachable"
    RETRY_SCHEDULED = "retry_scheduled"
    DEAD_LETTERED = "dead_lettered"
    REPLAYED = "replayed"
    PURGED = "purged"
    EXPIRED = "expired"
    EXTENDED = "extended"
    RECIPIENT_REGISTERED = "recipient_registered"
    RECIPIENT_LOST = "recipient_lost"
    RECIPIENT_ALIVE = "recipient_alive"
    # A registration took over an id alive at another address (detail: from -> to).
    RECIPIENT_TAKEN_OVER = "recipient_taken_over"
    # An operator removed a recipient (`skmq recipients remove`; detail: by whom).
    RECIPIENT_REMOVED = "recipient_removed"

    def __str__(self) -> str:
        return self.value


class Kind(str, Enum):  # noqa: UP042
    """The ``kind`` field: how a message is delivered."""

    QUEUE = "queue"
    TOPIC = "topic"

    def __str__(self) -> str:
        return self.value


# Events about a recipient, not a message (their msgid is empty).
RECIPIENT_EVENTS = frozenset(
    {
        Event.RECIPIENT_REGISTERED,
        Event.RECIPIENT_LOST,
        Event.RECIPIENT_ALIVE,
        Event.RECIPIENT_TAKEN_OVER,
        Event.RECIPIENT_REMOVED,
    }
)
MESSAGE_EVENTS = frozenset(Event) - RECIPIENT_EVENTS

# The `recipient` of a delivery pulled by a consumer group: `group:<name>`. Each group
# gets its own copy of every message, as each recipient of a topic message does.
GROUP_PREFIX = "group:"
# The detail of a group's `recipient_registered` (made or reset; `recipient_removed`:
# deleted) says from when it gets the messages stored, and its generation (the last part
# of the receipts it hands out since, in its pulls' details: `receipt <id>.<n>.<gen>`):
# `...; stored from <unix ms>; generation <gen>`.
GROUP_FROM = "stored from "
GENERATION = "generation "

# The fields of one line, in the order the broker writes them.
LOG_FIELDS = ("ts", "event", "msgid", "appid", "kind", "recipient", "attempt", "broker", "detail")

# The starts of the `detail`s the audit reads to tell how a delivery ended (docs/AUDIT.md).
# `dead_lettered`: a message whose TTL ran out (its detail is just this), one no recipient
# can take (the rest says why); else `after <n> attempts; last: <failure>`.
EXPIRED_REASON = "expired"
UNDELIVERABLE = "undeliverable"
# `expired`: the fate of a message whose TTL ran out with EXPIRED=drop (else `dead-lettered`).
DROPPED = "dropped"
# `purged`: a dead letter moved to another app (`skmq dlq replay --to-app`), and a message
# purged while pending, before any end (every delivery of it ends so); else a dead letter
# purged by an operator.
MOVED_TO_APP = "dead letter moved to app"
PENDING_PURGED = "pending message purged"

# The detail of an `acked` line a new owner writes for an ack it found in the journal's
# tail (the old owner may have died before its own line): the audit counts the message
# acked, but not acked twice where the old owner's line is there too.
RECOVERED_ACK = "recovered from the journal by a new owner"
