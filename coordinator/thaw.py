"""Thaw a committed snapshot into a running job, in two phases across the chosen nodes.

    fetch    every node downloads and verifies every chunk of its ranks, in parallel
             (a missing or altered chunk fails here: no process has started)
    restore  every node restores its ranks with CRIU and resumes them with its own store
             address and network settings

A failure in either phase leaves no process behind and the snapshot untouched.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

from coordinator.agents import AgentHandle, merge_streams, on_all, open_store_req
from snapshotter import errors
from snapshotter.launch.spec import JobSpec

Msg = dict[str, Any]


def ranks_by_node(meta: Msg, nnodes: int) -> list[list[Msg]]:
    """The snapshot's rank records grouped by the node rank they ran on."""
    out: list[list[Msg]] = [[] for _ in range(nnodes)]
    for r in meta["ranks"]:
        out[int(r["node_rank"])].append(r)
    return out


class ThawOperation:
    def __init__(
        self,
        snapshot_id: str,
        meta: Msg,
        spec: JobSpec,
        agents: Sequence[AgentHandle],
        resume_timeout: float = 120.0,
    ) -> None:
        if len(agents) != spec.nnodes:
            raise errors.InvalidArgument(
                f"snapshot {snapshot_id} has {spec.nnodes} node(s) of ranks but "
                f"{len(agents)} node(s) were given",
                f"pass exactly {spec.nnodes} node(s) with --nodes",
            )
        self.snapshot_id = snapshot_id
        self.thaw_id = f"thw-{secrets.token_hex(6)}"
        self.meta = meta
        self.spec = spec
        self.agents = list(agents)
        self.resume_timeout = resume_timeout
        self._ranks = ranks_by_node(meta, spec.nnodes)

    def run(self) -> Iterator[Msg]:
        # Node 0's store starts while every node fetches (it needs the job's torch imported).
        opened: dict[str, Any] = {}
        opener = threading.Thread(target=self._open_store, args=(opened,), daemon=True)
        opener.start()
        try:
            yield from self._run(opener, opened)
        except BaseException:
            opener.join()
            on_all(self.agents[:1], lambda a: a.call("CloseStore", {"job_id": self.spec.job_id}))
            raise

    def _open_store(self, out: dict[str, Any]) -> None:
        try:
            out["store"] = self.agents[0].call("OpenStore", open_store_req(self.spec), timeout=90)
        except BaseException as e:  # noqa: BLE001 - raised in the restore phase
            out["error"] = e

    def _run(self, opener: threading.Thread, opened: dict[str, Any]) -> Iterator[Msg]:
        t0 = time.monotonic()
        node_of = {a.name: i for i, a in enumerate(self.agents)}
        ops: dict[str, str] = {}
        fetch_s: dict[str, float] = {}
        failures: dict[str, BaseException] = {}
        yield {"event": "phase", "phase": "fetch", "snapshot_id": self.snapshot_id}
        for name, ev in merge_streams(
            self.agents,
            "Fetch",
            lambda a: {
                "snapshot_id": self.snapshot_id,
                "streams": [r["stream"] for r in self._ranks[node_of[a.name]]],
            },
        ):
            if isinstance(ev, BaseException):
                failures[name] = ev
            elif ev.get("event") == "fetched":
                ops[name] = ev["op"]
                fetch_s[name] = ev["fetch_s"]
            else:
                yield {**ev, "node": name}
        if failures:
            self._discard(ops)
            raise next(iter(failures.values()))

        opener.join()
        if "error" in opened:
            self._discard(ops)
            raise opened["error"]
        yield {"event": "phase", "phase": "restore"}
        t1 = time.monotonic()
        res, fail = on_all(
            self.agents,
            lambda a: a.call(
                "Restore",
                {
                    "op": ops[a.name],
                    "spec": self.spec.to_dict(),
                    "ranks": self._ranks[node_of[a.name]],
                    "node_rank": node_of[a.name],
                    "timeout": self.resume_timeout,
                    "store": opened["store"],
                    "epoch": self.thaw_id,
                },
                timeout=None,
            ),
        )
        if fail:
            # Nodes that did restore must not run a partial job.
            on_all(
                [a for a in self.agents if a.name in res],
                lambda a: a.call("Cancel", {"job_id": self.spec.job_id}),
            )
            self._discard(ops)
            raise next(iter(fail.values()))
        yield {
            "event": "done",
            "job_id": self.spec.job_id,
            "stats": {
                "fetch_s": max(fetch_s.values(), default=0.0),
                "restore_s": time.monotonic() - t1,
                "total_s": time.monotonic() - t0,
                "nodes": {n: r for n, r in res.items()},
            },
        }

    def _discard(self, ops: dict[str, str]) -> None:
        on_all(
            [a for a in self.agents if a.name in ops],
            lambda a: a.call("DiscardFetch", {"op": ops[a.name]}),
        )
