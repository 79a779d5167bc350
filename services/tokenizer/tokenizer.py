"""A checkpoint's tokenizer: HF `tokenizers` plus the checkpoint's chat template and EOS ids.

Loads from an HF model directory:
    tokenizer.json          required: the fast tokenizer (vocabulary, merges, added tokens)
    chat_template.jinja     optional: the chat template (before tokenizer_config.json's)
    tokenizer_config.json   optional: chat_template, eos_token
    generation_config.json  optional: eos_token_id (int or list), which ends generation;
                            temperature, top_p, top_k, min_p, repetition_penalty: the
                            model's sampling defaults (the frontend fills unset fields)
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Encoding, Tokenizer

from mili.engine.sampling_params import MODEL_DEFAULT_FIELDS, SamplingParams
from mili.errors import InvalidArgument, StartupError
from services.tokenizer.chat_content import ChatPrompt, ContentGuard
from services.tokenizer.chat_template import ChatTemplate, Message
from services.tokenizer.tools import Tool


@dataclass(frozen=True)
class SpecialToken:
    content: str
    id: int


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise StartupError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise StartupError(f"{path} must hold a JSON object, found {type(data).__name__}")
    return data


def _sampling_defaults(generation: dict[str, Any], model_dir: Path) -> dict[str, Any]:
    """The sampling fields generation_config.json sets, checked as a request's would be: a
    checkpoint whose defaults every request would be refused for fails the start instead."""
    defaults = {f: generation[f] for f in MODEL_DEFAULT_FIELDS if generation.get(f) is not None}
    if defaults.get("top_k") == -1:  # some configs write vLLM's "off"
        defaults["top_k"] = 0
    try:
        SamplingParams(**defaults)
    except InvalidArgument as e:
        raise StartupError(f"{model_dir / 'generation_config.json'}: {e}") from None
    return defaults


class ModelTokenizer:
    """Encode/decode with one checkpoint's tokenizer; every method is safe to call from threads."""

    def __init__(self, model_dir: Path) -> None:
        if not model_dir.is_dir():
            raise StartupError(f"model directory {model_dir} does not exist")
        path = model_dir / "tokenizer.json"
        if not path.exists():
            raise StartupError(f"model directory {model_dir} has no tokenizer.json")
        try:
            # Kept as read: the frontend detokenizes with the same file (GetTokenizerFile).
            self.file_bytes = path.read_bytes()
            self._tokenizer = Tokenizer.from_str(self.file_bytes.decode("utf-8"))
        except Exception as e:  # the Rust loader raises a bare Exception with a parse message
            raise StartupError(f"{path} is not a valid tokenizer file: {e}") from None
        self.file_sha256 = hashlib.sha256(self.file_bytes).hexdigest()
        config = _read_json(model_dir / "tokenizer_config.json") or {}
        generation = _read_json(model_dir / "generation_config.json") or {}

        self.model_name = model_dir.resolve().name
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        self.special_tokens = sorted(
            (
                SpecialToken(t.content, i)
                for i, t in self._tokenizer.get_added_tokens_decoder().items()
            ),
            key=lambda t: t.id,
        )
        self.eos_token_ids = self._eos_ids(config, generation, path)
        self.sampling_defaults = _sampling_defaults(generation, model_dir)
        self._guard = ContentGuard(
            (t.content, i)
            for i, t in self._tokenizer.get_added_tokens_decoder().items()
            if t.special
        )
        # The same tokenizer with special-token matching off, for chat content that holds
        # special-token strings; made on first use (most deployments never need it). A second
        # object, not a flag flipped on the first: other threads encode with that one meanwhile.
        self._as_text: Tokenizer | None = None
        self._as_text_lock = threading.Lock()
        # chat_template.jinja first, as HF loads it: transformers' save_pretrained writes the
        # template there and drops tokenizer_config.json's entry.
        template_file = model_dir / "chat_template.jinja"
        template_source = f"{template_file}"
        if template_file.is_file():
            template: object = template_file.read_text(encoding="utf-8")
        else:
            template = config.get("chat_template")
            template_source = f"{model_dir / 'tokenizer_config.json'}: chat_template"
        if isinstance(template, list):  # HF's named templates: [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        try:
            self.chat_template = ChatTemplate(
                template if isinstance(template, str) else None,
                bos_token=_token_text(config.get("bos_token")),
                eos_token=_token_text(config.get("eos_token")),
            )
        except ValueError as e:
            raise StartupError(f"{template_source}: {e}") from None

    def _eos_ids(self, config: dict[str, Any], generation: dict[str, Any], path: Path) -> list[int]:
        ids = generation.get("eos_token_id")
        if ids is None:
            eos = _token_text(config.get("eos_token"))
            token_id = self._tokenizer.token_to_id(eos) if eos else None
            return [] if token_id is None else [token_id]
        ids = [ids] if isinstance(ids, int) else list(ids)
        bad = [i for i in ids if not isinstance(i, int) or not 0 <= i < self.vocab_size]
        if bad:
            raise StartupError(
                f"generation_config.json beside {path}: eos_token_id {bad} not in vocab"
            )
        return ids

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, with no special tokens added (Qwen adds none anyway)."""
        return list(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def tokenize_chat(
        self,
        messages: list[Message],
        add_generation_prompt: bool,
        enable_thinking: bool | None,
        *,
        tools: list[Tool] | None = None,
        allow_special_tokens: bool = False,
    ) -> ChatPrompt:
        """The rendered conversation (with `tools` offered) and its ids. Special-token strings
        in the messages and tools are text (services/tokenizer/chat_content.py) unless
        `allow_special_tokens`; without any, the ids are those of the whole prompt, as HF's
        apply_chat_template(messages, tools=...) gives them."""
        offered = tools or []

        def render(turns: list[Message], listed: list[Tool]) -> str:
            return self.chat_template.render(turns, add_generation_prompt, enable_thinking, listed)

        if allow_special_tokens or not self._guard.finds_special_text(messages, offered):
            prompt = render(messages, offered)
            return ChatPrompt(prompt, self.encode(prompt))
        return self._guard.encode(messages, offered, render, self._encode, self._encode_as_text)

    def _encode(self, text: str) -> Encoding:
        return self._tokenizer.encode(text, add_special_tokens=False)

    def _encode_as_text(self, texts: list[str]) -> list[list[int]]:
        """Ids of each text with special-token strings split into their characters."""
        with self._as_text_lock:
            if self._as_text is None:
                tokenizer = Tokenizer.from_str(self.file_bytes.decode("utf-8"))
                tokenizer.encode_special_tokens = True
                self._as_text = tokenizer
        return [list(self._as_text.encode(t, add_special_tokens=False).ids) for t in texts]

    def check_ids(self, token_ids: list[int]) -> None:
        """Raise InvalidArgument naming the first id outside the vocabulary."""
        for i, token_id in enumerate(token_ids):
            if not 0 <= token_id < self.vocab_size:
                raise InvalidArgument(
                    f"token_ids[{i}]",
                    token_id,
                    f"outside the vocabulary (ids 0..{self.vocab_size - 1})",
                )

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        """Text of `token_ids`; bytes of an incomplete character become U+FFFD."""
        return self._tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)


def _token_text(value: object) -> str | None:
    """tokenizer_config.json writes a token as a string or as {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None
