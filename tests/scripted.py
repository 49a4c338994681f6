"""A test-only backend with a scripted delay and failures, and its server launcher.

Rollout tests need candidates that are slower or fail on some requests, on purpose and
the same on every machine: the ``scripted`` backend is OUTPUT0 = INPUT0 + ``offset`` on
FP32 [-1, 4], sleeps ``delay_s`` per run, and (``fail_marked``) raises when a row's first
value is negative, so a test fails exactly the requests it marks.

    build_scripted(repo, "canary", 1, delay_s=0.002)
    build_scripted(repo, "canary", 2, delay_s=0.002, fail_marked=True)
    RemoteServer(repo, args, log_dir=tmp_path, command=scripted_command())

Registered only by this module's launcher (``python tests/scripted.py serve ...``).
"""

from __future__ import annotations

import json
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

WIDTH = 4


def build_scripted(
    repo: Path,
    name: str,
    version: int,
    delay_s: float = 0.0,
    fail_marked: bool = False,
    offset: float = 0.0,
) -> Path:
    """REPO/name/<version>/model.script (the model's config.yaml is the test's)."""
    path = repo / name / str(version) / "model.script"
    path.parent.mkdir(parents=True, exist_ok=True)
    spec = {"delay_s": delay_s, "fail_marked": fail_marked, "offset": offset}
    path.write_text(json.dumps(spec))
    return path


def scripted_config(**extra: Any) -> dict[str, Any]:
    """The config.yaml every scripted model needs, plus ``extra``."""
    return {"backend": "scripted", "default_model_filename": "model.script",
            "max_batch_size": 8, "version_policy": {"all": {}}, **extra}  # fmt: skip


def scripted_command() -> list[str]:
    """argv prefix that runs the ``slipstream`` CLI with the scripted backend registered."""
    return [sys.executable, str(Path(__file__).resolve())]


class ScriptedBackend(Backend):
    name = "scripted"

    def __init__(self, delay_s: float, fail_marked: bool, offset: float) -> None:
        self._delay_s = delay_s
        self._fail_marked = fail_marked
        self._offset = np.float32(offset)

    @classmethod
    def load(cls, path: Path, parameters: dict[str, str], instance_count: int) -> Backend:
        spec = json.loads(path.read_text())
        return cls(float(spec["delay_s"]), bool(spec["fail_marked"]), float(spec["offset"]))

    def signature(self) -> ModelSignature:
        shape = (-1, WIDTH)
        return ModelSignature(
            inputs=(TensorSpec("INPUT0", "FP32", shape),),
            outputs=(TensorSpec("OUTPUT0", "FP32", shape),),
        )

    def run(self, inputs: dict[str, np.ndarray], output_names: Sequence[str]) -> dict[str, Any]:
        x = inputs["INPUT0"]
        if self._delay_s:
            time.sleep(self._delay_s)
        if self._fail_marked and bool((x[:, 0] < 0).any()):
            raise RuntimeError("scripted failure on a marked row")
        return {"OUTPUT0": x + self._offset}

    def close(self) -> None:
        pass


def main() -> None:
    from slipstream import runtime
    from slipstream.cli import main as cli_main

    runtime.register_backend("scripted", "tests.scripted", "ScriptedBackend")
    cli_main()


if __name__ == "__main__":
    main()
