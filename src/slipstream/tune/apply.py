"""``--apply``: the winning configuration as a new version of the model.

The winner's model file becomes ``MODEL_DIR/<next>/``, and its settings (batch size,
queue delay, instances, threads) go into ``MODEL_DIR/config.yaml`` (the previous one is
kept as ``config.yaml.before-tune``; a ``config.yml`` is rewritten in place). A server
polling the repository (``--model-control-mode poll``) loads the new version; one in
explicit mode loads it on ``POST /v2/repository/models/<name>/load``. The hardware
profile cannot be written into a config: ``tuned.json`` in the version directory says
which cores it ran on.
"""

from __future__ import annotations

import json
import secrets
import shutil
from pathlib import Path
from typing import Any

import yaml

from slipstream.repository.layout import CONFIG_FILENAMES, read_model_directory
from slipstream.runtime import model_files
from slipstream.tune.results import TuneResult
from slipstream.tune.trials import model_config

TUNED_RECORD = "tuned.json"


def apply_winner(result: TuneResult, model_dir: Path, base_config: dict[str, Any]) -> int:
    """Write the winner as the next version; its number. ValueError without a winner."""
    if result.winner is None:
        raise ValueError("no configuration met the SLO: nothing to apply")
    record = result.record(result.winner)
    variant = next(v for v in result.variants if v["name"] == record.config["variant"])
    profile = next(p for p in result.profiles if p["name"] == record.config["profile"])
    source = Path(variant["model_file"])
    version = max(read_model_directory(model_dir).versions, default=0) + 1
    config = model_config(
        base_config,
        {**record.config, "gpu": profile.get("gpu"), "backend": variant.get("backend", "")},
    )
    config_path = next(
        (model_dir / n for n in CONFIG_FILENAMES if (model_dir / n).is_file()),
        model_dir / CONFIG_FILENAMES[0],
    )
    if config_path.exists():
        shutil.copy2(config_path, config_path.with_name(config_path.name + ".before-tune"))
    # mkdir, not tempfile.mkdtemp: the rename keeps the mode, and mkdtemp's 0o700 would
    # lock out a server running as another user.
    staging = model_dir / f".{version}-{secrets.token_hex(8)}"
    staging.mkdir()
    try:
        for path in model_files(source):
            shutil.copyfile(path, staging / path.name)
        tuned = {
            "trial": record.trial,
            "config": record.config,
            "cpus": profile.get("cpus"),
            "price_per_hour": record.price_per_hour,
            "throughput_infer_per_s": record.throughput,
            "cost_per_1m_infer": record.cost_per_1m_infer,
            "slo": result.slo,
            "from_version": variant["version"],
        }
        (staging / TUNED_RECORD).write_text(json.dumps(tuned, indent=2, default=str) + "\n")
        header = (
            f"# Written by slipstream tune (trial {record.trial}); see {version}/{TUNED_RECORD}.\n"
        )
        # The config first, then the version appears whole: a polling server never sees
        # the new version with the settings it was not measured with.
        _write_atomic(config_path, header + yaml.safe_dump(config, sort_keys=False))
        staging.rename(model_dir / str(version))
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return version


def _write_atomic(path: Path, text: str) -> None:
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(text)
    temporary.replace(path)
