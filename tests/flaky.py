"""A test-only backend that fails on purpose, and its launcher (``python tests/flaky.py
serve|worker ...``), for the asynchronous job tests.

The ``flaky`` model is an identity on INPUT0 FP32 [-1, 4] whose first column is a
request's tag. A run holding a row with a negative tag raises (an internal fault, not
the request's: the job is retried, then dead-lettered); every run waits ``delay_ms``
(work a worker can be killed in the middle of) and logs its tags, so a test can tell
which rows ran more than once:

    build_flaky(repo, runs, delay_ms=20, config={"max_batch_size": 8})
    RemoteServer(repo, [...], command=flaky_command())         # slipstream serve
    subprocess.Popen([*flaky_command(), "worker", ...])        # slipstream worker

Registered only by this module's launcher, never by the product.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from slipstream.runtime.base import Backend, ModelSignature, TensorSpec  # noqa: E402

FLAKY_WIDTH = 4


def build_flaky(
    repo: Path, runs: Path, delay_ms: float = 0.0, config: dict[str, Any] | None = None,
    name: str = "flaky",
) -> Path:  # fmt: skip
    """REPO/name/1/model.flaky and a config.yaml with ``backend: flaky``."""
    import yaml

    version_dir = repo / name / "1"
    version_dir.mkdir(parents=True, exist_ok=True)
    path = version_dir / "model.flaky"
    path.write_text(json.dumps({"runs": str(runs), "delay_ms": delay_ms}))
    full = {"backend": "flaky", "default_model_filename": "model.flaky", **(config or {})}
    (repo / name / "config.yaml").write_text(yaml.safe_dump(full))
    return path


def flaky_input(tag: float) -> np.ndarray:
    """[1, 4] FP32 whose first column is ``tag`` (negative: the run fails)."""
    return np.array([[tag, 1.0, 2.0, 3.0]], np.float32)


def flaky_command() -> list[str]:
    """argv prefix that runs the ``slipstream`` CLI with the flaky backend registered."""
    return [sys.executable, str(Path(__file__).resolve())]


def logged_runs(runs: Path) -> list[float]:
    """Every tag run so far (a tag twice: its row ran twice)."""
    if not runs.exists():
        return []
    return [tag for line in runs.read_text().splitlines() if line for tag in json.loads(line)]


class FlakyBackend(Backend):
    name = "flaky"

    def __init__(self, runs: Path, delay_ms: float) -> None:
        self._runs = runs
        self._delay_s = delay_ms / 1e3

    @classmethod
    def load(cls, path: Path, parameters: dict[str, str], instance_count: int) -> Backend:
        spec = json.loads(path.read_text())
        return cls(Path(spec["runs"]), float(spec["delay_ms"]))

    def signature(self) -> ModelSignature:
        shape = (-1, FLAKY_WIDTH)
        return ModelSignature(
            inputs=(TensorSpec("INPUT0", "FP32", shape),),
            outputs=(TensorSpec("OUTPUT0", "FP32", shape),),
        )

    def run(self, inputs: dict[str, np.ndarray], output_names: Sequence[str]) -> dict[str, Any]:
        x = inputs["INPUT0"]
        if self._delay_s:
            time.sleep(self._delay_s)
        if (x[:, 0] < 0).any():
            raise RuntimeError("a negative tag: failing on purpose")
        # Logged after the work: a run logged is a run whose outputs came back.
        fd = os.open(self._runs, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        try:
            os.write(fd, (json.dumps(x[:, 0].tolist()) + "\n").encode())
        finally:
            os.close(fd)
        return {"OUTPUT0": x.copy()}

    def close(self) -> None:
        pass


def main() -> None:
    from slipstream import runtime
    from slipstream.cli import main as cli_main

    runtime.register_backend("flaky", "tests.flaky", "FlakyBackend")
    cli_main()


if __name__ == "__main__":
    main()
