"""What a restarted agent does with ranks its predecessor left held by a freeze."""

from __future__ import annotations

import pytest

from snapshotter.agent.settle import Plan, plan


@pytest.mark.parametrize(
    ("states", "here", "expected"),
    [
        (["idle", "idle"], True, Plan.NOTHING),
        (["", "idle"], True, Plan.NOTHING),  # a rank that did not answer is not held
        (["holding", "idle"], True, Plan.ABORT),
        (["parked", "armed"], False, Plan.ABORT),  # an abort needs no peer: any node may
        (["parked", "parked"], True, Plan.ABORT),
        (["suspended", "parked"], True, Plan.RESUME),
        (["suspended", "suspended"], True, Plan.RESUME),
        (["suspended", "suspended"], False, Plan.LEAVE),  # its peers elsewhere rebuild too
    ],
)
def test_plan(states: list[str], here: bool, expected: Plan) -> None:
    assert plan(states, here) is expected
