"""Between typed messages (snapshotter/v1) and plain data: `--json` output, manifest records.

`plain` keeps numbers as numbers (protobuf's own JSON mapping writes 64-bit integers as
strings, which would change the manifest format and every `--json` consumer), writes an
unset optional field as None and leaves out the members of a oneof that are not set. `parse`
reads plain data back into a message, ignoring fields it does not know (a newer writer's).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, TypeVar

from google.protobuf import json_format
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

from snapshotter import errors
from snapshotter.storage import format as fmt
from snapshotter.storage.sealing import Seal
from snapshotter.v1 import common_pb2

M = TypeVar("M", bound=Message)


def plain(msg: Message) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, kind, f in _plan(msg.DESCRIPTOR):
        if kind == _ONEOF:
            if not msg.HasField(name):
                continue
            kind = _ONE
        value = getattr(msg, name)
        if kind == _MAP:
            out[name] = {k: _one(f, v) for k, v in value.items()}
        elif kind == _REPEATED:
            out[name] = [_one(f, v) for v in value]
        elif kind == _OPTIONAL and not msg.HasField(name):
            out[name] = None
        else:
            out[name] = _one(f, value)
    return out


_ONE, _ONEOF, _MAP, _REPEATED, _OPTIONAL = range(5)


@functools.cache
def _plan(d: Descriptor) -> tuple[tuple[str, int, FieldDescriptor], ...]:
    """How `plain` treats each field of a message type, worked out once per type: the
    manifest of a 16,384-rank job holds as many rank records, and asking the descriptor about
    every field of every one took a tenth of a second."""
    plan = []
    for f in d.fields:
        if f.containing_oneof is not None:
            plan.append((f.name, _ONEOF, f))
        elif f.message_type is not None and f.message_type.GetOptions().map_entry:
            plan.append((f.name, _MAP, f.message_type.fields_by_name["value"]))
        elif f.is_repeated:
            plan.append((f.name, _REPEATED, f))
        elif f.has_presence:
            plan.append((f.name, _OPTIONAL, f))
        else:
            plan.append((f.name, _ONE, f))
    return tuple(plan)


def _one(f: FieldDescriptor, value: Any) -> Any:
    if f.message_type is not None:
        return plain(value)
    if f.type == FieldDescriptor.TYPE_BYTES:
        return bytes(value).decode(errors="replace")
    return value


def parse(data: Mapping[str, Any], cls: type[M]) -> M:
    """A message of type `cls` from plain data (None values are left unset).

    Raises:
        json_format.ParseError: a field has a value of the wrong type.
    """
    msg = cls()
    json_format.ParseDict(_drop_none(data), msg, ignore_unknown_fields=True)
    return msg


def _drop_none(v: Any) -> Any:
    if isinstance(v, Mapping):
        return {str(k): _drop_none(x) for k, x in v.items() if x is not None}
    if isinstance(v, list | tuple):
        return [_drop_none(x) for x in v]
    return v


def data_key(seal: Seal) -> common_pb2.DataKey:
    """A tenant data key as the coordinator hands it to an agent (over TLS, for one op)."""
    return common_pb2.DataKey(tenant=seal.tenant, key_id=seal.key_id, key=seal.key)


def seal_of(m: common_pb2.DataKey) -> Seal:
    """The data key a request carries. Raises InvalidArgument for a malformed one."""
    try:
        fmt.validate_name(m.tenant, "tenant")
        return Seal(m.tenant, m.key_id, bytes(m.key))
    except ValueError as e:
        raise errors.InvalidArgument(
            f"malformed data key in the request: {e}",
            "upgrade the coordinator and agents together",
        ) from e
