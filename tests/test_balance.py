"""The weighted balance: shares (w+1)/sum(w+1), in any registration order, and exact
even when claims use only part of what was picked."""

from __future__ import annotations

from collections import Counter

from hypothesis import given
from hypothesis import strategies as st

from skmq.registry.balance import Balancer


def share(picks: list[str]) -> Counter[str]:
    return Counter(picks)


def test_shares_follow_weight_plus_one() -> None:
    b = Balancer()
    weights = {"a": 0, "b": 1, "c": 2}
    picks = b.pick(weights, dict.fromkeys(weights, 10_000), 600)
    assert share(picks) == {"a": 100, "b": 200, "c": 300}


@given(st.dictionaries(st.text(min_size=1, max_size=4), st.integers(0, 5), min_size=1,
                       max_size=5), st.randoms())  # fmt: skip
def test_shares_do_not_depend_on_registration_order(weights: dict[str, int], rnd: object) -> None:
    total = sum(w + 1 for w in weights.values())
    items = list(weights.items())
    rnd.shuffle(items)  # type: ignore[attr-defined]
    picks = Balancer().pick(dict(items), dict.fromkeys(weights, 10**6), total * 7)
    assert share(picks) == {rid: (w + 1) * 7 for rid, w in weights.items()}


def test_commit_keeps_only_the_picks_used() -> None:
    """One message at a time: each claim proposes many picks but uses one."""
    b = Balancer()
    weights = {"a": 0, "b": 2}
    used = []
    for _ in range(40):
        picks = b.pick(weights, {"a": 64, "b": 64}, 16)
        b.commit(1)
        used.append(picks[0])
    assert share(used) == {"a": 10, "b": 30}


def test_a_full_recipient_keeps_its_turn() -> None:
    b = Balancer()
    weights = {"a": 0, "b": 0}
    first = b.pick(weights, {"a": 1, "b": 5}, 4)
    assert first == ["a", "b"]  # a's next turn comes up with no slot: the batch stops
    second = b.pick(weights, {"a": 5, "b": 5}, 4)
    assert second[0] == "a"
    assert share(first + second) == {"a": 3, "b": 3}


def test_departed_recipients_are_forgotten() -> None:
    b = Balancer()
    b.pick({"a": 0, "b": 0}, {"a": 5, "b": 5}, 3)
    picks = b.pick({"b": 0}, {"b": 5}, 3)
    assert picks == ["b", "b", "b"]


@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3), st.integers(1, 6),
                          st.booleans()), min_size=1, max_size=30))  # fmt: skip
def test_committing_every_pick_goes_on_as_picking_again(
    rounds: list[tuple[int, int, int, bool]],
) -> None:
    """`commit` of all a pick returned keeps the state `pick` left; it must give the same
    turns as restoring the state before the pick and picking exactly as many again."""
    kept, again = Balancer(), Balancer()
    weights = {"a": 0, "b": 2, "c": 1}
    for free_a, free_b, n, use_all in rounds:
        free = {"a": free_a, "b": free_b, "c": 2}
        picks = kept.pick(weights, free, n)
        assert again.pick(weights, free, n) == picks
        used = len(picks) if use_all else len(picks) // 2
        kept.commit(used)
        again._picked = -1  # (the other path: restore and pick `used` again)
        again.commit(used)
