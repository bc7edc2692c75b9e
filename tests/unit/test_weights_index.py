"""Weight push's pure decisions: the index a peer sends (checked whole), which tensors
travel, and whom a node pulls from."""

from __future__ import annotations

import json

import pytest

from snapshotter.errors import InvalidArgument
from snapshotter.weights.index import (
    Index,
    changed,
    check_channel,
    new_index,
    parse_index,
    tree_order,
    tree_parent,
)


def _ix(version: int = 1, digests: tuple[str, ...] = ("a1", "b2", "c3")) -> Index:
    ix = new_index(
        "policy",
        "trainer",
        version,
        [("w", "float32", [4, 4]), ("b", "bfloat16", [4]), ("n", "int64", [])],
    )
    return ix.with_digests(digests)


def test_layout_is_page_aligned_and_round_trips() -> None:
    ix = _ix()
    assert [e.length for e in ix.entries] == [64, 8, 8]
    assert [e.offset % 4096 for e in ix.entries] == [0, 0, 0]
    assert len({e.offset for e in ix.entries}) == 3
    assert parse_index(ix.to_json()) == ix
    assert ix.size == ix.entries[-1].offset + 8


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda d: d["tensors"][0].update(dtype="complex64"), "dtype"),
        (lambda d: d["tensors"][0].update(shape=[4, -1]), "shape"),
        (lambda d: d["tensors"][0].update(shape=[4, True]), "shape"),
        (lambda d: d["tensors"][0].update(length=63), "mis-sizes"),
        (lambda d: d["tensors"][1].update(offset=0), "overlaps"),
        (lambda d: d["tensors"][1].update(name="w"), "twice"),
        (lambda d: d["tensors"][0].update(name=""), "name"),
        (lambda d: d["tensors"][0].update(digest="../x"), "digest"),
        (lambda d: d["tensors"][0].update(offset=-4096), "offset"),
        (lambda d: d.update(version=0), "out of range"),
        (lambda d: d.update(version="3"), "lineage or version"),
        (lambda d: d.update(channel="../etc"), "not a valid name"),
        (lambda d: d.pop("tensors"), "no tensors"),
    ],
)
def test_a_bad_index_from_a_peer_is_refused_naming_why(edit, match) -> None:  # type: ignore[no-untyped-def]
    d = json.loads(_ix().to_json())
    edit(d)
    with pytest.raises(InvalidArgument, match=match):
        parse_index(json.dumps(d).encode())


def test_not_json_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="not JSON"):
        parse_index(b"\xff{")


@pytest.mark.parametrize("name", ["", ".hidden", "a/b", "x" * 65, "a b", "..", "-x"])
def test_channel_names_cannot_escape_their_directory(name: str) -> None:
    with pytest.raises(InvalidArgument, match="not a valid name"):
        check_channel(name)


def test_only_changed_tensors_travel() -> None:
    held = _ix(1, ("a1", "b2", "c3"))
    assert changed(_ix(2, ("a1", "bX", "c3")), held) == ["b"]
    assert changed(_ix(2), None) == ["w", "b", "n"]
    # No digest (not yet computed) is never taken for "the same".
    assert changed(_ix(2, ("", "b2", "c3")), _ix(1, ("", "b2", "c3"))) == ["w"]


def test_tree_parents_spread_the_load() -> None:
    order = tree_order(tree_order(tree_order([], "r1"), "r2"), "r3")
    order = tree_order(tree_order(tree_order(tree_order(order, "r4"), "r5"), "r6"), "r3")
    assert order == ["r1", "r2", "r3", "r4", "r5", "r6"]
    ok = lambda n: True  # noqa: E731
    parents = {n: tree_parent(order, n, ok) for n in order}
    # The publisher (None) serves two; every node at most two.
    assert parents == {"r1": None, "r2": None, "r3": "r1", "r4": "r1", "r5": "r2", "r6": "r2"}
    # A failed parent is skipped up to its own parent (here the publisher).
    assert tree_parent(order, "r6", lambda n: n != "r2") is None
    assert tree_parent(order + ["r7"], "r7", lambda n: n != "r3") == "r1"
    assert tree_parent(order, "stranger", ok) is None
