from mili.pb.common.v1 import sampling_pb2 as _sampling_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PairRequest(_message.Message):
    __slots__ = ("host_id", "device", "transports", "layout", "checksums")
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    host_id: str
    device: str
    transports: _containers.RepeatedScalarFieldContainer[str]
    layout: KvLayout
    checksums: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, host_id: _Optional[str] = ..., device: _Optional[str] = ..., transports: _Optional[_Iterable[str]] = ..., layout: _Optional[_Union[KvLayout, _Mapping]] = ..., checksums: _Optional[_Iterable[str]] = ...) -> None: ...

class PairResponse(_message.Message):
    __slots__ = ("transport", "host_id", "shm_path", "num_blocks", "cuda_ipc_export", "checksum", "max_message_bytes")
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    SHM_PATH_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_EXPORT_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    transport: str
    host_id: str
    shm_path: str
    num_blocks: int
    cuda_ipc_export: bytes
    checksum: str
    max_message_bytes: int
    def __init__(self, transport: _Optional[str] = ..., host_id: _Optional[str] = ..., shm_path: _Optional[str] = ..., num_blocks: _Optional[int] = ..., cuda_ipc_export: _Optional[bytes] = ..., checksum: _Optional[str] = ..., max_message_bytes: _Optional[int] = ...) -> None: ...

class KvLayout(_message.Message):
    __slots__ = ("block_size", "num_layers", "num_kv_heads", "head_dim", "dtype", "block_order", "model_fingerprint")
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_ORDER_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    block_order: str
    model_fingerprint: str
    def __init__(self, block_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ..., block_order: _Optional[str] = ..., model_fingerprint: _Optional[str] = ...) -> None: ...

class TransferKvRequest(_message.Message):
    __slots__ = ("header", "chunk", "commit", "chunks", "abort")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    header: TransferHeader
    chunk: KvChunk
    commit: TransferCommit
    chunks: KvChunks
    abort: TransferAbort
    def __init__(self, header: _Optional[_Union[TransferHeader, _Mapping]] = ..., chunk: _Optional[_Union[KvChunk, _Mapping]] = ..., commit: _Optional[_Union[TransferCommit, _Mapping]] = ..., chunks: _Optional[_Union[KvChunks, _Mapping]] = ..., abort: _Optional[_Union[TransferAbort, _Mapping]] = ...) -> None: ...

class TransferAbort(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class KvChunks(_message.Message):
    __slots__ = ("chunks", "commit")
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    chunks: _containers.RepeatedCompositeFieldContainer[KvChunk]
    commit: TransferCommit
    def __init__(self, chunks: _Optional[_Iterable[_Union[KvChunk, _Mapping]]] = ..., commit: _Optional[_Union[TransferCommit, _Mapping]] = ...) -> None: ...

class TransferHeader(_message.Message):
    __slots__ = ("request_id", "layout", "num_tokens", "num_chunks", "transfer_token", "transport", "checksum")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    layout: KvLayout
    num_tokens: int
    num_chunks: int
    transfer_token: str
    transport: str
    checksum: str
    def __init__(self, request_id: _Optional[str] = ..., layout: _Optional[_Union[KvLayout, _Mapping]] = ..., num_tokens: _Optional[int] = ..., num_chunks: _Optional[int] = ..., transfer_token: _Optional[str] = ..., transport: _Optional[str] = ..., checksum: _Optional[str] = ...) -> None: ...

class KvChunk(_message.Message):
    __slots__ = ("request_id", "seq", "layer", "block_ids", "data", "crc32", "xxh3_64")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    XXH3_64_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    seq: int
    layer: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    crc32: int
    xxh3_64: int
    def __init__(self, request_id: _Optional[str] = ..., seq: _Optional[int] = ..., layer: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ..., crc32: _Optional[int] = ..., xxh3_64: _Optional[int] = ...) -> None: ...

class TransferCommit(_message.Message):
    __slots__ = ("first_token_id", "first_logprobs")
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    first_logprobs: _sampling_pb2.Logprobs
    def __init__(self, first_token_id: _Optional[int] = ..., first_logprobs: _Optional[_Union[_sampling_pb2.Logprobs, _Mapping]] = ...) -> None: ...

class TransferKvResponse(_message.Message):
    __slots__ = ("num_blocks", "num_bytes")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    num_bytes: int
    def __init__(self, num_blocks: _Optional[int] = ..., num_bytes: _Optional[int] = ...) -> None: ...

class PrefixCacheInfo(_message.Message):
    __slots__ = ("enabled", "num_cached_blocks", "query_tokens", "hit_tokens", "evicted_blocks")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    QUERY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EVICTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    num_cached_blocks: int
    query_tokens: int
    hit_tokens: int
    evicted_blocks: int
    def __init__(self, enabled: _Optional[bool] = ..., num_cached_blocks: _Optional[int] = ..., query_tokens: _Optional[int] = ..., hit_tokens: _Optional[int] = ..., evicted_blocks: _Optional[int] = ...) -> None: ...
