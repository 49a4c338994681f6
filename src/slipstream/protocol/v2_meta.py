"""V2 REST bodies other than inference: metadata, model config, statistics, repository.

Shapes follow the Open Inference Protocol and Triton's extensions so that tritonclient
and perf_analyzer read them unchanged.
"""

from __future__ import annotations

from typing import Any

from slipstream.config import EnsembleConfig, ModelConfig, TensorConfig, WarmupSample
from slipstream.config.sequence import SequenceBatching
from slipstream.datatypes import to_config_datatype
from slipstream.observability.stats import ModelStats, ResponseStats, StatDuration
from slipstream.types import ModelMetadata, RepositoryEntry, ServerMetadata, TensorMetadata


def server_metadata_json(meta: ServerMetadata) -> dict[str, Any]:
    return {"name": meta.name, "version": meta.version, "extensions": meta.extensions}


def _tensor_json(tensor: TensorMetadata) -> dict[str, Any]:
    return {"name": tensor.name, "datatype": tensor.datatype, "shape": tensor.shape}


def model_metadata_json(meta: ModelMetadata) -> dict[str, Any]:
    return {
        "name": meta.name,
        "versions": meta.versions,
        "platform": meta.platform,
        "inputs": [_tensor_json(t) for t in meta.inputs],
        "outputs": [_tensor_json(t) for t in meta.outputs],
    }


def _config_tensor_json(tensor: TensorConfig) -> dict[str, Any]:
    out: dict[str, Any] = {
        "name": tensor.name,
        "data_type": to_config_datatype(tensor.data_type),
        "dims": tensor.dims,
    }
    if tensor.optional:
        out["optional"] = True
    if tensor.reshape is not None:
        out["reshape"] = {"shape": tensor.reshape}
    if tensor.label_filename:
        out["label_filename"] = tensor.label_filename
    return out


def model_config_json(config: ModelConfig) -> dict[str, Any]:
    """The completed config in Triton's JSON form (TYPE_* datatypes, queue policy nested)."""
    batching = config.dynamic_batching
    policy = config.version_policy
    if policy.all is not None:
        version_policy: dict[str, Any] = {"all": {}}
    elif policy.specific is not None:
        version_policy = {"specific": {"versions": policy.specific["versions"]}}
    else:
        version_policy = {"latest": {"num_versions": (policy.latest or {}).get("num_versions", 1)}}
    out = {
        "name": config.name,
        "platform": config.platform,
        "backend": config.backend,
        "max_batch_size": config.max_batch_size or 0,
        "input": [_config_tensor_json(t) for t in config.input],
        "output": [_config_tensor_json(t) for t in config.output],
        "version_policy": version_policy,
        "instance_group": [
            {"name": g.name or f"{config.name}_{i}", "kind": g.kind, "count": g.count}
            for i, g in enumerate(config.instance_group)
        ],
        "dynamic_batching": {
            "preferred_batch_size": batching.preferred_batch_size,
            "max_queue_delay_microseconds": batching.max_queue_delay_microseconds,
            "priority_levels": batching.priority_levels,
            "default_priority_level": batching.default_priority_level,
            "default_queue_policy": {
                "max_queue_size": batching.max_queue_size,
                "default_timeout_microseconds": batching.default_timeout_microseconds,
                "allow_timeout_override": batching.allow_timeout_override,
            },
            "priority_queue_policy": {
                str(level): policy.model_dump()
                for level, policy in batching.priority_queue_policy.items()
            },
        },
        "parameters": {k: {"string_value": v} for k, v in config.parameters.items()},
        "model_warmup": [_warmup_json(w) for w in config.model_warmup],
        # perf_analyzer reads this to report the cache's hits and misses.
        "response_cache": {"enable": config.response_cache.enable},
    }
    if config.default_scheduler and (config.backend == "python" or not config.max_batch_size):
        # Triton's default scheduler (the config named no scheduler): such a Python model
        # gets one request per execute, a model without batching one request per run.
        # Other backends' queued requests still run together, as dynamic_batching {}
        # without delay does: shown so. A config read here and loaded again (a
        # tritonclient load_model(config=...)) keeps its scheduler.
        del out["dynamic_batching"]
    if config.model_transaction_policy.decoupled:
        # tritonclient and perf_analyzer read it to expect several answers per request.
        out["model_transaction_policy"] = {"decoupled": True}
    if config.sequence_batching is not None:
        # One of Triton's scheduling choices (perf_analyzer sends sequences when it sees it).
        out.pop("dynamic_batching", None)
        out["sequence_batching"] = sequence_json(config.sequence_batching)
    if config.ensemble is not None:
        # Triton's scheduling is one of dynamic batching and ensemble scheduling; an
        # ensemble has no instances of its own (perf_analyzer reads the steps from here).
        out.pop("dynamic_batching", None)
        del out["instance_group"]
        out["ensemble_scheduling"] = {"step": ensemble_steps(config.ensemble)}
    return out


def sequence_json(sequences: SequenceBatching) -> dict[str, Any]:
    """``sequence_batching`` as Triton writes it: TYPE_* datatypes, defaults left out."""
    out = sequences.model_dump(exclude_defaults=True)
    out["max_sequence_idle_microseconds"] = sequences.max_sequence_idle_microseconds
    for control_input in out.get("control_input", []):
        for control in control_input["control"]:
            if control.get("data_type"):
                control["data_type"] = to_config_datatype(control["data_type"])
    for state in out.get("state", []):
        state["data_type"] = to_config_datatype(state["data_type"])
        for initial in state.get("initial_state", []):
            initial["zero_data"] = True
            if initial.get("data_type"):
                initial["data_type"] = to_config_datatype(initial["data_type"])
    return out


def ensemble_steps(ensemble: EnsembleConfig) -> list[dict[str, Any]]:
    """An ensemble's steps as Triton's ``ensemble_scheduling.step`` (-1: the default version)."""
    return [
        {
            "model_name": step.model,
            "model_version": int(step.version) if step.version else -1,
            "input_map": step.input_map,
            "output_map": step.output_map,
        }
        for step in ensemble.steps
    ]


def _warmup_json(sample: WarmupSample) -> dict[str, Any]:
    """A warm-up sample as Triton writes it: TYPE_* datatypes, as the tensors have."""
    out = sample.model_dump()
    for name, tensor in sample.inputs.items():
        out["inputs"][name]["data_type"] = to_config_datatype(tensor.data_type)
    return out


_INFER_STAT_NAMES = (
    "success", "fail", "queue", "compute_input", "compute_infer",
    "compute_output", "cache_hit", "cache_miss",
)  # fmt: skip


def _duration(d: StatDuration) -> dict[str, int]:
    return {"count": d.count, "ns": d.ns}


_RESPONSE_STAT_NAMES = (
    "compute_infer", "compute_output", "success", "fail", "empty_response", "cancel",
)  # fmt: skip


def _response(entry: ResponseStats) -> dict[str, dict[str, int]]:
    return {name: _duration(getattr(entry, name)) for name in _RESPONSE_STAT_NAMES}


def model_stats_json(stats: list[ModelStats]) -> dict[str, Any]:
    """Triton's statistics extension's ``$stats_model_response``, its fields in Triton's
    order."""
    out = []
    for s in stats:
        infer = s.inference_stats
        out.append(
            {
                "name": s.name,
                "version": s.version,
                "last_inference": s.last_inference_ms,
                "inference_count": s.inference_count,
                "execution_count": s.execution_count,
                "inference_stats": {
                    name: _duration(getattr(infer, name)) for name in _INFER_STAT_NAMES
                },
                "response_stats": {
                    index: _response(entry) for index, entry in s.response_stats.items()
                },
                "batch_stats": [
                    {
                        "batch_size": b.batch_size,
                        "compute_input": _duration(b.compute_input),
                        "compute_infer": _duration(b.compute_infer),
                        "compute_output": _duration(b.compute_output),
                    }
                    for b in s.batch_stats
                ],
                "memory_usage": [
                    {"type": m.type, "id": m.id, "byte_size": m.byte_size} for m in s.memory_usage
                ],
            }
        )
    return {"model_stats": out}


def repository_index_json(entries: list[RepositoryEntry]) -> list[dict[str, str]]:
    out = []
    for entry in entries:
        item = {"name": entry.name}
        if entry.version:
            item["version"] = entry.version
        if entry.state:
            item["state"] = entry.state
        if entry.reason:
            item["reason"] = entry.reason
        out.append(item)
    return out
