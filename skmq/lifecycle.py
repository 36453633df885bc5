"""The life of a delivery, as its owner runs it: the table below IS the state machine.

A delivery is one message for one consumer: the app's push recipients (a `queue`
message), one recipient's copy of a `topic` message, or one consumer group's entry.
Its owner (the broker that holds the app's queue, skmq/queue/ownership.py) keeps every
delivery's state in memory and changes it only through `step`, which looks the state
and the trigger up in `TABLE`: a pair the table lacks is refused, naming both, and changes
nothing (an ack for a delayed message, a purge of one in flight). Each row also
names the record that the journal (skmq/queue/journal.py) appends for it, or none where
the change need not survive the owner (a lease extended, a key freed, a delay run out:
a new owner derives them again). A new owner rebuilds the state by running the same
`step` over the journal's records, so recovery cannot drift from live behaviour.

    stored --> delayed | pending | waiting_key
    waiting_key --key_free--> delayed            (the one before it in its key is over)
    delayed | waiting_retry --due--> pending
    pending --push--> in_flight(n + 1)           (a push, or a pull handing it out)
    in_flight --extend--> in_flight              (arrived, or a pull's extend)
    in_flight --ack--> acked
    in_flight --retry--> waiting_retry           (reject, error, timeout, lost: attempts left)
    in_flight --give_up--> dead                  (the same, with RETRY_TIMES spent)
    in_flight --release--> pending               (never seen by the recipient: no attempt)
    pending --undeliverable--> dead              (content no alive recipient can take)
    waiting --expire--> dead | --drop--> dropped (TTL ran out; waiting: any state but dead)
    pending | delayed | waiting_retry | waiting_key --purge--> purged

A dead delivery leaves the owner's memory, as an acked one does: its flush writes it to
the app's dead letters (skmq/queue/dead.py), which operators list, replay (a new entry of
the app's inbox: attempts reset, TTL lifted), move or purge there, with or without a
broker running.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class State(enum.StrEnum):
    DELAYED = "delayed"  # not yet due: a delay, or the next of its key let go
    PENDING = "pending"  # due: waits for a recipient's free slot or a pull
    WAITING_KEY = "waiting_key"  # an earlier delivery of its ordering key is not over
    IN_FLIGHT = "in_flight"  # pushed or pulled, under a lease
    WAITING_RETRY = "waiting_retry"  # a failed attempt; due again after its backoff
    # over: the delivery leaves the owner's memory
    DEAD = "dead"  # to the app's dead letters
    ACKED = "acked"
    DROPPED = "dropped"  # its TTL ran out with EXPIRED=drop
    PURGED = "purged"  # removed by an operator


OVER = frozenset({State.DEAD, State.ACKED, State.DROPPED, State.PURGED})


class Trigger(enum.StrEnum):
    KEY_FREE = "key_free"
    DUE = "due"
    PUSH = "push"
    EXTEND = "extend"
    ACK = "ack"
    RETRY = "retry"
    GIVE_UP = "give_up"
    RELEASE = "release"
    UNDELIVERABLE = "undeliverable"
    EXPIRE = "expire"
    DROP = "drop"
    PURGE = "purge"


class Record(enum.StrEnum):
    """What the journal keeps of a transition (its `kind` field); see journal.py."""

    PUSHED = "p"  # attempt n handed out (so RETRY_TIMES holds across owners)
    ACKED = "a"
    RETRIED = "r"  # attempt n failed; due again at a time
    DEAD = "d"  # attempts spent, with the last failure
    UNDELIVERABLE = "u"  # no alive recipient can take its content
    RELEASED = "l"
    EXPIRED = "x"  # dead-lettered, reason expired
    DROPPED = "o"
    PURGED = "g"


@dataclass(frozen=True, slots=True)
class Rule:
    target: State
    record: Record | None  # None: nothing to journal (derived again by a new owner)


S, E, R = State, Trigger, Record
WAITING = (S.DELAYED, S.PENDING, S.WAITING_KEY, S.WAITING_RETRY)

TABLE: dict[State, dict[Trigger, Rule]] = {
    S.DELAYED: {
        E.DUE: Rule(S.PENDING, None),
        E.EXPIRE: Rule(S.DEAD, R.EXPIRED),
        E.DROP: Rule(S.DROPPED, R.DROPPED),
        E.PURGE: Rule(S.PURGED, R.PURGED),
    },
    S.WAITING_KEY: {
        E.KEY_FREE: Rule(S.DELAYED, None),
        E.EXPIRE: Rule(S.DEAD, R.EXPIRED),
        E.DROP: Rule(S.DROPPED, R.DROPPED),
        E.PURGE: Rule(S.PURGED, R.PURGED),
    },
    S.PENDING: {
        E.PUSH: Rule(S.IN_FLIGHT, R.PUSHED),
        E.UNDELIVERABLE: Rule(S.DEAD, R.UNDELIVERABLE),
        E.EXPIRE: Rule(S.DEAD, R.EXPIRED),
        E.DROP: Rule(S.DROPPED, R.DROPPED),
        E.PURGE: Rule(S.PURGED, R.PURGED),
    },
    S.IN_FLIGHT: {
        E.EXTEND: Rule(S.IN_FLIGHT, None),
        E.ACK: Rule(S.ACKED, R.ACKED),
        E.RETRY: Rule(S.WAITING_RETRY, R.RETRIED),
        E.GIVE_UP: Rule(S.DEAD, R.DEAD),
        E.RELEASE: Rule(S.PENDING, R.RELEASED),
        E.EXPIRE: Rule(S.DEAD, R.EXPIRED),
        E.DROP: Rule(S.DROPPED, R.DROPPED),
    },
    S.WAITING_RETRY: {
        E.DUE: Rule(S.PENDING, None),
        E.EXPIRE: Rule(S.DEAD, R.EXPIRED),
        E.DROP: Rule(S.DROPPED, R.DROPPED),
        E.PURGE: Rule(S.PURGED, R.PURGED),
    },
    S.DEAD: {},
    S.ACKED: {},
    S.DROPPED: {},
    S.PURGED: {},
}

# A journal record names the trigger it stands for: replaying it is the same `step`.
TRIGGER_OF: dict[Record, Trigger] = {
    rule.record: trigger
    for rules in TABLE.values()
    for trigger, rule in rules.items()
    if rule.record is not None
}

# The transitions no record stands for, each the one way forward from its state: a new
# owner replaying a record that its state refuses takes these first (a delivery whose
# delay ran out before it was pushed has no record of falling due).
DERIVED: dict[State, Trigger] = {
    S.WAITING_KEY: E.KEY_FREE,
    S.DELAYED: E.DUE,
    S.WAITING_RETRY: E.DUE,
}


class Refused(Exception):
    """A trigger the table has no row for, in the state the delivery is in."""

    def __init__(self, state: State, trigger: Trigger) -> None:
        super().__init__(f"{trigger} refused: the delivery is {state}")
        self.state = state
        self.trigger = trigger


def step(state: State, trigger: Trigger) -> Rule:
    """The rule for `trigger` in `state`, or Refused."""
    rule = TABLE[state].get(trigger)
    if rule is None:
        raise Refused(state, trigger)
    return rule


def detour(state: State, trigger: Trigger) -> list[Trigger]:
    """The derived transitions a delivery in `state` takes before `trigger`, as a new owner
    replays a record (a push recorded for a delivery whose delay it has not seen run
    out); Refused where none leads to a state that takes `trigger`."""
    path: list[Trigger] = []
    at = state
    while trigger not in TABLE[at]:
        derived = DERIVED.get(at)
        if derived is None:
            raise Refused(state, trigger)
        path.append(derived)
        at = TABLE[at][derived].target
    return path
