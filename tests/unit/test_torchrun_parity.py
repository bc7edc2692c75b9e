"""Every flag of the installed torchrun is accepted by `snapshotter run` with torchrun's
meaning (its effect tested here, or end to end where named), taken with a note saying why it
has no further effect, or refused by name with the reason."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest

from snapshotter import errors
from snapshotter.cli import main as cli_main
from snapshotter.cli import supervise, torchrun
from snapshotter.launch.env import RankPlacement, RdzvAddress, rank_env
from snapshotter.launch.spec import nproc_for

torch_run = pytest.importorskip("torch.distributed.run")


def parse(*argv: str, environ: dict[str, str] | None = None) -> argparse.Namespace:
    parser = cli_main.build_parser()
    if environ is not None:
        torchrun.env_defaults(_run_parser(parser), environ)
    return parser.parse_args(["run", *argv, "train.py"])


def torchrun_flags() -> dict[str, list[str]]:
    """dest -> option strings of the installed torchrun's parser."""
    out: dict[str, list[str]] = {}
    for action in torch_run.get_args_parser()._actions:
        if action.option_strings and action.dest != "help":
            out[action.dest] = list(action.option_strings)
    return out


# Flags whose effect a test names; the rest must be NOTED or REFUSED.
EFFECTS = {
    "nnodes": "test_sizes_and_ids", "nproc_per_node": "test_nproc_counts_as_torchrun_does",
    "node_rank": "test_a_per_node_launch_needs_a_shared_id (and e2e test_multinode "
                 "test_the_per_node_launch_idiom_starts_one_job)",
    "rdzv_id": "test_sizes_and_ids", "rdzv_backend": "test_rendezvous_backends",
    "standalone": "test_sizes_and_ids", "max_restarts": "test_max_restarts_is_recovery",
    "start_method": "test_start_methods", "role": "test_role_is_the_ranks_role_name",
    "module": "test_sizes_and_ids", "run_path": "test_sizes_and_ids",
    "log_dir": "test_log_routing (and e2e test_resilience test_ctrl_c_stops_a_foreground_run)",
    "redirects": "test_log_routing", "tee": "test_log_routing",
    "local_ranks_filter": "test_log_routing",
}  # fmt: skip


def test_every_torchrun_flag_is_accepted_under_each_of_its_spellings() -> None:
    ours = {s for a in _run_parser()._actions for s in a.option_strings}
    missing = {s for opts in torchrun_flags().values() for s in opts} - ours
    assert not missing, f"torchrun flags `snapshotter run` does not know: {sorted(missing)}"


def test_every_torchrun_flag_has_a_tested_effect_a_note_or_a_refusal() -> None:
    for dest in torchrun_flags():
        kinds = [dest in EFFECTS, dest in torchrun.NOTED, dest in torchrun.REFUSED]
        assert kinds.count(True) == 1, (dest, kinds)
    for dest, where in EFFECTS.items():
        assert where.split()[0] in globals(), (dest, where)


@pytest.mark.parametrize("dest", sorted(torchrun.REFUSED))
def test_refused_flags_are_refused_by_name(dest: str) -> None:
    flag = next(o for o in torchrun_flags()[dest] if o.startswith("--"))
    value = {"numa_binding": "node", "signals_to_handle": "SIGTERM"}.get(dest, "x")
    store_true = isinstance(_action(flag), argparse._StoreTrueAction)
    a = parse(flag) if store_true else parse(flag, value)
    with pytest.raises(errors.InvalidArgument) as e:
        torchrun.check(a)
    assert flag.replace("_", "-") in str(e.value) and e.value.next_step


@pytest.mark.parametrize("dest", sorted(torchrun.NOTED))
def test_noted_flags_say_why_they_have_no_effect(dest: str) -> None:
    flag = next(o for o in torchrun_flags()[dest] if o.startswith("--"))
    notes = torchrun.check(parse(flag, "29500" if "port" in dest else "1"))
    assert len(notes) == 1 and notes[0].startswith(flag) and torchrun.NOTED[dest] in notes[0]


def test_defaults_take_no_notes() -> None:
    assert torchrun.check(parse()) == []


def test_sizes_and_ids() -> None:
    a = parse("--nnodes=2:2", "--rdzv_id", "job-7", "--standalone", "-m", "--run-path")
    assert cli_main._nnodes(a.nnodes) == 2 and a.rdzv_id == "job-7"
    assert a.standalone and a.module and a.run_path
    with pytest.raises(errors.InvalidArgument, match="elastic"):
        cli_main._nnodes("1:4")


def test_pet_environment_variables_are_the_defaults() -> None:
    env = {"PET_NPROC_PER_NODE": "3", "PET_NNODES": "2", "PET_NODE_RANK": "1",
           "PET_RDZV_ID": "kf-job", "PET_MASTER_ADDR": "10.0.0.1", "PET_STANDALONE": "0",
           "PET_MAX_RESTARTS": "2"}  # fmt: skip
    a = parse(environ=env)
    assert (a.nproc_per_node, a.nnodes, a.node_rank, a.rdzv_id) == ("3", "2", 1, "kf-job")
    assert a.master_addr == "10.0.0.1" and a.standalone is False and a.max_restarts == 2
    # A flag on the command line wins over the environment.
    assert parse("--nnodes", "4", environ=env).nnodes == "4"


def test_nproc_counts_as_torchrun_does() -> None:
    # A kind travels to the coordinator, which counts it on the job's agents.
    assert torchrun.nproc_request("auto") == (0, "auto")
    assert torchrun.nproc_request("gpu") == (0, "gpu")
    assert torchrun.nproc_request("3") == (3, "")
    with pytest.raises(errors.InvalidArgument, match="node n1 has no NVIDIA GPU"):
        nproc_for("gpu", cpus=4, gpus=0, where="node n1")
    assert torchrun.nproc("4") == 4
    assert torchrun.nproc("cpu", cpus=16) == 16
    assert torchrun.nproc("auto", cpus=16, gpus=0) == 16
    assert torchrun.nproc("auto", cpus=16, gpus=8) == 8
    assert torchrun.nproc("gpu", gpus=8) == 8
    with pytest.raises(errors.InvalidArgument, match="no NVIDIA GPU"):
        torchrun.nproc("gpu", gpus=0)
    for bad in ("0", "-1", "many", ""):
        with pytest.raises(errors.InvalidArgument, match="--nproc-per-node"):
            torchrun.nproc(bad)


def test_a_per_node_launch_needs_a_shared_id() -> None:
    assert cli_main._per_node_launch(parse("--nnodes", "2", "--node-rank", "0"), "", 2) == 0
    assert cli_main._per_node_launch(parse("--node-rank", "1"), "j", 2) == 1
    with pytest.raises(errors.InvalidArgument, match="same --rdzv-id"):
        cli_main._per_node_launch(parse("--node-rank", "1"), "", 2)
    with pytest.raises(errors.InvalidArgument, match="not below --nnodes 2"):
        cli_main._per_node_launch(parse("--node-rank", "2"), "j", 2)
    with pytest.raises(errors.InvalidArgument, match="negative"):
        torchrun.check(parse("--node-rank", "-1"))


def test_rendezvous_backends() -> None:
    for ok in ("c10d", "static"):
        assert torchrun.check(parse("--rdzv-backend", ok)) == []
    with pytest.raises(errors.InvalidArgument, match="--rdzv-backend etcd"):
        torchrun.check(parse("--rdzv_backend", "etcd"))


def test_max_restarts_is_recovery() -> None:
    r = supervise.recovery_from_flags(parse("--max-restarts", "3"))
    assert r.mode == "auto" and r.max_tries == 3
    assert supervise.recovery_from_flags(parse()).mode == ""


def test_start_methods() -> None:
    for m in ("spawn", "fork", "forkserver"):
        assert parse("--start-method", m).start_method == m
    with pytest.raises(SystemExit):
        parse("--start-method", "thread")


def test_role_is_the_ranks_role_name() -> None:
    p = RankPlacement(rank=0, local_rank=0, node_rank=0, world_size=1, local_world_size=1,
                      nnodes=1)  # fmt: skip
    rdzv = RdzvAddress("127.0.0.1", 1)
    assert rank_env({}, p, rdzv, "j")["ROLE_NAME"] == "default"
    assert rank_env({"SNAPSHOTTER_ROLE": "trainer"}, p, rdzv, "j")["ROLE_NAME"] == "trainer"


def test_log_routing(tmp_path: Path) -> None:
    plain = torchrun.output(parse())
    assert plain.console(0) and not plain.to_file(0)
    tee = torchrun.output(parse("--log-dir", str(tmp_path), "--tee", "3"))
    assert tee.console(1) and tee.to_file(1)
    red = torchrun.output(parse("--log-dir", str(tmp_path), "-r", "0:3"))
    assert not red.console(0) and red.to_file(0) and red.console(1) and not red.to_file(1)
    shown = torchrun.output(parse("--local-ranks-filter", "0"))
    assert shown.console(0) and not shown.console(1)
    for bad, needle in ((("--tee", "3"), "need --log-dir"), (("-t", "1"), "one stream"),
                        (("-r", "9"), "not 0-3"), (("--local-ranks-filter", "a"), "local ranks"),
                        (("--log-dir", str(tmp_path), "--detach"), "foreground")):  # fmt: skip
        with pytest.raises(errors.InvalidArgument, match=needle):
            torchrun.output(parse(*bad))
    files = cli_main.RankFiles(str(tmp_path), "job-1")
    files.write(1, b"step 1\n")
    files.write(1, b"step 2\n")
    files.close()
    assert (tmp_path / "job-1/attempt_0/1/stdout.log").read_bytes() == b"step 1\nstep 2\n"


def _run_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    top = parser or cli_main.build_parser()
    sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    run: argparse.ArgumentParser = sub.choices["run"]
    return run


def _action(flag: str) -> argparse.Action:
    return next(a for a in _run_parser()._actions if flag in a.option_strings)


def test_the_environment_of_this_test_sets_no_pet_defaults() -> None:
    # The parity checks above parse with the real environment: a PET_* set there would skew them.
    assert not [k for k in os.environ if k.startswith("PET_")]
