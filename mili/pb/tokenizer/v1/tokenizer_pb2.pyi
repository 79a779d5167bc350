from mili.pb.common.v1 import chat_pb2 as _chat_pb2
from mili.pb.common.v1 import sampling_pb2 as _sampling_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TokenizeRequest(_message.Message):
    __slots__ = ("text", "messages", "add_generation_prompt", "enable_thinking", "allow_special_tokens", "tools")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    ENABLE_THINKING_FIELD_NUMBER: _ClassVar[int]
    ALLOW_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    text: str
    messages: _containers.RepeatedCompositeFieldContainer[_chat_pb2.ChatMessage]
    add_generation_prompt: bool
    enable_thinking: bool
    allow_special_tokens: bool
    tools: _containers.RepeatedCompositeFieldContainer[_chat_pb2.Tool]
    def __init__(self, text: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[_chat_pb2.ChatMessage, _Mapping]]] = ..., add_generation_prompt: _Optional[bool] = ..., enable_thinking: _Optional[bool] = ..., allow_special_tokens: _Optional[bool] = ..., tools: _Optional[_Iterable[_Union[_chat_pb2.Tool, _Mapping]]] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("token_ids", "prompt")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt: str
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., prompt: _Optional[str] = ...) -> None: ...

class DetokenizeRequest(_message.Message):
    __slots__ = ("token_ids", "skip_special_tokens")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    skip_special_tokens: bool
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., skip_special_tokens: _Optional[bool] = ...) -> None: ...

class DetokenizeResponse(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...

class DetokenizeStreamRequest(_message.Message):
    __slots__ = ("token_ids", "skip_special_tokens", "final")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    skip_special_tokens: bool
    final: bool
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., skip_special_tokens: _Optional[bool] = ..., final: _Optional[bool] = ...) -> None: ...

class DetokenizeStreamResponse(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SpecialToken(_message.Message):
    __slots__ = ("content", "id")
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    content: str
    id: int
    def __init__(self, content: _Optional[str] = ..., id: _Optional[int] = ...) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("model", "vocab_size", "special_tokens", "eos_token_ids", "chat_template_source", "max_input_chars", "max_token_ids", "tokenizer_file_sha256", "sampling_defaults")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_SOURCE_FIELD_NUMBER: _ClassVar[int]
    MAX_INPUT_CHARS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FILE_SHA256_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_DEFAULTS_FIELD_NUMBER: _ClassVar[int]
    model: str
    vocab_size: int
    special_tokens: _containers.RepeatedCompositeFieldContainer[SpecialToken]
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    chat_template_source: str
    max_input_chars: int
    max_token_ids: int
    tokenizer_file_sha256: str
    sampling_defaults: _sampling_pb2.SamplingParams
    def __init__(self, model: _Optional[str] = ..., vocab_size: _Optional[int] = ..., special_tokens: _Optional[_Iterable[_Union[SpecialToken, _Mapping]]] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., chat_template_source: _Optional[str] = ..., max_input_chars: _Optional[int] = ..., max_token_ids: _Optional[int] = ..., tokenizer_file_sha256: _Optional[str] = ..., sampling_defaults: _Optional[_Union[_sampling_pb2.SamplingParams, _Mapping]] = ...) -> None: ...

class GetTokenizerFileRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetTokenizerFileResponse(_message.Message):
    __slots__ = ("tokenizer_json", "sha256")
    TOKENIZER_JSON_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    tokenizer_json: bytes
    sha256: str
    def __init__(self, tokenizer_json: _Optional[bytes] = ..., sha256: _Optional[str] = ...) -> None: ...
