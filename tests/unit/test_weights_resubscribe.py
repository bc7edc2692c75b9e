"""A weights subscription follows its channel again after each resume of the rank
(snapshotter/weights: a thaw puts the rank under an agent that does not follow the channel
for it). The agent's answers are played here; the files it would write are real."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from snapshotter import errors, weights
from snapshotter.checkpoint import spool
from snapshotter.hook.protocol import RESUMED_ENV

pytestmark = pytest.mark.timeout(10)


class FakeAgent:
    """Answers `subscribe` with the channel directory of the agent the rank runs under now."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.node = "a"
        self.asked: list[str] = []
        self.down = False

    def submit(self, request: spool.Request, timeout: float = 600.0) -> dict[str, Any]:
        assert request.op == "subscribe" and request.name == "policy"
        self.asked.append(self.node)
        if self.down:
            raise errors.StorageUnavailable("the node agent did not answer", "retry")
        return {"ok": True, "dir": str(self.tmp / self.node)}

    def holds(self, node: str, version: int) -> None:
        d = self.tmp / node
        d.mkdir(exist_ok=True)
        (d / "current").write_text(json.dumps({"version": version, "lineage": "t"}))


@pytest.fixture
def agent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeAgent:
    a = FakeAgent(tmp_path)
    monkeypatch.setattr(weights, "_submit", a.submit)
    monkeypatch.setattr(weights, "_agent_request",
                        lambda op, ch, *x, **k: spool.Request(op, "id", "u", ch, ()))  # fmt: skip
    monkeypatch.setenv(RESUMED_ENV, "launch")
    return a


def test_a_resume_makes_the_subscription_follow_again_where_the_rank_now_runs(
    agent: FakeAgent, monkeypatch: pytest.MonkeyPatch
) -> None:
    agent.holds("a", 3)
    sub = weights.subscribe("policy")
    assert sub.latest() == 3 and agent.asked == ["a"]
    assert sub.latest() == 3 and agent.asked == ["a"]  # no resume: no new request

    # Thawed onto node b, whose agent holds version 5: the next look subscribes there.
    agent.node = "b"
    agent.holds("b", 5)
    monkeypatch.setenv(RESUMED_ENV, "thaw-1")
    assert sub.latest() == 5 and agent.asked == ["a", "b"]
    assert sub.latest() == 5 and agent.asked == ["a", "b"]  # once per resume


def test_a_failed_subscribe_after_a_resume_keeps_what_it_had_and_is_tried_again(
    agent: FakeAgent, monkeypatch: pytest.MonkeyPatch
) -> None:
    agent.holds("a", 3)
    sub = weights.subscribe("policy")
    agent.node, agent.down = "b", True
    agent.holds("b", 4)
    monkeypatch.setenv(RESUMED_ENV, "thaw-1")
    assert sub.latest() == 3  # the old directory, as before
    agent.down = False
    assert sub.latest() == 4 and agent.asked == ["a", "b", "b"]
