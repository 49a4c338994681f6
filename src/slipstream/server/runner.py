"""Running the HTTP and gRPC front ends in one event loop, and stopping them gracefully.

On SIGTERM or SIGINT: stop accepting connections, let in-flight requests finish (bounded
by ``shutdown_timeout_s``), unload the models, and return so the process exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Iterator
from typing import Any

import uvicorn

from slipstream.config import ServerSettings
from slipstream.server.http import HttpApp
from slipstream.serving.core import ModelServer

logger = logging.getLogger(__name__)

# An instance thread finishing a batch needs the GIL back to hand over its results; with
# CPython's default 5 ms switch interval it can wait that long behind the event loop
# decoding new requests, stalling a whole batch of clients.
GIL_SWITCH_INTERVAL_S = 0.0005


class _UvicornServer(uvicorn.Server):
    """uvicorn without its own signal handling: :func:`serve` owns shutdown."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def serve(settings: ServerSettings, stop: asyncio.Event | None = None) -> int:
    """Serve until ``stop`` is set or a termination signal arrives; return the exit code."""
    stop = stop or asyncio.Event()
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)

    service = ModelServer(settings)
    http_server = None
    if settings.http_port:
        app = HttpApp(service, service.metrics, settings.max_request_bytes)
        http_server = _UvicornServer(
            uvicorn.Config(
                app,
                host=settings.host,
                port=settings.http_port,
                loop="none",
                http="httptools",
                lifespan="off",
                access_log=False,
                log_level=settings.log_level,
                timeout_graceful_shutdown=int(settings.shutdown_timeout_s) or None,
                backlog=4096,
                # Per-response work uvicorn would otherwise do for every request.
                proxy_headers=False,
                server_header=False,
                date_header=False,
            )
        )
    grpc_server = None
    if settings.grpc_port:
        from slipstream.server.grpc import build_grpc_server

        try:
            grpc_server, grpc_port = build_grpc_server(
                service, settings.host, settings.grpc_port, settings.max_request_bytes
            )
        except OSError as exc:
            logger.error("%s", exc)
            return 1
        await grpc_server.start()
        logger.info("gRPC server listening on %s:%d", settings.host, grpc_port)

    http_task = asyncio.create_task(_serve_http(http_server)) if http_server else None
    # Models load while the servers already answer health/live (ready comes after).
    start_task = asyncio.create_task(service.start())
    stop_task = asyncio.create_task(stop.wait())
    exit_code = await _run_until_stopped(start_task, stop_task, http_task, settings)
    logger.info("shutting down: finishing in-flight requests (up to %.0f s)",
                settings.shutdown_timeout_s)  # fmt: skip
    for task in (start_task, stop_task):
        task.cancel()
    if http_server is not None:
        http_server.should_exit = True
    if grpc_server is not None:
        await grpc_server.stop(grace=settings.shutdown_timeout_s)
    if http_task is not None:
        await asyncio.gather(http_task, return_exceptions=True)
    await service.stop()
    logger.info("shutdown complete")
    return exit_code


async def _serve_http(server: _UvicornServer) -> None:
    try:
        await server.serve()
    except SystemExit:
        # uvicorn exits the process when it cannot bind; turn that into a failed task.
        raise OSError("HTTP server could not start (is the port in use?)") from None
    if not server.started:
        raise OSError("HTTP server could not start (is the port in use?)")


async def _run_until_stopped(
    start_task: asyncio.Task[None],
    stop_task: asyncio.Task[bool],
    http_task: asyncio.Task[None] | None,
    settings: ServerSettings,
) -> int:
    """Wait for a stop signal; 0 on a requested stop, 1 when a front end died."""
    watched: set[asyncio.Task[Any]] = {start_task, stop_task}
    if http_task is not None:
        watched.add(http_task)
    while True:
        done, _ = await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
        if stop_task in done:
            return 0
        if http_task in done:
            logger.error("%s; shutting down", http_task.exception() or "HTTP server stopped")
            return 1
        if start_task in done:
            watched.discard(start_task)
            if start_task.exception() is not None:
                logger.error("model loading failed: %s", start_task.exception())
                return 1
            logger.info("Slipstream is ready: HTTP port %s, gRPC port %s",
                        settings.http_port or "off", settings.grpc_port or "off")  # fmt: skip
