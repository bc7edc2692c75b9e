"""What the metrics count as an operation's events pass (snapshotter/metrics.py): phases,
outcomes by cause, bytes; read back from the registry each service's endpoint serves."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from snapshotter import errors, metrics
from snapshotter.v1 import agent_pb2, common_pb2, coordinator_pb2

pb = coordinator_pb2


def _value(registry: metrics.CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


def _freeze_events(fail: BaseException | None = None) -> Iterator[pb.FreezeEvent]:
    for phase in ("prepare", "quiesce", "dump"):
        yield pb.FreezeEvent(phase=common_pb2.PhaseEvent(phase=phase))
    yield pb.FreezeEvent(phase=common_pb2.PhaseEvent(phase="upload", bytes=1000))
    if fail is not None:
        raise fail
    done = pb.FreezeEvent()
    done.done.snapshot_id = "s1"
    done.done.stats.stall_s = 0.25
    yield done


def test_a_freeze_counts_its_phases_bytes_stall_and_outcome() -> None:
    r = metrics.COORDINATOR
    before = {p: _value(r, "snapshotter_operation_phases_total", op="freeze", phase=p)
              for p in ("prepare", "dump", "upload")}  # fmt: skip
    ok0 = _value(r, "snapshotter_operations_total", op="freeze", outcome="ok")
    bytes0 = _value(r, "snapshotter_operation_image_bytes_total", op="freeze")
    stalls0 = _value(r, "snapshotter_freeze_stall_seconds_count")
    timed0 = _value(r, "snapshotter_operation_phase_seconds_count", op="freeze", phase="upload")
    events = list(metrics.observed("freeze", _freeze_events()))
    assert len(events) == 5
    for p, n in before.items():
        assert _value(r, "snapshotter_operation_phases_total", op="freeze", phase=p) == n + 1
    assert _value(r, "snapshotter_operations_total", op="freeze", outcome="ok") == ok0 + 1
    assert _value(r, "snapshotter_operation_image_bytes_total", op="freeze") == bytes0 + 1000
    assert _value(r, "snapshotter_freeze_stall_seconds_count") == stalls0 + 1
    # The last phase ends with the operation.
    assert _value(r, "snapshotter_operation_phase_seconds_count", op="freeze",
                  phase="upload") == timed0 + 1  # fmt: skip


def test_failures_are_counted_by_their_cause_and_reraised() -> None:
    r = metrics.COORDINATOR
    cause = errors.StorageUnavailable("the store is down", "bring it back")
    n0 = _value(r, "snapshotter_operations_total", op="thaw", outcome=cause.code)
    with pytest.raises(errors.StorageUnavailable):
        list(metrics.observed("thaw", _freeze_events(cause)))
    assert _value(r, "snapshotter_operations_total", op="thaw", outcome=cause.code) == n0 + 1
    n1 = _value(r, "snapshotter_operations_total", op="thaw", outcome="internal")
    with pytest.raises(ZeroDivisionError):
        list(metrics.observed("thaw", _freeze_events(ZeroDivisionError())))
    assert _value(r, "snapshotter_operations_total", op="thaw", outcome="internal") == n1 + 1


def test_a_caller_that_stops_reading_closes_the_operation() -> None:
    r = metrics.COORDINATOR
    closed: list[bool] = []

    def inner() -> Iterator[pb.FreezeEvent]:
        try:
            yield from _freeze_events()
        finally:
            closed.append(True)

    n0 = _value(r, "snapshotter_operations_total", op="migrate", outcome="abandoned")
    it = metrics.observed("migrate", inner())
    next(it)
    it.close()
    assert closed == [True]
    assert _value(r, "snapshotter_operations_total", op="migrate",
                  outcome="abandoned") == n0 + 1  # fmt: skip


def test_transfers_add_each_streams_progress_once() -> None:
    r = metrics.AGENT
    raw0 = _value(r, "snapshotter_transfer_bytes_total", direction="upload", kind="raw")
    sent0 = _value(r, "snapshotter_transfer_bytes_total", direction="upload", kind="sent")

    def ev(stream: str, raw: int, sent: int) -> agent_pb2.UploadEvent:
        return agent_pb2.UploadEvent(progress=common_pb2.TransferProgress(
            node="a", stream=stream, raw_bytes=raw, uploaded_bytes=sent))  # fmt: skip

    # Running totals per stream: 300 + 50 raw bytes, 120 + 10 sent.
    stream = [ev("r0", 100, 40), ev("r1", 50, 10), ev("r0", 300, 120), ev("r0", 300, 120)]
    assert len(list(metrics.transfers("upload", stream))) == 4
    assert _value(r, "snapshotter_transfer_bytes_total", direction="upload",
                  kind="raw") == raw0 + 350  # fmt: skip
    assert _value(r, "snapshotter_transfer_bytes_total", direction="upload",
                  kind="sent") == sent0 + 130  # fmt: skip


@pytest.mark.parametrize("listen", ["nonsense", "127.0.0.1:notaport", ":9464", "1.2.3.4:99999"])
def test_a_bad_listen_address_is_refused(listen: str) -> None:
    with pytest.raises(errors.InvalidArgument, match="HOST:PORT"):
        metrics.serve(listen, metrics.AGENT, None, "agent")


def test_no_plain_metrics_beyond_loopback() -> None:
    with pytest.raises(errors.InvalidArgument, match="without TLS") as e:
        metrics.serve("10.1.2.3:9465", metrics.AGENT, None, "agent")
    assert "--tls-dir" in e.value.next_step


def test_every_rank_is_in_every_scrape_and_a_silent_one_has_no_figures() -> None:
    timing = common_pb2.CollectiveTiming(group="0", done=40, mean_s=0.02)
    running = common_pb2.JobProgress(job_id="j1", ranks=[
        common_pb2.RankProgress(rank=0, answered=True, step_s=0.5, in_flight_s=0.01,
                                timings=[timing]),
        common_pb2.RankProgress(rank=1, answered=False, proc_state="T"),  # stopped
    ])  # fmt: skip
    busy = common_pb2.JobProgress(job_id="j2", busy=True, ranks=[
        common_pb2.RankProgress(rank=0, answered=False, proc_state="S")])  # fmt: skip
    registry = CollectorRegistry()
    registry.register(metrics._Ranks(lambda: [running, busy]))
    text = generate_latest(registry).decode()
    lines = {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1])
             for ln in text.splitlines() if ln and not ln.startswith("#")}  # fmt: skip
    assert lines['snapshotter_rank_answered{job_id="j1",rank="0"}'] == 1.0
    assert lines['snapshotter_rank_answered{job_id="j1",rank="1"}'] == 0.0
    assert lines['snapshotter_rank_answered{job_id="j2",rank="0"}'] == 0.0
    assert lines['snapshotter_rank_step_seconds{job_id="j1",rank="0"}'] == 0.5
    assert lines['snapshotter_rank_collective_latency_seconds{job_id="j1",rank="0"}'] == 0.02
    # No figure is made up for a rank that did not answer.
    assert not [k for k in lines if 'rank="1"' in k and "answered" not in k], lines
    assert not [k for k in lines if 'job_id="j2"' in k and "answered" not in k], lines
