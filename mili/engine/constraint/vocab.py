"""The tokenizer as the grammar engine sees it: token bytes, the model's row count, EOS ids.

llguidance reads tokenizer.json itself (HF tokenizers format), so the engine's grammar
vocabulary is built from the very bytes whose sha256 the tokenizer service publishes
(`tokenizer_file_sha256`): prefill and decode that hold the same file compile the same masks.

The model's vocabulary (its embedding/logit rows) may be larger than the tokenizer's (Qwen3:
151,936 rows for 151,669 tokens; the demo model 896 for 836). Masks have one bit per model row,
and the padded rows are never allowed.

Building it takes about a second for a Qwen3-sized vocabulary (docs/benchmarks.md): build it once
per service, off the event loop.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import llguidance


class GrammarTokenizer:
    """llguidance's tokenizer for one tokenizer.json, `vocab_rows` model rows and EOS ids."""

    def __init__(
        self, tokenizer_json: bytes, vocab_rows: int, eos_token_ids: Sequence[int]
    ) -> None:
        num_tokens = _num_tokens(tokenizer_json)
        if vocab_rows < num_tokens:
            raise ValueError(f"vocab_rows {vocab_rows} < the tokenizer's {num_tokens} tokens")
        if not eos_token_ids or not all(0 <= t < num_tokens for t in eos_token_ids):
            raise ValueError(f"eos_token_ids {list(eos_token_ids)} are not tokenizer ids")
        self.source = tokenizer_json  # what a compile's child process builds its own from
        self.file_sha256 = hashlib.sha256(tokenizer_json).hexdigest()
        self.num_tokens = num_tokens
        self.vocab_rows = vocab_rows
        self.eos_token_ids = tuple(eos_token_ids)
        key = f"{self.file_sha256}:{vocab_rows}:{','.join(map(str, self.eos_token_ids))}"
        # The compile cache's tokenizer half: same file, rows and EOS ids -> same masks.
        self.fingerprint = hashlib.sha256(key.encode()).hexdigest()
        self.ll = llguidance.LLTokenizer(
            _byte_faithful(tokenizer_json), n_vocab=vocab_rows, eos_token=list(self.eos_token_ids)
        )
        # Tokens llguidance matches only by name, never as text: the special ones and every
        # added token spelled <...> (Qwen3's <think>, <tool_call>, ...), a subset of the added.
        self.special_ids = tuple(
            i for i in _added_ids(tokenizer_json) if self.ll.is_special_token(i)
        )

    @classmethod
    def from_file(
        cls, path: Path, vocab_rows: int, eos_token_ids: Sequence[int]
    ) -> GrammarTokenizer:
        return cls(path.read_bytes(), vocab_rows, eos_token_ids)

    @property
    def num_mask_words(self) -> int:
        """int32 words in one mask row: ceil(vocab_rows / 32)."""
        return (self.vocab_rows + 31) // 32

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (llguidance's tokenization of the same file; special tokens'
        names, `<think>`, as their single tokens)."""
        return list(self.ll.tokenize_str(text))

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self.ll.decode_str(list(token_ids)))


def _byte_faithful(tokenizer_json: bytes) -> str:
    """tokenizer.json without its normalizer, for llguidance. llguidance tokenizes the text a
    grammar forces (a choice, a const) with it; Qwen3's NFC normalizer turned a forced "e" +
    U+0301 into the token of "é", bytes the grammar does not allow, and the matcher then
    refused the token its own mask offered (INTERNAL). The model's output is token bytes, never
    normalized: the forced text must be tokenized as those bytes."""
    data: dict[str, Any] = json.loads(tokenizer_json)
    if data.get("normalizer") is None:
        return tokenizer_json.decode()
    data["normalizer"] = None
    return json.dumps(data)


def _added_ids(tokenizer_json: bytes) -> list[int]:
    data: dict[str, Any] = json.loads(tokenizer_json)
    return sorted(token["id"] for token in data.get("added_tokens", []))


def _num_tokens(tokenizer_json: bytes) -> int:
    """Ids the tokenizer defines: its model's vocabulary and added tokens (max id + 1)."""
    data: dict[str, Any] = json.loads(tokenizer_json)
    vocab = data.get("model", {}).get("vocab", {})
    ids = list(vocab.values()) if isinstance(vocab, dict) else list(range(len(vocab)))
    ids += [token["id"] for token in data.get("added_tokens", [])]
    return max(ids) + 1
