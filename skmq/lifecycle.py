"""The life of a message, in one place: its states, and every transition between them.

Each transition is one Lua script (`skmq/store/lua/<script>.lua`) run atomically by the
store, safe with any number of brokers on one Redis; docs/ARCHITECTURE.md draws this
table and tests/test_lifecycle.py has a test for each row, refusals included.

    received --store--> pending | delayed              (a duplicate msgid: refused)
    received --store--> waiting_key                    (key=: an earlier message of its
                                                        key is not over yet)
    waiting_key --finish | fail | reap | claim--> pending | delayed
                                                       (the message before it in its key
                                                        acked or dead: the next goes)
    pending | delayed | waiting_retry --claim--> in_flight(n + 1)
                                     --claim--> dead   (content no recipient can take)
    in_flight(n) --finish--> acked                     (only attempt n, only in flight)
    in_flight(n) --fail | reap--> waiting_retry | dead (a failed attempt; dead after
                                                        RETRY_TIMES)
    pending | delayed | waiting_retry --claim--> dead | gone
                                                       (TTL run out: expired, never pushed;
                                                        gone with EXPIRED=drop)
    in_flight(n) --fail | reap--> dead | gone          (TTL run out by then: expired, no
                                                        retry)
    in_flight(n) --extend--> in_flight(n)              (lease + ACK_TIMEOUT from now; only
                                                        attempt n, MAX_LEASE_EXTENSIONS times)
    in_flight(n) --release--> pending                  (never seen: no attempt spent)
    dead --replay--> delayed (due now, attempts reset, TTL lifted) (not dead: refused)
    dead --purge--> gone                               (anything not dead: refused)
    dead --move--> gone, and pending in another app    (`dlq replay --to-app`; not dead,
                                                        or a duplicate there: refused)
    pending | delayed | waiting_retry | waiting_key --purge_waiting--> gone
                                                       (`skmq purge`; in flight or dead:
                                                        left alone)

Pull consumption (skmq/pull/): each consumer group holds its own copy of these states
for every message stored after it subscribed (its receipts name an attempt and the
group's generation, which a reset or a delete and create renews):

    pending | delayed | waiting_retry --pull_receive--> in_flight(n + 1)
    pending | delayed | waiting_retry --pull_receive--> dead | gone (TTL ran out: expired)
    pending --pull_receive--> waiting_key              (an earlier entry of its key not over)
    waiting_key --pull_ack | pull_nack | pull_receive--> delayed (due now: the entry
                                                        before it acked or dead)
    in_flight(n) --pull_receive--> waiting_retry | dead (its lease ran out)
    in_flight(n) --pull_ack--> acked                   (only attempt n, lease running)
    in_flight(n) --pull_nack--> waiting_retry | dead   (only attempt n, lease running)
    in_flight(n) --pull_extend--> in_flight(n)         (only attempt n, lease running)
    dead --pull_replay--> delayed (due now, attempts reset, TTL lifted) (not dead: refused)
    dead --pull_purge--> gone                          (not dead: refused)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class State(enum.StrEnum):
    RECEIVED = "received"
    PENDING = "pending"  # in `ready`
    DELAYED = "delayed"  # in `delayed`, not yet due (a delay, or a replay due now)
    IN_FLIGHT = "in_flight"  # in `inflight`, leased to one recipient
    WAITING_RETRY = "waiting_retry"  # in `delayed` after a failed attempt
    WAITING_KEY = "waiting_key"  # in `kq` only: an earlier message of its key is not over
    ACKED = "acked"  # gone, its msgid in `done:<bucket>` for the dedupe window
    DEAD = "dead"  # in `dead`, the dead-letter queue
    GONE = "gone"  # purged


@dataclass(frozen=True, slots=True)
class Transition:
    script: str
    sources: frozenset[State]
    targets: frozenset[State]
    refused: str  # what the script answers instead when its source state does not hold


def _t(script: str, sources: set[State], targets: set[State], refused: str) -> Transition:
    return Transition(script, frozenset(sources), frozenset(targets), refused)


S = State
TRANSITIONS: tuple[Transition, ...] = (
    _t("store", {S.RECEIVED}, {S.PENDING, S.DELAYED}, "duplicate msgid: not stored again"),
    _t("store", {S.RECEIVED}, {S.WAITING_KEY}, "no earlier message of its key: pending"),
    # per-key order: a message acked or dead lets the next one of its key go
    _t("finish", {S.WAITING_KEY}, {S.PENDING, S.DELAYED}, "not the next of its key"),
    _t("fail", {S.WAITING_KEY}, {S.PENDING, S.DELAYED}, "not the next of a dead message's key"),
    _t("reap", {S.WAITING_KEY}, {S.PENDING, S.DELAYED}, "not the next of a dead message's key"),
    _t("claim", {S.WAITING_KEY}, {S.PENDING, S.DELAYED}, "not the next of a dead message's key"),
    _t("claim", {S.PENDING, S.DELAYED, S.WAITING_RETRY}, {S.IN_FLIGHT, S.DEAD}, "nothing due"),
    # expiry: a message whose TTL ran out is never pushed (dead-lettered, reason `expired`,
    # or dropped); a delayed one or a retry wait falls due at its expiry at the latest.
    _t("claim", {S.PENDING, S.DELAYED, S.WAITING_RETRY}, {S.DEAD, S.GONE}, "not expired"),
    _t("fail", {S.IN_FLIGHT}, {S.DEAD, S.GONE}, "not expired: retried or dead as usual"),
    _t("reap", {S.IN_FLIGHT}, {S.DEAD, S.GONE}, "not expired: retried or dead as usual"),
    _t("finish", {S.IN_FLIGHT}, {S.ACKED}, "not in flight, or another attempt"),
    _t("fail", {S.IN_FLIGHT}, {S.WAITING_RETRY, S.DEAD}, "not in flight, or another attempt"),
    _t("reap", {S.IN_FLIGHT}, {S.WAITING_RETRY, S.DEAD}, "lease not run out"),
    _t("extend", {S.IN_FLIGHT}, {S.IN_FLIGHT}, "not in flight, another attempt, or the limit"),
    _t("release", {S.IN_FLIGHT}, {S.PENDING}, "not in flight"),
    _t("replay", {S.DEAD}, {S.DELAYED}, "not dead"),
    _t("purge", {S.DEAD}, {S.GONE}, "not dead"),
    _t("move", {S.DEAD}, {S.GONE}, "not dead, or its msgid a duplicate in the target app"),
    _t(
        "purge_waiting",
        {S.PENDING, S.DELAYED, S.WAITING_RETRY, S.WAITING_KEY},
        {S.GONE},
        "in flight or dead: left alone",
    ),
    _t(
        "pull_receive",
        {S.PENDING, S.DELAYED, S.WAITING_RETRY, S.IN_FLIGHT},
        {S.IN_FLIGHT, S.WAITING_RETRY, S.DEAD},
        "nothing due for the group, or no such group",
    ),
    _t(
        "pull_receive",
        {S.PENDING, S.DELAYED, S.WAITING_RETRY},
        {S.DEAD, S.GONE},
        "not expired",
    ),
    _t("pull_receive", {S.PENDING}, {S.WAITING_KEY}, "no earlier entry of its key: leased"),
    # per-key order in a group: an entry acked or dead lets the next one of its key go
    _t("pull_ack", {S.WAITING_KEY}, {S.DELAYED}, "not the next of its key"),
    _t("pull_nack", {S.WAITING_KEY}, {S.DELAYED}, "not the next of a dead entry's key"),
    _t("pull_receive", {S.WAITING_KEY}, {S.DELAYED}, "not the next of a dead entry's key"),
    _t("pull_ack", {S.IN_FLIGHT}, {S.ACKED}, "stale receipt: another attempt or lease ran out"),
    _t(
        "pull_nack",
        {S.IN_FLIGHT},
        {S.WAITING_RETRY, S.DEAD},
        "stale receipt: another attempt or lease ran out",
    ),
    _t("pull_replay", {S.DEAD}, {S.DELAYED}, "not dead"),
    _t("pull_purge", {S.DEAD}, {S.GONE}, "not dead"),
    _t(
        "pull_extend",
        {S.IN_FLIGHT},
        {S.IN_FLIGHT},
        "stale receipt: another attempt or lease ran out",
    ),
)
