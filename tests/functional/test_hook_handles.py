"""The works a resumable group hands out, on a real one-rank gloo communicator in this process:
what is finished leaves the barrier's in-flight set whatever kind of work it is (gloo's
reduce_scatter reports completion only to a waiter), and a teardown releases every work a
caller still holds, keeping its outcome."""

from __future__ import annotations

from datetime import timedelta

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from snapshotter.hook.barrier import QuiesceBarrier  # noqa: E402
from snapshotter.hook.resumable import GroupRegistry, _Creating  # noqa: E402
from snapshotter.hook.sockets import Owned  # noqa: E402

pytestmark = pytest.mark.timeout(60)


def _group() -> tuple[GroupRegistry, object]:
    registry = GroupRegistry(QuiesceBarrier(lambda *_: None), Owned())
    pg = registry.create(_Creating("0", [0], "gloo"), dist.HashStore(), 0, 1,
                         timedelta(seconds=30))  # fmt: skip
    return registry, pg


def test_finished_works_leave_the_in_flight_set_of_every_kind() -> None:
    registry, pg = _group()
    t = torch.ones(8)
    out = torch.zeros(8)
    for _ in range(300):
        pg.allreduce([t]).wait()  # type: ignore[attr-defined]
        pg._reduce_scatter_base(out, t).wait()  # type: ignore[attr-defined]
    assert registry.barrier.in_flight() == 0
    assert len(registry.barrier._pending) < 70  # nothing finished is kept


def test_teardown_releases_works_a_caller_keeps_and_keeps_their_outcome() -> None:
    registry, pg = _group()
    t = torch.full((4,), 3.0)
    kept = pg.allreduce([t])  # type: ignore[attr-defined]
    kept.wait()
    rs = pg._reduce_scatter_base(torch.zeros(4), t)  # type: ignore[attr-defined]
    registry.teardown_all()
    assert kept._work is None and rs._work is None  # nothing pins the communicator now
    assert kept.is_completed() and kept.wait() and kept.is_success()
    assert torch.equal(kept.get_future().value()[0], t)
    assert rs.is_completed()
    with pytest.raises(RuntimeError, match="getFuture"):
        rs.get_future()
