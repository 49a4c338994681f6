"""Start the servers under test pinned to a core, wait until they serve, stop them.

Every server runs in its own process group so that stopping it also ends whatever it
spawned (PyTriton starts `tritonserver`, which starts a Python backend stub). Peer
servers run from cached venvs under `.bench-venvs/`, created on first use with the
interpreter that built the project venv, so their pins never touch Slipstream's deps.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from models import REPO_ROOT, RequestBody

VENVS_DIR = REPO_ROOT / ".bench-venvs"

# Peer venvs: name -> pip requirements. Changing a list rebuilds that venv.
PEER_REQUIREMENTS: dict[str, list[str]] = {
    "fastapi": ["fastapi", "uvicorn[standard]", "onnxruntime", "orjson", "numpy"],
    # PyTriton pins numpy<2; its wheel bundles tritonserver and the Python backend.
    "pytriton": ["nvidia-pytriton", "onnxruntime", "numpy<2"],
    # llama.cpp's Python server; the same release as the `llama` extra's lock pin, built
    # from source with the CMAKE_ARGS of the caller (pip's wheel cache reuses the build).
    "llama_cpp_server": ["llama-cpp-python[server]==0.3.36"],
    # The vLLM project's load generator, to cross-check `slipstream bench`'s OpenAI mode.
    # It requires torch: pinned to the CPU wheel the project's lock pins, so pip never
    # pulls another build.
    "guidellm": ["torch==2.13.0", "guidellm==0.8.1"],
}


@dataclass(frozen=True)
class ServerSpec:
    """How to launch one server and how to know it is ready."""

    label: str  # name in the results table, e.g. "slipstream"
    argv: list[str]  # command line, without the taskset prefix
    port: int  # HTTP port it listens on (127.0.0.1)
    ready_path: str  # GET path answering 200 once the model is loaded
    startup_timeout_s: float = 120.0  # PyTriton's first start unpacks tritonserver
    env: dict[str, str] = field(default_factory=dict)  # extra environment variables

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def base_python() -> str:
    """The interpreter the project venv was made from (not the venv's own python)."""
    for name in ("python3", f"python{sys.version_info.major}.{sys.version_info.minor}"):
        candidate = Path(sys.base_prefix) / "bin" / name
        if candidate.exists():
            return str(candidate)
    return "python3"


def ensure_venv(name: str, python: str | None = None) -> Path | None:
    """Return the python of venv `.bench-venvs/NAME`, creating it once; None on failure."""
    requirements = PEER_REQUIREMENTS[name]
    venv = VENVS_DIR / name
    marker = venv / ".bench-requirements"
    venv_python = venv / "bin" / "python"
    wanted = "\n".join(requirements)
    if venv_python.exists() and marker.exists() and marker.read_text() == wanted:
        return venv_python
    print(f"creating venv {venv} ({', '.join(requirements)}); this happens once", flush=True)
    steps = [
        [python or base_python(), "-m", "venv", str(venv)],
        [str(venv_python), "-m", "pip", "install", "-q", "--upgrade", *requirements],
    ]
    # A venv of its own: never satisfied by packages on our PYTHONPATH.
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    for step in steps:
        done = subprocess.run(step, capture_output=True, text=True, check=False, env=env)
        if done.returncode != 0:
            print(f"  venv {name}: `{' '.join(step)}` failed:\n{done.stderr[-1500:]}")
            return None
    marker.write_text(wanted)
    return venv_python


def _get_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def post(url: str, body: RequestBody) -> tuple[int, bytes]:
    """POST one request body; (status, response body). Status 0 means no HTTP answer."""
    headers = {"Content-Type": body.content_type}
    if body.header_length is not None:
        headers["Inference-Header-Content-Length"] = str(body.header_length)
    request = urllib.request.Request(url, data=body.body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return int(response.status), response.read()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read()
    except (urllib.error.URLError, OSError) as exc:
        return 0, str(exc).encode()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _stop(process: subprocess.Popen[bytes], grace_s: float = 15.0) -> None:
    """SIGTERM the server's process group; SIGKILL whatever is left of it after `grace_s`.

    Waits for the whole group, not just the leader: PyTriton's own process exits before
    the tritonserver it started, which would otherwise still hold the core while the
    next server is measured.
    """
    pgid = process.pid  # start_new_session made the server its group's leader
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        process.poll()  # reap the leader so it stops counting as a member
        if not _group_alive(pgid):
            return
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    process.wait(timeout=5)


def _log_tail(log_path: Path, chars: int = 1500) -> str:
    text = log_path.read_text(errors="replace") if log_path.exists() else ""
    return text[-chars:]


@contextlib.contextmanager
def running(spec: ServerSpec, core: int | None, log_path: Path) -> Iterator[ServerSpec]:
    """Run `spec` (pinned to `core`, output to `log_path`) for the duration of the block.

    Raises RuntimeError, with the tail of the server's log, if it exits or is not ready
    within its startup timeout.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    argv = (["taskset", "-c", str(core)] if core is not None else []) + spec.argv
    env = {**os.environ, **spec.env}
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        deadline = time.monotonic() + spec.startup_timeout_s
        while not _get_ok(spec.url(spec.ready_path)):
            if process.poll() is not None:
                raise RuntimeError(
                    f"{spec.label} exited with {process.returncode}:\n{_log_tail(log_path)}"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{spec.label} not ready after {spec.startup_timeout_s:.0f} s:\n"
                    f"{_log_tail(log_path)}"
                )
            time.sleep(0.25)
        yield spec
    finally:
        _stop(process)
