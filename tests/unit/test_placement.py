"""Which engine serves which model under ``--engines per-device`` (repository/placement.py):
devices read from configs as users write them, cascades kept with their stages, models
on a device without an engine served by the first, and the front end's routing table
following the repository as it changes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from slipstream.config import ModelConfig, parse_model_config
from slipstream.repository.layout import list_models
from slipstream.repository.placement import (
    CPU,
    Routing,
    Share,
    device_of,
    engine_devices,
    placements,
)
from tests.models import write_config


def _config(data: dict[str, Any]) -> ModelConfig:
    return parse_model_config(data, "test")


@pytest.mark.parametrize(
    ("config", "device"),
    [
        ({}, CPU),  # ONNX, no parameters
        ({"backend": "torch", "parameters": {"device": "cpu"}}, CPU),
        ({"backend": "torch", "parameters": {"device": "cuda"}}, "cuda:0"),
        ({"backend": "torch", "parameters": {"device": "cuda:3"}}, "cuda:3"),
        ({"backend": "torch", "parameters": {"device": " CUDA:1 "}}, "cuda:1"),
        ({"backend": "torch", "parameters": {"device": "cuda:01"}}, "cuda:1"),
        # A value the backend refuses when it loads: the CPU engine reports it.
        ({"backend": "torch", "parameters": {"device": "tpu"}}, CPU),
        ({"backend": "transformers", "generation": {"device": "cuda:2"}}, "cuda:2"),
        ({"backend": "transformers", "generation": {"device": "cpu"}}, CPU),
        # A generative model's device is its generation's, not parameters'.
        ({"backend": "transformers", "parameters": {"device": "cuda"}}, CPU),
    ],
)
def test_a_models_device_is_read_from_its_config(config: dict[str, Any], device: str) -> None:
    assert device_of(_config(config)) == device


def _torch(repo: Path, name: str, device: str) -> None:
    write_config(repo, name, {"backend": "torch", "parameters": {"device": device}})


def _cascade(repo: Path, name: str, *stages: str, remote: str = "") -> None:
    listed: list[dict[str, Any]] = [
        {"model": stage, "confidence": {"output": "p", "threshold": 0.5}} for stage in stages
    ]
    if remote:
        listed.append({"model": remote, "url": "http://127.0.0.1:9"})
    else:
        listed[-1].pop("confidence")
    write_config(repo, name, {"cascade": {"stages": listed}})


def test_a_cascade_and_its_stages_share_the_first_gpu_any_of_them_uses(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    write_config(repo, "small", {})  # CPU
    _torch(repo, "large", "cuda:1")
    _torch(repo, "other", "cuda:0")
    _cascade(repo, "triage", "small", "large")
    # Two cascades sharing a stage form one group: "small" cannot be in two engines.
    _cascade(repo, "second", "small", "other")
    write_config(repo, "alone", {})
    _cascade(repo, "cpu_only", "alone", "tiny")
    write_config(repo, "tiny", {})
    # A remote stage is not this server's model: it pulls nothing.
    _torch(repo, "far", "cuda:2")
    _cascade(repo, "edge", "plain", remote="far")
    write_config(repo, "plain", {})
    placed = placements(list_models(repo))
    assert placed == {
        "small": "cuda:0", "large": "cuda:0", "other": "cuda:0", "triage": "cuda:0",
        "second": "cuda:0", "alone": CPU, "cpu_only": CPU, "tiny": CPU,
        "far": "cuda:2", "edge": CPU, "plain": CPU,
    }  # fmt: skip
    assert engine_devices(list_models(repo)) == [CPU, "cuda:0", "cuda:2"]


def test_engines_are_the_cpu_then_gpus_by_index_and_a_broken_config_runs_on_the_cpu(
    tmp_path: Path,
) -> None:
    repo = tmp_path / "repo"
    for index in (10, 2, 0):
        _torch(repo, f"m{index}", f"cuda:{index}")
    write_config(repo, "broken", "backend: [not, a, name\n")
    models = list_models(repo)
    assert placements(models)["broken"] == CPU
    assert engine_devices(models) == [CPU, "cuda:0", "cuda:2", "cuda:10"]
    # No model at all: one engine, on the CPU.
    (tmp_path / "empty").mkdir()
    assert engine_devices(list_models(tmp_path / "empty")) == [CPU]


def test_each_engine_lists_its_share_and_the_first_takes_devices_without_an_engine(
    tmp_path: Path,
) -> None:
    repo = tmp_path / "repo"
    write_config(repo, "cpu_model", {})
    _torch(repo, "gpu0", "cuda:0")
    _torch(repo, "gpu1", "cuda:1")  # added after the engines started: no engine of its own
    devices = (CPU, "cuda:0")
    first, second = (Share(device, devices) for device in devices)
    assert sorted(list_models(repo, first)) == ["cpu_model", "gpu1"]
    assert sorted(list_models(repo, second)) == ["gpu0"]
    assert sorted(list_models(repo)) == ["cpu_model", "gpu0", "gpu1"]
    # GPUs only: the first engine is cuda:0's.
    gpu_first = Share("cuda:0", ("cuda:0", "cuda:1"))
    assert sorted(list_models(repo, gpu_first)) == ["cpu_model", "gpu0"]


def test_the_routing_table_follows_the_repository(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    write_config(repo, "a", {})
    _torch(repo, "b", "cuda:0")
    routing = Routing(repo, [CPU, "cuda:0"])
    assert (routing.engine_of("a"), routing.engine_of("b")) == (0, 1)
    # A name nobody serves goes to the first engine, which answers that it is not there.
    assert routing.engine_of("nowhere") == 0
    # Moved and added: seen once the table is read again, not before (no I/O per request).
    _torch(repo, "a", "cuda:0")
    write_config(repo, "c", {})
    assert (routing.engine_of("a"), routing.engine_of("c")) == (0, 0)
    routing.refresh()
    assert (routing.engine_of("a"), routing.engine_of("c")) == (1, 0)
    # Configs are parsed again only when their file changed; a rewrite of the same size
    # at once is still seen.
    for index in (1, 2):
        write_config(repo, "a", f"backend: torch\nparameters: {{device: cuda:{index}}}\n")
        assert placements(list_models(repo))["a"] == f"cuda:{index}"
    # The repository gone: every name goes to the first engine.
    for path in sorted(repo.rglob("*"), reverse=True):
        path.unlink() if path.is_file() else path.rmdir()
    repo.rmdir()
    routing.refresh()
    assert routing.engine_of("a") == 0
