from mili.pb.common.v1 import sampling_pb2 as _sampling_pb2
from mili.pb.kv.v1 import kv_pb2 as _kv_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "prefill_layout", "kv_lease_ms", "client_request_id", "priority")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PREFILL_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    KV_LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    CLIENT_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _sampling_pb2.SamplingParams
    prefill_layout: _kv_pb2.KvLayout
    kv_lease_ms: int
    client_request_id: str
    priority: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_sampling_pb2.SamplingParams, _Mapping]] = ..., prefill_layout: _Optional[_Union[_kv_pb2.KvLayout, _Mapping]] = ..., kv_lease_ms: _Optional[int] = ..., client_request_id: _Optional[str] = ..., priority: _Optional[int] = ...) -> None: ...

class GenerateStreamRequest(_message.Message):
    __slots__ = ("starts", "cancel_request_ids")
    STARTS_FIELD_NUMBER: _ClassVar[int]
    CANCEL_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    starts: _containers.RepeatedCompositeFieldContainer[StreamedGenerate]
    cancel_request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, starts: _Optional[_Iterable[_Union[StreamedGenerate, _Mapping]]] = ..., cancel_request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class StreamedGenerate(_message.Message):
    __slots__ = ("request", "timeout_ms", "trace_context")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    request: GenerateRequest
    timeout_ms: int
    trace_context: _containers.ScalarMap[str, str]
    def __init__(self, request: _Optional[_Union[GenerateRequest, _Mapping]] = ..., timeout_ms: _Optional[int] = ..., trace_context: _Optional[_Mapping[str, str]] = ...) -> None: ...

class GenerateStreamResponse(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[StreamedEvent]
    def __init__(self, events: _Optional[_Iterable[_Union[StreamedEvent, _Mapping]]] = ...) -> None: ...

class StreamedEvent(_message.Message):
    __slots__ = ("request_id", "admitted", "tokens", "error")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    admitted: Admitted
    tokens: Tokens
    error: RequestError
    def __init__(self, request_id: _Optional[str] = ..., admitted: _Optional[_Union[Admitted, _Mapping]] = ..., tokens: _Optional[_Union[Tokens, _Mapping]] = ..., error: _Optional[_Union[RequestError, _Mapping]] = ...) -> None: ...

class RequestError(_message.Message):
    __slots__ = ("code", "message", "status_details")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    STATUS_DETAILS_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    status_details: bytes
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., status_details: _Optional[bytes] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("admitted", "tokens")
    ADMITTED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    admitted: Admitted
    tokens: Tokens
    def __init__(self, admitted: _Optional[_Union[Admitted, _Mapping]] = ..., tokens: _Optional[_Union[Tokens, _Mapping]] = ...) -> None: ...

class Admitted(_message.Message):
    __slots__ = ("kv_lease_ms", "prompt_block_ids", "transfer_token", "num_cached_blocks")
    KV_LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    kv_lease_ms: int
    prompt_block_ids: _containers.RepeatedScalarFieldContainer[int]
    transfer_token: str
    num_cached_blocks: int
    def __init__(self, kv_lease_ms: _Optional[int] = ..., prompt_block_ids: _Optional[_Iterable[int]] = ..., transfer_token: _Optional[str] = ..., num_cached_blocks: _Optional[int] = ...) -> None: ...

class Tokens(_message.Message):
    __slots__ = ("token_ids", "logprobs", "finish_reason")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_sampling_pb2.Logprobs]
    finish_reason: _sampling_pb2.FinishReason
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_sampling_pb2.Logprobs, _Mapping]]] = ..., finish_reason: _Optional[_Union[_sampling_pb2.FinishReason, str]] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("model", "dtype", "device", "kv_layout", "attention_backend", "max_context_tokens", "max_running", "num_total_blocks", "num_free_blocks", "num_running", "num_waiting", "kv_cache_bytes", "num_cuda_graphs", "prefix_cache", "kv_transports", "fused_ops", "architecture", "num_experts", "num_active_experts", "tokenizer_file_sha256")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_BACKEND_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_CUDA_GRAPHS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    FUSED_OPS_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACTIVE_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FILE_SHA256_FIELD_NUMBER: _ClassVar[int]
    model: str
    dtype: str
    device: str
    kv_layout: _kv_pb2.KvLayout
    attention_backend: str
    max_context_tokens: int
    max_running: int
    num_total_blocks: int
    num_free_blocks: int
    num_running: int
    num_waiting: int
    kv_cache_bytes: int
    num_cuda_graphs: int
    prefix_cache: _kv_pb2.PrefixCacheInfo
    kv_transports: _containers.RepeatedScalarFieldContainer[str]
    fused_ops: str
    architecture: str
    num_experts: int
    num_active_experts: int
    tokenizer_file_sha256: str
    def __init__(self, model: _Optional[str] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., kv_layout: _Optional[_Union[_kv_pb2.KvLayout, _Mapping]] = ..., attention_backend: _Optional[str] = ..., max_context_tokens: _Optional[int] = ..., max_running: _Optional[int] = ..., num_total_blocks: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., kv_cache_bytes: _Optional[int] = ..., num_cuda_graphs: _Optional[int] = ..., prefix_cache: _Optional[_Union[_kv_pb2.PrefixCacheInfo, _Mapping]] = ..., kv_transports: _Optional[_Iterable[str]] = ..., fused_ops: _Optional[str] = ..., architecture: _Optional[str] = ..., num_experts: _Optional[int] = ..., num_active_experts: _Optional[int] = ..., tokenizer_file_sha256: _Optional[str] = ...) -> None: ...
