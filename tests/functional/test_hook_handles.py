"""The works a resumable group hands out, on a real one-rank gloo communicator in this process,
on both paths (the native one of csrc/gate.cpp and the Python fallback): what is finished leaves
the barrier's in-flight set whatever kind of work it is (gloo's reduce_scatter reports
completion only to a waiter), and a teardown releases every work a caller still holds, keeping
its outcome."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from snapshotter.hook import native  # noqa: E402
from snapshotter.hook.barrier import QuiesceBarrier  # noqa: E402
from snapshotter.hook.resumable import GroupRegistry, _Creating  # noqa: E402
from snapshotter.hook.sockets import Owned  # noqa: E402

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(params=["native", "python"])
def path(request: pytest.FixtureRequest) -> str:
    if request.param == "native" and native.load() is None:
        pytest.fail("the native hook is not built: python -m snapshotter.hook.native --build")
    return str(request.param)


def _group(path: str) -> tuple[GroupRegistry, Any]:
    def parked(*_: object) -> None:
        pass

    ext = native.load()
    barrier: Any = native.NativeBarrier(ext, parked) if path == "native" else QuiesceBarrier(parked)
    registry = GroupRegistry(barrier, Owned())
    pg = registry.create(_Creating("0", [0], "gloo"), dist.HashStore(), 0, 1,
                         timedelta(seconds=30))  # fmt: skip
    return registry, pg


def _held(registry: GroupRegistry) -> int:
    b: Any = registry.barrier
    return int(b.gate.held()) if registry.native is not None else len(b._pending)


def _holds_work(registry: GroupRegistry, work: Any) -> bool:
    if registry.native is not None:
        return bool(registry.native.holds_work(work))
    return work._work is not None


def test_finished_works_leave_the_in_flight_set_of_every_kind(path: str) -> None:
    registry, pg = _group(path)
    assert (registry.native is not None) == (path == "native")
    t = torch.ones(8)
    out = torch.zeros(8)
    for _ in range(300):
        pg.allreduce([t]).wait()
        pg._reduce_scatter_base(out, t).wait()
    assert registry.barrier.in_flight() == 0
    assert _held(registry) < 70  # nothing finished is kept
    assert registry.barrier.counts() == {"0": 600}


def test_teardown_releases_works_a_caller_keeps_and_keeps_their_outcome(path: str) -> None:
    registry, pg = _group(path)
    t = torch.full((4,), 3.0)
    kept = pg.allreduce([t])
    kept.wait()
    rs = pg._reduce_scatter_base(torch.zeros(4), t)
    assert _holds_work(registry, kept) and _holds_work(registry, rs)
    registry.teardown_all()
    # Nothing pins the communicator now.
    assert not _holds_work(registry, kept) and not _holds_work(registry, rs)
    assert kept.is_completed() and kept.wait() and kept.is_success()
    assert torch.equal(kept.get_future().value()[0], t)
    assert rs.is_completed()
    with pytest.raises(RuntimeError, match="getFuture"):
        rs.get_future()
    with pytest.raises(RuntimeError, match="has no communicator"):
        pg.allreduce([t])


_EXIT_SCRIPT = """
import sys, threading, time
import torch  # noqa: F401 - native.load() looks for the torch this process imported
from snapshotter.hook import native
barrier = native.NativeBarrier(native.load(), lambda *a: None)
def poll():  # what the control thread does for each progress query of the agent
    while True:
        barrier.counts()
        barrier.oldest_in_flight_s()
for _ in range(2):
    threading.Thread(target=poll, daemon=True).start()
time.sleep(0.05)
print("exiting", flush=True)
"""


_LATE_SCRIPT = """
import atexit
box = {}
def late():  # registered before the gate's own atexit: runs after it, on the exiting thread
    box["b"].counts()
    box["b"].oldest_in_flight_s()
    print("late call returned", flush=True)
atexit.register(late)
import torch  # noqa: F401
from snapshotter.hook import native
box["b"] = native.NativeBarrier(native.load(), lambda *a: None)
"""


def test_a_rank_exits_cleanly_while_a_daemon_thread_is_in_the_gate(tmp_path: Any) -> None:
    """The interpreter's exit must not abort the rank while its control thread is inside the
    native gate: CPython ends such a thread with pthread_exit, and without the gate's guards
    that unwind hit a noexcept destructor ('terminate called without an active exception',
    exit 134): a job that finished every step was reported FAILED. Before the fix every run
    of this script aborted."""
    import subprocess
    import sys

    if native.load() is None:
        pytest.fail("the native hook is not built: python -m snapshotter.hook.native --build")
    script = tmp_path / "exit_in_gate.py"
    script.write_text(_EXIT_SCRIPT)
    for _ in range(5):
        r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                           timeout=60)  # fmt: skip
        assert (r.returncode, r.stdout) == (0, "exiting\n"), r.stderr[-2000:]
        assert "terminate called" not in r.stderr
    # The exiting thread itself still uses the gate to the end (its finalizers and atexit
    # handlers may destroy groups): it must never be held back, or the rank hangs at exit.
    late = tmp_path / "late_call.py"
    late.write_text(_LATE_SCRIPT)
    r = subprocess.run([sys.executable, str(late)], capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stdout) == (0, "late call returned\n"), r.stderr[-2000:]
