from mili.pb.common.v1 import chat_pb2 as _chat_pb2
from mili.pb.common.v1 import sampling_pb2 as _sampling_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class InstanceKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    INSTANCE_KIND_UNSPECIFIED: _ClassVar[InstanceKind]
    INSTANCE_KIND_PREFILL: _ClassVar[InstanceKind]
    INSTANCE_KIND_DECODE: _ClassVar[InstanceKind]

class InstanceState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    INSTANCE_STATE_UNSPECIFIED: _ClassVar[InstanceState]
    INSTANCE_STATE_UP: _ClassVar[InstanceState]
    INSTANCE_STATE_DOWN: _ClassVar[InstanceState]
    INSTANCE_STATE_DRAINING: _ClassVar[InstanceState]
INSTANCE_KIND_UNSPECIFIED: InstanceKind
INSTANCE_KIND_PREFILL: InstanceKind
INSTANCE_KIND_DECODE: InstanceKind
INSTANCE_STATE_UNSPECIFIED: InstanceState
INSTANCE_STATE_UP: InstanceState
INSTANCE_STATE_DOWN: InstanceState
INSTANCE_STATE_DRAINING: InstanceState

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt", "messages", "token_ids", "sampling", "enable_thinking", "allow_special_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    ENABLE_THINKING_FIELD_NUMBER: _ClassVar[int]
    ALLOW_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: str
    messages: _containers.RepeatedCompositeFieldContainer[_chat_pb2.ChatMessage]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _sampling_pb2.SamplingParams
    enable_thinking: bool
    allow_special_tokens: bool
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[_chat_pb2.ChatMessage, _Mapping]]] = ..., token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_sampling_pb2.SamplingParams, _Mapping]] = ..., enable_thinking: _Optional[bool] = ..., allow_special_tokens: _Optional[bool] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "logprobs", "finish_reason", "usage", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[_sampling_pb2.Logprobs]
    finish_reason: _sampling_pb2.FinishReason
    usage: Usage
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_sampling_pb2.Logprobs]
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[_sampling_pb2.Logprobs, _Mapping]]] = ..., finish_reason: _Optional[_Union[_sampling_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_sampling_pb2.Logprobs, _Mapping]]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ...) -> None: ...

class CompleteRequest(_message.Message):
    __slots__ = ("request_id", "prompt", "messages", "token_ids", "sampling", "enable_thinking", "allow_special_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    ENABLE_THINKING_FIELD_NUMBER: _ClassVar[int]
    ALLOW_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: str
    messages: _containers.RepeatedCompositeFieldContainer[_chat_pb2.ChatMessage]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _sampling_pb2.SamplingParams
    enable_thinking: bool
    allow_special_tokens: bool
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[_chat_pb2.ChatMessage, _Mapping]]] = ..., token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_sampling_pb2.SamplingParams, _Mapping]] = ..., enable_thinking: _Optional[bool] = ..., allow_special_tokens: _Optional[bool] = ...) -> None: ...

class CompleteResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "logprobs", "finish_reason", "usage", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[_sampling_pb2.Logprobs]
    finish_reason: _sampling_pb2.FinishReason
    usage: Usage
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_sampling_pb2.Logprobs]
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[_sampling_pb2.Logprobs, _Mapping]]] = ..., finish_reason: _Optional[_Union[_sampling_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_sampling_pb2.Logprobs, _Mapping]]] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("model", "max_context_tokens", "max_tokens_limit", "default_max_tokens", "prefill_addresses", "decode_addresses", "prefill_targets", "decode_targets", "instances", "target_problems")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_LIMIT_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    DECODE_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TARGETS_FIELD_NUMBER: _ClassVar[int]
    DECODE_TARGETS_FIELD_NUMBER: _ClassVar[int]
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    TARGET_PROBLEMS_FIELD_NUMBER: _ClassVar[int]
    model: str
    max_context_tokens: int
    max_tokens_limit: int
    default_max_tokens: int
    prefill_addresses: _containers.RepeatedScalarFieldContainer[str]
    decode_addresses: _containers.RepeatedScalarFieldContainer[str]
    prefill_targets: _containers.RepeatedScalarFieldContainer[str]
    decode_targets: _containers.RepeatedScalarFieldContainer[str]
    instances: _containers.RepeatedCompositeFieldContainer[Instance]
    target_problems: _containers.RepeatedCompositeFieldContainer[TargetProblem]
    def __init__(self, model: _Optional[str] = ..., max_context_tokens: _Optional[int] = ..., max_tokens_limit: _Optional[int] = ..., default_max_tokens: _Optional[int] = ..., prefill_addresses: _Optional[_Iterable[str]] = ..., decode_addresses: _Optional[_Iterable[str]] = ..., prefill_targets: _Optional[_Iterable[str]] = ..., decode_targets: _Optional[_Iterable[str]] = ..., instances: _Optional[_Iterable[_Union[Instance, _Mapping]]] = ..., target_problems: _Optional[_Iterable[_Union[TargetProblem, _Mapping]]] = ...) -> None: ...

class TargetProblem(_message.Message):
    __slots__ = ("target", "problem")
    TARGET_FIELD_NUMBER: _ClassVar[int]
    PROBLEM_FIELD_NUMBER: _ClassVar[int]
    target: str
    problem: str
    def __init__(self, target: _Optional[str] = ..., problem: _Optional[str] = ...) -> None: ...

class Instance(_message.Message):
    __slots__ = ("kind", "address", "state", "target", "num_in_flight")
    KIND_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    NUM_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    kind: InstanceKind
    address: str
    state: InstanceState
    target: str
    num_in_flight: int
    def __init__(self, kind: _Optional[_Union[InstanceKind, str]] = ..., address: _Optional[str] = ..., state: _Optional[_Union[InstanceState, str]] = ..., target: _Optional[str] = ..., num_in_flight: _Optional[int] = ...) -> None: ...
