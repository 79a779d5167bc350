"""ReasoningSplitter: Qwen3's thinking goes to reasoning, never to content, however the text is
cut into deltas (every cut into two and three pieces is tried)."""

from __future__ import annotations

import itertools

import pytest

from services.frontend.reasoning import (
    ReasoningSplitter,
    ThinkFirstSplitter,
    opens_reasoning,
    think_block,
)

THINKING = "<think>\nLet me add 2 and 2.\nIt is 4.\n</think>\n\nThe answer is 4."
CASES = [
    # (generated text, reasoning, content)
    (THINKING, "Let me add 2 and 2.\nIt is 4.", "The answer is 4."),
    # enable_thinking false: the template closed the block, the model only answers
    ("The answer is 4.\n", "", "The answer is 4.\n"),
    # cut off while thinking (max_tokens): all of it is reasoning
    ("<think>\nStill thinking\n\n", "Still thinking\n\n", ""),
    # text that only looks like the start of a tag stays text
    ("a < b, <thin k> </thinking <", "", "a < b, <thin k> </thinking <"),
    # a closing tag with no opening one is dropped (Qwen3's template never opens the block in
    # the prompt: the model writes <think> itself)
    ("reasoning\n</think>\n\nanswer", "", "reasoning\nanswer"),
    # thinking twice: both blocks are reasoning, no tag anywhere
    ("<think>a</think>b<think>\nc\n</think>d", "ac", "bd"),
    # the closing tag right at the end
    ("<think>\nx\n</think>", "x", ""),
]


# Started in reasoning: the prompt opened the block (Qwen3's Thinking-2507 templates end their
# generation prompt with "<think>\n"); the model writes the reasoning and "</think>" only.
STARTED = [
    ("The user greets me.\n</think>\n\nHello!", "The user greets me.", "Hello!"),
    ("cut off while thinking\n", "cut off while thinking\n", ""),
    ("a</think>b</think>c", "a", "bc"),
]


def _split(
    pieces: list[str], *, started: bool = False, splitter_type: type = ReasoningSplitter
) -> tuple[str, str]:
    splitter = splitter_type()
    splitter.is_reasoning = started
    reasoning, content = [], []
    for piece in pieces:
        r, c = splitter.push(piece)
        reasoning.append(r)
        content.append(c)
    r, c = splitter.finish()
    return "".join([*reasoning, r]), "".join([*content, c])


@pytest.mark.parametrize(("text", "reasoning", "content"), CASES)
def test_whole_text(text: str, reasoning: str, content: str) -> None:
    assert _split([text]) == (reasoning, content)


@pytest.mark.parametrize(("text", "reasoning", "content"), CASES)
def test_every_cut_gives_the_same_split(text: str, reasoning: str, content: str) -> None:
    n = len(text)
    for i, j in itertools.combinations_with_replacement(range(n + 1), 2):
        pieces = [text[:i], text[i:j], text[j:]]
        assert _split(pieces) == (reasoning, content), pieces


@pytest.mark.parametrize(("text", "reasoning", "content"), STARTED)
def test_a_block_the_prompt_opened_is_reasoning_up_to_its_end(
    text: str, reasoning: str, content: str
) -> None:
    """It went to content, tag dropped, reasoning and answer glued ("...me.\\nHello!")."""
    n = len(text)
    for i, j in itertools.combinations_with_replacement(range(n + 1), 2):
        pieces = [text[:i], text[i:j], text[j:]]
        assert _split(pieces, started=True) == (reasoning, content), pieces


@pytest.mark.parametrize(
    ("prompt", "is_open"),
    [
        ("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", False),  # hybrid, thinking
        ("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n", False),
        ("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n", True),  # 2507
        # the caller's text is no tag of the template's
        ("<|im_start|>user\nWhat is <think>?<|im_end|>\n<|im_start|>assistant\n", False),
        (
            "<|im_start|>assistant\n<think>\nold</think>\n\nx<|im_end|>\n<|im_start|>assistant\n<think>\n",
            True,
        ),
        ("<think>\n", False),  # no generation prompt: not a chat prompt
    ],
)
def test_opens_reasoning_reads_the_generation_prompt_only(prompt: str, is_open: bool) -> None:
    assert opens_reasoning(prompt) is is_open


def test_no_tag_or_reasoning_reaches_content_in_any_delta() -> None:
    """Delta by delta (what a streaming client sees), one character at a time."""
    splitter = ReasoningSplitter()
    for ch in THINKING:
        _, content = splitter.push(ch)
        assert "<" not in content and "add" not in content
    assert splitter.finish() == ("", "")


def test_token_deltas_of_the_real_tokenizer(demo_model_dir: object) -> None:
    """The tags as Qwen3's tokenizer cuts them (one token each) and any neighbouring text."""
    from pathlib import Path

    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(str(demo_model_dir)) / "tokenizer.json"))
    ids = tokenizer.encode(THINKING, add_special_tokens=False).ids
    pieces = [tokenizer.decode([i], skip_special_tokens=False) for i in ids]
    assert "".join(pieces) == THINKING
    assert _split(pieces) == CASES[0][1:]


# A constraint's output with its think block (mili.engine.constraint.think): one block at the
# start at most, then the answer exactly as generated.
THINK_FIRST = [
    # (generated text, started in reasoning, reasoning, content)
    (
        '<think>\nthe user wants JSON\n</think>\n\n{"a": 1}',
        False,
        "the user wants JSON",
        '{"a": 1}',
    ),
    ('{"a": 1}', False, "", '{"a": 1}'),  # the model thought nothing
    ("<think>\n\n</think>\n\nyes", False, "", "yes"),  # an empty block
    # tags and newlines inside the answer are its text (a JSON string, a regex's match)
    ('<think>x</think>\n\n{"t": "<think>a</think>"}', False, "x", '{"t": "<think>a</think>"}'),
    ('{"t": "<think>"}', False, "", '{"t": "<think>"}'),
    ("<think>x</think>\n\n\n\nab\n", False, "x", "\n\nab\n"),  # only the separator goes
    ("<thin", False, "", "<thin"),  # cut short: a tag's beginning is text
    ("<think>\nstill thinking\n", False, "still thinking\n", ""),  # cut short in the block
    ("<think>x</think>\n", False, "x", ""),  # cut inside the separator
    # the prompt opened the block: the model writes the reasoning and </think> only
    ("the user greets me\n</think>\n\nhi <think>", True, "the user greets me", "hi <think>"),
    ("cut off\n", True, "cut off\n", ""),
]


@pytest.mark.parametrize(("text", "started", "reasoning", "content"), THINK_FIRST)
def test_a_constraints_think_block_alone_is_split_off_in_any_cut(
    text: str, started: bool, reasoning: str, content: str
) -> None:
    """The answer of a constraint is passed through whole: ReasoningSplitter read a tag inside
    it (a JSON string's "<think>") as one, and the newlines it begins with as trimmable."""
    n = len(text)
    for i, j in itertools.combinations_with_replacement(range(n + 1), 2):
        pieces = [text[:i], text[i:j], text[j:]]
        assert _split(pieces, started=started, splitter_type=ThinkFirstSplitter) == (
            reasoning,
            content,
        ), pieces


def test_what_comes_before_a_constraint() -> None:
    assert think_block(is_chat=True, enable_thinking=None, starts_in_reasoning=False) == "optional"
    assert think_block(is_chat=True, enable_thinking=True, starts_in_reasoning=True) == "open"
    assert think_block(is_chat=True, enable_thinking=False, starts_in_reasoning=False) == "none"
    assert think_block(is_chat=False, enable_thinking=None, starts_in_reasoning=False) == "none"
