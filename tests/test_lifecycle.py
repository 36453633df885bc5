"""The owner's state machine (skmq/lifecycle.py): one test a transition, one a
refusal, and the rebuild of a new owner over journal records."""

from __future__ import annotations

import pytest

from skmq.lifecycle import (
    DERIVED,
    OVER,
    TABLE,
    TRIGGER_OF,
    Record,
    Refused,
    State,
    Trigger,
    detour,
    step,
)

ROWS = [(s, e, rule) for s, rules in TABLE.items() for e, rule in rules.items()]
REFUSALS = [(s, e) for s in State for e in Trigger if e not in TABLE[s]]


@pytest.mark.parametrize(("state", "trigger", "rule"), ROWS, ids=lambda x: str(x))
def test_each_transition(state: State, trigger: Trigger, rule: object) -> None:
    assert step(state, trigger) is rule


@pytest.mark.parametrize(("state", "trigger"), REFUSALS, ids=lambda x: str(x))
def test_each_refusal_names_the_state_and_the_event(state: State, trigger: Trigger) -> None:
    with pytest.raises(Refused) as refused:
        step(state, trigger)
    assert refused.value.state is state and refused.value.trigger is trigger
    assert str(state) in str(refused.value) and str(trigger) in str(refused.value)


def test_the_rows_users_rely_on() -> None:
    assert step(State.IN_FLIGHT, Trigger.ACK).target is State.ACKED
    assert step(State.IN_FLIGHT, Trigger.RETRY).target is State.WAITING_RETRY
    assert step(State.IN_FLIGHT, Trigger.GIVE_UP).target is State.DEAD
    assert State.DEAD in OVER  # to the app's dead letters (skmq/queue/dead.py)
    for state in (State.DELAYED, State.PENDING, State.WAITING_RETRY, State.DEAD):
        with pytest.raises(Refused):
            step(state, Trigger.ACK)  # only a delivery in flight can be acked
    for state in State:
        if state is not State.IN_FLIGHT:
            with pytest.raises(Refused):
                step(state, Trigger.EXTEND)  # only a lease can be extended


def test_over_is_final_and_every_other_state_has_a_way_out() -> None:
    for state in State:
        assert (not TABLE[state]) == (state in OVER)


def test_every_record_stands_for_one_event() -> None:
    recorded = [rule.record for rules in TABLE.values() for rule in rules.values()]
    assert set(TRIGGER_OF) == set(Record) == {r for r in recorded if r is not None}
    for state, rules in TABLE.items():
        for trigger, rule in rules.items():
            if rule.record is not None:
                assert TRIGGER_OF[rule.record] is trigger, (state, trigger)


def test_derived_transitions_carry_no_record() -> None:
    for state, trigger in DERIVED.items():
        assert TABLE[state][trigger].record is None


def test_a_replayed_record_takes_the_derived_steps_it_needs() -> None:
    # pushed after its delay ran out, and after the one before it in its key was over
    assert detour(State.DELAYED, Trigger.PUSH) == [Trigger.DUE]
    assert detour(State.WAITING_KEY, Trigger.PUSH) == [Trigger.KEY_FREE, Trigger.DUE]
    assert detour(State.WAITING_RETRY, Trigger.PUSH) == [Trigger.DUE]
    assert detour(State.IN_FLIGHT, Trigger.ACK) == []
    assert detour(State.DELAYED, Trigger.PURGE) == []  # no detour: its own row


def test_a_record_no_path_leads_to_is_refused() -> None:
    with pytest.raises(Refused):
        detour(State.PENDING, Trigger.ACK)  # acked, never pushed
    with pytest.raises(Refused):
        detour(State.ACKED, Trigger.PUSH)
    with pytest.raises(Refused):
        detour(State.DEAD, Trigger.ACK)
