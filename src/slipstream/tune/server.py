"""A trial's ``slipstream serve``: a subprocess on free loopback ports, pinned to the
hardware profile's cores, polled until ready, stopped with SIGTERM.

Example::

    with TrialServer(repo, cpus=[0], gpu=None, log_path=tmp / "server.log") as server:
        print(server.url, server.pid)
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

HOST = "127.0.0.1"
# Starts tried when another process takes the picked port first.
_BIND_ATTEMPTS = 3
_STOP_TIMEOUT_S = 15.0
# How much of a failed server's log a trial keeps.
LOG_TAIL_CHARS = 2000


class TrialServerError(Exception):
    """The server exited or never became ready; the message ends with its log tail."""

    def __init__(self, message: str, log_tail: str) -> None:
        super().__init__(message)
        self.log_tail = log_tail


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


class TrialServer:
    """``slipstream serve`` for one trial; see the module docstring."""

    def __init__(
        self,
        repository: Path,
        *,
        cpus: Sequence[int] | None,
        gpu: str | None,
        log_path: Path,
        startup_timeout_s: float = 120.0,
        extra_args: Sequence[str] = (),
    ) -> None:
        self._repository = repository
        self._cpus = list(cpus) if cpus is not None else None
        self._gpu = gpu
        self._log_path = log_path
        self._startup_timeout_s = startup_timeout_s
        self._extra_args = list(extra_args)
        self._proc: subprocess.Popen[bytes] | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def __enter__(self) -> TrialServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    def start(self) -> None:
        """Start and wait until ready; TrialServerError with the log tail otherwise."""
        for attempt in range(_BIND_ATTEMPTS):
            self._spawn()
            try:
                self._wait_ready()
                return
            except TrialServerError:
                self.stop()
                if "in use" not in self.log_tail().lower() or attempt == _BIND_ATTEMPTS - 1:
                    raise
            except BaseException:
                self.stop()
                raise

    def _spawn(self) -> None:
        self.port = free_port()
        argv = [
            sys.executable, "-c", "from slipstream.cli import main; main()", "serve",
            "--model-repository", str(self._repository),
            "--host", HOST, "--http-port", str(self.port), "--grpc-port", "0",
            "--log-level", "warning", *self._extra_args,
        ]  # fmt: skip
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env["CUDA_VISIBLE_DEVICES"] = self._gpu if self._gpu is not None else ""
        if self._cpus is not None:
            # taskset execs the server on these cores, so it and every thread it starts
            # (ONNX Runtime's pools size themselves from this affinity) run there. Not a
            # preexec_fn: that makes Popen fork rather than vfork, which runs OpenBLAS's
            # fork handler in this thread, and that deadlocks against another thread of
            # this process using BLAS at the moment (seen in the test suite).
            argv = ["taskset", "-c", ",".join(map(str, sorted(self._cpus))), *argv]
        self._log_path.parent.mkdir(parents=True, exist_ok=True)
        with self._log_path.open("wb") as log:
            self._proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )

    def _wait_ready(self) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + self._startup_timeout_s
        while True:
            code = self._proc.poll()
            if code is not None:
                raise TrialServerError(f"server exited with code {code}", self.log_tail())
            try:
                with urllib.request.urlopen(f"{self.url}/v2/health/ready", timeout=2) as reply:
                    if reply.status == 200:
                        return
            except urllib.error.HTTPError:
                # Up but not ready: a model that failed to load keeps it so (strict
                # readiness), so say why now instead of waiting for the timeout.
                failure = self._load_failure()
                if failure:
                    raise TrialServerError(
                        f"the model failed to load: {failure}", self.log_tail()
                    ) from None
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TrialServerError(
                    f"server not ready after {self._startup_timeout_s:.0f} s", self.log_tail()
                )
            time.sleep(0.1)

    def _load_failure(self) -> str:
        """The reason of the first model version the repository index lists as failed."""
        request = urllib.request.Request(f"{self.url}/v2/repository/index", data=b"{}")
        try:
            with urllib.request.urlopen(request, timeout=2) as reply:
                index = json.loads(reply.read())
        except (OSError, ValueError):
            return ""
        for entry in index if isinstance(index, list) else []:
            if isinstance(entry, dict) and entry.get("state") == "UNAVAILABLE":
                return str(entry.get("reason") or "unavailable")
        return ""

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL after a grace period; the exit code (None: never ran)."""
        proc, self._proc = self._proc, None
        if proc is None:
            return None
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        return proc.returncode

    def log_tail(self) -> str:
        try:
            data = self._log_path.read_bytes()
        except OSError:
            return ""
        return data[-LOG_TAIL_CHARS:].decode("utf-8", "replace")
