from mili.pb.common.v1 import sampling_pb2 as _sampling_pb2
from mili.pb.kv.v1 import kv_pb2 as _kv_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KvDestination(_message.Message):
    __slots__ = ("address", "prompt_block_ids", "transfer_token", "num_cached_blocks")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    address: str
    prompt_block_ids: _containers.RepeatedScalarFieldContainer[int]
    transfer_token: str
    num_cached_blocks: int
    def __init__(self, address: _Optional[str] = ..., prompt_block_ids: _Optional[_Iterable[int]] = ..., transfer_token: _Optional[str] = ..., num_cached_blocks: _Optional[int] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "sampling", "destination", "prompt_token_ids", "client_request_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CLIENT_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    sampling: _sampling_pb2.SamplingParams
    destination: KvDestination
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    client_request_id: str
    def __init__(self, request_id: _Optional[str] = ..., sampling: _Optional[_Union[_sampling_pb2.SamplingParams, _Mapping]] = ..., destination: _Optional[_Union[KvDestination, _Mapping]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., client_request_id: _Optional[str] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token_id", "first_logprobs", "num_prompt_tokens", "queue_ms", "compute_ms", "transfer_ms", "kv_bytes", "num_cached_tokens", "prompt_logprobs")
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_MS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    first_logprobs: _sampling_pb2.Logprobs
    num_prompt_tokens: int
    queue_ms: float
    compute_ms: float
    transfer_ms: float
    kv_bytes: int
    num_cached_tokens: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_sampling_pb2.Logprobs]
    def __init__(self, first_token_id: _Optional[int] = ..., first_logprobs: _Optional[_Union[_sampling_pb2.Logprobs, _Mapping]] = ..., num_prompt_tokens: _Optional[int] = ..., queue_ms: _Optional[float] = ..., compute_ms: _Optional[float] = ..., transfer_ms: _Optional[float] = ..., kv_bytes: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_sampling_pb2.Logprobs, _Mapping]]] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("model", "dtype", "device", "kv_layout", "attention_backend", "max_prompt_tokens", "max_batch_tokens", "num_queued_tokens", "num_total_blocks", "num_free_blocks", "kv_cache_bytes", "prefix_cache", "kv_transports", "fused_ops", "architecture", "num_experts", "num_active_experts", "tokenizer_file_sha256", "num_cuda_graphs")
    class KvTransportsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_BACKEND_FIELD_NUMBER: _ClassVar[int]
    MAX_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_QUEUED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    FUSED_OPS_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACTIVE_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FILE_SHA256_FIELD_NUMBER: _ClassVar[int]
    NUM_CUDA_GRAPHS_FIELD_NUMBER: _ClassVar[int]
    model: str
    dtype: str
    device: str
    kv_layout: _kv_pb2.KvLayout
    attention_backend: str
    max_prompt_tokens: int
    max_batch_tokens: int
    num_queued_tokens: int
    num_total_blocks: int
    num_free_blocks: int
    kv_cache_bytes: int
    prefix_cache: _kv_pb2.PrefixCacheInfo
    kv_transports: _containers.ScalarMap[str, str]
    fused_ops: str
    architecture: str
    num_experts: int
    num_active_experts: int
    tokenizer_file_sha256: str
    num_cuda_graphs: int
    def __init__(self, model: _Optional[str] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., kv_layout: _Optional[_Union[_kv_pb2.KvLayout, _Mapping]] = ..., attention_backend: _Optional[str] = ..., max_prompt_tokens: _Optional[int] = ..., max_batch_tokens: _Optional[int] = ..., num_queued_tokens: _Optional[int] = ..., num_total_blocks: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., kv_cache_bytes: _Optional[int] = ..., prefix_cache: _Optional[_Union[_kv_pb2.PrefixCacheInfo, _Mapping]] = ..., kv_transports: _Optional[_Mapping[str, str]] = ..., fused_ops: _Optional[str] = ..., architecture: _Optional[str] = ..., num_experts: _Optional[int] = ..., num_active_experts: _Optional[int] = ..., tokenizer_file_sha256: _Optional[str] = ..., num_cuda_graphs: _Optional[int] = ...) -> None: ...
