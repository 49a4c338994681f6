"""``slipstream serve --ray``: every model of the repository as a Ray Serve application.

Each V2 model is one application at the route prefix ``/v2/models/<model>``, whose
replicas each run the serving core on that one model (:class:`~slipstream.serving.core.ModelServer`:
the same config, batcher and runtime as ``slipstream serve``) behind the same V2 REST
front end (:class:`~slipstream.server.v2_rest.V2RestApp`: JSON and binary tensors,
metadata, config, statistics). Ray's HTTP proxy routes by the longest prefix, so a request
goes from the proxy straight to a replica of its model; one more application at ``/``
answers the server's routes (health, metadata, and from every replica's reports the
repository index and statistics: :mod:`slipstream.rayserve.control`). The replicas of a
model scale by its config.yaml's ``ray_serve:`` section (Ray Serve's autoscaling_config):

    # REPO/minilm/config.yaml
    ray_serve: {min_replicas: 1, max_replicas: 4, target_ongoing_requests: 4}

    slipstream serve --ray --model-repository ./models --http-port 8000
    RAY_ADDRESS=ray://head:10001 slipstream serve --ray ...     # an existing cluster

The generative models are one more application at ``/v1`` (the OpenAI routes: Ray routes
by path, and an OpenAI request names its model in its body); their V2 routes (Triton's
vLLM backend's contract) reach the root, which relays them to that application's
replicas (:mod:`slipstream.rayserve.relay`). ``/metrics`` at the root answers every
replica's metrics, with the server's names and a ``replica`` label
(:mod:`slipstream.rayserve.metrics`); each replica monitors drift on the requests it
answers (:class:`slipstream.rayserve.control.ReplicaDrift`). ``--tls-cert/--tls-key``
make Ray's proxy serve HTTPS (:func:`http_options`). KServe V1's routes are the front's
(Ray routes ``/v1`` to the generative application, else the root), which relays a
``:predict`` to the model's application (:mod:`slipstream.rayserve.kserve`). Not served
under Ray: gRPC, /v1/embeddings and vLLM's scoring routes (their model is a V2
application of its own), client shared memory; the options that would need them (API
keys, jobs, client certificates...) are refused at start, as is a repository with a
config that does not read (:mod:`slipstream.rayserve.options`). Model load and unload
are Ray Serve's (the repository and ``ray_serve:``, read at start): 400.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import ssl
import threading
from collections.abc import AsyncIterator, Sequence
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST

from slipstream.config import ModelConfig, RayServeConfig, ServerSettings
from slipstream.llm.service import LlmModels
from slipstream.monitor.registry import DriftMonitors
from slipstream.observability.metrics import ServerMetrics
from slipstream.protocol import v2, v2_meta
from slipstream.rayserve import control
from slipstream.rayserve.kserve import KServeFront, TensorApplications, predictions_only
from slipstream.rayserve.metrics import (
    BOARD_NAME,
    BOARD_NAMESPACE,
    PUSH_INTERVAL_S,
    ReplicaReport,
    board_actor,
    merged_text,
    snapshot,
)
from slipstream.rayserve.options import NO_GRPC, refused_options, unreadable_configs
from slipstream.rayserve.relay import GenerativeRelay, RelayedHead, relayed
from slipstream.repository.layout import is_generative, list_models, read_config
from slipstream.server.http_messages import BodyRefused
from slipstream.server.httpd import HttpRequest, StreamingResponse
from slipstream.server.kserve_v1_rest import KServeV1App
from slipstream.server.openai_rest import OpenAIApp
from slipstream.server.router import Handler, Router
from slipstream.server.v2_llm import GenerativeV2
from slipstream.server.v2_rest import V2RestApp
from slipstream.serving.core import ModelServer

logger = logging.getLogger(__name__)

# The root application (server routes) holds no model: it reserves no CPU.
_ROOT_APP = "slipstream"
_OPENAI_APP = "openai"
_REPLICA_HEADER = b"x-slipstream-replica"
# The root relays the generative models' V2 requests, streams that last a generation
# among them: more at once than Ray's default of 5 per replica, so that health probes
# and /metrics never queue behind them (each costs the root a coroutine, no CPU).
_ROOT_MAX_ONGOING_REQUESTS = 1000
# How often the driver looks at the replicas (to log what autoscaling did): a status
# call to the controller, a few ms, twice a second.
_STATUS_INTERVAL_S = 0.5


def deployment_options(config: RayServeConfig, together: int = 5) -> dict[str, Any]:
    """Ray Serve deployment options of one model from its ``ray_serve:`` config;
    ``together``: the requests its replica can run at once (when the config leaves
    ``max_ongoing_requests`` out; Ray's own default, 5, would cap every batch at 5).

    >>> deployment_options(RayServeConfig(min_replicas=2, max_replicas=2))["num_replicas"]
    2
    >>> deployment_options(RayServeConfig(max_replicas=4))["autoscaling_config"]["max_replicas"]
    4
    >>> deployment_options(RayServeConfig(), together=64)["max_ongoing_requests"]
    64
    >>> deployment_options(RayServeConfig(max_ongoing_requests=8), 64)["max_ongoing_requests"]
    8
    """
    options: dict[str, Any] = {
        "ray_actor_options": {"num_cpus": config.num_cpus},
        "max_ongoing_requests": config.max_ongoing_requests or max(5, together),
    }
    if config.min_replicas == config.max_replicas:
        options["num_replicas"] = config.max_replicas
        return options
    options["autoscaling_config"] = {
        "min_replicas": config.min_replicas,
        "max_replicas": config.max_replicas,
        "target_ongoing_requests": config.target_ongoing_requests,
        "upscale_delay_s": config.upscale_delay_s,
        "downscale_delay_s": config.downscale_delay_s,
        "look_back_period_s": config.look_back_period_s,
        # Ray wants load reported more often than it averages over (default 10 s).
        "metrics_interval_s": min(10.0, config.look_back_period_s / 2),
    }
    return options


def runs_together(config: ModelConfig) -> int:
    """The requests a replica of a (tensor) model can run at once: twice its batch per
    instance (one batch running, the next one forming)."""
    instances = sum(group.count for group in config.instance_group)
    return 2 * max(1, config.max_batch_size or 1) * max(1, instances)


class V2Replica:
    """One Ray Serve replica: a serving core on ``models`` behind the V2 REST routes, and
    with ``generative`` the LLM lane on them behind the OpenAI routes (``/v1/``) and the
    V2 routes too (as Triton's vLLM backend shows a model). The root replica (no
    ``models``) relays the V2 requests of the ``relayed_models`` (the generative ones)
    to the generative application. The root and the generative replicas (Ray routes
    ``/v1`` to one of them) relay KServe V1 predictions of the ``tensor_applications``
    to those models' replicas (:mod:`slipstream.rayserve.kserve`)."""

    # Ray runs an async __init__ to its end before the replica takes requests.
    async def __init__(  # type: ignore[misc]
        self,
        settings: dict[str, Any],
        models: list[str],
        generative: bool = False,
        relayed_models: Sequence[str] = (),
        tensor_applications: TensorApplications | None = None,
    ) -> None:
        import ray

        explicit = ServerSettings(
            **{**settings, "model_control_mode": "explicit", "load_models": models}
        )
        # A Ray worker's root logger has no handler (Ray Serve logs on its own loggers):
        # the replica's log goes to its stderr, which Ray copies to the driver's, with
        # slipstream serve's level and format.
        logging.basicConfig(level=explicit.log_level.upper(),
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")  # fmt: skip
        self._max_request_bytes = explicit.max_request_bytes
        self._models = models
        self._metrics = ServerMetrics()
        # The drift of the requests this replica answers, in its /metrics and reports.
        self._monitors = DriftMonitors()
        self._metrics.registry.register(self._monitors)
        # The root holds a generative lane that loads nothing: the repository index lists
        # the generative models it knows.
        lanes: list[LlmModels] = []
        if generative or not models:
            lanes.append(LlmModels(explicit.model_repository, self._metrics.registry,
                                   explicit.idle_unload_seconds, explicit.load_wait_s))  # fmt: skip
        self._service = ModelServer(explicit, self._metrics, lanes=lanes,
                                    tap_factory=self._monitors.tap_for)  # fmt: skip
        # The V2 routes' service: a generative model's requests run on its lane.
        self._v2 = GenerativeV2(self._service, lanes[0]) if generative else self._service
        self._board = ray.get_actor(BOARD_NAME, namespace=BOARD_NAMESPACE)
        actor = ray.get_runtime_context().get_actor_id() or str(os.getpid())
        self._replica_id = f"{models[0] if models else 'root'}-{actor[:8]}"
        drift = control.ReplicaDrift(self._monitors, self._replica_id, self._board)
        v2_app = V2RestApp(self._v2, self._metrics, drift=drift.report)
        routes: list[tuple[str, Handler]] = [
            (route, control.no_embeddings_or_scoring) for route in control.NOT_ON_RAY_ROUTES
        ]
        routes += [(route, control.no_files_or_batches) for route in control.FILES_AND_BATCHES]
        if generative or not models:
            # The root answers /v1/ where no generative application is (Ray routes /v1
            # to that one when it is): its lane and core hold no model, so it lists
            # none, as the plain server's OpenAI routes list none without one.
            openai_app = OpenAIApp(lanes[0], self._service, explicit.model_repository)
            v1 = KServeV1App(self._v2, openai_app.handle)
            front = KServeFront(tensor_applications or TensorApplications(), self._board,
                                _model_handle, v1.handle, openai_app.handle)  # fmt: skip
            routes += [("/v1/models", front.handle), ("/v1/", openai_app.handle)]
        else:  # the predictions a front relays here (slipstream.rayserve.kserve)
            routes.append(("/v1/models", KServeV1App(self._v2, predictions_only).handle))
        for model in models:
            stats = control.ModelStatsRoute(model, self._replica_id, self._board, v2_app.handle)
            routes.append((f"/v2/models/{model}/", stats.handle))
        if not models:
            root = control.RootRoutes(self._service, self._board, v2_app.handle).handle
            if relayed_models:
                root = GenerativeRelay(relayed_models, _generative_handle, root).handle
            routes.append(("/v2", root))  # GET /v2 (server metadata) among them
        self._handle = Router(fallback=v2_app.handle, routes=routes,
                              middleware=[control.refuse_per_process_changes]).handle  # fmt: skip
        self._replica = str(os.getpid()).encode()
        # The root application (no models) answers /metrics for every replica.
        self._gathers_metrics = not models
        # Loaded and warmed up before Ray routes a request here.
        await self._service.start()
        self._pusher = asyncio.create_task(self._push_reports()) if models else None

    async def _push_reports(self) -> None:
        while True:
            stats = v2_meta.model_stats_json(await self._v2.model_statistics())
            index = v2_meta.repository_index_json(await self._service.repository_index())
            report = ReplicaReport(
                snapshot(self._metrics.registry),
                [s for s in stats["model_stats"] if s["name"] in self._models],
                [entry for entry in index if entry["name"] in self._models],
                self._monitors.reports(),
            )
            self._board.put.remote(self._replica_id, report)
            await asyncio.sleep(PUSH_INTERVAL_S)

    async def __call__(self, request: Any) -> Any:
        """A Starlette request from Ray's proxy -> the V2 route's answer."""
        from starlette.responses import Response
        from starlette.responses import StreamingResponse as Streamed

        headers = [(k.lower(), v) for k, v in request.headers.raw]
        try:
            body = await control.read_body(request, headers, self._max_request_bytes)
        except BodyRefused as refused:
            if refused.status == 413:
                self._metrics.transport.count_close("body_too_large")
            return Response(v2.encode_error(refused.message), refused.status,
                            media_type="application/json")  # fmt: skip
        http = HttpRequest(
            request.method, request.url.path, headers, body, request.url.query.encode()
        )
        if self._gathers_metrics and http.path == "/metrics" and http.method in ("GET", "HEAD"):
            text = merged_text(await self._board.all.remote())
            return Response(text, 200, media_type=CONTENT_TYPE_LATEST)
        reply = await self._handle(http)
        headers_out = {k.decode("latin-1"): v.decode("latin-1") for k, v in reply.headers}
        # A relayed answer names the replica that made it.
        headers_out.setdefault(_REPLICA_HEADER.decode(), self._replica.decode())
        if isinstance(reply, StreamingResponse):  # server-sent events of a generation
            return Streamed(reply.chunks, reply.status, headers_out, reply.content_type.decode())
        return Response(reply.body, reply.status, headers_out, reply.content_type.decode())

    async def relay(self, request: HttpRequest) -> AsyncIterator[RelayedHead | bytes]:
        """A V2 request of a generative model, relayed by the root replica (over a Ray
        Serve handle): its answer in parts (:mod:`slipstream.rayserve.relay`)."""
        async for part in relayed(self._handle, request, [(_REPLICA_HEADER, self._replica)]):
            yield part

    def check_health(self) -> None:
        """Ray replaces a replica whose check raises."""
        if not self._service.is_live():
            raise RuntimeError("the serving core is not live")

    async def __del__(self) -> None:
        if self._pusher is not None:
            self._pusher.cancel()
            self._board.drop.remote(self._replica_id)
        await self._service.stop()


def applications(settings: ServerSettings) -> dict[str, tuple[str, Any]]:
    """Application name -> (route prefix, bound application): one per V2 model, one at
    ``/v1`` for the generative models (Ray routes by path, and an OpenAI request names its
    model in the body: one application serves them all, scaled by the first one's
    ``ray_serve:``), and the root one last."""
    from ray import serve

    # A stopping replica drains its requests for --shutdown-timeout-s, looking every 0.5 s.
    replica: Any = serve.deployment(
        V2Replica, graceful_shutdown_timeout_s=settings.shutdown_timeout_s,
        graceful_shutdown_wait_loop_s=0.5,
    )  # fmt: skip
    plain = settings.model_dump(mode="json")
    apps: dict[str, tuple[str, Any]] = {}
    generative: dict[str, ModelConfig] = {}
    scaled_to_zero: set[str] = set()
    for name, directory in list_models(settings.model_repository).items():
        config: ModelConfig = read_config(directory)
        if is_generative(directory):
            generative[name] = config
            continue
        if config.ray_serve.min_replicas == 0:
            scaled_to_zero.add(name)
        options = deployment_options(config.ray_serve, runs_together(config))
        apps[name] = (f"/v2/models/{name}",
                      replica.options(name=name, **options).bind(plain, [name]))  # fmt: skip
    # What the front replicas (Ray routes /v1 to one) relay KServe V1 predictions to.
    tensor = TensorApplications(frozenset(apps), frozenset(scaled_to_zero))
    if generative:
        first = next(iter(generative.values()))
        options = deployment_options(first.ray_serve, first.generation.max_num_seqs)
        bound = replica.options(name=_OPENAI_APP, **options).bind(
            plain, list(generative), True, (), tensor
        )
        apps[_OPENAI_APP] = ("/v1", bound)
    root = replica.options(name=_ROOT_APP, num_replicas=1, ray_actor_options={"num_cpus": 0},
                           max_ongoing_requests=_ROOT_MAX_ONGOING_REQUESTS)  # fmt: skip
    apps[_ROOT_APP] = ("/", root.bind(plain, [], False, list(generative), tensor))
    return apps


def http_options(settings: ServerSettings) -> dict[str, Any]:
    """Ray Serve's HTTP proxy options: the address, and with ``--tls-cert/--tls-key`` the
    PEM files it serves HTTPS with, checked here first as the plain server checks them
    (OSError or ssl.SSLError naming the option). Every node's proxy reads them at the
    same path, as it reads the repository.

    >>> from pathlib import Path
    >>> http_options(ServerSettings(model_repository=Path("."), http_port=8000))
    {'host': '0.0.0.0', 'port': 8000}
    """
    options: dict[str, Any] = {"host": settings.host, "port": settings.http_port}
    if settings.tls_cert is not None and settings.tls_key is not None:
        from slipstream.security.tls import http_context

        http_context(settings.tls_cert, settings.tls_key)
        options["ssl_certfile"] = str(settings.tls_cert.resolve())
        options["ssl_keyfile"] = str(settings.tls_key.resolve())
    return options


def _generative_handle() -> Any:
    """The generative application's deployment handle (the root relays to it)."""
    from ray import serve

    return serve.get_deployment_handle(_OPENAI_APP, app_name=_OPENAI_APP)


def _model_handle(model: str) -> Any:
    """The deployment handle of a tensor model's application (a front relays to it)."""
    from ray import serve

    return serve.get_deployment_handle(model, app_name=model)


def _log_replica_changes(status: Any, before: dict[str, int]) -> dict[str, int]:
    """Log each model whose count of running replicas changed (autoscaling at work)."""
    now = {}
    for name, application in status.applications.items():
        for deployment in application.deployments.values():
            states = {str(state): count for state, count in deployment.replica_states.items()}
            now[name] = sum(n for state, n in states.items() if state.endswith("RUNNING"))
    for name, count in now.items():
        if before.get(name) != count:
            logger.info("model %s: %d replica%s running", name, count, "" if count == 1 else "s")
    return now


def run(settings: ServerSettings, address: str = "") -> int:
    """Deploy every application, wait for SIGTERM/SIGINT, shut them down; the exit code
    (1 at once for an option Ray Serve would not honour, or a config that does not read)."""
    refused = [*refused_options(settings), *unreadable_configs(settings)]
    if refused:
        for problem in refused:
            logger.error("%s", problem)
        return 1
    try:
        proxy_options = http_options(settings)
    except (OSError, ssl.SSLError) as exc:
        logger.error("%s", exc)
        return 1
    if settings.grpc_port:
        logger.warning("%s", NO_GRPC)
    import ray
    from ray import serve

    ray.init(address=address or os.environ.get("RAY_ADDRESS") or None,
             include_dashboard=False, log_to_driver=True)  # fmt: skip
    # Owned by this process: it lives as long as the applications do.
    board = board_actor().options(name=BOARD_NAME, namespace=BOARD_NAMESPACE).remote()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options=proxy_options)
        apps = applications(settings)
        root = apps.pop(_ROOT_APP)
        # The models together; the root (health) only once they run, so ready means ready.
        if apps:
            serve.run_many([serve.RunTarget(app, name=name, route_prefix=prefix)
                            for name, (prefix, app) in apps.items()])  # fmt: skip
        serve.run(root[1], name=_ROOT_APP, route_prefix=root[0])
        scheme = "HTTPS" if "ssl_certfile" in proxy_options else "HTTP"
        logger.info("Slipstream on Ray Serve is ready: %s port %d", scheme, settings.http_port)
        counts: dict[str, int] = {}
        while not stop.wait(_STATUS_INTERVAL_S):
            counts = _log_replica_changes(serve.status(), counts)
        logger.info("shutting down the Ray Serve applications")
        serve.shutdown()  # type: ignore[no-untyped-call]
        ray.kill(board)
        return 0
    except Exception:
        logger.exception("Ray Serve deployment failed")
        return 1
    finally:
        ray.shutdown()
