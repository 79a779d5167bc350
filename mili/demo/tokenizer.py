"""The demo checkpoint's tokenizer: a byte-level BPE trained offline on `corpus.txt`.

It is built the way Qwen's tokenizer is (NFC, Qwen's pre-tokenization regex, byte-level BPE,
control tokens appended after the learned vocabulary) so the tokenizer service meets the same
shapes of data as with a real Qwen3 checkpoint, just with a small vocabulary.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    trainers,
)

_HERE = Path(__file__).resolve().parent
CORPUS = _HERE / "corpus.txt"
CHAT_TEMPLATE = _HERE / "chat_template.jinja"

# Qwen2/Qwen3 pre-tokenization: contractions, letter runs with one leading non-letter, single
# digits, punctuation runs, newlines, and whitespace.
_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Control tokens, "special" as in Qwen: skipped by skip_special_tokens.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Added tokens Qwen3 keeps in the decoded text (special=False there too).
ADDED_TOKENS = (
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
)
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"


def train_tokenizer(vocab_size: int = 2048) -> Tokenizer:
    """Train the demo BPE on the shipped corpus; deterministic for a given corpus and size."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    lines = CORPUS.read_text(encoding="utf-8").splitlines(keepends=True)
    tokenizer.train_from_iterator(lines, trainer=trainer)
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS]
    )
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS])
    return tokenizer


def token_id(tokenizer: Tokenizer, token: str) -> int:
    found = tokenizer.token_to_id(token)
    if found is None:
        raise KeyError(f"{token!r} is not in the demo vocabulary")
    return found


def write_tokenizer_files(directory: Path, tokenizer: Tokenizer, model_max_length: int) -> None:
    """Write tokenizer.json, tokenizer_config.json and generation_config.json, Qwen3-style."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"), pretty=True)
    eos_id = token_id(tokenizer, EOS_TOKEN)
    pad_id = token_id(tokenizer, PAD_TOKEN)
    added: dict[str, Any] = {
        str(token_id(tokenizer, t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": t in SPECIAL_TOKENS,
        }
        for t in SPECIAL_TOKENS + ADDED_TOKENS
    }
    tokenizer_config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "errors": "replace",
        "chat_template": CHAT_TEMPLATE.read_text(encoding="utf-8"),
    }
    generation_config = {
        "bos_token_id": pad_id,
        "eos_token_id": [eos_id, pad_id],
        "pad_token_id": pad_id,
        "do_sample": True,
        "temperature": 0.6,
        "top_p": 0.95,
        "top_k": 20,
    }
    for name, data in (
        ("tokenizer_config.json", tokenizer_config),
        ("generation_config.json", generation_config),
    ):
        (directory / name).write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
