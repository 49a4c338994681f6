"""Protobuf messages of the V2 gRPC API (generated from inference.proto; see README)."""
