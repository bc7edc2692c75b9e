"""The rank environment matches torchrun's, and the node's settings win."""

from snapshotter.launch.env import RdzvAddress, placements, rank_argv, rank_env, resume_env


def test_placements_are_node_major() -> None:
    ps = placements(nnodes=2, nproc_per_node=3, node_rank=1)
    assert [p.rank for p in ps] == [3, 4, 5]
    assert [p.local_rank for p in ps] == [0, 1, 2]
    assert {p.world_size for p in ps} == {6}


def test_rank_env_sets_torchrun_variables() -> None:
    p = placements(1, 2, 0)[1]
    env = rank_env(
        {"PATH": "/bin", "GLOO_SOCKET_IFNAME": "eth9"},
        p,
        RdzvAddress("10.0.0.1", 1234),
        "job-x",
        {"GLOO_SOCKET_IFNAME": "veth0"},
    )
    assert env["RANK"] == "1" and env["LOCAL_RANK"] == "1"
    assert env["WORLD_SIZE"] == "2" and env["LOCAL_WORLD_SIZE"] == "2"
    assert env["MASTER_ADDR"] == "10.0.0.1" and env["MASTER_PORT"] == "1234"
    assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True"
    assert env["TORCHELASTIC_RUN_ID"] == "job-x"
    assert env["PATH"] == "/bin"
    assert env["OMP_NUM_THREADS"] == "1"
    assert env["GLOO_SOCKET_IFNAME"] == "veth0"  # the node's own setting wins
    assert env["SNAPSHOTTER_CTL_IN"] == "3" and env["SNAPSHOTTER_CTL_OUT"] == "4"


def test_user_omp_setting_is_kept() -> None:
    p = placements(1, 2, 0)[0]
    env = rank_env({"OMP_NUM_THREADS": "4"}, p, RdzvAddress("h", 1), "j")
    assert env["OMP_NUM_THREADS"] == "4"


def test_resume_env_points_at_the_new_rdzv_server() -> None:
    env = resume_env(RdzvAddress("10.1.1.1", 99), {"NCCL_SOCKET_IFNAME": "ib0"})
    assert env == {"MASTER_ADDR": "10.1.1.1", "MASTER_PORT": "99", "NCCL_SOCKET_IFNAME": "ib0"}


def test_rank_argv_goes_through_bootstrap() -> None:
    assert rank_argv("/py", "t.py", ["--a"], module=False) == [
        "/py",
        "-m",
        "snapshotter.hook.bootstrap",
        "t.py",
        "--a",
    ]
    assert rank_argv("/py", "pkg.mod", [], module=True)[-2:] == ["-m", "pkg.mod"]
