"""A Triton ``config.pbtxt``, read as the ``config.yaml`` it stands for.

A Triton model repository is served as it is: the protobuf text file is parsed by
protobuf's own text format parser into the ``ModelConfig`` message of our V2 proto (its
field names are Triton's), and translated into the keys of Slipstream's config, which
then validates it as it validates a ``config.yaml``. What Slipstream does not do is
refused with the field named, never silently ignored: a model that relied on a sequence
batcher or an ensemble would otherwise serve wrong answers.
"""

from __future__ import annotations

import json
import re
from typing import Any

from google.protobuf import json_format, text_format
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from slipstream.config import ConfigError
from slipstream.protocol.proto import inference_pb2 as pb

TRITON_CONFIG_FILENAME = "config.pbtxt"

# Triton's platform / backend names -> Slipstream's backend.
_BACKENDS = {
    "onnxruntime_onnx": "onnxruntime",
    "onnxruntime": "onnxruntime",
    "pytorch_libtorch": "torch",
    "pytorch": "torch",
    "openvino": "openvino",
    "python": "python",
    # Triton's FIL backend: XGBoost and LightGBM trees (runtime/fil.py).
    "fil": "fil",
}

# Triton settings Slipstream has no counterpart for, and what to do instead.
_UNSUPPORTED = {
    "optimization": (
        "Triton's optimization settings are not read; remove the block (ONNX Runtime's "
        "options go in parameters: intra_op_thread_count, ...)"
    ),
    "batch_input": "batch inputs are not supported",
    "batch_output": "batch outputs are not supported",
    "gpus": 'choose the device with parameters { key: "device" value { string_value: ... } }',
    "rate_limiter": "Triton's rate limiter is not supported (see --rate-limit)",
    "input_data_file": "warm-up data from a file is not supported; use zero_data or random_data",
}

_NO_FIELD = re.compile(r'^(\d+):\d+ : Message type "([\w.]+)" has no field named "(\w+)"')
_JSON_NO_FIELD = re.compile(r'Message type "([\w.]+)" has no field named "(\w+)"')


def parse_triton_config(text: str, source: str) -> dict[str, Any]:
    """``config.pbtxt``'s text as the keys of a config.yaml; ConfigError naming the field."""
    message = pb.ModelConfig()
    try:
        text_format.Parse(text, message)
    except text_format.ParseError as exc:
        raise ConfigError(f"{source}: {_explain(str(exc))}") from None
    config = _as_dict(message)
    try:
        return _translate(config)
    except ValueError as exc:
        raise ConfigError(f"{source}: {exc}") from None


def parse_triton_json(text: str, source: str) -> dict[str, Any]:
    """A model config in Triton's JSON form (what a load request's ``config`` parameter
    carries, as tritonclient's ``load_model(config=...)`` sends it) as the keys of a
    config.yaml; ConfigError naming the field."""
    message = pb.ModelConfig()
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"{source}: not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"{source}: a model config is a JSON object (Triton's ModelConfig), got "
            f"{type(data).__name__}"
        )
    data = _without_unset(data, top=True)
    try:
        json_format.ParseDict(data, message)
    except json_format.ParseError as exc:
        unknown = _JSON_NO_FIELD.search(str(exc))
        if unknown is not None:
            raise ConfigError(f"{source}: {_unknown(*unknown.groups())}") from None
        raise ConfigError(f"{source}: not a valid Triton model configuration: {exc}") from None
    try:
        return _translate(_as_dict(message))
    except ValueError as exc:
        raise ConfigError(f"{source}: {exc}") from None


# Triton's optimization block as its GET config writes it for every model: defaults.
_DEFAULT_OPTIMIZATION = {
    "priority": "PRIORITY_DEFAULT",
    "input_pinned_memory": {"enable": True},
    "output_pinned_memory": {"enable": True},
}


def _without_unset(value: Any, top: bool = False) -> Any:
    """A config as Triton's GET config writes it (every field, defaults included: ``""``,
    ``false``, ``0``, ``[]``, ``{}``) without the fields left at their defaults, which
    proto3 JSON reads as unset anyway: fields Slipstream does not read are then refused
    only when they say something. ``max_batch_size`` is kept at the top (0 says no
    batching); the default optimization block goes too."""
    if isinstance(value, list):
        return [_without_unset(item) for item in value]
    if not isinstance(value, dict):
        return value
    kept = {}
    for key, item in value.items():
        item = _without_unset(item)
        if item in ("", False, 0, [], {}, None) and not (top and key == "max_batch_size"):
            continue
        kept[key] = item
    if top and kept.get("optimization") is not None:
        optimization = kept["optimization"]
        if all(_DEFAULT_OPTIMIZATION.get(k) == v for k, v in optimization.items()):
            del kept["optimization"]
    return kept


def _explain(error: str) -> str:
    unknown = _NO_FIELD.match(error)
    if unknown is None:
        return f"not a valid Triton model configuration: {error}"
    line, message, field = unknown.groups()
    return f"line {line}: {_unknown(message, field)}"


def _unknown(message: str, field: str) -> str:
    """Why ``field`` of ``message`` (a full proto name) was refused."""
    if field in _UNSUPPORTED:
        return f"{field}: {_UNSUPPORTED[field]}"
    where = message.rsplit(".", 1)[-1]
    return (
        f"{field}: not a field of Triton's {where}, or one Slipstream does not support "
        "(see the README's Serving your own models)"
    )


def _as_dict(message: Message) -> dict[str, Any]:
    """The fields set in ``message``, by name, as plain values (enums by name)."""
    return {field.name: _field_value(field, value) for field, value in message.ListFields()}


def _field_value(field: FieldDescriptor, value: Any) -> Any:
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        entry = field.message_type.fields_by_name["value"]
        return {key: _one(entry, item) for key, item in value.items()}
    if field.is_repeated:
        return [_one(field, item) for item in value]
    return _one(field, value)


def _one(field: FieldDescriptor, value: Any) -> Any:
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        return _as_dict(value)
    if field.enum_type is not None:
        return field.enum_type.values_by_number[value].name
    return value


def _translate(config: dict[str, Any]) -> dict[str, Any]:
    """Triton's message (as a dict) -> Slipstream's config keys; ValueError naming a field."""
    if config.pop("model_transaction_policy", {}).get("decoupled"):
        config["model_transaction_policy"] = {"decoupled": True}  # checked at load
    named = config.get("backend") or config.get("platform")
    if "ensemble_scheduling" in config or named == "ensemble":
        return _ensemble(config)
    if named is not None:
        if named not in _BACKENDS:
            known = ", ".join(sorted(_BACKENDS))
            field = "backend" if config.get("backend") else "platform"
            raise ValueError(f"{field}: {named!r} is not a backend Slipstream runs ({known})")
        config["backend"] = _BACKENDS[named]
        config.pop("platform", None)  # completed from the backend, as Triton names it
    for kind in ("input", "output"):
        config[kind] = [_tensor(kind, tensor) for tensor in config.get(kind, [])]
    if "dynamic_batching" in config:
        config["dynamic_batching"] = _batching(config["dynamic_batching"])
    if "sequence_batching" in config:
        _sequences(config)
    # Neither: Triton's default scheduler (a Python model's execute gets one request).
    config["default_scheduler"] = not {"dynamic_batching", "sequence_batching"} & set(config)
    # Triton's default queue policy, with or without dynamic_batching: requests' own
    # timeouts are ignored unless the policy allows an override.
    config.setdefault("dynamic_batching", {}).setdefault("allow_timeout_override", False)
    for index, sample in enumerate(config.get("model_warmup", [])):
        for name, tensor in sample.get("inputs", {}).items():
            if "input_data_file" in tensor:
                raise ValueError(
                    f"model_warmup[{index}].inputs[{name!r}]: {_UNSUPPORTED['input_data_file']}"
                )
    for group in config.get("instance_group", []):
        if group.get("kind") == "KIND_MODEL":
            group["kind"] = "KIND_AUTO"  # the backend's own placement
    return config


def _tensor(kind: str, tensor: dict[str, Any]) -> dict[str, Any]:
    where = f"{kind} {tensor.get('name', '')!r}"
    for flag in ("is_shape_tensor", "allow_ragged_batch"):
        if tensor.pop(flag, False):
            raise ValueError(f"{where}: {flag} is not supported")
    reshape = tensor.pop("reshape", None)
    if reshape is not None:
        tensor["reshape"] = reshape.get("shape", [])
    tensor.pop("format", None)  # an image layout: informational
    tensor.setdefault("dims", [])
    return tensor


def _sequences(config: dict[str, Any]) -> None:
    """A stateful model's ``sequence_batching``: kept as it is (its keys are Triton's);
    its strategy's batching settings become the model's dynamic_batching."""
    sequences = config["sequence_batching"]
    if sequences.pop("iterative_sequence", False):
        raise ValueError("sequence_batching.iterative_sequence is not supported")
    for control_input in sequences.get("control_input", []):
        for control in control_input.get("control", []):
            control.setdefault("kind", "CONTROL_SEQUENCE_START")  # proto3's default: unset
    for state in sequences.get("state", []):
        for initial in state.get("initial_state", []):
            if "data_file" in initial:
                raise ValueError(
                    f"sequence_batching.state {state.get('input_name', '')!r}: initial_state "
                    "from a data_file is not supported; a sequence's state starts at zeros"
                )
    strategy = sequences.get("oldest") or sequences.get("direct") or {}
    batching = {
        key: strategy[key]
        for key in ("preferred_batch_size", "max_queue_delay_microseconds")
        if key in strategy
    }
    if batching:
        config.setdefault("dynamic_batching", batching)


def _ensemble(config: dict[str, Any]) -> dict[str, Any]:
    """An ensemble: its steps as ``ensemble.steps``; its signature as any model's."""
    if config.pop("platform", "ensemble") != "ensemble" or "backend" in config:
        raise ValueError('ensemble_scheduling: an ensemble\'s platform is "ensemble"')
    steps = []
    for index, step in enumerate(config.pop("ensemble_scheduling", {}).get("step", [])):
        if step.get("model_namespace"):
            raise ValueError(f"ensemble_scheduling.step[{index}]: model_namespace is not supported")
        version = step.get("model_version", -1)
        steps.append({
            "model": step.get("model_name", ""),
            "version": "" if version == -1 else str(version),
            "input_map": step.get("input_map", {}),
            "output_map": step.get("output_map", {}),
        })  # fmt: skip
    config["ensemble"] = {"steps": steps}
    for kind in ("input", "output"):
        config[kind] = [_tensor(kind, tensor) for tensor in config.get(kind, [])]
    config.pop("instance_group", None)  # an ensemble has no instances of its own
    return config


def _batching(batching: dict[str, Any]) -> dict[str, Any]:
    batching.pop("preserve_ordering", None)  # each request is answered on its own
    batching.update(_queue_policy(batching.pop("default_queue_policy", {}), "default_queue_policy"))
    levels = batching.pop("priority_queue_policy", {})
    if levels:
        batching["priority_queue_policy"] = {
            int(level): _queue_policy(policy, f"priority_queue_policy[{level}]")
            for level, policy in levels.items()
        }
    return batching


def _queue_policy(policy: dict[str, Any], field: str) -> dict[str, Any]:
    """A ModelQueuePolicy as Slipstream's keys; DELAY refused, naming where."""
    if policy.get("timeout_action") == "DELAY":
        raise ValueError(
            f"dynamic_batching.{field}.timeout_action: DELAY is not supported (a request "
            "past its timeout is refused, as REJECT does)"
        )
    keys: dict[str, Any] = {}
    if "default_timeout_microseconds" in policy:
        keys["default_timeout_microseconds"] = policy["default_timeout_microseconds"]
    # Triton's default: a request's own timeout is ignored unless the policy allows it.
    keys["allow_timeout_override"] = policy.get("allow_timeout_override", False)
    if policy.get("max_queue_size"):  # 0: unbounded in Triton; Slipstream's default bound
        keys["max_queue_size"] = policy["max_queue_size"]
    return keys
