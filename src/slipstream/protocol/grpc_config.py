"""A model's completed config as Triton's gRPC ``ModelConfig`` message."""

from __future__ import annotations

from google.protobuf import json_format

from slipstream.config import (
    DynamicBatching,
    ModelConfig,
    TensorConfig,
    VersionPolicy,
    WarmupSample,
)
from slipstream.datatypes import to_config_datatype
from slipstream.protocol.proto import inference_pb2 as pb
from slipstream.protocol.v2_meta import ensemble_steps, sequence_json


def encode_model_config(config: ModelConfig) -> pb.ModelConfigResponse:
    """A completed :class:`ModelConfig` in Triton's ModelConfig message."""
    message = pb.ModelConfig(
        name=config.name,
        platform=config.platform,
        backend=config.backend,
        max_batch_size=config.max_batch_size or 0,
        default_model_filename=config.default_model_filename,
        version_policy=_version_policy(config.version_policy),
        input=[
            pb.ModelInput(
                name=t.name,
                data_type=_data_type(t.data_type),
                dims=t.dims,
                optional=t.optional,
                reshape=_reshape(t),
            )
            for t in config.input
        ],
        output=[_model_output(t) for t in config.output],
        instance_group=[
            pb.ModelInstanceGroup(name=g.name, count=g.count, kind=g.kind)
            for g in config.instance_group
        ],
        # Slipstream queues every model version, so dynamic_batching is always present.
        dynamic_batching=_dynamic_batching(config.dynamic_batching),
        model_warmup=[_warmup(sample) for sample in config.model_warmup],
        response_cache=pb.ModelResponseCache(enable=config.response_cache.enable),
    )
    for key, value in config.parameters.items():
        message.parameters[key].string_value = value
    if config.model_transaction_policy.decoupled:
        message.model_transaction_policy.decoupled = True
    if config.sequence_batching is not None:
        sequences = json_format.ParseDict(
            sequence_json(config.sequence_batching), pb.ModelSequenceBatching()
        )
        message.sequence_batching.CopyFrom(sequences)  # clears dynamic_batching (a oneof)
    if config.ensemble is not None:
        # One of Triton's scheduling choices: setting the ensemble's clears the batching.
        steps = [pb.ModelEnsembling.Step(**step) for step in ensemble_steps(config.ensemble)]
        message.ensemble_scheduling.CopyFrom(pb.ModelEnsembling(step=steps))
        del message.instance_group[:]
    return pb.ModelConfigResponse(config=message)


def _data_type(datatype: str) -> str:
    # Enum fields take the value's name; Triton's names are TYPE_FP32, TYPE_STRING, ...
    return to_config_datatype(datatype)


def _model_output(tensor: TensorConfig) -> pb.ModelOutput:
    return pb.ModelOutput(
        name=tensor.name,
        data_type=_data_type(tensor.data_type),
        dims=tensor.dims,
        label_filename=tensor.label_filename,
        reshape=_reshape(tensor),
    )


def _reshape(tensor: TensorConfig) -> pb.ModelTensorReshape | None:
    return None if tensor.reshape is None else pb.ModelTensorReshape(shape=tensor.reshape)


def _dynamic_batching(batching: DynamicBatching) -> pb.ModelDynamicBatching:
    return pb.ModelDynamicBatching(
        preferred_batch_size=batching.preferred_batch_size,
        max_queue_delay_microseconds=batching.max_queue_delay_microseconds,
        priority_levels=batching.priority_levels,
        default_priority_level=batching.default_priority_level,
        default_queue_policy=pb.ModelQueuePolicy(
            timeout_action=pb.ModelQueuePolicy.REJECT,
            default_timeout_microseconds=batching.default_timeout_microseconds,
            allow_timeout_override=batching.allow_timeout_override,
            max_queue_size=batching.max_queue_size,
        ),
        priority_queue_policy={
            level: pb.ModelQueuePolicy(
                timeout_action=pb.ModelQueuePolicy.REJECT,
                default_timeout_microseconds=policy.default_timeout_microseconds,
                allow_timeout_override=policy.allow_timeout_override,
                max_queue_size=policy.max_queue_size,
            )
            for level, policy in batching.priority_queue_policy.items()
        },
    )


def _version_policy(policy: VersionPolicy) -> pb.ModelVersionPolicy:
    if policy.all is not None:
        return pb.ModelVersionPolicy(all=pb.ModelVersionPolicy.All())
    if policy.specific is not None:
        specific = pb.ModelVersionPolicy.Specific(versions=policy.specific["versions"])
        return pb.ModelVersionPolicy(specific=specific)
    # No policy set means Triton's default, the latest version only.
    num_versions = (policy.latest or {}).get("num_versions", 1)
    return pb.ModelVersionPolicy(latest=pb.ModelVersionPolicy.Latest(num_versions=num_versions))


def _warmup(sample: WarmupSample) -> pb.ModelWarmup:
    inputs = {
        name: pb.ModelWarmup.Input(
            data_type=_data_type(spec.data_type),
            dims=spec.dims,
            # One member of the input_data_type oneof must be set; zeros are the default.
            random_data=True if spec.random_data else None,
            zero_data=None if spec.random_data else True,
        )
        for name, spec in sample.inputs.items()
    }
    return pb.ModelWarmup(
        name=sample.name, batch_size=sample.batch_size, count=sample.count, inputs=inputs
    )
