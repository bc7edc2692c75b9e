"""JSON Schema of the contract's messages, generated from the .proto descriptors: the OpenAPI
document's components, so the HTTP API's bodies are the gRPC messages by construction.

Messages travel as protobuf's JSON mapping with the .proto field names (json_format,
preserving_proto_field_name): 64-bit integers are strings (JSON numbers lose precision past
2**53) and may be sent as numbers, enums are their names, bytes base64. Unknown fields are
refused, so every object says additionalProperties: false. This module is pure.
"""

from __future__ import annotations

from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor

_NON_FINITE = {"type": "string", "enum": ["NaN", "Infinity", "-Infinity"]}
# In range of int64 either way (a decimal string of up to 18 digits always is): protobuf's
# JSON parser refuses a value beyond it, so the document must not call it valid.
_INT64 = {"oneOf": [{"type": "integer", "minimum": -(2**63), "maximum": 2**63 - 1},
                    {"type": "string", "pattern": r"^-?[0-9]{1,18}$"}]}  # fmt: skip
_SCALARS: dict[int, dict[str, Any]] = {
    FieldDescriptor.TYPE_STRING: {"type": "string"},
    FieldDescriptor.TYPE_BOOL: {"type": "boolean"},
    FieldDescriptor.TYPE_BYTES: {"type": "string", "format": "byte"},
    FieldDescriptor.TYPE_DOUBLE: {"type": "number"},
    FieldDescriptor.TYPE_FLOAT: {"type": "number"},
    FieldDescriptor.TYPE_INT32: {"type": "integer", "format": "int32"},
    FieldDescriptor.TYPE_SINT32: {"type": "integer", "format": "int32"},
    FieldDescriptor.TYPE_SFIXED32: {"type": "integer", "format": "int32"},
    FieldDescriptor.TYPE_UINT32: {"type": "integer", "minimum": 0},
    FieldDescriptor.TYPE_FIXED32: {"type": "integer", "minimum": 0},
    FieldDescriptor.TYPE_INT64: _INT64,
    FieldDescriptor.TYPE_SINT64: _INT64,
    FieldDescriptor.TYPE_SFIXED64: _INT64,
    FieldDescriptor.TYPE_UINT64: _INT64,
    FieldDescriptor.TYPE_FIXED64: _INT64,
}


def ref(desc: Descriptor, defs: dict[str, Any]) -> dict[str, Any]:
    """A reference to `desc`'s schema, which (with every message it uses) is added to `defs`."""
    name = desc.name
    if name not in defs:
        defs[name] = {}  # placeholder: recursive messages refer to themselves
        props = {f.name: _field(f, defs) for f in desc.fields}
        defs[name] = {"type": "object", "properties": props, "additionalProperties": False}
    return {"$ref": f"#/components/schemas/{name}"}


def _field(f: FieldDescriptor, defs: dict[str, Any]) -> dict[str, Any]:
    if f.message_type is not None and f.message_type.GetOptions().map_entry:
        value = f.message_type.fields_by_name["value"]
        return {"type": "object", "additionalProperties": _single(value, defs)}
    one = _single(f, defs)
    if f.is_repeated:
        return {"type": "array", "items": one}
    return one


def _single(f: FieldDescriptor, defs: dict[str, Any]) -> dict[str, Any]:
    if f.type == FieldDescriptor.TYPE_MESSAGE:
        return ref(f.message_type, defs)
    if f.type == FieldDescriptor.TYPE_ENUM:
        return {"type": "string", "enum": [v.name for v in f.enum_type.values]}
    if f.type in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        # json_format writes the non-finite ones as strings.
        return {"oneOf": [{"type": "number"}, _NON_FINITE]}
    return dict(_SCALARS[f.type])
