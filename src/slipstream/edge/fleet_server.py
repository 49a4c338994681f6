"""``slipstream fleet serve``: the fleet repository over HTTP, and the devices' reports.

Routes (Slipstream's own HTTP transport; any static file server can serve the first two
instead, and then reports go wherever ``slipstream edge --report-url`` says)::

    GET  /metadata/<file>, /targets/<path>    DIR/public as it is (TUF checks the bytes)
    POST /v2/fleet/devices/<device id>        a device's state (JSON, at most 64 KiB)
    GET  /v2/fleet/devices                    every device's last state, with when it came

Reports are kept in DIR/devices.json too, so a restarted publisher still lists them.
Example::

    slipstream fleet serve --repo fleet --port 8700
    curl localhost:8700/v2/fleet/devices
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from datetime import UTC, datetime
from typing import Any

from slipstream.edge.fleet_repo import FleetPaths, write_atomic
from slipstream.server.httpd import HttpLimits, HttpRequest, HttpResponse, HttpServer
from slipstream.server.runner import stop_on_signals

logger = logging.getLogger(__name__)

_DEVICES = "/v2/fleet/devices"
_DEVICE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_MAX_REPORT_BYTES = 64 * 1024
_STATIC_PREFIXES = ("/metadata/", "/targets/")


def _json(status: int, body: Any) -> HttpResponse:
    return HttpResponse(status, json.dumps(body, indent=2).encode() + b"\n")


def _error(status: int, message: str) -> HttpResponse:
    return _json(status, {"error": message})


class FleetApp:
    """The routes above, over one repository directory."""

    def __init__(self, paths: FleetPaths) -> None:
        self.paths = paths
        self.public = paths.public.resolve()
        self.devices: dict[str, dict[str, Any]] = {}
        if paths.devices.is_file():
            try:
                self.devices = json.loads(paths.devices.read_text())
            except ValueError as exc:
                logger.warning("%s: unreadable (%s); starting an empty list", paths.devices, exc)

    async def handle(self, request: HttpRequest) -> HttpResponse:
        path = request.path
        if path.startswith(_STATIC_PREFIXES):
            if request.method not in ("GET", "HEAD"):
                return _error(405, f"{request.method} {path}: the repository is read-only")
            return self._static(path, head=request.method == "HEAD")
        if path.rstrip("/") == _DEVICES:
            if request.method != "GET":
                return _error(405, f"{request.method} {_DEVICES}: use GET")
            return _json(200, {"devices": self._listing()})
        if path.startswith(_DEVICES + "/"):
            if request.method != "POST":
                return _error(405, f"{request.method} {path}: devices POST their state here")
            return self._report(path[len(_DEVICES) + 1 :], request.body)
        return _error(404, f"{path}: not found (/metadata/, /targets/, {_DEVICES})")

    def _static(self, path: str, head: bool) -> HttpResponse:
        file = (self.public / path.lstrip("/")).resolve()
        if not file.is_relative_to(self.public) or not file.is_file():
            return _error(404, f"{path}: not in the repository")
        data = b"" if head else file.read_bytes()
        kind = b"application/json" if file.suffix == ".json" else b"application/octet-stream"
        return HttpResponse(200, data, content_type=kind)

    def _report(self, device_id: str, body: bytes) -> HttpResponse:
        if not _DEVICE_ID.match(device_id):
            return _error(
                400, f"device id {device_id[:64]!r}: expected letters, digits, '.', '_', '-'"
            )
        if len(body) > _MAX_REPORT_BYTES:
            return _error(413, f"report of {len(body)} bytes; at most {_MAX_REPORT_BYTES}")
        try:
            state = json.loads(body)
        except ValueError as exc:
            return _error(400, f"report body: not JSON ({exc})")
        if not isinstance(state, dict):
            return _error(400, "report body: expected a JSON object")
        state["device_id"] = device_id
        state["received"] = datetime.now(UTC).isoformat(timespec="seconds")
        state["received_unix_s"] = time.time()
        self.devices[device_id] = state
        try:
            write_atomic(self.paths.devices, json.dumps(self.devices, indent=2).encode())
        except OSError as exc:
            logger.warning("%s: not written (%s); the list is kept in memory", self.paths.devices,
                           exc)  # fmt: skip
        return _json(200, {"device_id": device_id})

    def _listing(self) -> list[dict[str, Any]]:
        now = time.time()
        return [
            {**state, "seen_s_ago": round(now - float(state.get("received_unix_s", now)), 1)}
            for _, state in sorted(self.devices.items())
        ]


async def serve_fleet(paths: FleetPaths, host: str, port: int) -> int:
    """Serve until SIGTERM or SIGINT; the exit code."""
    if not (paths.metadata / "root.json").is_file():
        logger.error("--repo %s: no fleet repository (slipstream fleet init --repo DIR)",
                     paths.repo)  # fmt: skip
        return 1
    stop = stop_on_signals(None)
    app = FleetApp(paths)
    server = HttpServer(
        app.handle, error_body=lambda m: json.dumps({"error": m}).encode(),
        limits=HttpLimits(max_body_bytes=_MAX_REPORT_BYTES * 2),
    )  # fmt: skip
    try:
        bound = await server.start(host, port)
    except OSError as exc:
        logger.error("cannot bind %s:%d: %s; choose another with --port", host, port, exc)
        return 1
    logger.info("fleet repository %s served on %s:%d", paths.public, host, bound)
    await stop.wait()
    await server.shutdown(5.0)
    return 0


def run_fleet_server(paths: FleetPaths, host: str, port: int) -> int:
    return asyncio.run(serve_fleet(paths, host, port))
