"""Helpers shared by the integration and e2e tiers: a real server in a subprocess.

    with RemoteServer(repo, ["--max-request-bytes", "1048576"], log_dir=tmp_path) as server:
        server.http.get("/v2/health/ready")
        tritonclient.http.InferenceServerClient(server.http_address)
        tritonclient.grpc.InferenceServerClient(server.grpc_address)

The server runs the ``slipstream`` command as a user would, on free loopback ports,
with its output in a log file that is printed when it fails to start or to stop.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

import httpx

HOST = "127.0.0.1"
# How much of the server log to show in a failure message.
_LOG_TAIL_CHARS = 6000
# Starts tried when the server finds a port taken (see RemoteServer.start).
_BIND_ATTEMPTS = 3


def slipstream_command() -> list[str]:
    """The ``slipstream`` console script of this interpreter's environment."""
    script = Path(sys.executable).parent / "slipstream"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-c", "from slipstream.cli import main; main()"]


def free_ports(count: int) -> list[int]:
    """``count`` distinct loopback ports that were free a moment ago."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind((HOST, 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


class ServerError(AssertionError):
    """The server did not start, or did not stop as expected; the message holds its log."""


class RemoteServer:
    """``slipstream serve`` in a subprocess, for the duration of a ``with`` block.

    On entry it starts the server and waits (at most ``startup_timeout_s``) until
    ``GET /v2/health/<wait_for>`` answers 200 (``wait_for=None``: no wait). On exit it
    sends SIGTERM and, when the block itself raised nothing, asserts the process exited
    with ``expected_exit_code``.
    """

    def __init__(
        self,
        repository: Path | str,  # a str for a URL (s3://...), which Path would mangle
        args: Sequence[str] = (),
        *,
        log_dir: Path,
        wait_for: Literal["ready", "live"] | None = "ready",
        startup_timeout_s: float = 90.0,
        shutdown_timeout_s: float = 60.0,
        expected_exit_code: int = 0,
        env: dict[str, str] | None = None,
        command: Sequence[str] | None = None,
    ) -> None:
        self.repository = repository
        # argv prefix that runs the CLI; the slipstream console script by default.
        self._command = list(command) if command else slipstream_command()
        self._args = list(args)
        self._log_dir = log_dir
        self._pick_ports()
        self._wait_for = wait_for
        self._startup_timeout_s = startup_timeout_s
        self._shutdown_timeout_s = shutdown_timeout_s
        self._expected_exit_code = expected_exit_code
        self._env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None
        self._http: httpx.Client | None = None
        self._sdks: list[Any] = []

    def _pick_ports(self) -> None:
        self.http_port, self.grpc_port = free_ports(2)
        self.argv = [
            *self._command,
            "serve",
            "--model-repository", str(self.repository),
            "--host", HOST,
            "--http-port", str(self.http_port),
            "--grpc-port", str(self.grpc_port),
            *self._args,
        ]  # fmt: skip
        self.log_path = self._log_dir / f"slipstream-{self.http_port}.log"

    # -- addresses -----------------------------------------------------------------------

    @property
    def http_url(self) -> str:
        """Base URL of the HTTP front end, e.g. ``http://127.0.0.1:8000``."""
        return f"http://{HOST}:{self.http_port}"

    @property
    def http_address(self) -> str:
        """``host:port`` of the HTTP front end, as tritonclient.http takes it."""
        return f"{HOST}:{self.http_port}"

    @property
    def grpc_address(self) -> str:
        """``host:port`` of the gRPC front end, as tritonclient.grpc takes it."""
        return f"{HOST}:{self.grpc_port}"

    grpc_url = grpc_address

    def url(self, path: str) -> str:
        """Absolute URL of an HTTP path, e.g. ``url("/v2/models/m/infer")``."""
        return self.http_url + path

    @property
    def http(self) -> httpx.Client:
        """An httpx client of the HTTP front end (``http.get("/metrics")``), made on first
        use and closed with the server; it can be shared between threads. A call of
        ``httpx.get()`` makes a client of its own, ~30 ms of loading CA certificates here."""
        if self._http is None:
            self._http = httpx.Client(base_url=self.http_url, timeout=60)
        return self._http

    def openai(self, api_key: str = "unused") -> Any:
        """An ``openai.OpenAI`` client of the ``/v1`` routes (no retries), closed with the
        server: a client left open leaks its pooled sockets, which the collector then
        reports as a ResourceWarning against whichever test runs next."""
        import openai

        sdk = openai.OpenAI(base_url=self.url("/v1"), api_key=api_key, max_retries=0)
        self._sdks.append(sdk)
        return sdk

    # -- lifecycle -----------------------------------------------------------------------

    def __enter__(self) -> RemoteServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        code = self.stop()
        if exc_type is None and code != self._expected_exit_code:
            raise ServerError(
                f"server exited with {code}, expected {self._expected_exit_code}\n"
                + self.log_tail()
            )

    def start(self) -> None:
        # The ports were free when picked, but a process started meanwhile (other test
        # sessions share this machine) may take one first: pick again and retry.
        for attempt in range(_BIND_ATTEMPTS):
            self._spawn()
            if self._wait_for is None:
                return
            try:
                self.wait_until(self._wait_for, self._startup_timeout_s)
                return
            except ServerError:
                self.kill()
                lost_port = "in use" in self.log_text().lower()
                if not lost_port or attempt == _BIND_ATTEMPTS - 1:
                    raise
                self._pick_ports()
            except BaseException:
                self.kill()
                raise

    def _spawn(self) -> None:
        with self.log_path.open("wb") as log:
            # A session of its own: a Ctrl-C meant for pytest does not reach the server,
            # and kill() can always end the whole group.
            self.proc = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self._env,
                start_new_session=True,
            )

    def wait_until(self, state: Literal["ready", "live"], timeout_s: float) -> None:
        """Poll ``/v2/health/<state>`` until it answers 200; ServerError after timeout_s."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        # Plain HTTP: no TLS context to build (loading CA certificates, ~30 ms here).
        with httpx.Client(timeout=2.0, verify=False) as client:
            while True:
                code = self.proc.poll()
                if code is not None:
                    raise ServerError(
                        f"server exited with {code} while starting\n" + self.log_tail()
                    )
                try:
                    if client.get(self.url(f"/v2/health/{state}")).status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise ServerError(
                        f"server not {state} after {timeout_s:.0f} s\n" + self.log_tail()
                    )
                # Servers start in ~0.5 s here: a poll every 0.1 s waited ~0.05 s too long
                # a start; a refused connection or a 503 costs the server next to nothing.
                time.sleep(0.025)

    def terminate(self) -> None:
        """Send SIGTERM (graceful shutdown) without waiting."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout_s: float | None = None) -> int:
        """Wait for the process to exit; ServerError (after killing it) on timeout."""
        assert self.proc is not None
        timeout_s = self._shutdown_timeout_s if timeout_s is None else timeout_s
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise ServerError(
                f"server still running {timeout_s:.0f} s after SIGTERM\n" + self.log_tail()
            ) from None

    def stop(self) -> int:
        """SIGTERM, wait for the exit, return the exit code."""
        if self._http is not None:
            self._http.close()
            self._http = None
        while self._sdks:
            self._sdks.pop().close()
        if self.proc is None:
            return 0
        self.terminate()
        return self.wait()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def engine_pids(self) -> list[int]:
        """The engine processes the supervisor of a split layout has started so far,
        oldest first (from its log)."""
        return [int(pid) for pid in re.findall(r"engine started \(pid (\d+)\)", self.log_text())]

    def log_tail(self) -> str:
        text = self.log_text()
        return f"--- server log {self.log_path} (tail) ---\n{text[-_LOG_TAIL_CHARS:]}"


def posts_during(
    url: str, body: dict[str, Any], action: Callable[[], None], threads: int = 4
) -> tuple[Counter[object], set[str | None]]:
    """POST ``body`` to ``url`` over and over from ``threads`` threads while ``action``
    runs (load for 0.5 s before it and 0.5 s after): how many times each outcome came (a
    status code, or an httpx error's class name), and the Retry-After of the 503s.
    Fails when a request is still unanswered 30 s after the load stopped."""
    outcomes: Counter[object] = Counter()
    retry_after: set[str | None] = set()
    stop = threading.Event()

    def load() -> None:
        with httpx.Client(timeout=10) as http:
            while not stop.is_set():
                try:
                    answer = http.post(url, json=body)
                except httpx.HTTPError as exc:
                    outcomes[type(exc).__name__] += 1
                    continue
                outcomes[answer.status_code] += 1
                if answer.status_code == 503:
                    retry_after.add(answer.headers.get("retry-after"))

    workers = [threading.Thread(target=load) for _ in range(threads)]
    for worker in workers:
        worker.start()
    try:
        time.sleep(0.5)
        action()
        time.sleep(0.5)
    finally:
        stop.set()
        for worker in workers:
            worker.join(timeout=30)
    assert not any(worker.is_alive() for worker in workers), "a request hung"
    return outcomes, retry_after
