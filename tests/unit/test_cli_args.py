"""The CLI accepts torchrun's flags and spellings and refuses what it cannot honour."""

import pytest

from snapshotter import errors
from snapshotter.cli.main import _nnodes, build_parser


def parse(*argv: str):  # type: ignore[no-untyped-def]
    return build_parser().parse_args(list(argv))


def test_torchrun_spellings_and_script_args_pass_through() -> None:
    a = parse("run", "--nproc_per_node", "2", "--nnodes=1", "--rdzv-id", "myjob", "--standalone",
              "train.py", "--lr", "0.1", "--nproc-per-node", "9")
    assert a.nproc_per_node == "2" and a.nnodes == "1" and a.rdzv_id == "myjob"
    assert a.script == "train.py"
    # Everything after the script belongs to the script, even flags snapshotter also knows.
    assert a.script_args == ["--lr", "0.1", "--nproc-per-node", "9"]


def test_module_mode_and_detach() -> None:
    a = parse("run", "-m", "--detach", "--job-id", "j1", "pkg.train", "x")
    assert a.module and a.detach and a.job_id == "j1"
    assert a.script == "pkg.train" and a.script_args == ["x"]


def test_fixed_node_range_accepted_elastic_refused() -> None:
    assert _nnodes("2") == 2 and _nnodes("2:2") == 2
    with pytest.raises(errors.InvalidArgument, match="elastic"):
        _nnodes("1:4")


@pytest.mark.parametrize("cmd", ["jobs", "list", "down"])
def test_every_command_takes_json(cmd: str) -> None:
    assert parse(cmd, "--json").json is True


def test_freeze_flags() -> None:
    a = parse("freeze", "job-1", "--stop", "--quiesce-timeout", "5")
    assert a.job_id == "job-1" and a.stop and a.quiesce_timeout == 5.0
