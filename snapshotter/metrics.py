"""Prometheus metrics of the coordinator and the agents, and the endpoint that serves them.

Each service kind has its own registry (a test or the embedded daemon may run both in one
process; each endpoint shows its own service's metrics). What is counted, and where:

- every rpc either service answers: its duration and status code (rpc/server.py);
- the coordinator's operations (freeze, thaw, migrate, reroute): each phase reached and how
  long the one before took, the outcome (`ok` or the error code: failures by cause), the
  duration, the image bytes and a freeze's stall (`observed`, wrapped in core/migrate/reroute);
- the coordinator's job events by kind (recoveries, give-ups, policy snapshots; life.py),
  heartbeats received per node, live agents and jobs by state (daemon.py);
- an agent's heartbeats sent by outcome and the bytes its uploads and fetches move, live
  (`transfers`, in agent/service.py).

Served on loopback as plain HTTP; anywhere else only over TLS with a client certificate of the
cluster's CA (the same rule as the gRPC services: rpc/server.py).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from snapshotter import errors
from snapshotter.rpc.tls import TlsFiles

E = TypeVar("E")

COORDINATOR = CollectorRegistry()
AGENT = CollectorRegistry()
for _r in (COORDINATOR, AGENT):
    ProcessCollector(registry=_r)  # RSS, CPU seconds, open fds of the service itself

# Seconds: a control rpc takes milliseconds, a dump or an upload minutes.
_BUCKETS = (0.005, 0.02, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900, 1800)


class RpcMetrics:
    """Every rpc a service answered: how long it took, with its status code."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.seconds = Histogram("snapshotter_rpc_seconds", "rpcs answered, by method and "
                                 "code", ["method", "code"], registry=registry,
                                 buckets=_BUCKETS)  # fmt: skip
        self.in_flight = Gauge("snapshotter_rpcs_in_flight", "rpcs being answered", ["method"],
                               registry=registry)  # fmt: skip

    def observe(self, method: str, code: str, seconds: float) -> None:
        self.seconds.labels(method.rsplit("/", 1)[-1], code).observe(seconds)


RPC = {"coordinator": RpcMetrics(COORDINATOR), "agent": RpcMetrics(AGENT)}

# ---- the coordinator ---------------------------------------------------------------------------
PHASES = Counter("snapshotter_operation_phases", "phases operations reached",
                 ["op", "phase"], registry=COORDINATOR)  # fmt: skip
PHASE_SECONDS = Histogram("snapshotter_operation_phase_seconds",
                          "how long each phase of an operation took", ["op", "phase"],
                          registry=COORDINATOR, buckets=_BUCKETS)  # fmt: skip
OPERATIONS = Counter("snapshotter_operations", "operations ended, by outcome (ok or the error "
                     "code)", ["op", "outcome"], registry=COORDINATOR)  # fmt: skip
OPERATION_SECONDS = Histogram("snapshotter_operation_seconds", "operations that succeeded",
                              ["op"], registry=COORDINATOR, buckets=_BUCKETS)  # fmt: skip
IMAGE_BYTES = Counter("snapshotter_operation_image_bytes", "image bytes operations stored",
                      ["op"], registry=COORDINATOR)  # fmt: skip
STALL_SECONDS = Histogram("snapshotter_freeze_stall_seconds", "how long freezes held the job",
                          registry=COORDINATOR, buckets=_BUCKETS)  # fmt: skip
POLICY_LAG = Histogram("snapshotter_policy_lag_seconds", "how late policy snapshots started "
                       "after they were due (the supervisor's tick, a busy job, a backoff)",
                       registry=COORDINATOR, buckets=_BUCKETS)  # fmt: skip
JOB_EVENTS = Counter("snapshotter_job_events", "job events by kind (recovered, gave_up, "
                     "snapshot, failure...)", ["kind"], registry=COORDINATOR)  # fmt: skip
HEARTBEATS = Counter("snapshotter_agent_heartbeats_received", "agents' heartbeats", ["node"],
                     registry=COORDINATOR)  # fmt: skip

# ---- an agent ----------------------------------------------------------------------------------
HEARTBEATS_SENT = Counter("snapshotter_heartbeats_sent", "heartbeats to the coordinator, by "
                          "outcome", ["outcome"], registry=AGENT)  # fmt: skip
TRANSFER_BYTES = Counter("snapshotter_transfer_bytes", "bytes moved by uploads and fetches: raw "
                         "image bytes, and stored bytes sent", ["direction", "kind"],
                         registry=AGENT)  # fmt: skip
WEIGHTS_VERSIONS = Counter("snapshotter_weights_versions", "weight versions this agent took, "
                           "by how (published here, pulled whole, pull failed)", ["how"],
                           registry=AGENT)  # fmt: skip
WEIGHTS_BYTES = Counter("snapshotter_weights_bytes", "weight-push bytes by direction (published "
                        "here, fetched from peers, served to peers, copied unchanged)",
                        ["direction"], registry=AGENT)  # fmt: skip


def observed(op: str, events: Iterable[E]) -> Iterator[E]:
    """`events` (an operation's FreezeEvent/ThawEvent/MigrateEvent stream), counted as they
    pass: a phase ends when the next begins, the last one when the operation ends."""
    t0 = last = time.monotonic()
    phase = ""
    outcome = "abandoned"  # the caller stopped reading (a cancelled rpc)

    def close_phase(now: float) -> None:
        if phase:
            PHASE_SECONDS.labels(op, phase).observe(now - last)

    try:
        for ev in events:
            which = ev.WhichOneof("event")  # type: ignore[attr-defined]
            if which == "phase":
                now = time.monotonic()
                close_phase(now)
                phase, last = ev.phase.phase, now  # type: ignore[attr-defined]
                PHASES.labels(op, phase).inc()
                if ev.phase.bytes > 0:  # type: ignore[attr-defined]
                    IMAGE_BYTES.labels(op).inc(ev.phase.bytes)  # type: ignore[attr-defined]
            elif which == "done" and op == "freeze":
                stats = ev.done.stats  # type: ignore[attr-defined]
                if stats.HasField("stall_s"):
                    STALL_SECONDS.observe(stats.stall_s)
            yield ev
        outcome = "ok"
        OPERATION_SECONDS.labels(op).observe(time.monotonic() - t0)
    except errors.SnapshotterError as e:
        outcome = e.code
        raise
    except GeneratorExit:
        raise
    except BaseException:
        outcome = "internal"
        raise
    finally:
        close_phase(time.monotonic())
        OPERATIONS.labels(op, outcome).inc()
        close = getattr(events, "close", None)
        if close is not None:
            close()


def transfers(direction: str, events: Iterable[E]) -> Iterator[E]:
    """An agent's UploadEvent/FetchEvent stream, its progress added to the byte counters as it
    passes (each progress event carries a stream's running totals)."""
    seen: dict[tuple[str, str], tuple[int, int]] = {}
    raw, sent = TRANSFER_BYTES.labels(direction, "raw"), TRANSFER_BYTES.labels(direction, "sent")
    for ev in events:
        if ev.WhichOneof("event") == "progress":  # type: ignore[attr-defined]
            p = ev.progress  # type: ignore[attr-defined]
            key = (p.node, p.stream)
            r0, s0 = seen.get(key, (0, 0))
            if p.raw_bytes > r0:
                raw.inc(p.raw_bytes - r0)
            if p.uploaded_bytes > s0:
                sent.inc(p.uploaded_bytes - s0)
            seen[key] = (max(r0, p.raw_bytes), max(s0, p.uploaded_bytes))
        yield ev


class _Live(Collector):
    """Gauges read when scraped (the coordinator's agents and jobs)."""

    def __init__(self, read: Callable[[], dict[str, dict[str, float]]], helps: dict[str, str],
                 label: str) -> None:  # fmt: skip
        self.read, self.helps, self.label = read, helps, label

    def collect(self) -> Iterator[GaugeMetricFamily]:
        values = self.read()
        for name, help_ in self.helps.items():
            g = GaugeMetricFamily(name, help_, labels=[self.label])
            for k, v in sorted(values.get(name, {}).items()):
                g.add_metric([k], v)
            yield g


def watch_coordinator(agents: Callable[[], dict[str, int]], jobs: Callable[[], dict[str, int]]
                      ) -> None:  # fmt: skip
    """Live gauges of a coordinator: agents by state (live, lost), jobs by state."""

    def read() -> dict[str, dict[str, float]]:
        return {"snapshotter_agents": dict(agents()), "snapshotter_jobs": dict(jobs())}

    COORDINATOR.register(_Live(read, {"snapshotter_agents": "agents by state",
                                      "snapshotter_jobs": "jobs by state"}, "state"))  # fmt: skip


class _Ranks(Collector):
    """Every running job's ranks on this node, sampled when scraped (agent/progress.py: a
    query each rank's hook answers from memory). A rank that did not answer within the
    sample's deadline (stopped, dead, starved), or whose job a freeze or thaw holds, has no
    figures in that scrape, only `snapshotter_rank_answered` 0: every rank of every running job
    is in every scrape, so a rank that stays silent can be alerted on."""

    HELP = {
        "snapshotter_rank_step_seconds": "the median of the rank's latest optimizer steps",
        "snapshotter_rank_collective_latency_seconds":
            "the mean issue-to-completion time of the rank's latest collectives on its busiest "
            "group (low on the rank its peers wait for)",
        "snapshotter_rank_collective_in_flight_seconds":
            "how long the rank's oldest collective still in flight has been",
        "snapshotter_rank_answered":
            "1 if the rank answered this scrape's sample within its deadline, 0 if not (the rank "
            "is stopped, dead or starved, or a freeze or thaw holds its job)",
    }

    def __init__(self, sample: Callable[[], Iterable[Any]]) -> None:
        self.sample = sample

    def collect(self) -> Iterator[GaugeMetricFamily]:
        fams = {n: GaugeMetricFamily(n, h, labels=["job_id", "rank"]) for n, h in self.HELP.items()}
        rtt = GaugeMetricFamily("snapshotter_peer_rtt_milliseconds", "the worst smoothed RTT of "
                                "a job's connections from this node to a peer address",
                                labels=["job_id", "peer"])  # fmt: skip
        for p in self.sample():
            for r in p.ranks:
                labels = [p.job_id, str(r.rank)]
                fams["snapshotter_rank_answered"].add_metric(labels, 1.0 if r.answered else 0.0)
                if not r.answered:
                    continue
                busiest = max(r.timings, key=lambda t: t.done, default=None)
                fams["snapshotter_rank_step_seconds"].add_metric(labels, r.step_s)
                fams["snapshotter_rank_collective_in_flight_seconds"].add_metric(
                    labels, r.in_flight_s)
                if busiest is not None:
                    fams["snapshotter_rank_collective_latency_seconds"].add_metric(
                        labels, busiest.mean_s)
            for peer in p.peers:
                rtt.add_metric([p.job_id, peer.address], peer.rtt_ms)
        yield from fams.values()
        yield rtt


def watch_ranks(sample: Callable[[], Iterable[Any]]) -> None:
    """Live gauges of an agent: its running jobs' ranks' step times and collective latencies
    (`sample` yields a JobProgress per running job)."""
    AGENT.register(_Ranks(sample))


class MetricsServer:
    """A running metrics endpoint: its address and how to stop it."""

    def __init__(self, server: Any, thread: threading.Thread, address: str) -> None:
        self._server, self._thread, self.address = server, thread, address

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def serve(listen: str, registry: CollectorRegistry, tls: TlsFiles | None, kind: str
          ) -> MetricsServer:  # fmt: skip
    """Serve `registry` at http(s)://`listen`/metrics.

    Raises:
        InvalidArgument: `listen` is not HOST:PORT, or is beyond loopback without TLS.
        ServiceUnavailable: the address cannot be bound.
    """
    host, sep, port_s = listen.rpartition(":")
    from snapshotter.rpc.server import is_loopback  # the server counts its rpcs here

    host = host.strip("[]")
    if not sep or not host or not port_s.isdigit() or int(port_s) > 65535:
        raise errors.InvalidArgument(f"--metrics-listen {listen!r} is not HOST:PORT",
                                     "pass e.g. 127.0.0.1:9464")  # fmt: skip
    if not is_loopback(host) and tls is None:
        raise errors.InvalidArgument(
            f"the {kind}'s metrics would be served on {listen} without TLS",
            "serve them on loopback (127.0.0.1:PORT), or give the service --tls-dir: beyond "
            "loopback they are served over HTTPS to clients with a certificate of its CA",
        )
    tls_kw: dict[str, Any] = {}
    if tls is not None and not is_loopback(host):
        tls.read()  # a missing file is named here, not as an ssl error
        tls_kw = {"certfile": str(tls.cert), "keyfile": str(tls.key),
                  "client_cafile": str(tls.ca), "client_auth_required": True}  # fmt: skip
    try:
        server, thread = start_http_server(int(port_s), host, registry=registry, **tls_kw)
    except OSError as e:
        raise errors.ServiceUnavailable(f"cannot serve the {kind}'s metrics on {listen}: "
                                        f"{e.strerror or e}", "choose a free address/port"
                                        ) from e  # fmt: skip
    bound = server.server_address[1]
    scheme = "https" if tls_kw else "http"
    return MetricsServer(server, thread, f"{scheme}://{host}:{bound}/metrics")
