"""Edge bundles made by hand for the fleet tests: tiny, and each version tells itself apart.

``write_bundle(out, "adder", 3)`` writes what ``slipstream export`` would for a model
whose OUTPUT0 is INPUT0 + 3 (FP32 [-1, 4]): config.yaml, 3/model.onnx, the sample rows and
outputs, manifest.json. ``wrong_samples``: the shipped outputs are off by one, so the
bundle is intact and signed but fails its own check.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from slipstream.edge.manifest import MANIFEST_NAME, Manifest, SampleFiles, file_entries
from tests.models import build_add_constant

SAMPLE_ROWS = np.arange(8, dtype=np.float32).reshape(2, 4)


def write_bundle(
    out: Path,
    name: str,
    version: int,
    wrong_samples: bool = False,
    config: dict[str, Any] | None = None,
) -> Path:
    """The bundle directory ``out`` (see the module docstring); its model adds ``version``.
    ``config``: more keys of its config.yaml."""
    out.mkdir(parents=True)
    with tempfile.TemporaryDirectory() as scratch:
        model = build_add_constant(Path(scratch), name, version, float(version))
        (out / str(version)).mkdir()
        shutil.copyfile(model, out / str(version) / "model.onnx")
    settings = {"backend": "onnxruntime", "max_batch_size": 8, **(config or {})}
    (out / "config.yaml").write_text(yaml.safe_dump(settings))
    expected = SAMPLE_ROWS + version + (1.0 if wrong_samples else 0.0)
    np.savez(out / "sample_inputs.npz", INPUT0=SAMPLE_ROWS)
    np.savez(out / "sample_outputs.npz", OUTPUT0=expected.astype(np.float32))
    manifest = Manifest(
        name=name,
        version=version,
        target="edge",
        backend="onnxruntime",
        created="2026-01-01T00:00:00+00:00",
        files=file_entries(out),
        samples=SampleFiles("sample_inputs.npz", "sample_outputs.npz", len(SAMPLE_ROWS)),
        gate={},
        minimum_runtime_versions={},
        size={},
    )
    (out / MANIFEST_NAME).write_text(manifest.to_json())
    return out
