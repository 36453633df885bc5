"""`python -m bench.takeover --scenarios kill` at a tiny size: two brokers on a
Redis of their own, 200 messages held in flight by the recipient, the owner killed with
SIGKILL; the other broker takes the app over and pushes every held message again."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from bench.takeover import amain, parse_args

LEASE = 2.0


@pytest.fixture(scope="module")
def kill_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("takeover") / "takeover.json"
    flags = f"--scenarios kill --messages 200 --lease {LEASE} --settle 1 --wait 8"
    asyncio.run(amain(parse_args([*flags.split(), "--json", str(out)])))
    result: dict[str, Any] = json.loads(out.read_text())["results"][0]
    return result


def test_the_other_broker_pushes_every_held_message_again(kill_run: dict[str, Any]) -> None:
    r = kill_run
    assert "error" not in r, r
    assert (r["in_flight"], r["repushed"], r["lost"]) == (200, 200, 0), r
    # the lease runs out before the other broker may take the app: never sooner (the
    # bench polls for the owner key: it may see the first re-push before the key)
    assert LEASE / 2 < r["acquired_s"], r
    assert LEASE / 2 < r["repush_first_s"] <= r["repush_last_s"], r


def test_every_message_pushed_again_is_acked_and_the_queue_empties(
    kill_run: dict[str, Any],
) -> None:
    assert kill_run["drained_after_ack_s"] is not None, kill_run
