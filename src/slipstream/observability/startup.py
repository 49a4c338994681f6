"""Where a server's start-up time goes: the process start (interpreter and imports), the
front ends listening, each model's load and warm-up, and ready.

One trace a process (:data:`TRACE`): the serving core and the LLM lane note their first
load of each model, the runner marks the stages and logs the whole at ready
(``slipstream serve --trace-startup FILE`` also writes it as JSON).

    TRACE.mark("http_listening")
    TRACE.model_loaded("mlp/1", load_s=0.05, warmup_s=0.01)
    logger.info("%s", TRACE.summary())
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any


def _seconds_since_process_start() -> float:
    """How long this process has run (Linux: /proc; elsewhere 0, from this import)."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        started_ticks = int(fields[19])  # field 22, starttime, in clock ticks since boot
        uptime_s = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime_s - started_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


class StartupTrace:
    """Stages and model loads, in seconds since the process started."""

    def __init__(self) -> None:
        self._origin = time.perf_counter() - _seconds_since_process_start()
        self.stages: dict[str, float] = {}
        # "model/version" (generative: "model") -> its first load's load and warm-up.
        self.models: dict[str, dict[str, float]] = {}

    def now(self) -> float:
        return time.perf_counter() - self._origin

    def mark(self, stage: str) -> None:
        """The first time ``stage`` was reached."""
        self.stages.setdefault(stage, round(self.now(), 3))

    def model_loaded(self, model: str, load_s: float, warmup_s: float) -> None:
        self.models.setdefault(model, {"load_s": round(load_s, 3), "warmup_s": round(warmup_s, 3)})

    def as_json(self) -> dict[str, Any]:
        return {
            "stages_s": dict(self.stages),
            "models": dict(self.models),
            "frameworks": frameworks_imported(),
        }

    def summary(self) -> str:
        stages = ", ".join(f"{stage} {at:.2f} s" for stage, at in self.stages.items())
        models = ", ".join(
            f"{name} {times['load_s']:.2f} s" + (f" + warm-up {times['warmup_s']:.2f} s"
                                                 if times["warmup_s"] else "")
            for name, times in sorted(self.models.items(), key=lambda item: -item[1]["load_s"])
        )  # fmt: skip
        return (
            f"start-up (seconds since the process started): {stages}; loads: "
            f"{models or 'none'}; frameworks imported: {', '.join(frameworks_imported())}"
        )


# The heavy imports a start-up may pay for; a server imports only what its models use.
_FRAMEWORKS = ("onnxruntime", "openvino", "torch", "transformers", "tokenizers", "sklearn",
               "llama_cpp", "scipy", "redis")  # fmt: skip


def frameworks_imported() -> list[str]:
    """Which of the heavy frameworks this process has imported."""
    return [name for name in _FRAMEWORKS if name in sys.modules]


TRACE = StartupTrace()
