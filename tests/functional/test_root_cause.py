"""A rank that fails under torch's @record names its root cause in the job's status: a real
agent launches real ranks in their sandboxes (TORCHELASTIC_ERROR_FILE set for each), reads the
failed rank's error file, and a real coordinator's Status shows it, as torchrun's summary
would."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from snapshotter import __version__
from snapshotter.agent import service as agent_service
from snapshotter.agent.allow import ExecPolicy
from snapshotter.agent.node import NodeAgent, NodeSettings
from snapshotter.config import Paths
from snapshotter.coordinator.core import Coordinator
from snapshotter.rpc.client import Target
from snapshotter.rpc.server import Listen, serve
from snapshotter.storage import LocalDirStore
from snapshotter.v1 import coordinator_pb2

pb = coordinator_pb2
pytestmark = pytest.mark.timeout(120)

FAILING = """\
import os
import time

from torch.distributed.elastic.multiprocessing.errors import record


def fail(rank):
    raise RuntimeError(f"injected bug on rank {rank}")


@record
def main():
    rank = int(os.environ["RANK"])
    if rank == 1:
        fail(rank)
    time.sleep(60)  # the agent ends it when rank 1 fails


if __name__ == "__main__":
    main()
"""


@pytest.fixture
def coordinator(tmp_path: Path) -> Iterator[Coordinator]:
    store = LocalDirStore(tmp_path / "store")
    node = NodeAgent(NodeSettings(name="n0", paths=Paths(tmp_path / "agent"), freeze_lease_s=0,
                                  policy=ExecPolicy(anything=True)), store)  # fmt: skip
    sock = node.paths.run_dir / "agent.sock"
    srv = serve("agent", Listen(f"unix:{sock}"), agent_service.register(node),
                [agent_service.SERVICE])  # fmt: skip
    try:
        coord = Coordinator(store, f"file://{tmp_path / 'store'}",
                            lambda address, name: Target(address, server_name=name))  # fmt: skip
        coord.register_agent(pb.RegisterAgentRequest(
            name="n0", address=f"unix:{sock}", host="127.0.0.1",
            incarnation=node.incarnation, version=__version__))  # fmt: skip
        yield coord
    finally:
        srv.stop(0)
        node.shutdown()


def test_the_status_of_a_failed_job_shows_the_traceback_its_rank_recorded(
    coordinator: Coordinator, tmp_path: Path
) -> None:
    script = tmp_path / "failing.py"
    script.write_text(FAILING)
    began = time.time()
    st = coordinator.run(pb.RunRequest(
        job_id="bug", script=str(script), python=sys.executable, cwd=str(tmp_path),
        env={"PATH": "/usr/bin"}, nnodes=1, nproc_per_node=2))  # fmt: skip
    st = coordinator.wait(st.job_id, 90)
    assert st.state == "FAILED", st
    ranks = {r.rank: r for r in st.ranks}
    assert ranks[1].exit_code == 1 and ranks[1].failed_first, st
    err = ranks[1].error
    assert err.startswith("Traceback (most recent call last)"), err
    assert 'in fail\n    raise RuntimeError(f"injected bug on rank {rank}")' in err, err
    assert err.endswith("RuntimeError: injected bug on rank 1"), err
    assert int(began) <= ranks[1].error_time <= time.time()
    # Ended by the agent (a signal): nothing recorded, nothing made up.
    assert ranks[0].error == "" and ranks[0].error_time == 0, ranks[0]
    assert coordinator.status("bug").ranks[1].error == err  # what `snapshotter status` shows
