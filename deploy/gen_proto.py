"""Generate the Python code of the control-plane contract (proto/snapshotter/v1/*.proto) into
snapshotter/v1/, and the provider HTTP API's OpenAPI document (proto/openapi.json, its schemas
from the same descriptors: snapshotter/gateway/), or with --check fail if what is checked in
differs from what the .proto files generate (CI runs that: stale stubs are a build error, not a
surprise at run time).

    python deploy/gen_proto.py [--check]

Needs grpcio-tools (a test dependency: `deploy/install.sh --test-deps`).
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROTO = ROOT / "proto"
OUT = ROOT / "snapshotter" / "v1"
GENERATED = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
OPENAPI = PROTO / "openapi.json"


def openapi_text() -> str:
    """The OpenAPI document as generated from the checked-in stubs."""
    import json

    sys.path.insert(0, str(ROOT))
    from snapshotter.gateway.app import openapi

    return json.dumps(openapi(), indent=1, sort_keys=True) + "\n"


def generate(dest: Path) -> list[Path]:
    from grpc_tools import protoc  # imported late: a dev/test dependency only

    sources = sorted(PROTO.glob("snapshotter/v1/*.proto"))
    # The proto include path of grpc_tools carries google/protobuf/*.proto.
    import grpc_tools

    include = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO}",
        f"-I{include}",
        f"--python_out={dest}",
        f"--pyi_out={dest}",
        f"--grpc_python_out={dest}",
        *map(str, sources),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    return sorted(p for p in (dest / "snapshotter" / "v1").iterdir() if p.name.endswith(GENERATED))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true", help="only compare, change nothing")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        names = {p.name for p in fresh}
        current = {p.name for p in OUT.iterdir() if p.name.endswith(GENERATED)}
        stale = sorted(
            p.name for p in fresh if not (OUT / p.name).exists() or not filecmp.cmp(p, OUT / p.name)
        )
        extra = sorted(current - names)
        if a.check:
            if not OPENAPI.exists() or OPENAPI.read_text() != openapi_text():
                stale.append(str(OPENAPI.relative_to(ROOT)))
            if stale or extra:
                print(
                    f"generated code in {OUT} is stale: {', '.join(stale + extra)}\n"
                    "  next step: run `python deploy/gen_proto.py` and commit the result",
                    file=sys.stderr,
                )
                return 1
            print(f"generated code in {OUT} matches proto/")
            return 0
        OUT.mkdir(parents=True, exist_ok=True)
        for p in fresh:
            (OUT / p.name).write_bytes(p.read_bytes())
        for name in extra:
            (OUT / name).unlink()
        OPENAPI.write_text(openapi_text())
        print(f"wrote {len(fresh)} files to {OUT}, and {OPENAPI.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
