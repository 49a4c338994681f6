"""The coordinator's few calls besides inference: metadata, config and statistics.

These run between measurements, never on the hot path, so they are plain blocking
calls: ``urllib`` for HTTP and a synchronous gRPC channel. Config and statistics are
Triton extensions other V2 servers may lack; without them the run goes on with the
batch dim inferred from the metadata and no server breakdown.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from abc import ABC, abstractmethod
from typing import Any

import orjson
from google.protobuf.json_format import MessageToDict

from slipstream.bench.core.endpoint import Endpoint
from slipstream.bench.core.errors import BenchError, ServerUnreachable
from slipstream.bench.v2.clients import model_path
from slipstream.bench.v2.inputs import RemoteModel, signature_from_metadata
from slipstream.bench.v2.server_stats import StatsSnapshot, snapshot_from_json

_SERVICE = "/inference.GRPCInferenceService/"


class ServerApi(ABC):
    """Metadata and statistics of the model under test."""

    def __init__(self, endpoint: Endpoint, model: str, version: str, timeout_s: float) -> None:
        self.endpoint = endpoint
        self.model = model
        self.version = version
        self.timeout_s = timeout_s
        # False once the server showed it has no statistics extension: stop asking.
        self._stats_offered = True
        # The model's config (Triton's extension), read once; None: not offered.
        self._config_read = False
        self._config_doc: dict[str, Any] | None = None

    def signature(self) -> RemoteModel:
        """The model's signature; raises BenchError when it cannot be served."""
        metadata = self._metadata()
        self._check_ready()
        return signature_from_metadata(metadata, self._max_batch_size())

    def model_config(self) -> dict[str, Any] | None:
        """The model's config in Triton's JSON form, or None when the server does not
        publish it (read once)."""
        if not self._config_read:
            self._config_doc = self._config()
            self._config_read = True
        return self._config_doc

    def stats_snapshot(self) -> StatsSnapshot | None:
        """Cumulative statistics now, or None when the server does not offer them."""
        if not self._stats_offered:
            return None
        snapshot = self._stats()
        if snapshot is None:
            self._stats_offered = False
        return snapshot

    def close(self) -> None:  # noqa: B027 - most APIs hold nothing to close
        """Release connections."""

    @abstractmethod
    def _metadata(self) -> dict[str, Any]: ...

    @abstractmethod
    def _check_ready(self) -> None: ...

    @abstractmethod
    def _config(self) -> dict[str, Any] | None: ...

    def _max_batch_size(self) -> int | None:
        config = self.model_config()
        if config is None:
            return None
        value = config.get("max_batch_size")
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    @abstractmethod
    def _stats(self) -> StatsSnapshot | None: ...

    def _unreachable(self, reason: str) -> ServerUnreachable:
        how = "host:port" if self.endpoint.protocol == "grpc" else "http://host:port"
        return ServerUnreachable(
            f"cannot reach the server at {self.endpoint.address} over "
            f"{self.endpoint.protocol} ({reason}); is it running, and is {how} the right "
            f"address for --protocol {self.endpoint.protocol}?"
        )


def connect_api(endpoint: Endpoint, model: str, version: str, timeout_s: float) -> ServerApi:
    if endpoint.protocol == "grpc":
        return GrpcServerApi(endpoint, model, version, timeout_s)
    return HttpServerApi(endpoint, model, version, timeout_s)


class HttpServerApi(ServerApi):
    def _get(self, suffix: str) -> tuple[int, bytes]:
        url = self.endpoint.origin + model_path(self.endpoint, self.model, self.version) + suffix
        try:
            with urllib.request.urlopen(url, timeout=self.timeout_s) as response:
                return int(response.status), response.read()
        except urllib.error.HTTPError as exc:
            return int(exc.code), exc.read()
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise self._unreachable(str(reason)) from None

    def _metadata(self) -> dict[str, Any]:
        status, body = self._get("")
        if status != 200:
            raise BenchError(
                f"GET model metadata of {self.model!r} answered {status}: "
                f"{body.decode(errors='replace')[:300]}; check --model and --model-version"
            )
        try:
            doc = orjson.loads(body)
        except orjson.JSONDecodeError:
            raise self._unreachable("the model metadata is not JSON") from None
        if not isinstance(doc, dict):
            raise self._unreachable("the model metadata is not a JSON object")
        return doc

    def _check_ready(self) -> None:
        status, _ = self._get("/ready")
        if status != 200:
            raise BenchError(f"model {self.model!r} is not ready (GET .../ready answered {status})")

    def _config(self) -> dict[str, Any] | None:
        status, body = self._get("/config")
        if status != 200:
            return None
        try:
            doc = orjson.loads(body)
        except orjson.JSONDecodeError:
            return None
        return doc if isinstance(doc, dict) else None

    def _stats(self) -> StatsSnapshot | None:
        status, body = self._get("/stats")
        if status != 200:
            return None
        try:
            return snapshot_from_json(orjson.loads(body), self.version)
        except (orjson.JSONDecodeError, AttributeError, TypeError, ValueError):
            return None


class GrpcServerApi(ServerApi):
    def __init__(self, endpoint: Endpoint, model: str, version: str, timeout_s: float) -> None:
        super().__init__(endpoint, model, version, timeout_s)
        import grpc

        from slipstream.protocol.proto import inference_pb2 as pb

        self._grpc: Any = grpc
        self._pb: Any = pb
        if endpoint.tls:
            credentials = grpc.ssl_channel_credentials()
            self._channel = grpc.secure_channel(endpoint.address, credentials)
        else:
            self._channel = grpc.insecure_channel(endpoint.address)

    def _call(self, method: str) -> dict[str, Any]:
        """``Model{method}`` of the model under test; the reply in the HTTP API's JSON
        form (int64 fields as strings, which the readers pass through int())."""
        pb = self._pb
        request = getattr(pb, f"Model{method}Request")(name=self.model, version=self.version)
        call = self._channel.unary_unary(
            f"{_SERVICE}Model{method}",
            request_serializer=type(request).SerializeToString,
            response_deserializer=getattr(pb, f"Model{method}Response").FromString,
        )
        reply = call(request, timeout=self.timeout_s)
        return MessageToDict(reply, preserving_proto_field_name=True)

    def _metadata(self) -> dict[str, Any]:
        try:
            return self._call("Metadata")
        except self._grpc.RpcError as exc:
            if exc.code() in (
                self._grpc.StatusCode.UNAVAILABLE,
                self._grpc.StatusCode.DEADLINE_EXCEEDED,
            ):
                raise self._unreachable(exc.details() or exc.code().name) from None
            raise BenchError(
                f"ModelMetadata of {self.model!r} failed with {exc.code().name}: "
                f"{exc.details()}; check --model and --model-version"
            ) from None

    def _check_ready(self) -> None:
        try:
            ready = self._call("Ready").get("ready", False)
        except self._grpc.RpcError as exc:
            raise BenchError(f"ModelReady of {self.model!r} failed: {exc.details()}") from None
        if not ready:
            raise BenchError(f"model {self.model!r} is not ready")

    def _config(self) -> dict[str, Any] | None:
        try:
            config = self._call("Config").get("config", {})
        except self._grpc.RpcError:
            return None
        if not isinstance(config, dict):
            return None
        # proto3 leaves out a field at its default: no max_batch_size is 0.
        config.setdefault("max_batch_size", 0)
        return config

    def _stats(self) -> StatsSnapshot | None:
        try:
            return snapshot_from_json(self._call("Statistics"), self.version)
        except self._grpc.RpcError:
            return None

    def close(self) -> None:
        self._channel.close()
