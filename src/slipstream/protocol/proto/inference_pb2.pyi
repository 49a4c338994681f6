from collections.abc import Iterable as _Iterable
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar

from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper

DESCRIPTOR: _descriptor.FileDescriptor

class DataType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TYPE_INVALID: _ClassVar[DataType]
    TYPE_BOOL: _ClassVar[DataType]
    TYPE_UINT8: _ClassVar[DataType]
    TYPE_UINT16: _ClassVar[DataType]
    TYPE_UINT32: _ClassVar[DataType]
    TYPE_UINT64: _ClassVar[DataType]
    TYPE_INT8: _ClassVar[DataType]
    TYPE_INT16: _ClassVar[DataType]
    TYPE_INT32: _ClassVar[DataType]
    TYPE_INT64: _ClassVar[DataType]
    TYPE_FP16: _ClassVar[DataType]
    TYPE_FP32: _ClassVar[DataType]
    TYPE_FP64: _ClassVar[DataType]
    TYPE_STRING: _ClassVar[DataType]
    TYPE_BF16: _ClassVar[DataType]

TYPE_INVALID: DataType
TYPE_BOOL: DataType
TYPE_UINT8: DataType
TYPE_UINT16: DataType
TYPE_UINT32: DataType
TYPE_UINT64: DataType
TYPE_INT8: DataType
TYPE_INT16: DataType
TYPE_INT32: DataType
TYPE_INT64: DataType
TYPE_FP16: DataType
TYPE_FP32: DataType
TYPE_FP64: DataType
TYPE_STRING: DataType
TYPE_BF16: DataType

class ServerLiveRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServerLiveResponse(_message.Message):
    __slots__ = ("live",)
    LIVE_FIELD_NUMBER: _ClassVar[int]
    live: bool
    def __init__(self, live: bool | None = ...) -> None: ...

class ServerReadyRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServerReadyResponse(_message.Message):
    __slots__ = ("ready",)
    READY_FIELD_NUMBER: _ClassVar[int]
    ready: bool
    def __init__(self, ready: bool | None = ...) -> None: ...

class ModelReadyRequest(_message.Message):
    __slots__ = ("name", "version")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: str
    def __init__(self, name: str | None = ..., version: str | None = ...) -> None: ...

class ModelReadyResponse(_message.Message):
    __slots__ = ("ready",)
    READY_FIELD_NUMBER: _ClassVar[int]
    ready: bool
    def __init__(self, ready: bool | None = ...) -> None: ...

class ServerMetadataRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServerMetadataResponse(_message.Message):
    __slots__ = ("extensions", "name", "version")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    EXTENSIONS_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: str
    extensions: _containers.RepeatedScalarFieldContainer[str]
    def __init__(
        self,
        name: str | None = ...,
        version: str | None = ...,
        extensions: _Iterable[str] | None = ...,
    ) -> None: ...

class ModelMetadataRequest(_message.Message):
    __slots__ = ("name", "version")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: str
    def __init__(self, name: str | None = ..., version: str | None = ...) -> None: ...

class ModelMetadataResponse(_message.Message):
    __slots__ = ("inputs", "name", "outputs", "platform", "versions")
    class TensorMetadata(_message.Message):
        __slots__ = ("datatype", "name", "shape")
        NAME_FIELD_NUMBER: _ClassVar[int]
        DATATYPE_FIELD_NUMBER: _ClassVar[int]
        SHAPE_FIELD_NUMBER: _ClassVar[int]
        name: str
        datatype: str
        shape: _containers.RepeatedScalarFieldContainer[int]
        def __init__(
            self,
            name: str | None = ...,
            datatype: str | None = ...,
            shape: _Iterable[int] | None = ...,
        ) -> None: ...

    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    PLATFORM_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    name: str
    versions: _containers.RepeatedScalarFieldContainer[str]
    platform: str
    inputs: _containers.RepeatedCompositeFieldContainer[ModelMetadataResponse.TensorMetadata]
    outputs: _containers.RepeatedCompositeFieldContainer[ModelMetadataResponse.TensorMetadata]
    def __init__(
        self,
        name: str | None = ...,
        versions: _Iterable[str] | None = ...,
        platform: str | None = ...,
        inputs: _Iterable[ModelMetadataResponse.TensorMetadata | _Mapping] | None = ...,
        outputs: _Iterable[ModelMetadataResponse.TensorMetadata | _Mapping] | None = ...,
    ) -> None: ...

class InferParameter(_message.Message):
    __slots__ = ("bool_param", "double_param", "int64_param", "string_param", "uint64_param")
    BOOL_PARAM_FIELD_NUMBER: _ClassVar[int]
    INT64_PARAM_FIELD_NUMBER: _ClassVar[int]
    STRING_PARAM_FIELD_NUMBER: _ClassVar[int]
    DOUBLE_PARAM_FIELD_NUMBER: _ClassVar[int]
    UINT64_PARAM_FIELD_NUMBER: _ClassVar[int]
    bool_param: bool
    int64_param: int
    string_param: str
    double_param: float
    uint64_param: int
    def __init__(
        self,
        bool_param: bool | None = ...,
        int64_param: int | None = ...,
        string_param: str | None = ...,
        double_param: float | None = ...,
        uint64_param: int | None = ...,
    ) -> None: ...

class InferTensorContents(_message.Message):
    __slots__ = (
        "bool_contents",
        "bytes_contents",
        "fp32_contents",
        "fp64_contents",
        "int64_contents",
        "int_contents",
        "uint64_contents",
        "uint_contents",
    )
    BOOL_CONTENTS_FIELD_NUMBER: _ClassVar[int]
    INT_CONTENTS_FIELD_NUMBER: _ClassVar[int]
    INT64_CONTENTS_FIELD_NUMBER: _ClassVar[int]
    UINT_CONTENTS_FIELD_NUMBER: _ClassVar[int]
    UINT64_CONTENTS_FIELD_NUMBER: _ClassVar[int]
    FP32_CONTENTS_FIELD_NUMBER: _ClassVar[int]
    FP64_CONTENTS_FIELD_NUMBER: _ClassVar[int]
    BYTES_CONTENTS_FIELD_NUMBER: _ClassVar[int]
    bool_contents: _containers.RepeatedScalarFieldContainer[bool]
    int_contents: _containers.RepeatedScalarFieldContainer[int]
    int64_contents: _containers.RepeatedScalarFieldContainer[int]
    uint_contents: _containers.RepeatedScalarFieldContainer[int]
    uint64_contents: _containers.RepeatedScalarFieldContainer[int]
    fp32_contents: _containers.RepeatedScalarFieldContainer[float]
    fp64_contents: _containers.RepeatedScalarFieldContainer[float]
    bytes_contents: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(
        self,
        bool_contents: _Iterable[bool] | None = ...,
        int_contents: _Iterable[int] | None = ...,
        int64_contents: _Iterable[int] | None = ...,
        uint_contents: _Iterable[int] | None = ...,
        uint64_contents: _Iterable[int] | None = ...,
        fp32_contents: _Iterable[float] | None = ...,
        fp64_contents: _Iterable[float] | None = ...,
        bytes_contents: _Iterable[bytes] | None = ...,
    ) -> None: ...

class ModelInferRequest(_message.Message):
    __slots__ = (
        "id",
        "inputs",
        "model_name",
        "model_version",
        "outputs",
        "parameters",
        "raw_input_contents",
    )
    class InferInputTensor(_message.Message):
        __slots__ = ("contents", "datatype", "name", "parameters", "shape")
        class ParametersEntry(_message.Message):
            __slots__ = ("key", "value")
            KEY_FIELD_NUMBER: _ClassVar[int]
            VALUE_FIELD_NUMBER: _ClassVar[int]
            key: str
            value: InferParameter
            def __init__(
                self, key: str | None = ..., value: InferParameter | _Mapping | None = ...
            ) -> None: ...

        NAME_FIELD_NUMBER: _ClassVar[int]
        DATATYPE_FIELD_NUMBER: _ClassVar[int]
        SHAPE_FIELD_NUMBER: _ClassVar[int]
        PARAMETERS_FIELD_NUMBER: _ClassVar[int]
        CONTENTS_FIELD_NUMBER: _ClassVar[int]
        name: str
        datatype: str
        shape: _containers.RepeatedScalarFieldContainer[int]
        parameters: _containers.MessageMap[str, InferParameter]
        contents: InferTensorContents
        def __init__(
            self,
            name: str | None = ...,
            datatype: str | None = ...,
            shape: _Iterable[int] | None = ...,
            parameters: _Mapping[str, InferParameter] | None = ...,
            contents: InferTensorContents | _Mapping | None = ...,
        ) -> None: ...

    class InferRequestedOutputTensor(_message.Message):
        __slots__ = ("name", "parameters")
        class ParametersEntry(_message.Message):
            __slots__ = ("key", "value")
            KEY_FIELD_NUMBER: _ClassVar[int]
            VALUE_FIELD_NUMBER: _ClassVar[int]
            key: str
            value: InferParameter
            def __init__(
                self, key: str | None = ..., value: InferParameter | _Mapping | None = ...
            ) -> None: ...

        NAME_FIELD_NUMBER: _ClassVar[int]
        PARAMETERS_FIELD_NUMBER: _ClassVar[int]
        name: str
        parameters: _containers.MessageMap[str, InferParameter]
        def __init__(
            self, name: str | None = ..., parameters: _Mapping[str, InferParameter] | None = ...
        ) -> None: ...

    class ParametersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: InferParameter
        def __init__(
            self, key: str | None = ..., value: InferParameter | _Mapping | None = ...
        ) -> None: ...

    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    RAW_INPUT_CONTENTS_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    model_version: str
    id: str
    parameters: _containers.MessageMap[str, InferParameter]
    inputs: _containers.RepeatedCompositeFieldContainer[ModelInferRequest.InferInputTensor]
    outputs: _containers.RepeatedCompositeFieldContainer[
        ModelInferRequest.InferRequestedOutputTensor
    ]
    raw_input_contents: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(
        self,
        model_name: str | None = ...,
        model_version: str | None = ...,
        id: str | None = ...,
        parameters: _Mapping[str, InferParameter] | None = ...,
        inputs: _Iterable[ModelInferRequest.InferInputTensor | _Mapping] | None = ...,
        outputs: _Iterable[ModelInferRequest.InferRequestedOutputTensor | _Mapping] | None = ...,
        raw_input_contents: _Iterable[bytes] | None = ...,
    ) -> None: ...

class ModelInferResponse(_message.Message):
    __slots__ = (
        "id",
        "model_name",
        "model_version",
        "outputs",
        "parameters",
        "raw_output_contents",
    )
    class InferOutputTensor(_message.Message):
        __slots__ = ("contents", "datatype", "name", "parameters", "shape")
        class ParametersEntry(_message.Message):
            __slots__ = ("key", "value")
            KEY_FIELD_NUMBER: _ClassVar[int]
            VALUE_FIELD_NUMBER: _ClassVar[int]
            key: str
            value: InferParameter
            def __init__(
                self, key: str | None = ..., value: InferParameter | _Mapping | None = ...
            ) -> None: ...

        NAME_FIELD_NUMBER: _ClassVar[int]
        DATATYPE_FIELD_NUMBER: _ClassVar[int]
        SHAPE_FIELD_NUMBER: _ClassVar[int]
        PARAMETERS_FIELD_NUMBER: _ClassVar[int]
        CONTENTS_FIELD_NUMBER: _ClassVar[int]
        name: str
        datatype: str
        shape: _containers.RepeatedScalarFieldContainer[int]
        parameters: _containers.MessageMap[str, InferParameter]
        contents: InferTensorContents
        def __init__(
            self,
            name: str | None = ...,
            datatype: str | None = ...,
            shape: _Iterable[int] | None = ...,
            parameters: _Mapping[str, InferParameter] | None = ...,
            contents: InferTensorContents | _Mapping | None = ...,
        ) -> None: ...

    class ParametersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: InferParameter
        def __init__(
            self, key: str | None = ..., value: InferParameter | _Mapping | None = ...
        ) -> None: ...

    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    RAW_OUTPUT_CONTENTS_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    model_version: str
    id: str
    parameters: _containers.MessageMap[str, InferParameter]
    outputs: _containers.RepeatedCompositeFieldContainer[ModelInferResponse.InferOutputTensor]
    raw_output_contents: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(
        self,
        model_name: str | None = ...,
        model_version: str | None = ...,
        id: str | None = ...,
        parameters: _Mapping[str, InferParameter] | None = ...,
        outputs: _Iterable[ModelInferResponse.InferOutputTensor | _Mapping] | None = ...,
        raw_output_contents: _Iterable[bytes] | None = ...,
    ) -> None: ...

class ModelStreamInferResponse(_message.Message):
    __slots__ = ("error_message", "infer_response")
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    INFER_RESPONSE_FIELD_NUMBER: _ClassVar[int]
    error_message: str
    infer_response: ModelInferResponse
    def __init__(
        self,
        error_message: str | None = ...,
        infer_response: ModelInferResponse | _Mapping | None = ...,
    ) -> None: ...

class ModelConfigRequest(_message.Message):
    __slots__ = ("name", "version")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: str
    def __init__(self, name: str | None = ..., version: str | None = ...) -> None: ...

class ModelConfigResponse(_message.Message):
    __slots__ = ("config",)
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    config: ModelConfig
    def __init__(self, config: ModelConfig | _Mapping | None = ...) -> None: ...

class ModelTensorReshape(_message.Message):
    __slots__ = ("shape",)
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, shape: _Iterable[int] | None = ...) -> None: ...

class ModelInput(_message.Message):
    __slots__ = (
        "allow_ragged_batch",
        "data_type",
        "dims",
        "format",
        "is_shape_tensor",
        "name",
        "optional",
        "reshape",
    )
    class Format(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        FORMAT_NONE: _ClassVar[ModelInput.Format]
        FORMAT_NHWC: _ClassVar[ModelInput.Format]
        FORMAT_NCHW: _ClassVar[ModelInput.Format]

    FORMAT_NONE: ModelInput.Format
    FORMAT_NHWC: ModelInput.Format
    FORMAT_NCHW: ModelInput.Format
    NAME_FIELD_NUMBER: _ClassVar[int]
    DATA_TYPE_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    DIMS_FIELD_NUMBER: _ClassVar[int]
    RESHAPE_FIELD_NUMBER: _ClassVar[int]
    IS_SHAPE_TENSOR_FIELD_NUMBER: _ClassVar[int]
    ALLOW_RAGGED_BATCH_FIELD_NUMBER: _ClassVar[int]
    OPTIONAL_FIELD_NUMBER: _ClassVar[int]
    name: str
    data_type: DataType
    format: ModelInput.Format
    dims: _containers.RepeatedScalarFieldContainer[int]
    reshape: ModelTensorReshape
    is_shape_tensor: bool
    allow_ragged_batch: bool
    optional: bool
    def __init__(
        self,
        name: str | None = ...,
        data_type: DataType | str | None = ...,
        format: ModelInput.Format | str | None = ...,
        dims: _Iterable[int] | None = ...,
        reshape: ModelTensorReshape | _Mapping | None = ...,
        is_shape_tensor: bool | None = ...,
        allow_ragged_batch: bool | None = ...,
        optional: bool | None = ...,
    ) -> None: ...

class ModelOutput(_message.Message):
    __slots__ = ("data_type", "dims", "is_shape_tensor", "label_filename", "name", "reshape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DATA_TYPE_FIELD_NUMBER: _ClassVar[int]
    DIMS_FIELD_NUMBER: _ClassVar[int]
    LABEL_FILENAME_FIELD_NUMBER: _ClassVar[int]
    RESHAPE_FIELD_NUMBER: _ClassVar[int]
    IS_SHAPE_TENSOR_FIELD_NUMBER: _ClassVar[int]
    name: str
    data_type: DataType
    dims: _containers.RepeatedScalarFieldContainer[int]
    label_filename: str
    reshape: ModelTensorReshape
    is_shape_tensor: bool
    def __init__(
        self,
        name: str | None = ...,
        data_type: DataType | str | None = ...,
        dims: _Iterable[int] | None = ...,
        label_filename: str | None = ...,
        reshape: ModelTensorReshape | _Mapping | None = ...,
        is_shape_tensor: bool | None = ...,
    ) -> None: ...

class ModelTransactionPolicy(_message.Message):
    __slots__ = ("decoupled",)
    DECOUPLED_FIELD_NUMBER: _ClassVar[int]
    decoupled: bool
    def __init__(self, decoupled: bool | None = ...) -> None: ...

class ModelVersionPolicy(_message.Message):
    __slots__ = ("all", "latest", "specific")
    class Latest(_message.Message):
        __slots__ = ("num_versions",)
        NUM_VERSIONS_FIELD_NUMBER: _ClassVar[int]
        num_versions: int
        def __init__(self, num_versions: int | None = ...) -> None: ...

    class All(_message.Message):
        __slots__ = ()
        def __init__(self) -> None: ...

    class Specific(_message.Message):
        __slots__ = ("versions",)
        VERSIONS_FIELD_NUMBER: _ClassVar[int]
        versions: _containers.RepeatedScalarFieldContainer[int]
        def __init__(self, versions: _Iterable[int] | None = ...) -> None: ...

    LATEST_FIELD_NUMBER: _ClassVar[int]
    ALL_FIELD_NUMBER: _ClassVar[int]
    SPECIFIC_FIELD_NUMBER: _ClassVar[int]
    latest: ModelVersionPolicy.Latest
    all: ModelVersionPolicy.All
    specific: ModelVersionPolicy.Specific
    def __init__(
        self,
        latest: ModelVersionPolicy.Latest | _Mapping | None = ...,
        all: ModelVersionPolicy.All | _Mapping | None = ...,
        specific: ModelVersionPolicy.Specific | _Mapping | None = ...,
    ) -> None: ...

class ModelInstanceGroup(_message.Message):
    __slots__ = ("count", "kind", "name")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_AUTO: _ClassVar[ModelInstanceGroup.Kind]
        KIND_GPU: _ClassVar[ModelInstanceGroup.Kind]
        KIND_CPU: _ClassVar[ModelInstanceGroup.Kind]
        KIND_MODEL: _ClassVar[ModelInstanceGroup.Kind]

    KIND_AUTO: ModelInstanceGroup.Kind
    KIND_GPU: ModelInstanceGroup.Kind
    KIND_CPU: ModelInstanceGroup.Kind
    KIND_MODEL: ModelInstanceGroup.Kind
    NAME_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    name: str
    count: int
    kind: ModelInstanceGroup.Kind
    def __init__(
        self,
        name: str | None = ...,
        count: int | None = ...,
        kind: ModelInstanceGroup.Kind | str | None = ...,
    ) -> None: ...

class ModelQueuePolicy(_message.Message):
    __slots__ = (
        "allow_timeout_override",
        "default_timeout_microseconds",
        "max_queue_size",
        "timeout_action",
    )
    class TimeoutAction(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        REJECT: _ClassVar[ModelQueuePolicy.TimeoutAction]
        DELAY: _ClassVar[ModelQueuePolicy.TimeoutAction]

    REJECT: ModelQueuePolicy.TimeoutAction
    DELAY: ModelQueuePolicy.TimeoutAction
    TIMEOUT_ACTION_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_TIMEOUT_MICROSECONDS_FIELD_NUMBER: _ClassVar[int]
    ALLOW_TIMEOUT_OVERRIDE_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_SIZE_FIELD_NUMBER: _ClassVar[int]
    timeout_action: ModelQueuePolicy.TimeoutAction
    default_timeout_microseconds: int
    allow_timeout_override: bool
    max_queue_size: int
    def __init__(
        self,
        timeout_action: ModelQueuePolicy.TimeoutAction | str | None = ...,
        default_timeout_microseconds: int | None = ...,
        allow_timeout_override: bool | None = ...,
        max_queue_size: int | None = ...,
    ) -> None: ...

class ModelDynamicBatching(_message.Message):
    __slots__ = (
        "default_priority_level",
        "default_queue_policy",
        "max_queue_delay_microseconds",
        "preferred_batch_size",
        "preserve_ordering",
        "priority_levels",
        "priority_queue_policy",
    )
    class PriorityQueuePolicyEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: ModelQueuePolicy
        def __init__(
            self, key: int | None = ..., value: ModelQueuePolicy | _Mapping | None = ...
        ) -> None: ...

    PREFERRED_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_DELAY_MICROSECONDS_FIELD_NUMBER: _ClassVar[int]
    PRESERVE_ORDERING_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_LEVELS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_PRIORITY_LEVEL_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_QUEUE_POLICY_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_QUEUE_POLICY_FIELD_NUMBER: _ClassVar[int]
    preferred_batch_size: _containers.RepeatedScalarFieldContainer[int]
    max_queue_delay_microseconds: int
    preserve_ordering: bool
    priority_levels: int
    default_priority_level: int
    default_queue_policy: ModelQueuePolicy
    priority_queue_policy: _containers.MessageMap[int, ModelQueuePolicy]
    def __init__(
        self,
        preferred_batch_size: _Iterable[int] | None = ...,
        max_queue_delay_microseconds: int | None = ...,
        preserve_ordering: bool | None = ...,
        priority_levels: int | None = ...,
        default_priority_level: int | None = ...,
        default_queue_policy: ModelQueuePolicy | _Mapping | None = ...,
        priority_queue_policy: _Mapping[int, ModelQueuePolicy] | None = ...,
    ) -> None: ...

class ModelParameter(_message.Message):
    __slots__ = ("string_value",)
    STRING_VALUE_FIELD_NUMBER: _ClassVar[int]
    string_value: str
    def __init__(self, string_value: str | None = ...) -> None: ...

class ModelWarmup(_message.Message):
    __slots__ = ("batch_size", "count", "inputs", "name")
    class Input(_message.Message):
        __slots__ = ("data_type", "dims", "input_data_file", "random_data", "zero_data")
        DATA_TYPE_FIELD_NUMBER: _ClassVar[int]
        DIMS_FIELD_NUMBER: _ClassVar[int]
        ZERO_DATA_FIELD_NUMBER: _ClassVar[int]
        RANDOM_DATA_FIELD_NUMBER: _ClassVar[int]
        INPUT_DATA_FILE_FIELD_NUMBER: _ClassVar[int]
        data_type: DataType
        dims: _containers.RepeatedScalarFieldContainer[int]
        zero_data: bool
        random_data: bool
        input_data_file: str
        def __init__(
            self,
            data_type: DataType | str | None = ...,
            dims: _Iterable[int] | None = ...,
            zero_data: bool | None = ...,
            random_data: bool | None = ...,
            input_data_file: str | None = ...,
        ) -> None: ...

    class InputsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: ModelWarmup.Input
        def __init__(
            self, key: str | None = ..., value: ModelWarmup.Input | _Mapping | None = ...
        ) -> None: ...

    NAME_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    name: str
    batch_size: int
    inputs: _containers.MessageMap[str, ModelWarmup.Input]
    count: int
    def __init__(
        self,
        name: str | None = ...,
        batch_size: int | None = ...,
        inputs: _Mapping[str, ModelWarmup.Input] | None = ...,
        count: int | None = ...,
    ) -> None: ...

class ModelConfig(_message.Message):
    __slots__ = (
        "backend",
        "default_model_filename",
        "dynamic_batching",
        "ensemble_scheduling",
        "input",
        "instance_group",
        "max_batch_size",
        "model_transaction_policy",
        "model_warmup",
        "name",
        "output",
        "parameters",
        "platform",
        "response_cache",
        "sequence_batching",
        "version_policy",
    )
    class ParametersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: ModelParameter
        def __init__(
            self, key: str | None = ..., value: ModelParameter | _Mapping | None = ...
        ) -> None: ...

    NAME_FIELD_NUMBER: _ClassVar[int]
    PLATFORM_FIELD_NUMBER: _ClassVar[int]
    VERSION_POLICY_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    INPUT_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_GROUP_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_MODEL_FILENAME_FIELD_NUMBER: _ClassVar[int]
    DYNAMIC_BATCHING_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_BATCHING_FIELD_NUMBER: _ClassVar[int]
    ENSEMBLE_SCHEDULING_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    MODEL_WARMUP_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    MODEL_TRANSACTION_POLICY_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_CACHE_FIELD_NUMBER: _ClassVar[int]
    name: str
    platform: str
    version_policy: ModelVersionPolicy
    max_batch_size: int
    input: _containers.RepeatedCompositeFieldContainer[ModelInput]
    output: _containers.RepeatedCompositeFieldContainer[ModelOutput]
    instance_group: _containers.RepeatedCompositeFieldContainer[ModelInstanceGroup]
    default_model_filename: str
    dynamic_batching: ModelDynamicBatching
    sequence_batching: ModelSequenceBatching
    ensemble_scheduling: ModelEnsembling
    parameters: _containers.MessageMap[str, ModelParameter]
    model_warmup: _containers.RepeatedCompositeFieldContainer[ModelWarmup]
    backend: str
    model_transaction_policy: ModelTransactionPolicy
    response_cache: ModelResponseCache
    def __init__(
        self,
        name: str | None = ...,
        platform: str | None = ...,
        version_policy: ModelVersionPolicy | _Mapping | None = ...,
        max_batch_size: int | None = ...,
        input: _Iterable[ModelInput | _Mapping] | None = ...,
        output: _Iterable[ModelOutput | _Mapping] | None = ...,
        instance_group: _Iterable[ModelInstanceGroup | _Mapping] | None = ...,
        default_model_filename: str | None = ...,
        dynamic_batching: ModelDynamicBatching | _Mapping | None = ...,
        sequence_batching: ModelSequenceBatching | _Mapping | None = ...,
        ensemble_scheduling: ModelEnsembling | _Mapping | None = ...,
        parameters: _Mapping[str, ModelParameter] | None = ...,
        model_warmup: _Iterable[ModelWarmup | _Mapping] | None = ...,
        backend: str | None = ...,
        model_transaction_policy: ModelTransactionPolicy | _Mapping | None = ...,
        response_cache: ModelResponseCache | _Mapping | None = ...,
    ) -> None: ...

class ModelSequenceBatching(_message.Message):
    __slots__ = (
        "control_input",
        "direct",
        "iterative_sequence",
        "max_sequence_idle_microseconds",
        "oldest",
        "state",
    )
    class Control(_message.Message):
        __slots__ = ("bool_false_true", "data_type", "fp32_false_true", "int32_false_true", "kind")
        class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
            __slots__ = ()
            CONTROL_SEQUENCE_START: _ClassVar[ModelSequenceBatching.Control.Kind]
            CONTROL_SEQUENCE_READY: _ClassVar[ModelSequenceBatching.Control.Kind]
            CONTROL_SEQUENCE_END: _ClassVar[ModelSequenceBatching.Control.Kind]
            CONTROL_SEQUENCE_CORRID: _ClassVar[ModelSequenceBatching.Control.Kind]

        CONTROL_SEQUENCE_START: ModelSequenceBatching.Control.Kind
        CONTROL_SEQUENCE_READY: ModelSequenceBatching.Control.Kind
        CONTROL_SEQUENCE_END: ModelSequenceBatching.Control.Kind
        CONTROL_SEQUENCE_CORRID: ModelSequenceBatching.Control.Kind
        KIND_FIELD_NUMBER: _ClassVar[int]
        INT32_FALSE_TRUE_FIELD_NUMBER: _ClassVar[int]
        FP32_FALSE_TRUE_FIELD_NUMBER: _ClassVar[int]
        DATA_TYPE_FIELD_NUMBER: _ClassVar[int]
        BOOL_FALSE_TRUE_FIELD_NUMBER: _ClassVar[int]
        kind: ModelSequenceBatching.Control.Kind
        int32_false_true: _containers.RepeatedScalarFieldContainer[int]
        fp32_false_true: _containers.RepeatedScalarFieldContainer[float]
        data_type: DataType
        bool_false_true: _containers.RepeatedScalarFieldContainer[bool]
        def __init__(
            self,
            kind: ModelSequenceBatching.Control.Kind | str | None = ...,
            int32_false_true: _Iterable[int] | None = ...,
            fp32_false_true: _Iterable[float] | None = ...,
            data_type: DataType | str | None = ...,
            bool_false_true: _Iterable[bool] | None = ...,
        ) -> None: ...

    class ControlInput(_message.Message):
        __slots__ = ("control", "name")
        NAME_FIELD_NUMBER: _ClassVar[int]
        CONTROL_FIELD_NUMBER: _ClassVar[int]
        name: str
        control: _containers.RepeatedCompositeFieldContainer[ModelSequenceBatching.Control]
        def __init__(
            self,
            name: str | None = ...,
            control: _Iterable[ModelSequenceBatching.Control | _Mapping] | None = ...,
        ) -> None: ...

    class InitialState(_message.Message):
        __slots__ = ("data_file", "data_type", "dims", "name", "zero_data")
        DATA_TYPE_FIELD_NUMBER: _ClassVar[int]
        DIMS_FIELD_NUMBER: _ClassVar[int]
        ZERO_DATA_FIELD_NUMBER: _ClassVar[int]
        DATA_FILE_FIELD_NUMBER: _ClassVar[int]
        NAME_FIELD_NUMBER: _ClassVar[int]
        data_type: DataType
        dims: _containers.RepeatedScalarFieldContainer[int]
        zero_data: bool
        data_file: str
        name: str
        def __init__(
            self,
            data_type: DataType | str | None = ...,
            dims: _Iterable[int] | None = ...,
            zero_data: bool | None = ...,
            data_file: str | None = ...,
            name: str | None = ...,
        ) -> None: ...

    class State(_message.Message):
        __slots__ = (
            "data_type",
            "dims",
            "initial_state",
            "input_name",
            "output_name",
            "use_growable_memory",
            "use_same_buffer_for_input_output",
        )
        INPUT_NAME_FIELD_NUMBER: _ClassVar[int]
        OUTPUT_NAME_FIELD_NUMBER: _ClassVar[int]
        DATA_TYPE_FIELD_NUMBER: _ClassVar[int]
        DIMS_FIELD_NUMBER: _ClassVar[int]
        INITIAL_STATE_FIELD_NUMBER: _ClassVar[int]
        USE_SAME_BUFFER_FOR_INPUT_OUTPUT_FIELD_NUMBER: _ClassVar[int]
        USE_GROWABLE_MEMORY_FIELD_NUMBER: _ClassVar[int]
        input_name: str
        output_name: str
        data_type: DataType
        dims: _containers.RepeatedScalarFieldContainer[int]
        initial_state: _containers.RepeatedCompositeFieldContainer[
            ModelSequenceBatching.InitialState
        ]
        use_same_buffer_for_input_output: bool
        use_growable_memory: bool
        def __init__(
            self,
            input_name: str | None = ...,
            output_name: str | None = ...,
            data_type: DataType | str | None = ...,
            dims: _Iterable[int] | None = ...,
            initial_state: _Iterable[ModelSequenceBatching.InitialState | _Mapping] | None = ...,
            use_same_buffer_for_input_output: bool | None = ...,
            use_growable_memory: bool | None = ...,
        ) -> None: ...

    class StrategyDirect(_message.Message):
        __slots__ = ("max_queue_delay_microseconds", "minimum_slot_utilization")
        MAX_QUEUE_DELAY_MICROSECONDS_FIELD_NUMBER: _ClassVar[int]
        MINIMUM_SLOT_UTILIZATION_FIELD_NUMBER: _ClassVar[int]
        max_queue_delay_microseconds: int
        minimum_slot_utilization: float
        def __init__(
            self,
            max_queue_delay_microseconds: int | None = ...,
            minimum_slot_utilization: float | None = ...,
        ) -> None: ...

    class StrategyOldest(_message.Message):
        __slots__ = (
            "max_candidate_sequences",
            "max_queue_delay_microseconds",
            "preferred_batch_size",
            "preserve_ordering",
        )
        MAX_CANDIDATE_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
        PREFERRED_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
        MAX_QUEUE_DELAY_MICROSECONDS_FIELD_NUMBER: _ClassVar[int]
        PRESERVE_ORDERING_FIELD_NUMBER: _ClassVar[int]
        max_candidate_sequences: int
        preferred_batch_size: _containers.RepeatedScalarFieldContainer[int]
        max_queue_delay_microseconds: int
        preserve_ordering: bool
        def __init__(
            self,
            max_candidate_sequences: int | None = ...,
            preferred_batch_size: _Iterable[int] | None = ...,
            max_queue_delay_microseconds: int | None = ...,
            preserve_ordering: bool | None = ...,
        ) -> None: ...

    DIRECT_FIELD_NUMBER: _ClassVar[int]
    OLDEST_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQUENCE_IDLE_MICROSECONDS_FIELD_NUMBER: _ClassVar[int]
    CONTROL_INPUT_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ITERATIVE_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    direct: ModelSequenceBatching.StrategyDirect
    oldest: ModelSequenceBatching.StrategyOldest
    max_sequence_idle_microseconds: int
    control_input: _containers.RepeatedCompositeFieldContainer[ModelSequenceBatching.ControlInput]
    state: _containers.RepeatedCompositeFieldContainer[ModelSequenceBatching.State]
    iterative_sequence: bool
    def __init__(
        self,
        direct: ModelSequenceBatching.StrategyDirect | _Mapping | None = ...,
        oldest: ModelSequenceBatching.StrategyOldest | _Mapping | None = ...,
        max_sequence_idle_microseconds: int | None = ...,
        control_input: _Iterable[ModelSequenceBatching.ControlInput | _Mapping] | None = ...,
        state: _Iterable[ModelSequenceBatching.State | _Mapping] | None = ...,
        iterative_sequence: bool | None = ...,
    ) -> None: ...

class ModelEnsembling(_message.Message):
    __slots__ = ("step",)
    class Step(_message.Message):
        __slots__ = ("input_map", "model_name", "model_namespace", "model_version", "output_map")
        class InputMapEntry(_message.Message):
            __slots__ = ("key", "value")
            KEY_FIELD_NUMBER: _ClassVar[int]
            VALUE_FIELD_NUMBER: _ClassVar[int]
            key: str
            value: str
            def __init__(self, key: str | None = ..., value: str | None = ...) -> None: ...

        class OutputMapEntry(_message.Message):
            __slots__ = ("key", "value")
            KEY_FIELD_NUMBER: _ClassVar[int]
            VALUE_FIELD_NUMBER: _ClassVar[int]
            key: str
            value: str
            def __init__(self, key: str | None = ..., value: str | None = ...) -> None: ...

        MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
        MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
        INPUT_MAP_FIELD_NUMBER: _ClassVar[int]
        OUTPUT_MAP_FIELD_NUMBER: _ClassVar[int]
        MODEL_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
        model_name: str
        model_version: int
        input_map: _containers.ScalarMap[str, str]
        output_map: _containers.ScalarMap[str, str]
        model_namespace: str
        def __init__(
            self,
            model_name: str | None = ...,
            model_version: int | None = ...,
            input_map: _Mapping[str, str] | None = ...,
            output_map: _Mapping[str, str] | None = ...,
            model_namespace: str | None = ...,
        ) -> None: ...

    STEP_FIELD_NUMBER: _ClassVar[int]
    step: _containers.RepeatedCompositeFieldContainer[ModelEnsembling.Step]
    def __init__(self, step: _Iterable[ModelEnsembling.Step | _Mapping] | None = ...) -> None: ...

class ModelResponseCache(_message.Message):
    __slots__ = ("enable",)
    ENABLE_FIELD_NUMBER: _ClassVar[int]
    enable: bool
    def __init__(self, enable: bool | None = ...) -> None: ...

class ModelStatisticsRequest(_message.Message):
    __slots__ = ("name", "version")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: str
    def __init__(self, name: str | None = ..., version: str | None = ...) -> None: ...

class StatisticDuration(_message.Message):
    __slots__ = ("count", "ns")
    COUNT_FIELD_NUMBER: _ClassVar[int]
    NS_FIELD_NUMBER: _ClassVar[int]
    count: int
    ns: int
    def __init__(self, count: int | None = ..., ns: int | None = ...) -> None: ...

class InferStatistics(_message.Message):
    __slots__ = (
        "cache_hit",
        "cache_miss",
        "compute_infer",
        "compute_input",
        "compute_output",
        "fail",
        "queue",
        "success",
    )
    SUCCESS_FIELD_NUMBER: _ClassVar[int]
    FAIL_FIELD_NUMBER: _ClassVar[int]
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_INPUT_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_INFER_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    CACHE_HIT_FIELD_NUMBER: _ClassVar[int]
    CACHE_MISS_FIELD_NUMBER: _ClassVar[int]
    success: StatisticDuration
    fail: StatisticDuration
    queue: StatisticDuration
    compute_input: StatisticDuration
    compute_infer: StatisticDuration
    compute_output: StatisticDuration
    cache_hit: StatisticDuration
    cache_miss: StatisticDuration
    def __init__(
        self,
        success: StatisticDuration | _Mapping | None = ...,
        fail: StatisticDuration | _Mapping | None = ...,
        queue: StatisticDuration | _Mapping | None = ...,
        compute_input: StatisticDuration | _Mapping | None = ...,
        compute_infer: StatisticDuration | _Mapping | None = ...,
        compute_output: StatisticDuration | _Mapping | None = ...,
        cache_hit: StatisticDuration | _Mapping | None = ...,
        cache_miss: StatisticDuration | _Mapping | None = ...,
    ) -> None: ...

class InferBatchStatistics(_message.Message):
    __slots__ = ("batch_size", "compute_infer", "compute_input", "compute_output")
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_INPUT_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_INFER_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    batch_size: int
    compute_input: StatisticDuration
    compute_infer: StatisticDuration
    compute_output: StatisticDuration
    def __init__(
        self,
        batch_size: int | None = ...,
        compute_input: StatisticDuration | _Mapping | None = ...,
        compute_infer: StatisticDuration | _Mapping | None = ...,
        compute_output: StatisticDuration | _Mapping | None = ...,
    ) -> None: ...

class InferResponseStatistics(_message.Message):
    __slots__ = ("cancel", "compute_infer", "compute_output", "empty_response", "fail", "success")
    COMPUTE_INFER_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    SUCCESS_FIELD_NUMBER: _ClassVar[int]
    FAIL_FIELD_NUMBER: _ClassVar[int]
    EMPTY_RESPONSE_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    compute_infer: StatisticDuration
    compute_output: StatisticDuration
    success: StatisticDuration
    fail: StatisticDuration
    empty_response: StatisticDuration
    cancel: StatisticDuration
    def __init__(
        self,
        compute_infer: StatisticDuration | _Mapping | None = ...,
        compute_output: StatisticDuration | _Mapping | None = ...,
        success: StatisticDuration | _Mapping | None = ...,
        fail: StatisticDuration | _Mapping | None = ...,
        empty_response: StatisticDuration | _Mapping | None = ...,
        cancel: StatisticDuration | _Mapping | None = ...,
    ) -> None: ...

class MemoryUsage(_message.Message):
    __slots__ = ("byte_size", "id", "type")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    BYTE_SIZE_FIELD_NUMBER: _ClassVar[int]
    type: str
    id: int
    byte_size: int
    def __init__(
        self, type: str | None = ..., id: int | None = ..., byte_size: int | None = ...
    ) -> None: ...

class ModelStatistics(_message.Message):
    __slots__ = (
        "batch_stats",
        "execution_count",
        "inference_count",
        "inference_stats",
        "last_inference",
        "memory_usage",
        "name",
        "response_stats",
        "version",
    )
    class ResponseStatsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: InferResponseStatistics
        def __init__(
            self, key: str | None = ..., value: InferResponseStatistics | _Mapping | None = ...
        ) -> None: ...

    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LAST_INFERENCE_FIELD_NUMBER: _ClassVar[int]
    INFERENCE_COUNT_FIELD_NUMBER: _ClassVar[int]
    EXECUTION_COUNT_FIELD_NUMBER: _ClassVar[int]
    INFERENCE_STATS_FIELD_NUMBER: _ClassVar[int]
    BATCH_STATS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USAGE_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_STATS_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: str
    last_inference: int
    inference_count: int
    execution_count: int
    inference_stats: InferStatistics
    batch_stats: _containers.RepeatedCompositeFieldContainer[InferBatchStatistics]
    memory_usage: _containers.RepeatedCompositeFieldContainer[MemoryUsage]
    response_stats: _containers.MessageMap[str, InferResponseStatistics]
    def __init__(
        self,
        name: str | None = ...,
        version: str | None = ...,
        last_inference: int | None = ...,
        inference_count: int | None = ...,
        execution_count: int | None = ...,
        inference_stats: InferStatistics | _Mapping | None = ...,
        batch_stats: _Iterable[InferBatchStatistics | _Mapping] | None = ...,
        memory_usage: _Iterable[MemoryUsage | _Mapping] | None = ...,
        response_stats: _Mapping[str, InferResponseStatistics] | None = ...,
    ) -> None: ...

class ModelStatisticsResponse(_message.Message):
    __slots__ = ("model_stats",)
    MODEL_STATS_FIELD_NUMBER: _ClassVar[int]
    model_stats: _containers.RepeatedCompositeFieldContainer[ModelStatistics]
    def __init__(self, model_stats: _Iterable[ModelStatistics | _Mapping] | None = ...) -> None: ...

class ModelRepositoryParameter(_message.Message):
    __slots__ = ("bool_param", "bytes_param", "int64_param", "string_param")
    BOOL_PARAM_FIELD_NUMBER: _ClassVar[int]
    INT64_PARAM_FIELD_NUMBER: _ClassVar[int]
    STRING_PARAM_FIELD_NUMBER: _ClassVar[int]
    BYTES_PARAM_FIELD_NUMBER: _ClassVar[int]
    bool_param: bool
    int64_param: int
    string_param: str
    bytes_param: bytes
    def __init__(
        self,
        bool_param: bool | None = ...,
        int64_param: int | None = ...,
        string_param: str | None = ...,
        bytes_param: bytes | None = ...,
    ) -> None: ...

class RepositoryIndexRequest(_message.Message):
    __slots__ = ("ready", "repository_name")
    REPOSITORY_NAME_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    repository_name: str
    ready: bool
    def __init__(self, repository_name: str | None = ..., ready: bool | None = ...) -> None: ...

class RepositoryIndexResponse(_message.Message):
    __slots__ = ("models",)
    class ModelIndex(_message.Message):
        __slots__ = ("name", "reason", "state", "version")
        NAME_FIELD_NUMBER: _ClassVar[int]
        VERSION_FIELD_NUMBER: _ClassVar[int]
        STATE_FIELD_NUMBER: _ClassVar[int]
        REASON_FIELD_NUMBER: _ClassVar[int]
        name: str
        version: str
        state: str
        reason: str
        def __init__(
            self,
            name: str | None = ...,
            version: str | None = ...,
            state: str | None = ...,
            reason: str | None = ...,
        ) -> None: ...

    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[RepositoryIndexResponse.ModelIndex]
    def __init__(
        self, models: _Iterable[RepositoryIndexResponse.ModelIndex | _Mapping] | None = ...
    ) -> None: ...

class RepositoryModelLoadRequest(_message.Message):
    __slots__ = ("model_name", "parameters", "repository_name")
    class ParametersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: ModelRepositoryParameter
        def __init__(
            self, key: str | None = ..., value: ModelRepositoryParameter | _Mapping | None = ...
        ) -> None: ...

    REPOSITORY_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    repository_name: str
    model_name: str
    parameters: _containers.MessageMap[str, ModelRepositoryParameter]
    def __init__(
        self,
        repository_name: str | None = ...,
        model_name: str | None = ...,
        parameters: _Mapping[str, ModelRepositoryParameter] | None = ...,
    ) -> None: ...

class RepositoryModelLoadResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RepositoryModelUnloadRequest(_message.Message):
    __slots__ = ("model_name", "parameters", "repository_name")
    class ParametersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: ModelRepositoryParameter
        def __init__(
            self, key: str | None = ..., value: ModelRepositoryParameter | _Mapping | None = ...
        ) -> None: ...

    REPOSITORY_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    repository_name: str
    model_name: str
    parameters: _containers.MessageMap[str, ModelRepositoryParameter]
    def __init__(
        self,
        repository_name: str | None = ...,
        model_name: str | None = ...,
        parameters: _Mapping[str, ModelRepositoryParameter] | None = ...,
    ) -> None: ...

class RepositoryModelUnloadResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SystemSharedMemoryStatusRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: str | None = ...) -> None: ...

class SystemSharedMemoryStatusResponse(_message.Message):
    __slots__ = ("regions",)
    class RegionStatus(_message.Message):
        __slots__ = ("byte_size", "key", "name", "offset")
        NAME_FIELD_NUMBER: _ClassVar[int]
        KEY_FIELD_NUMBER: _ClassVar[int]
        OFFSET_FIELD_NUMBER: _ClassVar[int]
        BYTE_SIZE_FIELD_NUMBER: _ClassVar[int]
        name: str
        key: str
        offset: int
        byte_size: int
        def __init__(
            self,
            name: str | None = ...,
            key: str | None = ...,
            offset: int | None = ...,
            byte_size: int | None = ...,
        ) -> None: ...

    class RegionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: SystemSharedMemoryStatusResponse.RegionStatus
        def __init__(
            self,
            key: str | None = ...,
            value: SystemSharedMemoryStatusResponse.RegionStatus | _Mapping | None = ...,
        ) -> None: ...

    REGIONS_FIELD_NUMBER: _ClassVar[int]
    regions: _containers.MessageMap[str, SystemSharedMemoryStatusResponse.RegionStatus]
    def __init__(
        self, regions: _Mapping[str, SystemSharedMemoryStatusResponse.RegionStatus] | None = ...
    ) -> None: ...

class SystemSharedMemoryRegisterRequest(_message.Message):
    __slots__ = ("byte_size", "key", "name", "offset")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    BYTE_SIZE_FIELD_NUMBER: _ClassVar[int]
    name: str
    key: str
    offset: int
    byte_size: int
    def __init__(
        self,
        name: str | None = ...,
        key: str | None = ...,
        offset: int | None = ...,
        byte_size: int | None = ...,
    ) -> None: ...

class SystemSharedMemoryRegisterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SystemSharedMemoryUnregisterRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: str | None = ...) -> None: ...

class SystemSharedMemoryUnregisterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CudaSharedMemoryStatusRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: str | None = ...) -> None: ...

class CudaSharedMemoryStatusResponse(_message.Message):
    __slots__ = ("regions",)
    class RegionStatus(_message.Message):
        __slots__ = ("byte_size", "device_id", "name")
        NAME_FIELD_NUMBER: _ClassVar[int]
        DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
        BYTE_SIZE_FIELD_NUMBER: _ClassVar[int]
        name: str
        device_id: int
        byte_size: int
        def __init__(
            self, name: str | None = ..., device_id: int | None = ..., byte_size: int | None = ...
        ) -> None: ...

    class RegionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: CudaSharedMemoryStatusResponse.RegionStatus
        def __init__(
            self,
            key: str | None = ...,
            value: CudaSharedMemoryStatusResponse.RegionStatus | _Mapping | None = ...,
        ) -> None: ...

    REGIONS_FIELD_NUMBER: _ClassVar[int]
    regions: _containers.MessageMap[str, CudaSharedMemoryStatusResponse.RegionStatus]
    def __init__(
        self, regions: _Mapping[str, CudaSharedMemoryStatusResponse.RegionStatus] | None = ...
    ) -> None: ...

class CudaSharedMemoryRegisterRequest(_message.Message):
    __slots__ = ("byte_size", "device_id", "name", "raw_handle")
    NAME_FIELD_NUMBER: _ClassVar[int]
    RAW_HANDLE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    BYTE_SIZE_FIELD_NUMBER: _ClassVar[int]
    name: str
    raw_handle: bytes
    device_id: int
    byte_size: int
    def __init__(
        self,
        name: str | None = ...,
        raw_handle: bytes | None = ...,
        device_id: int | None = ...,
        byte_size: int | None = ...,
    ) -> None: ...

class CudaSharedMemoryRegisterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CudaSharedMemoryUnregisterRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: str | None = ...) -> None: ...

class CudaSharedMemoryUnregisterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LogSettingsRequest(_message.Message):
    __slots__ = ("settings",)
    class SettingValue(_message.Message):
        __slots__ = ("bool_param", "string_param", "uint32_param")
        BOOL_PARAM_FIELD_NUMBER: _ClassVar[int]
        UINT32_PARAM_FIELD_NUMBER: _ClassVar[int]
        STRING_PARAM_FIELD_NUMBER: _ClassVar[int]
        bool_param: bool
        uint32_param: int
        string_param: str
        def __init__(
            self,
            bool_param: bool | None = ...,
            uint32_param: int | None = ...,
            string_param: str | None = ...,
        ) -> None: ...

    class SettingsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: LogSettingsRequest.SettingValue
        def __init__(
            self,
            key: str | None = ...,
            value: LogSettingsRequest.SettingValue | _Mapping | None = ...,
        ) -> None: ...

    SETTINGS_FIELD_NUMBER: _ClassVar[int]
    settings: _containers.MessageMap[str, LogSettingsRequest.SettingValue]
    def __init__(
        self, settings: _Mapping[str, LogSettingsRequest.SettingValue] | None = ...
    ) -> None: ...

class LogSettingsResponse(_message.Message):
    __slots__ = ("settings",)
    class SettingValue(_message.Message):
        __slots__ = ("bool_param", "string_param", "uint32_param")
        BOOL_PARAM_FIELD_NUMBER: _ClassVar[int]
        UINT32_PARAM_FIELD_NUMBER: _ClassVar[int]
        STRING_PARAM_FIELD_NUMBER: _ClassVar[int]
        bool_param: bool
        uint32_param: int
        string_param: str
        def __init__(
            self,
            bool_param: bool | None = ...,
            uint32_param: int | None = ...,
            string_param: str | None = ...,
        ) -> None: ...

    class SettingsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: LogSettingsResponse.SettingValue
        def __init__(
            self,
            key: str | None = ...,
            value: LogSettingsResponse.SettingValue | _Mapping | None = ...,
        ) -> None: ...

    SETTINGS_FIELD_NUMBER: _ClassVar[int]
    settings: _containers.MessageMap[str, LogSettingsResponse.SettingValue]
    def __init__(
        self, settings: _Mapping[str, LogSettingsResponse.SettingValue] | None = ...
    ) -> None: ...

class TraceSettingRequest(_message.Message):
    __slots__ = ("model_name", "settings")
    class SettingValue(_message.Message):
        __slots__ = ("value",)
        VALUE_FIELD_NUMBER: _ClassVar[int]
        value: _containers.RepeatedScalarFieldContainer[str]
        def __init__(self, value: _Iterable[str] | None = ...) -> None: ...

    class SettingsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: TraceSettingRequest.SettingValue
        def __init__(
            self,
            key: str | None = ...,
            value: TraceSettingRequest.SettingValue | _Mapping | None = ...,
        ) -> None: ...

    SETTINGS_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    settings: _containers.MessageMap[str, TraceSettingRequest.SettingValue]
    model_name: str
    def __init__(
        self,
        settings: _Mapping[str, TraceSettingRequest.SettingValue] | None = ...,
        model_name: str | None = ...,
    ) -> None: ...

class TraceSettingResponse(_message.Message):
    __slots__ = ("settings",)
    class SettingValue(_message.Message):
        __slots__ = ("value",)
        VALUE_FIELD_NUMBER: _ClassVar[int]
        value: _containers.RepeatedScalarFieldContainer[str]
        def __init__(self, value: _Iterable[str] | None = ...) -> None: ...

    class SettingsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: TraceSettingResponse.SettingValue
        def __init__(
            self,
            key: str | None = ...,
            value: TraceSettingResponse.SettingValue | _Mapping | None = ...,
        ) -> None: ...

    SETTINGS_FIELD_NUMBER: _ClassVar[int]
    settings: _containers.MessageMap[str, TraceSettingResponse.SettingValue]
    def __init__(
        self, settings: _Mapping[str, TraceSettingResponse.SettingValue] | None = ...
    ) -> None: ...
