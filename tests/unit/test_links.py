"""Data links and rerouting decisions as pure functions: which plane a job uses, the routes
that carry a failed plane's traffic meanwhile, and what counts as a link that is up."""

from __future__ import annotations

import pytest

from snapshotter import errors
from snapshotter.agent.links import Links, check_links, is_up
from snapshotter.coordinator.decisions import bridge_routes, next_plane, usable_planes

UP, DOWN = True, False


def test_a_plane_is_usable_only_where_every_node_has_it_up() -> None:
    assert usable_planes([[UP, UP], [UP, UP]]) == [0, 1]
    assert usable_planes([[DOWN, UP], [UP, UP]]) == [1]
    assert usable_planes([[UP, UP], [UP, DOWN]]) == [0]
    assert usable_planes([[DOWN, UP], [UP, DOWN]]) == []
    # A node without data links has one plane: the others' second plane does not exist there.
    assert usable_planes([[UP, UP], [UP]]) == [0]
    assert usable_planes([]) == []


@pytest.mark.parametrize(
    ("current", "links", "want"),
    [
        (0, [[UP, UP], [UP, UP]], 0),  # nothing wrong: stay
        (0, [[UP, UP], [DOWN, UP]], 1),  # its link died: move
        (1, [[UP, UP], [UP, UP]], 1),  # plane 0 is back: stay (no back and forth)
        (1, [[UP, DOWN], [UP, UP]], 0),  # plane 1 died, plane 0 works: home
        (0, [[DOWN, UP, UP], [UP, DOWN, UP]], 2),  # the lowest that works everywhere
        (0, [[DOWN, DOWN], [UP, UP]], None),  # nothing works
    ],
)
def test_next_plane(current: int, links: list[list[bool]], want: int | None) -> None:
    assert next_plane(current, links) == want


def test_bridge_routes_send_each_peer_through_its_other_address() -> None:
    peers = {"a": ["10.0.0.1", "10.1.0.1"], "b": ["10.0.0.2", "10.1.0.2"],
             "c": ["10.0.0.3", ""]}  # fmt: skip
    assert bridge_routes(peers, "a", 0, 1) == [("10.0.0.2", "10.1.0.2")]
    assert bridge_routes(peers, "b", 0, 1) == [("10.0.0.1", "10.1.0.1")]
    assert bridge_routes(peers, "a", 1, 0) == [("10.1.0.2", "10.0.0.2")]
    assert bridge_routes({"a": ["10.0.0.1"]}, "b", 0, 1) == []


def test_a_link_is_up_when_administratively_up_and_running() -> None:
    assert is_up(0x1 | 0x40)
    assert not is_up(0x1)  # no carrier
    assert not is_up(0x40)  # set down
    assert not is_up(0)  # no such interface


def test_each_plane_sets_every_interface_variable() -> None:
    links = Links(["d0", "d1"], {"GLOO_SOCKET_IFNAME": "eth0", "NCCL_IB_HCA": "mlx5_0"})
    assert links.env(1) == {"GLOO_SOCKET_IFNAME": "d1", "NCCL_SOCKET_IFNAME": "d1",
                            "TP_SOCKET_IFNAME": "d1", "NCCL_IB_HCA": "mlx5_0"}  # fmt: skip
    assert links.env(7)["GLOO_SOCKET_IFNAME"] == "d0"  # a plane it lacks: its first
    plain = Links([], {"GLOO_SOCKET_IFNAME": "eth0"})
    assert plain.env(0) == plain.env(1) == {"GLOO_SOCKET_IFNAME": "eth0"}


def test_bad_link_settings_are_refused_by_name() -> None:
    with pytest.raises(errors.InvalidArgument, match="no interface 'nosuch0'"):
        check_links(["lo", "nosuch0"], {})
    with pytest.raises(errors.InvalidArgument, match="repeat"):
        check_links(["lo", "lo"], {})
    with pytest.raises(errors.InvalidArgument, match="GLOO_SOCKET_IFNAME"):
        check_links(["lo"], {"GLOO_SOCKET_IFNAME": "lo"})
    check_links(["lo"], {"NCCL_IB_HCA": "mlx5_0"})


def test_a_bridge_needs_a_plane_the_node_has() -> None:
    with pytest.raises(errors.InvalidArgument, match="plane 3"):
        Links(["lo"], {}).bridge(3, [("10.0.0.1", "10.1.0.1")], remove=False)
