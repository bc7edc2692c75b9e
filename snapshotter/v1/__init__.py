"""The control plane's contract, generated from proto/snapshotter/v1/*.proto by
deploy/gen_proto.py (checked in; CI fails when it is stale). Do not edit the *_pb2* files."""
