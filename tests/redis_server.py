"""A real ``redis-server`` for the tests, on a free loopback port in a temp directory.

    with RedisServer(tmp_path) as redis:
        url = redis.url                 # redis://127.0.0.1:<port>
        redis.kill(); redis.start()     # an outage, then the same server back

``make install`` installs the Debian package when ``redis-server`` is missing; the
tests never stand in a mock for it.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path
from types import TracebackType

from tests.utils import HOST, free_ports


class RedisServer:
    """``redis-server`` without persistence, for the duration of a ``with`` block."""

    def __init__(self, directory: Path) -> None:
        binary = shutil.which("redis-server")
        assert binary, "redis-server is not installed: run `make install` (it installs it)"
        self._binary = binary
        self._dir = directory
        self._dir.mkdir(parents=True, exist_ok=True)
        self.port = free_ports(1)[0]
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}"

    def start(self, timeout_s: float = 10.0) -> None:
        """Start (or start again, on the same port) and wait until it accepts connections."""
        log = (self._dir / "redis.log").open("ab")
        self.proc = subprocess.Popen(
            [self._binary, "--port", str(self.port), "--bind", HOST, "--dir", str(self._dir),
             "--save", "", "--appendonly", "no", "--protected-mode", "no"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, "redis-server exited:\n" + self.log_text()
            try:
                with socket.create_connection((HOST, self.port), timeout=1) as sock:
                    sock.sendall(b"PING\r\n")
                    if sock.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            time.sleep(0.05)
        raise AssertionError("redis-server did not start:\n" + self.log_text())

    def kill(self) -> None:
        """SIGKILL: an outage, as a crashed Redis looks to its clients."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def log_text(self) -> str:
        path = self._dir / "redis.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.kill()
