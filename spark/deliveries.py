"""Per delivery and per message: the definitions of docs/AUDIT.md as Spark expressions.

``delivery_table`` folds the events of each delivery into one row (a queue message is
one delivery, a topic message one per recipient) with fixed-width aggregates only, so
Spark hash-aggregates and never sorts the events.  The message events are shuffled
once, by message: the aggregation, the window over a message's deliveries and the
per-message table need no other shuffle.
``message_table`` folds deliveries into messages. Each row has its ``outcome``, one of
``OUTCOMES``: how it ended, or how it waits.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F

from skmq.events import (
    DROPPED,
    EXPIRED_REASON,
    GENERATION,
    GROUP_FROM,
    GROUP_PREFIX,
    MOVED_TO_APP,
    PENDING_PURGED,
    RECIPIENT_EVENTS,
    RECOVERED_ACK,
    UNDELIVERABLE,
    Event,
    Kind,
)

__all__ = [
    "FAILURES",
    "OUTCOMES",
    "OUTCOME_GROUPS",
    "PRECEDENCE",
    "ack_attempt",
    "ack_key",
    "ack_ts",
    "copy_key",
    "count_if",
    "counted",
    "delivery_table",
    "group_change",
    "is_event",
    "message_table",
]

# An acked event's (ts, attempt) packed in a long: ts << 20 | attempt (all ones: none).
_ATTEMPT_BITS = 20
_NO_ATTEMPT = (1 << _ATTEMPT_BITS) - 1
_MAX_ATTEMPT = _NO_ATTEMPT - 1
# Why the last dead letter of a delivery was written, named by its detail, as a small
# number so that the aggregation stays fixed-width (0: not named): the last failure of
# "after 5 attempts; last: timeout", then a message whose TTL ran out, one no recipient
# can take, and "after N attempts" naming no known failure.
FAILURES = (
    Event.REJECTED.value,
    Event.ERRORED.value,
    Event.TIMEOUT.value,
    Event.UNREACHABLE.value,
    UNDELIVERABLE,
    EXPIRED_REASON,
    "attempts",
)
_DELIVER_AT = r"deliver_at=(\d+)"
_NEXT_AT = r"next attempt at (\d+)"
_LAST_FAILURE = r"last: (\w+)"
_AFTER_ATTEMPTS = r"^after \d+ attempts"
_GROUP_FROM = GROUP_FROM + r"(\d+)"
_GENERATION = GENERATION + r"(\d+)"
# A pull's receipt (skmq/pull/groups.py): its generation, where it has one.
_RECEIPT_GENERATION = r"receipt \d+-\d+\.\d+\.(\d+)"

# Every way a delivery (and a message) ends or waits, in the report's order, with the
# group its message counts in (totals): docs/AUDIT.md defines each.
OUTCOME_GROUPS = {
    "acked": "acked",
    "dead_lettered_attempts": "dead_lettered",
    "dead_lettered_rejected": "dead_lettered",
    "dead_lettered_undeliverable": "dead_lettered",
    "dead_lettered_expired": "dead_lettered",
    "dead_lettered_unnamed": "dead_lettered",
    "dead_letter_purged": "dead_lettered",
    "dead_letter_moved": "dead_lettered",
    "expired_dropped": "dropped",
    "purged_pending": "dropped",
    "not_yet_due": "unresolved",
    "waiting_for_recipient": "unresolved",
    "in_flight": "unresolved",
    "stuck": "unresolved",
}
OUTCOMES = tuple(OUTCOME_GROUPS)
# A message's outcome: the first of these that one of its deliveries has (a dead letter
# before a drop, before anything open, before acked).
PRECEDENCE = (
    *(o for o in OUTCOMES if OUTCOME_GROUPS[o] == "dead_lettered"),
    "expired_dropped",
    "purged_pending",
    "stuck",
    "in_flight",
    "waiting_for_recipient",
    "not_yet_due",
    "acked",
)
# The dead-lettered outcome of each failure code (FAILURES' index + 1; 0: unnamed): any
# failure but these is `dead_lettered_attempts`.
_DEAD_OUTCOME_OF = {
    Event.REJECTED.value: "dead_lettered_rejected",
    UNDELIVERABLE: "dead_lettered_undeliverable",
    EXPIRED_REASON: "dead_lettered_expired",
}
_DEAD_OUTCOMES = (
    "dead_lettered_unnamed",
    *(_DEAD_OUTCOME_OF.get(f, "dead_lettered_attempts") for f in FAILURES),
)


def is_event(event: Event) -> Column:
    return F.col("event") == F.lit(event.value)


def count_if(cond: Column) -> Column:
    return F.count(F.when(cond, F.lit(1)))


def _recovered() -> Column:
    return F.coalesce(F.col("detail").startswith(RECOVERED_ACK), F.lit(False))


def counted(event: Event) -> Column:
    """The lines of `event` that count as one each: an `acked` line a new owner wrote
    again (RECOVERED_ACK, from the journal) is not another ack; it only stands in for
    the old owner's line where a kill -9 took that line with it (`_units`)."""
    return is_event(event) & ~_recovered() if event is Event.ACKED else is_event(event)


def ack_key() -> Column:
    """``ts`` and ``attempt`` of an event in one long that orders as (ts, attempt).

    A missing attempt sorts after any number; attempts are clamped to the field.
    """
    attempt = F.least(F.greatest(F.col("attempt"), F.lit(0)), F.lit(_MAX_ATTEMPT))
    return F.shiftleft(F.col("ts"), _ATTEMPT_BITS) + F.coalesce(attempt, F.lit(_NO_ATTEMPT))


def ack_ts(key: Column) -> Column:
    return F.shiftright(key, _ATTEMPT_BITS)


def ack_attempt(key: Column) -> Column:
    attempt = key.bitwiseAND(F.lit(_NO_ATTEMPT))
    return F.when(attempt != _NO_ATTEMPT, attempt)


def _number_in(pattern: str) -> Column:
    """The number ``pattern`` finds in the detail; null if none (a detail without it, or
    digits beyond a long: a cast of "" fails under ANSI SQL, Spark 4's default)."""
    return F.regexp_extract(F.col("detail"), pattern, 1).try_cast("long")


def _detail_starts(prefix: str) -> Column:
    return F.col("detail").startswith(prefix)


def _code(name: str) -> Column:
    return F.lit(FAILURES.index(name) + 1)


def _failure_code() -> Column:
    """FAILURES' index + 1 of a dead letter's detail; 0: not named."""
    named = F.regexp_extract(F.col("detail"), _LAST_FAILURE, 1)
    after = F.col("detail").rlike(_AFTER_ATTEMPTS)
    code = F.when(_detail_starts(EXPIRED_REASON), _code(EXPIRED_REASON)).when(
        _detail_starts(UNDELIVERABLE), _code(UNDELIVERABLE)
    )
    for failure in FAILURES[:4]:
        code = code.when(after & (named == failure), _code(failure))
    return code.when(after, _code("attempts")).otherwise(F.lit(0))


def _when(event: Event, value: Column) -> Column:
    return F.when(is_event(event), value)


# The per-delivery aggregates: the message-level ones (stored) and the delivery ones.
_MESSAGE_FIELDS = ("n_stored", "stored_ts", "due_at")
# A delivery field that a copy takes from its message's row too: a purge of the pending
# message ends every delivery of it.
_WHOLE_MESSAGE = "pending_pg"
_DELIVERY_FIELDS = (
    "n_acked",
    "n_acked_again",
    "first_ack",
    "first_push",
    "last_push",
    "n_dl",
    "last_dl",
    "sum_dl",
    "dl_attempts",
    "last_dl_attempts",
    "failure",
    "n_rp",
    "last_rp",
    "sum_rp",
    "last_pg",
    "last_mv",
    _WHOLE_MESSAGE,
    "last_drop",
    "last_ts",
    "last_retry",
    "next_at",
)


def copy_key() -> Column:
    """A delivery's own key beside its message's: a topic copy's recipient, and a pull
    consumer group's (`group:<name>`) whatever the kind; null for a queue message's
    pushes, which go to one recipient or another."""
    recipient = F.col("recipient")
    is_copy = (F.col("kind") == Kind.TOPIC.value) | recipient.startswith(GROUP_PREFIX)
    return F.when(is_copy, recipient)


def group_change() -> Column:
    """A consumer group's making, reset or deletion."""
    made_or_deleted = F.col("event").isin(
        Event.RECIPIENT_REGISTERED.value, Event.RECIPIENT_REMOVED.value
    )
    return made_or_deleted & F.col("recipient").startswith(GROUP_PREFIX)


# The rkey suffix of a consumer group's copy as it was before the group's last change
# (a reset or its deletion); no group name has a '#'.
_BEFORE = "#before"
_GROUP_FIELDS = ("g_alive", "g_start", "g_at")


def _group_starts(events: DataFrame) -> DataFrame:
    """Each consumer group's last change (ordered by ts; a making after a deletion in the
    same ms is the last): ``g_alive`` (a making or reset, not a deletion), ``g_start``
    (from when it gets the messages stored: GROUP_FROM in its detail), ``g_at`` (its
    ts) and ``g_gen`` (its generation: GENERATION). The groups are few: the caller
    broadcasts them."""
    c = F.col
    changes = events.where(group_change())
    made = is_event(Event.RECIPIENT_REGISTERED)
    last = F.max_by(
        F.struct(
            made.alias("alive"),
            _number_in(_GROUP_FROM).alias("start"),
            c("ts").alias("at"),
            F.regexp_extract(c("detail"), _GENERATION, 1).alias("gen"),
        ),
        F.struct(c("ts"), made),
    )
    return (
        changes.groupBy(c("appid").alias("g_app"), c("recipient").alias("g_name"))
        .agg(last.alias("last"))
        .select(
            "g_app",
            "g_name",
            c("last.alive").alias("g_alive"),
            c("last.start").alias("g_start"),
            c("last.at").alias("g_at"),
            c("last.gen").alias("g_gen"),
        )
    )


def _with_group_copies(events: DataFrame) -> DataFrame:
    """The events, a group's before its last change marked (rkey `<group>#before`, with
    the change: _GROUP_FIELDS), and a `stored` event for each live group's copy of each
    message stored from its start: a copy that the group has not received yet is a
    delivery too (waiting for it), as a topic recipient's copy is, though the group has
    no event of it. _joined_deliveries says what a copy before a change becomes."""
    c = F.col
    starts = F.broadcast(_group_starts(events))
    marked = events.join(
        starts, (c("appid") == c("g_app")) & (c("recipient") == c("g_name")), "left"
    )
    # Before the change: a pull of another generation (its receipt's), else an event
    # before it (null: no change known of the recipient's)
    generation = F.regexp_extract(c("detail"), _RECEIPT_GENERATION, 1)
    by_receipt = (generation != "") & (c("g_gen") != "")
    before = F.when(by_receipt, generation != c("g_gen")).otherwise(c("ts") < c("g_at"))
    renamed = F.when(before, F.concat(c("recipient"), F.lit(_BEFORE))).otherwise(c("recipient"))
    old = marked.select(
        *(renamed.alias(f) if f == "recipient" else c(f) for f in events.columns),
        *(F.when(before, c(f)).alias(f) for f in _GROUP_FIELDS),
    )
    stored = events.where(is_event(Event.STORED))
    live = starts.where(c("g_alive") & c("g_start").isNotNull())
    copies = stored.join(live, (c("appid") == c("g_app")) & (c("ts") >= c("g_start"))).select(
        *(c("g_name").alias(f) if f == "recipient" else c(f) for f in events.columns),
        *(F.lit(None).alias(f) for f in _GROUP_FIELDS),
    )
    return old.unionByName(copies)


def _units(events: DataFrame, groups: bool) -> DataFrame:
    """One row per (appid, msgid, rkey): rkey is a copy's key (copy_key), else null;
    ``groups``: with _GROUP_FIELDS (_with_group_copies).

    The events are partitioned by message first: a message's events come from several
    files (and brokers), so a map-side partial aggregation would merge few of them and
    shuffle its wide buffers instead of the events; and what follows (the window over
    the message, :func:`message_table`) finds them partitioned so.
    """
    ts = F.col("ts")
    rkey = copy_key()
    messages = events.where(~F.col("event").isin(*[e.value for e in RECIPIENT_EVENTS])).repartition(
        "appid", "msgid"
    )
    # The last dead letter and retry by (ts, attempt): of equal ts, the later attempt's,
    # whatever order their lines come in (files, brokers, read paths).
    last_dl = _when(Event.DEAD_LETTERED, ack_key())
    last_retry = _when(Event.RETRY_SCHEDULED, ack_key())
    return messages.groupBy("appid", "msgid", rkey.alias("rkey")).agg(
        count_if(is_event(Event.STORED)).alias("n_stored"),
        F.min(_when(Event.STORED, ts)).alias("stored_ts"),
        F.max(_when(Event.STORED, _number_in(_DELIVER_AT))).alias("due_at"),
        (count_if(F.col("kind") == Kind.TOPIC.value) > 0).alias("topic"),
        count_if(counted(Event.ACKED)).alias("n_acked"),
        count_if(is_event(Event.ACKED) & _recovered()).alias("n_acked_again"),
        F.min(_when(Event.ACKED, ack_key())).alias("first_ack"),
        F.min(_when(Event.PUSHED, ts)).alias("first_push"),
        F.max(_when(Event.PUSHED, ts)).alias("last_push"),
        count_if(is_event(Event.DEAD_LETTERED)).alias("n_dl"),
        F.max(_when(Event.DEAD_LETTERED, ts)).alias("last_dl"),
        F.sum(_when(Event.DEAD_LETTERED, ts)).alias("sum_dl"),
        F.sum(_when(Event.DEAD_LETTERED, F.col("attempt"))).alias("dl_attempts"),
        F.max_by(_when(Event.DEAD_LETTERED, F.col("attempt")), last_dl).alias("last_dl_attempts"),
        F.max_by(_when(Event.DEAD_LETTERED, _failure_code()), last_dl).alias("failure"),
        count_if(is_event(Event.REPLAYED)).alias("n_rp"),
        F.max(_when(Event.REPLAYED, ts)).alias("last_rp"),
        F.sum(_when(Event.REPLAYED, ts)).alias("sum_rp"),
        F.max(_when(Event.PURGED, ts)).alias("last_pg"),
        F.max(F.when(is_event(Event.PURGED) & _detail_starts(MOVED_TO_APP), ts)).alias("last_mv"),
        F.max(F.when(is_event(Event.PURGED) & _detail_starts(PENDING_PURGED), ts)).alias(
            _WHOLE_MESSAGE
        ),
        F.max(F.when(is_event(Event.EXPIRED) & _detail_starts(DROPPED), ts)).alias("last_drop"),
        F.max(ts).alias("last_ts"),
        F.max(_when(Event.RETRY_SCHEDULED, ts)).alias("last_retry"),
        F.max_by(_when(Event.RETRY_SCHEDULED, _number_in(_NEXT_AT)), last_retry).alias("next_at"),
        *(F.max(f).alias(f) for f in _GROUP_FIELDS if groups),
    )


def _joined_deliveries(units: DataFrame, groups: bool) -> DataFrame:
    """Deliveries with their message's fields: every copy (a topic message's recipient, a
    consumer group) with its message's row's fields; a message's own row is a delivery
    when it has no copy, or, for a queue message, when it was pushed too.

    ``groups``: a group's copy before its last change (_with_group_copies) is no delivery
    where a reset takes the message again (the group's copy since is); else it is the
    group's, ended by the change where it had not ended (a reset or a deletion drops the
    group's leases, waits and dead letters): purged.

    The message's fields reach its copies through a window over (appid, msgid), not a
    join: one shuffle of the units, no second computation of them (a join reads them
    twice).
    """
    c = F.col
    rkey = c("rkey")
    whole_message = Window.partitionBy("appid", "msgid")
    own = rkey.isNull()

    def of_message(name: str) -> Column:
        # one row of a message has no rkey (its own): max picks it, null if none
        return F.max(F.when(own, c(name))).over(whole_message)

    marked = units.select(
        "*",
        of_message("topic").alias("m_topic"),
        *(of_message(f).alias("m_" + f) for f in _MESSAGE_FIELDS),
        of_message(_WHOLE_MESSAGE).alias("m_" + _WHOLE_MESSAGE),
        F.max(rkey.isNotNull()).over(whole_message).alias("copied"),
    )
    acks = c("n_acked") + c("n_acked_again")  # (an ack a new owner logged again: one)
    pushed = c("first_push").isNotNull() | (acks > 0) | (c("n_dl") > 0)
    # (a consumer group's copy is in the group log, which a pending purge leaves)
    whole = F.when(rkey.startswith(GROUP_PREFIX), c(_WHOLE_MESSAGE)).otherwise(
        F.greatest(c(_WHOLE_MESSAGE), c("m_" + _WHOLE_MESSAGE))
    )
    # (a queue message purged pending was in the push queue: a delivery, pushed or not)
    in_queue = pushed | c(_WHOLE_MESSAGE).isNotNull()
    kept = marked.where(rkey.isNotNull() | ~c("copied") | (~c("topic") & in_queue))
    recipient = rkey
    if groups:
        before = rkey.endswith(_BEFORE)
        again = before & c("g_alive") & (c("m_stored_ts") >= c("g_start"))
        kept = kept.where(~F.coalesce(again, F.lit(False)))
        recipient = F.when(before, F.expr(f"left(rkey, length(rkey) - {len(_BEFORE)})"))
        recipient = recipient.otherwise(rkey)
        whole = F.when(before, F.greatest(whole, c("g_at"))).otherwise(whole)
    return kept.select(
        "appid",
        "msgid",
        recipient.alias("recipient"),
        F.when(own, c("topic")).otherwise(F.coalesce(c("m_topic"), c("topic"))).alias("topic"),
        *(F.when(own, c(f)).otherwise(c("m_" + f)).alias(f) for f in _MESSAGE_FIELDS),
        *(
            F.when(own, c(f)).otherwise(whole).alias(f) if f == _WHOLE_MESSAGE else c(f)
            for f in _DELIVERY_FIELDS
        ),
    )


def delivery_table(
    events: DataFrame, as_of: int, stuck_after_ms: int, groups: bool = True
) -> DataFrame:
    """One row per delivery of the valid ``events``, with the columns the report uses.
    ``groups``: the events may make or delete a consumer group (``group_change``; False
    leaves out the query of their copies).

    ``as_of`` is the time the log ends (its last ts): open deliveries are split by it
    into not yet due, waiting for a recipient (never pushed), in flight and stuck (no
    event for ``stuck_after_ms``). ``outcome`` is one of OUTCOMES; ``status`` groups
    them as the report's sections do: acked, dead (in the dead-letter queue), purged
    (a dead letter an operator purged or moved), dropped, not_yet_due,
    waiting_for_recipient, in_flight, stuck.
    """
    c = F.col
    acked = (c("n_acked") + c("n_acked_again")) > 0
    dead = ~acked & (c("n_dl") > 0) & (c("last_rp").isNull() | (c("last_dl") > c("last_rp")))
    # an operator removed the dead letter (or the whole message)
    purged = dead & (F.greatest(c("last_pg"), c(_WHOLE_MESSAGE)) >= c("last_dl"))
    moved = dead & (c("last_mv") >= c("last_dl"))  # ... into another app
    ended = acked | dead
    dropped = ~ended & c("last_drop").isNotNull()
    purged_pending = ~ended & c(_WHOLE_MESSAGE).isNotNull()
    due = F.coalesce(c("due_at"), c("stored_ts"))
    first_ack_ts = ack_ts(c("first_ack"))
    # Time in the dead-letter queue before the ack: each replay ends a stay that its
    # dead letter began; a dead letter never replayed lasts until the ack.
    in_dlq = F.when(
        acked & (c("n_dl") > 0) & (c("n_rp") <= c("n_dl")),
        F.coalesce(c("sum_rp"), F.lit(0)) - c("sum_dl") + (c("n_dl") - c("n_rp")) * first_ack_ts,
    ).otherwise(F.lit(0))
    # Attempts before the ack's own: those of each dead letter that a replay ended (a
    # dead letter not replayed, the last, belongs to the same run of attempts).
    replayed_attempts = F.coalesce(c("dl_attempts"), F.lit(0)) - F.when(
        c("n_dl") > c("n_rp"), F.coalesce(c("last_dl_attempts"), F.lit(0))
    ).otherwise(F.lit(0))
    waiting_retry = c("last_retry").isNotNull() & (c("last_retry") == c("last_ts"))
    pending_until = F.greatest(due, F.when(waiting_retry, c("next_at")))
    dead_outcome = F.element_at(
        F.array(*(F.lit(o) for o in _DEAD_OUTCOMES)), F.coalesce(c("failure"), F.lit(0)) + 1
    )
    outcome = (
        F.when(acked, F.lit("acked"))
        .when(moved, F.lit("dead_letter_moved"))
        .when(purged, F.lit("dead_letter_purged"))
        .when(dead, dead_outcome)
        .when(dropped, F.lit("expired_dropped"))
        .when(purged_pending, F.lit("purged_pending"))
        .when(pending_until > F.lit(as_of), F.lit("not_yet_due"))
        .when(c("first_push").isNull(), F.lit("waiting_for_recipient"))
        .when(c("last_ts") >= F.lit(as_of - stuck_after_ms), F.lit("in_flight"))
        .otherwise(F.lit("stuck"))
    )
    status = (
        F.when(outcome.isin("dead_letter_moved", "dead_letter_purged"), F.lit("purged"))
        .when(dead, F.lit("dead"))
        .when(outcome.isin("expired_dropped", "purged_pending"), F.lit("dropped"))
        .otherwise(outcome)
    )
    if groups:
        events = _with_group_copies(events)
    return _joined_deliveries(_units(events, groups), groups).select(
        "appid",
        "msgid",
        "recipient",
        "topic",
        (c("n_stored") > 0).alias("stored"),
        status.alias("status"),
        outcome.alias("outcome"),
        due.alias("due_ts"),
        F.when(acked, first_ack_ts - due - F.coalesce(in_dlq, F.lit(0))).alias("latency"),
        (c("first_push") - due).alias("push_latency"),
        F.when(acked, ack_attempt(c("first_ack")) + replayed_attempts).alias("attempt"),
        (c("n_acked") > 1).alias("acked_more_than_once"),
        F.coalesce(c("last_push") > first_ack_ts, F.lit(False)).alias("pushed_after_ack"),
        (acked & (c("n_dl") > 0)).alias("acked_and_dead"),
        c("last_dl").alias("dead_since"),
        c("failure"),
        F.coalesce(c("dl_attempts"), F.lit(0)).alias("tries"),
        c("last_ts"),
    )


def message_table(deliveries: DataFrame) -> DataFrame:
    """One row per message: its ``outcome``, the first in PRECEDENCE that one of its
    deliveries has, ``status``, the outcome's group (OUTCOME_GROUPS: acked,
    dead_lettered, dropped, unresolved), and ``in_dlq``: a delivery of the stored
    message is in the dead-letter queue."""

    def lookup(pairs: Iterable[tuple[str, Any]]) -> Column:
        return F.create_map(*(F.lit(v) for pair in pairs for v in pair))

    rank = lookup((o, i) for i, o in enumerate(PRECEDENCE))[F.col("outcome")]
    first = F.element_at(F.array(*(F.lit(o) for o in PRECEDENCE)), F.col("rank") + 1)
    group = lookup(OUTCOME_GROUPS.items())[F.col("outcome")]
    return (
        deliveries.groupBy("appid", "msgid")
        .agg(
            F.max("stored").alias("stored"),
            F.min(rank).alias("rank"),
            F.max(F.col("stored") & (F.col("status") == "dead")).alias("in_dlq"),
        )
        .select("appid", "msgid", "stored", first.alias("outcome"), "in_dlq")
        .withColumn("status", group)
    )
