"""Per delivery and per message: the definitions of docs/AUDIT.md as Spark expressions.

``delivery_table`` folds the events of each delivery into one row (a queue message is
one delivery, a topic message one per recipient) with fixed-width aggregates only, so
Spark hash-aggregates with map-side partial aggregation and never sorts the events.
``message_table`` folds deliveries into messages.
"""

from __future__ import annotations

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from skmq.events import GROUP_PREFIX, RECIPIENT_EVENTS, Event, Kind

__all__ = [
    "FAILURES",
    "ack_attempt",
    "ack_key",
    "ack_ts",
    "copy_key",
    "count_if",
    "delivery_table",
    "is_event",
    "message_table",
]

# An acked event's (ts, attempt) packed in a long: ts << 20 | attempt (all ones: none).
_ATTEMPT_BITS = 20
_NO_ATTEMPT = (1 << _ATTEMPT_BITS) - 1
_MAX_ATTEMPT = _NO_ATTEMPT - 1
# The outcome named by a dead letter's detail ("after 5 attempts; last: timeout"),
# as a small number so that the aggregation stays fixed-width; 0: not named.
FAILURES = (Event.REJECTED, Event.ERRORED, Event.TIMEOUT, Event.UNREACHABLE)
_DELIVER_AT = r"deliver_at=(\d+)"
_NEXT_AT = r"next attempt at (\d+)"
_LAST_FAILURE = r"last: (\w+)"


def is_event(event: Event) -> Column:
    return F.col("event") == F.lit(event.value)


def count_if(cond: Column) -> Column:
    return F.count(F.when(cond, F.lit(1)))


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


def _failure_code() -> Column:
    named = F.regexp_extract(F.col("detail"), _LAST_FAILURE, 1)
    code = F.lit(0)
    for index, failure in reversed(list(enumerate(FAILURES, start=1))):
        code = F.when(named == failure.value, F.lit(index)).otherwise(code)
    return code


def _when(event: Event, value: Column) -> Column:
    return F.when(is_event(event), value)


# The per-delivery aggregates: the message-level ones (stored) and the delivery ones.
_MESSAGE_FIELDS = ("n_stored", "stored_ts", "due_at")
_DELIVERY_FIELDS = (
    "n_acked",
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


def _units(events: DataFrame) -> DataFrame:
    """One row per (appid, msgid, rkey): rkey is a copy's key (copy_key), else null."""
    ts = F.col("ts")
    rkey = copy_key()
    messages = events.where(~F.col("event").isin(*[e.value for e in RECIPIENT_EVENTS]))
    return messages.groupBy("appid", "msgid", rkey.alias("rkey")).agg(
        count_if(is_event(Event.STORED)).alias("n_stored"),
        F.min(_when(Event.STORED, ts)).alias("stored_ts"),
        F.max(_when(Event.STORED, _number_in(_DELIVER_AT))).alias("due_at"),
        (count_if(F.col("kind") == Kind.TOPIC.value) > 0).alias("topic"),
        count_if(is_event(Event.ACKED)).alias("n_acked"),
        F.min(_when(Event.ACKED, ack_key())).alias("first_ack"),
        F.min(_when(Event.PUSHED, ts)).alias("first_push"),
        F.max(_when(Event.PUSHED, ts)).alias("last_push"),
        count_if(is_event(Event.DEAD_LETTERED)).alias("n_dl"),
        F.max(_when(Event.DEAD_LETTERED, ts)).alias("last_dl"),
        F.sum(_when(Event.DEAD_LETTERED, ts)).alias("sum_dl"),
        F.sum(_when(Event.DEAD_LETTERED, F.col("attempt"))).alias("dl_attempts"),
        F.max_by(
            _when(Event.DEAD_LETTERED, F.col("attempt")), _when(Event.DEAD_LETTERED, ts)
        ).alias("last_dl_attempts"),
        F.max_by(_when(Event.DEAD_LETTERED, _failure_code()), _when(Event.DEAD_LETTERED, ts)).alias(
            "failure"
        ),
        count_if(is_event(Event.REPLAYED)).alias("n_rp"),
        F.max(_when(Event.REPLAYED, ts)).alias("last_rp"),
        F.sum(_when(Event.REPLAYED, ts)).alias("sum_rp"),
        F.max(_when(Event.PURGED, ts)).alias("last_pg"),
        F.max(ts).alias("last_ts"),
        F.max(_when(Event.RETRY_SCHEDULED, ts)).alias("last_retry"),
        F.max_by(
            _when(Event.RETRY_SCHEDULED, _number_in(_NEXT_AT)), _when(Event.RETRY_SCHEDULED, ts)
        ).alias("next_at"),
    )


def _joined_deliveries(units: DataFrame) -> DataFrame:
    """Deliveries with their message's fields: every copy (a topic message's recipient, a
    consumer group) joined to its message's row; a message's own row is a delivery when it
    has no copy, or, for a queue message, when it was pushed too."""
    rkey = F.col("rkey")
    message_rows = units.where(rkey.isNull()).select(
        "appid",
        "msgid",
        F.col("topic").alias("m_topic"),
        *_MESSAGE_FIELDS,
        *(F.col(f).alias("m_" + f) for f in _DELIVERY_FIELDS),
    )
    copies = units.where(rkey.isNotNull()).select(
        "appid", "msgid", "rkey", F.col("topic").alias("c_topic"), *_DELIVERY_FIELDS
    )
    copy_rows = message_rows.join(copies, ["appid", "msgid"], "right").select(
        "appid",
        "msgid",
        rkey.alias("recipient"),
        F.coalesce(F.col("m_topic"), F.col("c_topic")).alias("topic"),
        *_MESSAGE_FIELDS,
        *_DELIVERY_FIELDS,
    )
    copied = copies.select("appid", "msgid").distinct().withColumn("copied", F.lit(True))
    pushed = F.col("m_first_push").isNotNull() | (F.col("m_n_acked") > 0) | (F.col("m_n_dl") > 0)
    own_rows = (
        message_rows.join(copied, ["appid", "msgid"], "left")
        .where(F.col("copied").isNull() | (~F.col("m_topic") & pushed))
        .select(
            "appid",
            "msgid",
            F.lit(None).cast("string").alias("recipient"),
            F.col("m_topic").alias("topic"),
            *_MESSAGE_FIELDS,
            *(F.col("m_" + f).alias(f) for f in _DELIVERY_FIELDS),
        )
    )
    return own_rows.unionByName(copy_rows)


def delivery_table(events: DataFrame, as_of: int, stuck_after_ms: int) -> DataFrame:
    """One row per delivery of the valid ``events``, with the columns the report uses.

    ``as_of`` is the time the log ends (its last ts): unresolved deliveries are split
    by it into not yet due, in flight and stuck (no event for ``stuck_after_ms``).
    """
    c = F.col
    acked = c("n_acked") > 0
    dead = ~acked & (c("n_dl") > 0) & (c("last_rp").isNull() | (c("last_dl") > c("last_rp")))
    purged = dead & (c("last_pg") >= c("last_dl"))  # an operator removed the dead letter
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
    status = (
        F.when(acked, F.lit("acked"))
        .when(purged, F.lit("purged"))
        .when(dead, F.lit("dead"))
        .when(pending_until > F.lit(as_of), F.lit("not_yet_due"))
        .when(c("last_ts") >= F.lit(as_of - stuck_after_ms), F.lit("in_flight"))
        .otherwise(F.lit("stuck"))
    )
    return _joined_deliveries(_units(events)).select(
        "appid",
        "msgid",
        "recipient",
        "topic",
        (c("n_stored") > 0).alias("stored"),
        status.alias("status"),
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
    """One row per message: ``status`` dead_lettered if any delivery is dead (or its dead
    letter purged), else unresolved if any is not acked, else acked."""
    status = F.col("status")
    rank = (
        F.when(status.isin("dead", "purged"), F.lit(2))
        .when(status == "acked", F.lit(0))
        .otherwise(1)
    )
    return (
        deliveries.groupBy("appid", "msgid")
        .agg(F.max("stored").alias("stored"), F.max(rank).alias("rank"))
        .select(
            "appid",
            "msgid",
            "stored",
            F.when(F.col("rank") == 2, F.lit("dead_lettered"))
            .when(F.col("rank") == 1, F.lit("unresolved"))
            .otherwise(F.lit("acked"))
            .alias("status"),
        )
    )
