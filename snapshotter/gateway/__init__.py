"""The provider HTTP/JSON API: a gateway in front of the coordinator's gRPC contract."""
