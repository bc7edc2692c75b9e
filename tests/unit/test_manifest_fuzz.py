"""Fuzzing the manifest parser (hypothesis): whatever bytes the store hands back, and whatever a
writer to the store changes in a valid manifest (its checksum recomputed, as an attacker would),
`Manifest.from_json` either returns a manifest that passes every rule or raises ManifestError,
which readers report as a corrupt snapshot. Nothing else escapes: no crash, no other error."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from snapshotter.storage import format as fmt

SHA = "ab" * 32

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                  max_size=4),
    max_leaves=12,
)  # fmt: skip


def _valid(sealed: bool) -> dict[str, Any]:
    chunks = [fmt.ChunkInfo(i, fmt.content_key(f"{i:02x}" * 32), 4096, 100, "", f"{i:02x}" * 32,
                            "cd" * 16) for i in range(3)]  # fmt: skip
    stream = fmt.StreamInfo("rank-0", 3 * 4096, 8192, tuple(chunks), chunking=fmt.CONTENT)
    seal = fmt.Sealing("acme", "0123456789abcdef") if sealed else None
    m = fmt.Manifest("snap-1", 1.0, {"job": {"a": 1}}, {"rank-0": stream},
                     version=3 if sealed else 2, sealed=seal)  # fmt: skip
    return dict(json.loads(m.to_json()))


def _parse_or_refuse(data: bytes) -> None:
    try:
        m = fmt.Manifest.from_json(data)
    except fmt.ManifestError as e:
        assert str(e)  # every refusal says why
        return
    fmt.validate(m)
    assert fmt.Manifest.from_json(m.to_json()) == m  # what parses round-trips


def _paths(node: Any, at: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [at]
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, (*at, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _paths(v, (*at, i))
    return out


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=2000))
def test_any_bytes_parse_or_are_refused(data: bytes) -> None:
    _parse_or_refuse(data)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.booleans(), st.data(), json_values)
def test_any_change_to_a_valid_manifest_parses_or_is_refused(
    sealed: bool, data: st.DataObject, value: Any
) -> None:
    body = _valid(sealed)
    body.pop("checksum")
    paths = [p for p in _paths(body) if p]
    path = data.draw(st.sampled_from(paths))
    node = body
    for k in path[:-1]:
        node = node[k]
    if data.draw(st.booleans()) and isinstance(node, dict):
        del node[path[-1]]
    else:
        node[path[-1]] = value
    # The checksum as someone writing to the store would make it (NaN and infinities too).
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=True)
    body["checksum"] = fmt.sha256_hex(canonical.encode())
    _parse_or_refuse(json.dumps(body).encode())


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=300))
def test_text_that_is_almost_a_manifest_is_refused(tail: str) -> None:
    _parse_or_refuse(json.dumps(_valid(True))[:-1].encode() + tail.encode())
