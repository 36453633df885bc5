"""The one module that owns every Redis key and every state change of SKMQ."""

from skmq.config import redacted
from skmq.store.checks import (
    EvictionWatch,
    check_eviction_policy,
    check_listpack_sizes,
    tcp_port,
)
from skmq.store.store import (
    SEP,
    AliveRecipient,
    AppCounts,
    ClaimArgs,
    Claimed,
    ClaimResult,
    DeadLetter,
    Extended,
    Failed,
    Finished,
    NewMessage,
    Reaped,
    Retries,
    Store,
    Tally,
    connect_redis,
    split_delivery,
)

__all__ = [
    "SEP",
    "AliveRecipient",
    "AppCounts",
    "ClaimArgs",
    "ClaimResult",
    "Claimed",
    "DeadLetter",
    "EvictionWatch",
    "Extended",
    "Failed",
    "Finished",
    "NewMessage",
    "Reaped",
    "Retries",
    "Store",
    "Tally",
    "check_eviction_policy",
    "check_listpack_sizes",
    "connect_redis",
    "redacted",
    "split_delivery",
    "tcp_port",
]
