"""SKMQ's Redis: connections, checks, and the store of what lives beside the delivery
engine's own keys (recipients, the apps directory, brokers); the engine's state changes
are the app owners' (skmq/queue/)."""

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
    Purged,
    Reaped,
    Retries,
    Store,
    Tally,
    Waiting,
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
    "Purged",
    "Reaped",
    "Retries",
    "Store",
    "Tally",
    "Waiting",
    "check_eviction_policy",
    "check_listpack_sizes",
    "connect_redis",
    "redacted",
    "split_delivery",
    "tcp_port",
]
