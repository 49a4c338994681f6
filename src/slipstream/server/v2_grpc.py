"""The V2 gRPC front end: ``inference.GRPCInferenceService`` on grpc.aio.

Each RPC decodes its message with :mod:`slipstream.protocol.grpc_codec`, calls one
method of the :class:`InferenceService`, and encodes the result. A
:class:`SlipstreamError` becomes its own status code and message; anything else is
logged here, once, and answered INTERNAL without its details.

The method handlers are registered by hand under the service name clients call,
``inference.GRPCInferenceService``: our messages live in the protobuf package
``slipstream.inference`` (so they never clash with tritonclient's ``inference.*`` in
one process), and a generated stub would serve the wrong paths.

Example::

    server, port = build_grpc_server(service, "0.0.0.0", 8001, 64 * 1024 * 1024)
    await server.start()  # on the event loop that serves requests
    await server.wait_for_termination()
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any, NoReturn

import grpc

from slipstream.errors import Decoupled, InvalidRequest, SlipstreamError, Unavailable
from slipstream.names import validate_model_name
from slipstream.protocol import grpc_codec, grpc_config, v2_shm
from slipstream.protocol.proto import inference_pb2 as pb
from slipstream.server import grpc_stream
from slipstream.server.grpc_front_door import (
    KEY_MODELS,
    KEY_NAME,
    STREAM_ERRORS,
    STREAM_MARKS,
)
from slipstream.server.triton_settings import log_settings_grpc, trace_setting_grpc
from slipstream.serving.service import InferenceService
from slipstream.types import InferRequest

logger = logging.getLogger(__name__)

SERVICE_NAME = "inference.GRPCInferenceService"
# Sticky routing during rollouts, as HTTP's X-Slipstream-Route-Key header.
ROUTE_KEY_METADATA = "x-slipstream-route-key"

# What clients see for an internal fault; the details stay in the server log.
_INTERNAL_MESSAGE = "internal error while serving the request; see the server log"

_Unary = Callable[..., Awaitable[Any]]

# RPCs one client connection may have open at once (gRPC's default: unlimited); more
# wait in the client until one ends, so one connection cannot pile up unbounded work.
MAX_CONCURRENT_STREAMS = 1000
# Connection health, with Triton's defaults for its --grpc-keepalive-* options made
# explicit: the server pings a connection silent for 2 h and drops it when 20 s pass
# without an answer (a vanished client's resources are released); a client pinging
# more often than every 5 min without calls gets GOAWAY after 2 strikes.
_KEEPALIVE_OPTIONS = [
    ("grpc.keepalive_time_ms", 7_200_000),
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.keepalive_permit_without_calls", 0),
    ("grpc.http2.min_ping_interval_without_data_ms", 300_000),
    ("grpc.http2.max_ping_strikes", 2),
]


def build_grpc_server(
    service: InferenceService,
    host: str,
    port: int,
    max_message_bytes: int,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    max_concurrent_streams: int = MAX_CONCURRENT_STREAMS,
    credentials: grpc.ServerCredentials | None = None,
    reuse_port: bool = False,
) -> tuple[grpc.aio.Server, int]:
    """A gRPC server (not started) serving ``service``, and the port it bound.

    ``port`` 0 picks a free port. Call this on the event loop that will run the server,
    since grpc.aio binds the server to the running loop. Raises OSError when the
    address cannot be bound. ``interceptors`` run before every RPC, in order: the gRPC
    side of the HTTP router's middleware (auth, rate limits, request ids). A message
    over ``max_message_bytes`` is refused with RESOURCE_EXHAUSTED. ``credentials``
    (``grpc.ssl_server_credentials``) serve TLS. ``reuse_port``: share the port with
    the other front-end processes of this server (SO_REUSEPORT).
    """
    frontend = _GrpcFrontend(service)
    server = grpc.aio.server(
        interceptors=list(interceptors),
        options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_concurrent_streams", max_concurrent_streams),
            *_KEEPALIVE_OPTIONS,
            # gRPC sets SO_REUSEPORT by default, which lets a second server bind the
            # same port silently and steal half the connections; fail loudly instead,
            # unless this server's own front-end processes share the port on purpose.
            ("grpc.so_reuseport", int(reuse_port)),
        ],
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE_NAME, frontend.method_handlers()),)
    )
    address = f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
    try:
        if credentials is None:
            bound_port = server.add_insecure_port(address)
        else:
            bound_port = server.add_secure_port(address, credentials)
    except RuntimeError as exc:
        raise OSError(
            f"gRPC server could not bind {address} ({exc}); is the port in use? "
            "Choose another with --grpc-port"
        ) from None
    if not bound_port:
        raise OSError(f"gRPC server could not bind {address}; choose another with --grpc-port")
    return server, int(bound_port)


class _GrpcFrontend:
    """The RPC implementations: each takes a request message and returns its answer."""

    def __init__(self, service: InferenceService) -> None:
        self._service = service
        # Model name -> whether its config is decoupled (Triton's transaction policy is
        # the model's, every version's): a streamed request goes straight to the path it
        # takes, looked up once per model (a model that is not there is not remembered).
        self._decoupled: dict[str, bool] = {}

    def method_handlers(self) -> dict[str, grpc.RpcMethodHandler]:
        unary: dict[str, _Unary] = {
            "ServerLive": self.server_live,
            "ServerReady": self.server_ready,
            "ModelReady": self.model_ready,
            "ServerMetadata": self.server_metadata,
            "ModelMetadata": self.model_metadata,
            "ModelInfer": self.model_infer,
            "ModelConfig": self.model_config,
            "ModelStatistics": self.model_statistics,
            "RepositoryIndex": self.repository_index,
            "RepositoryModelLoad": self.repository_model_load,
            "RepositoryModelUnload": self.repository_model_unload,
            "SystemSharedMemoryStatus": self.system_shared_memory_status,
            "SystemSharedMemoryRegister": self.system_shared_memory_register,
            "SystemSharedMemoryUnregister": self.system_shared_memory_unregister,
            "CudaSharedMemoryStatus": self.cuda_shared_memory_status,
            "CudaSharedMemoryRegister": self.cuda_shared_memory_register,
            "CudaSharedMemoryUnregister": self.cuda_shared_memory_unregister,
            "LogSettings": self.log_settings,
            "TraceSetting": self.trace_setting,
        }
        handlers = {}
        # Each unary RPC <Name> takes <Name>Request and answers <Name>Response, except
        # that ModelInfer returns its answer already serialised.
        for name, call in unary.items():
            response_type = getattr(pb, f"{name}Response")
            serializer = None if name == "ModelInfer" else response_type.SerializeToString
            handlers[name] = grpc.unary_unary_rpc_method_handler(
                _unary_behavior(name, call, with_context=name == "ModelInfer"),
                request_deserializer=getattr(pb, f"{name}Request").FromString,
                response_serializer=serializer,
            )
        handlers["ModelStreamInfer"] = grpc.stream_stream_rpc_method_handler(
            self.model_stream_infer,
            request_deserializer=pb.ModelInferRequest.FromString,
            response_serializer=None,  # answers are serialised already
        )
        return handlers

    # ------------------------------------------------------------ health and metadata

    async def server_live(self, request: pb.ServerLiveRequest) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=self._service.is_live())

    async def server_ready(self, request: pb.ServerReadyRequest) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=await self._service.is_ready())

    async def model_ready(self, request: pb.ModelReadyRequest) -> pb.ModelReadyResponse:
        name = validate_model_name(request.name)
        return pb.ModelReadyResponse(ready=await self._service.model_ready(name, request.version))

    async def server_metadata(self, request: pb.ServerMetadataRequest) -> pb.ServerMetadataResponse:
        return grpc_codec.encode_server_metadata(await self._service.server_metadata())

    async def model_metadata(self, request: pb.ModelMetadataRequest) -> pb.ModelMetadataResponse:
        metadata = await self._service.model_metadata(
            validate_model_name(request.name), request.version
        )
        return grpc_codec.encode_model_metadata(metadata)

    async def model_config(self, request: pb.ModelConfigRequest) -> pb.ModelConfigResponse:
        config = await self._service.model_config(
            validate_model_name(request.name), request.version
        )
        return grpc_config.encode_model_config(config)

    async def model_statistics(
        self, request: pb.ModelStatisticsRequest
    ) -> pb.ModelStatisticsResponse:
        # An empty name asks for every model.
        name = validate_model_name(request.name) if request.name else ""
        stats = await self._service.model_statistics(name, request.version)
        visible = KEY_MODELS.get()
        if visible is not None:  # only what the caller's key may use
            stats = [entry for entry in stats if entry.name in visible]
        return grpc_codec.encode_model_statistics(stats)

    # ------------------------------------------------------------ inference

    async def model_infer(self, request: pb.ModelInferRequest, context: Any) -> bytes:
        # Serialised here rather than by grpc: see grpc_codec.serialize_infer_response.
        validate_model_name(request.model_name)
        decoded = grpc_codec.decode_infer_request(request)
        decoded.route_key = _route_key(context)
        decoded.owner = KEY_NAME.get()
        response = await self._service.infer(decoded)
        return grpc_codec.serialize_infer_response(response)

    async def model_stream_infer(
        self, requests: AsyncIterator[pb.ModelInferRequest], context: Any
    ) -> AsyncIterator[grpc_stream.Answer]:
        """Answer each request on the stream, in the order the requests came, as Triton.

        Requests run concurrently (a slow one holds back the answers after it, never
        their runs); see :func:`grpc_stream.in_request_order`.
        """
        route_key = _route_key(context)
        answers = grpc_stream.in_request_order(
            requests, lambda request: self._stream_answer(request, route_key)
        )
        # Closed with this generator, so a client that leaves cancels the runs it left.
        async with contextlib.aclosing(answers):
            async for item in answers:
                yield item

    async def _stream_answer(
        self, request: pb.ModelInferRequest, route_key: str
    ) -> bytes | grpc_stream.Answers:
        # A failed request is answered on the stream; the stream itself stays open.
        try:
            validate_model_name(request.model_name)
            decoded = grpc_codec.decode_infer_request(request)
            empty_final = decoded.parameters.pop(grpc_stream.ENABLE_EMPTY_FINAL_RESPONSE, None)
            decoded.route_key = route_key
            decoded.owner = KEY_NAME.get()
            decoupled = self._decoupled.get(decoded.model_name)
            if decoupled is None:
                decoupled = await self._is_decoupled(decoded.model_name)
            if not decoupled:
                try:
                    response = await self._service.infer(decoded)
                    return grpc_codec.serialize_stream_infer_response(response, final=True)
                except Decoupled:  # reloaded as a decoupled model since it was looked up
                    self._decoupled[decoded.model_name] = True
            # Any number of answers, as they come (one, where a model reloaded since is
            # no longer decoupled: infer_stream answers any model).
            answers = self._decoupled_answers(request, decoded, empty_final is True)
            return grpc_stream.Answers(answers)
        except SlipstreamError as exc:
            message, code = exc.message, exc.grpc_code
        except Exception:
            logger.exception("gRPC ModelStreamInfer request failed")
            message, code = _INTERNAL_MESSAGE, "INTERNAL"
        errors = STREAM_ERRORS.get()
        if errors is not None:  # for the access log's line of this message
            errors[id(request)] = code
        return grpc_stream.serialize_stream_error(request, message)

    async def _is_decoupled(self, name: str) -> bool:
        """Whether model ``name`` is decoupled, remembered where it is known; False for
        a model not there (``infer`` answers why)."""
        try:
            config = await self._service.model_config(name)
        except SlipstreamError:
            return False
        decoupled = self._decoupled[name] = config.model_transaction_policy.decoupled
        return decoupled

    async def _decoupled_answers(
        self, request: pb.ModelInferRequest, decoded: InferRequest, empty_final: bool
    ) -> AsyncIterator[grpc_stream.Answer]:
        """A decoupled model's answers to ``request`` on the wire; a failure ends them
        with its error, as a one-answer request's is answered."""
        marked = STREAM_MARKS.get()  # the front door counts answers: mark them
        try:
            async for response, message, final in self._service.infer_stream(decoded):
                if message:
                    data = grpc_stream.serialize_stream_error(request, message, final)
                elif response is not None:
                    data = grpc_codec.serialize_stream_infer_response(response, final=final)
                elif empty_final:  # the model's final flag came without a response
                    data = grpc_stream.serialize_empty_final(request)
                else:
                    if final and marked:  # nothing to write, but counted
                        yield grpc_stream.Done()
                    continue
                yield grpc_stream.Partial(data) if marked and not final else data
        except SlipstreamError as exc:
            yield grpc_stream.serialize_stream_error(request, exc.message)
        except Exception:
            logger.exception("gRPC ModelStreamInfer request failed")
            yield grpc_stream.serialize_stream_error(request, _INTERNAL_MESSAGE)

    # ------------------------------------------------------------ repository

    async def repository_index(
        self, request: pb.RepositoryIndexRequest
    ) -> pb.RepositoryIndexResponse:
        _check_repository_name(request.repository_name)
        entries = await self._service.repository_index(ready_only=request.ready)
        visible = KEY_MODELS.get()
        if visible is not None:  # only what the caller's key may use, as over HTTP
            entries = [entry for entry in entries if entry.name in visible]
        return grpc_codec.encode_repository_index(entries)

    async def repository_model_load(
        self, request: pb.RepositoryModelLoadRequest
    ) -> pb.RepositoryModelLoadResponse:
        _check_repository_name(request.repository_name)
        name = validate_model_name(request.model_name)
        await self._service.load_model(name, _load_config(name, request.parameters))
        return pb.RepositoryModelLoadResponse()

    async def repository_model_unload(
        self, request: pb.RepositoryModelUnloadRequest
    ) -> pb.RepositoryModelUnloadResponse:
        _check_repository_name(request.repository_name)
        # Triton's only unload parameter: an ensemble's models are unloaded too.
        dependents = request.parameters.get("unload_dependents")
        await self._service.unload_model(
            validate_model_name(request.model_name),
            dependents is not None and dependents.bool_param,
        )
        return pb.RepositoryModelUnloadResponse()

    # ------------------------------------------------------------ shared memory

    async def system_shared_memory_status(
        self, request: pb.SystemSharedMemoryStatusRequest
    ) -> pb.SystemSharedMemoryStatusResponse:
        regions = await self._service.region_status(request.name, KEY_NAME.get())
        return v2_shm.encode_status_grpc(regions)

    async def system_shared_memory_register(
        self, request: pb.SystemSharedMemoryRegisterRequest
    ) -> pb.SystemSharedMemoryRegisterResponse:
        register = v2_shm.decode_register_grpc(request)
        await self._service.register_region(
            request.name, register.key, register.offset, register.byte_size, KEY_NAME.get()
        )
        return pb.SystemSharedMemoryRegisterResponse()

    async def system_shared_memory_unregister(
        self, request: pb.SystemSharedMemoryUnregisterRequest
    ) -> pb.SystemSharedMemoryUnregisterResponse:
        await self._service.unregister_region(request.name, KEY_NAME.get())
        return pb.SystemSharedMemoryUnregisterResponse()

    async def cuda_shared_memory_status(
        self, request: pb.CudaSharedMemoryStatusRequest
    ) -> pb.CudaSharedMemoryStatusResponse:
        regions = await self._service.cuda_region_status(request.name, KEY_NAME.get())
        return v2_shm.encode_cuda_status_grpc(regions)

    async def cuda_shared_memory_register(
        self, request: pb.CudaSharedMemoryRegisterRequest
    ) -> pb.CudaSharedMemoryRegisterResponse:
        register = v2_shm.decode_cuda_register_grpc(request)
        await self._service.register_cuda_region(
            request.name, register.raw_handle, register.device_id, register.byte_size,
            KEY_NAME.get(),
        )  # fmt: skip
        return pb.CudaSharedMemoryRegisterResponse()

    async def cuda_shared_memory_unregister(
        self, request: pb.CudaSharedMemoryUnregisterRequest
    ) -> pb.CudaSharedMemoryUnregisterResponse:
        await self._service.unregister_cuda_region(request.name, KEY_NAME.get())
        return pb.CudaSharedMemoryUnregisterResponse()

    # ------------------------------------------------------------ logging and trace

    async def log_settings(self, request: pb.LogSettingsRequest) -> pb.LogSettingsResponse:
        return log_settings_grpc(request)

    async def trace_setting(self, request: pb.TraceSettingRequest) -> pb.TraceSettingResponse:
        if request.model_name:  # NOT_FOUND for a model not served
            await self._service.model_metadata(validate_model_name(request.model_name))
        return trace_setting_grpc(request)


def _check_repository_name(name: str) -> None:
    if name:
        raise InvalidRequest(
            f"repository_name {name!r}: Slipstream serves a single repository; "
            "leave repository_name empty"
        )


def _load_config(
    model_name: str, parameters: Mapping[str, pb.ModelRepositoryParameter]
) -> str | None:
    """A load's config override (Triton's JSON form), or None. Triton lets a load carry
    model files too; Slipstream reads them from the repository only, and silently
    ignoring them would load the wrong model."""
    others = sorted(set(parameters) - {"config"})
    if others:
        raise InvalidRequest(
            f"load of model '{model_name}': parameters ({', '.join(others)}) are not "
            "supported; put the model's files in the model repository instead"
        )
    if "config" not in parameters:
        return None
    config = parameters["config"]
    if config.WhichOneof("parameter_choice") != "string_param":
        raise InvalidRequest("parameters.config: expected the model config as a JSON string")
    return config.string_param


def _route_key(context: Any) -> str:
    """The x-slipstream-route-key metadata of a call ("" when absent): sticky routing."""
    for key, value in context.invocation_metadata() or ():
        if key == ROUTE_KEY_METADATA:
            return value if isinstance(value, str) else value.decode("latin-1")
    return ""


def _unary_behavior(
    name: str, call: Callable[..., Awaitable[Any]], with_context: bool = False
) -> Callable[[Any, Any], Awaitable[Any]]:
    """Wrap one RPC so errors become gRPC statuses; ``with_context``: the call takes the
    RPC's context too."""

    async def behavior(request: Any, context: Any) -> Any:
        try:
            if with_context:
                return await call(request, context)
            return await call(request)
        except SlipstreamError as exc:
            await _abort_with(context, exc)
        except Exception:
            logger.exception("gRPC %s failed", name)
            await _abort(context, grpc.StatusCode.INTERNAL, _INTERNAL_MESSAGE)

    return behavior


async def _abort_with(context: Any, error: SlipstreamError) -> NoReturn:
    trailers: tuple[tuple[str, str], ...] = ()
    if isinstance(error, Unavailable) and error.retry_after_s is not None:
        trailers = (("retry-after", str(error.retry_after_s)),)
    await _abort(context, grpc.StatusCode[error.grpc_code], error.message, trailers)


async def _abort(
    context: Any, code: Any, message: str, trailers: tuple[tuple[str, str], ...] = ()
) -> NoReturn:
    await context.abort(code, message, trailers)
    raise AssertionError("grpc.aio context.abort always raises")
