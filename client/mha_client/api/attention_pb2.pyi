from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]

class Variant(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    VARIANT_UNSPECIFIED: _ClassVar[Variant]
    VARIANT_MHA: _ClassVar[Variant]
    VARIANT_GQA: _ClassVar[Variant]
    VARIANT_MQA: _ClassVar[Variant]
DTYPE_UNSPECIFIED: DType
DTYPE_FLOAT32: DType
DTYPE_FLOAT16: DType
DTYPE_BFLOAT16: DType
VARIANT_UNSPECIFIED: Variant
VARIANT_MHA: Variant
VARIANT_GQA: Variant
VARIANT_MQA: Variant

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class WeightsRequest(_message.Message):
    __slots__ = ("enabled", "heads", "query_start", "query_end", "dtype")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    HEADS_FIELD_NUMBER: _ClassVar[int]
    QUERY_START_FIELD_NUMBER: _ClassVar[int]
    QUERY_END_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    heads: _containers.RepeatedScalarFieldContainer[int]
    query_start: int
    query_end: int
    dtype: DType
    def __init__(self, enabled: _Optional[bool] = ..., heads: _Optional[_Iterable[int]] = ..., query_start: _Optional[int] = ..., query_end: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ...) -> None: ...

class AttendRequest(_message.Message):
    __slots__ = ("model", "input", "lengths", "causal", "weights", "head_mask", "output_dtype", "session_id")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    INPUT_FIELD_NUMBER: _ClassVar[int]
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    CAUSAL_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    HEAD_MASK_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_DTYPE_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    model: str
    input: Tensor
    lengths: _containers.RepeatedScalarFieldContainer[int]
    causal: bool
    weights: WeightsRequest
    head_mask: _containers.RepeatedScalarFieldContainer[float]
    output_dtype: DType
    session_id: str
    def __init__(self, model: _Optional[str] = ..., input: _Optional[_Union[Tensor, _Mapping]] = ..., lengths: _Optional[_Iterable[int]] = ..., causal: _Optional[bool] = ..., weights: _Optional[_Union[WeightsRequest, _Mapping]] = ..., head_mask: _Optional[_Iterable[float]] = ..., output_dtype: _Optional[_Union[DType, str]] = ..., session_id: _Optional[str] = ...) -> None: ...

class Timing(_message.Message):
    __slots__ = ("queue_ms", "compute_ms", "total_ms", "batch_size", "restore_ms")
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    RESTORE_MS_FIELD_NUMBER: _ClassVar[int]
    queue_ms: float
    compute_ms: float
    total_ms: float
    batch_size: int
    restore_ms: float
    def __init__(self, queue_ms: _Optional[float] = ..., compute_ms: _Optional[float] = ..., total_ms: _Optional[float] = ..., batch_size: _Optional[int] = ..., restore_ms: _Optional[float] = ...) -> None: ...

class AttendResponse(_message.Message):
    __slots__ = ("model", "output", "attention_weights", "weight_heads", "weight_query_start", "timing", "session")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_HEADS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_QUERY_START_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    model: str
    output: Tensor
    attention_weights: Tensor
    weight_heads: _containers.RepeatedScalarFieldContainer[int]
    weight_query_start: int
    timing: Timing
    session: SessionInfo
    def __init__(self, model: _Optional[str] = ..., output: _Optional[_Union[Tensor, _Mapping]] = ..., attention_weights: _Optional[_Union[Tensor, _Mapping]] = ..., weight_heads: _Optional[_Iterable[int]] = ..., weight_query_start: _Optional[int] = ..., timing: _Optional[_Union[Timing, _Mapping]] = ..., session: _Optional[_Union[SessionInfo, _Mapping]] = ...) -> None: ...

class CreateSessionRequest(_message.Message):
    __slots__ = ("model", "max_len", "ttl_s")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MAX_LEN_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    model: str
    max_len: int
    ttl_s: float
    def __init__(self, model: _Optional[str] = ..., max_len: _Optional[int] = ..., ttl_s: _Optional[float] = ...) -> None: ...

class GetSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class ForkSessionRequest(_message.Message):
    __slots__ = ("session_id", "ttl_s")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    ttl_s: float
    def __init__(self, session_id: _Optional[str] = ..., ttl_s: _Optional[float] = ...) -> None: ...

class TruncateSessionRequest(_message.Message):
    __slots__ = ("session_id", "num_tokens")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    num_tokens: int
    def __init__(self, session_id: _Optional[str] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CloseSessionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SessionInfo(_message.Message):
    __slots__ = ("session_id", "model", "num_tokens", "max_len", "ttl_s", "num_blocks", "bytes_held")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_LEN_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_HELD_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    model: str
    num_tokens: int
    max_len: int
    ttl_s: float
    num_blocks: int
    bytes_held: int
    def __init__(self, session_id: _Optional[str] = ..., model: _Optional[str] = ..., num_tokens: _Optional[int] = ..., max_len: _Optional[int] = ..., ttl_s: _Optional[float] = ..., num_blocks: _Optional[int] = ..., bytes_held: _Optional[int] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class ModelLimits(_message.Message):
    __slots__ = ("max_seq_len", "max_batch_size", "max_weights_bytes", "max_request_bytes", "max_response_bytes")
    MAX_SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_WEIGHTS_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_REQUEST_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_RESPONSE_BYTES_FIELD_NUMBER: _ClassVar[int]
    max_seq_len: int
    max_batch_size: int
    max_weights_bytes: int
    max_request_bytes: int
    max_response_bytes: int
    def __init__(self, max_seq_len: _Optional[int] = ..., max_batch_size: _Optional[int] = ..., max_weights_bytes: _Optional[int] = ..., max_request_bytes: _Optional[int] = ..., max_response_bytes: _Optional[int] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "variant", "embed_dim", "num_heads", "num_kv_heads", "head_dim", "bias", "causal_default", "dtype", "device", "limits", "num_parameters", "kv_cache")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VARIANT_FIELD_NUMBER: _ClassVar[int]
    EMBED_DIM_FIELD_NUMBER: _ClassVar[int]
    NUM_HEADS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    BIAS_FIELD_NUMBER: _ClassVar[int]
    CAUSAL_DEFAULT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    NUM_PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_FIELD_NUMBER: _ClassVar[int]
    name: str
    variant: Variant
    embed_dim: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    bias: bool
    causal_default: bool
    dtype: DType
    device: str
    limits: ModelLimits
    num_parameters: int
    kv_cache: KVCacheInfo
    def __init__(self, name: _Optional[str] = ..., variant: _Optional[_Union[Variant, str]] = ..., embed_dim: _Optional[int] = ..., num_heads: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., bias: _Optional[bool] = ..., causal_default: _Optional[bool] = ..., dtype: _Optional[_Union[DType, str]] = ..., device: _Optional[str] = ..., limits: _Optional[_Union[ModelLimits, _Mapping]] = ..., num_parameters: _Optional[int] = ..., kv_cache: _Optional[_Union[KVCacheInfo, _Mapping]] = ...) -> None: ...

class KVCacheInfo(_message.Message):
    __slots__ = ("budget_bytes", "block_size", "bytes_per_token", "num_blocks", "num_blocks_used", "num_sessions", "evict_idle_sessions", "dtype")
    BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    NUM_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    EVICT_IDLE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    budget_bytes: int
    block_size: int
    bytes_per_token: int
    num_blocks: int
    num_blocks_used: int
    num_sessions: int
    evict_idle_sessions: bool
    dtype: DType
    def __init__(self, budget_bytes: _Optional[int] = ..., block_size: _Optional[int] = ..., bytes_per_token: _Optional[int] = ..., num_blocks: _Optional[int] = ..., num_blocks_used: _Optional[int] = ..., num_sessions: _Optional[int] = ..., evict_idle_sessions: _Optional[bool] = ..., dtype: _Optional[_Union[DType, str]] = ...) -> None: ...

class AnalyzeHeadsRequest(_message.Message):
    __slots__ = ("attend", "include_weights")
    ATTEND_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    attend: AttendRequest
    include_weights: bool
    def __init__(self, attend: _Optional[_Union[AttendRequest, _Mapping]] = ..., include_weights: _Optional[bool] = ...) -> None: ...

class HeadStats(_message.Message):
    __slots__ = ("head", "mean_entropy", "mean_max_weight", "importance")
    HEAD_FIELD_NUMBER: _ClassVar[int]
    MEAN_ENTROPY_FIELD_NUMBER: _ClassVar[int]
    MEAN_MAX_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    IMPORTANCE_FIELD_NUMBER: _ClassVar[int]
    head: int
    mean_entropy: float
    mean_max_weight: float
    importance: float
    def __init__(self, head: _Optional[int] = ..., mean_entropy: _Optional[float] = ..., mean_max_weight: _Optional[float] = ..., importance: _Optional[float] = ...) -> None: ...

class PruningStep(_message.Message):
    __slots__ = ("num_pruned", "head", "output_error", "head_mask")
    NUM_PRUNED_FIELD_NUMBER: _ClassVar[int]
    HEAD_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_ERROR_FIELD_NUMBER: _ClassVar[int]
    HEAD_MASK_FIELD_NUMBER: _ClassVar[int]
    num_pruned: int
    head: int
    output_error: float
    head_mask: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, num_pruned: _Optional[int] = ..., head: _Optional[int] = ..., output_error: _Optional[float] = ..., head_mask: _Optional[_Iterable[float]] = ...) -> None: ...

class AnalyzeHeadsResponse(_message.Message):
    __slots__ = ("model", "heads", "pruning", "attention_weights", "compute_ms")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    HEADS_FIELD_NUMBER: _ClassVar[int]
    PRUNING_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    model: str
    heads: _containers.RepeatedCompositeFieldContainer[HeadStats]
    pruning: _containers.RepeatedCompositeFieldContainer[PruningStep]
    attention_weights: Tensor
    compute_ms: float
    def __init__(self, model: _Optional[str] = ..., heads: _Optional[_Iterable[_Union[HeadStats, _Mapping]]] = ..., pruning: _Optional[_Iterable[_Union[PruningStep, _Mapping]]] = ..., attention_weights: _Optional[_Union[Tensor, _Mapping]] = ..., compute_ms: _Optional[float] = ...) -> None: ...
