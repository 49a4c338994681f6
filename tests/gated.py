"""A test-only backend whose runs wait until the test opens a gate, and its server launcher.

Queue behaviour (timeouts, cancellation, priorities, backpressure, batching, draining on
shutdown) is about requests that wait behind a running batch. Tests must construct that
state rather than hope a model is slow enough on this machine, so the ``gated`` backend
holds every run while its gate is closed, and logs every run it starts:

    gate = Gate(tmp_path / "gate")
    build_gated(repo, "held", gate, {"max_batch_size": 1})
    with gated_server(repo, log_dir=tmp_path) as server:
        with gate.closed():
            send(tag=1)               # starts running and waits at the gate
            gate.wait_runs(1)         # ...which the test sees happen
            send(tag=2)               # queued behind it, for as long as the test likes
        # the gate opens: both finish; gate.runs() == [[1.0], [2.0]]

The model is an identity on INPUT0 FP32 [-1, width]: a request's tag is its first column,
so ``Gate.runs()`` tells which requests each batch held, in the order batches started
(the server's warm-up at load is a run too: take a baseline ``len(gate.runs())`` first).

The backend is registered only by this module's launcher (``python tests/gated.py serve
...``), never by the product: no user's server can load it.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from slipstream.runtime.base import Backend, ModelSignature, TensorSpec  # noqa: E402

# Longest a run waits at a closed gate: a test that forgets to open it fails, never hangs.
MAX_HOLD_S = 60.0
# Longest a test waits for the server to reach a state it constructed.
WAIT_S = 30.0
GATED_WIDTH = 4


class Gate:
    """The test's side of a gated model: open/close its runs and read which ran."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self._hold = directory / "hold"
        self._log = directory / "runs.jsonl"

    def close(self) -> None:
        """Runs that start from now on wait until :meth:`open`."""
        self._hold.touch()

    def open(self) -> None:
        self._hold.unlink(missing_ok=True)

    @contextlib.contextmanager
    def closed(self) -> Iterator[Gate]:
        """Closed for the block, open after it (also when the block fails)."""
        self.close()
        try:
            yield self
        finally:
            self.open()

    def runs(self) -> list[list[float]]:
        """The tags (first column) of the rows of every run started so far, in order."""
        if not self._log.exists():
            return []
        return [json.loads(line) for line in self._log.read_text().splitlines() if line]

    def wait_runs(self, count: int) -> list[list[float]]:
        """Wait until ``count`` runs have started; AssertionError after WAIT_S."""
        wait_until(lambda: len(self.runs()) >= count, f"{count} run(s) of the gated model")
        return self.runs()


def wait_until(condition: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> None:
    """Poll ``condition`` (every 5 ms) until true; AssertionError naming ``what``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.005)


def build_gated(
    repo: Path,
    name: str,
    gate: Gate,
    config: dict[str, Any] | None = None,
    width: int = GATED_WIDTH,
    version: int = 1,
) -> Path:
    """REPO/name/<version>/model.gate and a config.yaml with ``backend: gated``."""
    import yaml

    version_dir = repo / name / str(version)
    version_dir.mkdir(parents=True, exist_ok=True)
    path = version_dir / "model.gate"
    path.write_text(json.dumps({"gate": str(gate.directory), "width": width}))
    full = {"backend": "gated", "default_model_filename": "model.gate", **(config or {})}
    (repo / name / "config.yaml").write_text(yaml.safe_dump(full))
    return path


def gated_input(tag: float, rows: int = 1, width: int = GATED_WIDTH) -> np.ndarray:
    """[rows, width] FP32 whose first column is ``tag`` (one tag per request)."""
    x = np.zeros((rows, width), np.float32)
    x[:, 0] = tag
    x[:, 1:] = np.arange(1, width, dtype=np.float32)
    return x


def gated_command() -> list[str]:
    """argv prefix that runs the ``slipstream`` CLI with the gated backend registered."""
    return [sys.executable, str(Path(__file__).resolve())]


class GatedBackend(Backend):
    """Identity on INPUT0 that waits at its gate before returning; logs each run's tags."""

    name = "gated"

    def __init__(self, gate: Path, width: int) -> None:
        self._hold = gate / "hold"
        self._log = gate / "runs.jsonl"
        self._width = width

    @classmethod
    def load(cls, path: Path, parameters: dict[str, str], instance_count: int) -> Backend:
        spec = json.loads(path.read_text())
        return cls(Path(spec["gate"]), int(spec["width"]))

    def signature(self) -> ModelSignature:
        shape = (-1, self._width)
        return ModelSignature(
            inputs=(TensorSpec("INPUT0", "FP32", shape),),
            outputs=(TensorSpec("OUTPUT0", "FP32", shape),),
        )

    def run(self, inputs: dict[str, np.ndarray], output_names: Sequence[str]) -> dict[str, Any]:
        x = inputs["INPUT0"]
        # O_APPEND writes of one short line are atomic: the test never reads half a record.
        fd = os.open(self._log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        try:
            os.write(fd, (json.dumps(x[:, 0].tolist()) + "\n").encode())
        finally:
            os.close(fd)
        deadline = time.monotonic() + MAX_HOLD_S
        while self._hold.exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"gate {self._hold} stayed closed for {MAX_HOLD_S} s")
            time.sleep(0.002)
        return {"OUTPUT0": x.copy()}

    def close(self) -> None:
        pass


def main() -> None:
    from slipstream import runtime
    from slipstream.cli import main as cli_main

    runtime.register_backend("gated", "tests.gated", "GatedBackend")
    cli_main()


if __name__ == "__main__":
    main()
