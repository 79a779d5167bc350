"""Chat rendering matches Qwen3's ChatML layout byte for byte, through every template path."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from mili.errors import InvalidArgument
from services.tokenizer.chat_template import ChatTemplate, Message, render_chatml
from services.tokenizer.tokenizer import ModelTokenizer

CONVERSATION = [
    Message("system", "You are terse."),
    Message("user", "What is 2+2?"),
    Message("assistant", "<think>\nAdd them.\n</think>\n\n4"),
    Message("user", "And 3+3?"),
]
TURNS = (
    "<|im_start|>system\nYou are terse.<|im_end|>\n"
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
    # Reasoning of turns before the last user query is dropped, as Qwen3 was trained.
    "<|im_start|>assistant\n4<|im_end|>\n"
    "<|im_start|>user\nAnd 3+3?<|im_end|>\n"
)
EXPECTED = {
    # (add_generation_prompt, enable_thinking) -> prompt
    (False, None): TURNS,
    (True, None): TURNS + "<|im_start|>assistant\n",
    (True, True): TURNS + "<|im_start|>assistant\n",
    (True, False): TURNS + "<|im_start|>assistant\n<think>\n\n</think>\n\n",
    (False, False): TURNS,
}
CASES = sorted(EXPECTED, key=str)


def _checkpoint_with_template(src: Path, dst: Path, template: str | None) -> Path:
    """A test checkpoint: the demo tokenizer with `template` (or none) in tokenizer_config."""
    dst.mkdir()
    shutil.copy(src / "tokenizer.json", dst / "tokenizer.json")
    config = json.loads((src / "tokenizer_config.json").read_text())
    config.pop("chat_template")
    if template is not None:
        config["chat_template"] = template
    (dst / "tokenizer_config.json").write_text(json.dumps(config))
    return dst


@pytest.fixture(scope="module")
def tokenizers(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("templates")
    jinja = (demo_model_dir / "tokenizer_config.json").read_text()
    template = json.loads(jinja)["chat_template"]
    return {
        "builtin": ModelTokenizer(_checkpoint_with_template(demo_model_dir, tmp / "b", None)),
        "jinja": ModelTokenizer(_checkpoint_with_template(demo_model_dir, tmp / "j", template)),
    }


@pytest.mark.parametrize("kind", ["builtin", "jinja"])
@pytest.mark.parametrize(("add_generation_prompt", "enable_thinking"), CASES)
def test_three_turn_conversation_layout(
    tokenizers: dict, kind: str, add_generation_prompt: bool, enable_thinking: bool | None
) -> None:
    tokenizer = tokenizers[kind]
    assert tokenizer.chat_template.source == ("builtin" if kind == "builtin" else "checkpoint")
    prompt = tokenizer.chat_template.render(CONVERSATION, add_generation_prompt, enable_thinking)
    assert prompt == EXPECTED[(add_generation_prompt, enable_thinking)]


@pytest.mark.parametrize(("add_generation_prompt", "enable_thinking"), CASES)
def test_matches_hf_apply_chat_template(
    demo_model_dir: Path, add_generation_prompt: bool, enable_thinking: bool | None
) -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(demo_model_dir)
    kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    expected = hf.apply_chat_template(
        [m.as_dict() for m in CONVERSATION],
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        **kwargs,
    )
    ours = ModelTokenizer(demo_model_dir).chat_template.render(
        CONVERSATION, add_generation_prompt, enable_thinking
    )
    assert ours == expected


def test_reasoning_kept_after_last_query_and_tool_turns_grouped(tokenizers: dict) -> None:
    messages = [
        Message("user", "Weather?"),
        Message("assistant", "", reasoning_content="Need a tool."),
        Message("tool", '{"temp": 21}'),
        Message("tool", '{"wind": 3}'),
        Message("assistant", "<think>\nIt is mild.\n</think>\n\nMild, 21 degrees."),
    ]
    expected = (
        "<|im_start|>user\nWeather?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nNeed a tool.\n</think>\n\n<|im_end|>\n"
        '<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response>\n'
        '<tool_response>\n{"wind": 3}\n</tool_response><|im_end|>\n'
        "<|im_start|>assistant\n<think>\nIt is mild.\n</think>\n\nMild, 21 degrees.<|im_end|>\n"
    )
    assert render_chatml(messages, False, None) == expected
    assert tokenizers["jinja"].chat_template.render(messages, False, None) == expected


@pytest.mark.parametrize("kind", ["builtin", "jinja"])
def test_unknown_role_names_the_field(tokenizers: dict, kind: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        tokenizers[kind].chat_template.render(
            [Message("user", "hi"), Message("robot", "beep")], True, None
        )
    assert err.value.violations[0].field == "messages[1].role"
    assert "'robot'" in err.value.violations[0].description


def test_template_raise_exception_is_invalid_argument() -> None:
    template = ChatTemplate(
        "{{ raise_exception('system message must come first') }}", bos_token=None, eos_token=None
    )
    with pytest.raises(InvalidArgument, match="system message must come first"):
        template.render([Message("user", "hi")], True, None)


def test_sandbox_blocks_unsafe_attribute_access() -> None:
    template = ChatTemplate("{{ messages.__class__.__mro__ }}", bos_token=None, eos_token=None)
    with pytest.raises(InvalidArgument, match="chat template failed"):
        template.render([Message("user", "hi")], True, None)


def test_a_checkpoint_saved_by_transformers_keeps_its_template(
    demo_model_dir: Path, tmp_path: Path
) -> None:
    """transformers' save_pretrained writes the template to chat_template.jinja and drops
    tokenizer_config.json's entry; HF loads the file first, and so do we."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(demo_model_dir)
    hf.chat_template = "saved: " + hf.chat_template  # not the built-in renderer's output
    hf.save_pretrained(tmp_path)
    assert (tmp_path / "chat_template.jinja").is_file()
    ours = ModelTokenizer(tmp_path)
    assert ours.chat_template.source == "checkpoint"
    messages = [Message("user", "Hi")]
    expected = transformers.AutoTokenizer.from_pretrained(tmp_path).apply_chat_template(
        [m.as_dict() for m in messages], tokenize=False, add_generation_prompt=True
    )
    assert ours.chat_template.render(messages, True, None) == expected
    assert expected.startswith("saved:<|im_start|>user")


def test_a_template_marking_the_assistants_part_renders_as_hf(
    demo_model_dir: Path, tmp_path: Path
) -> None:
    """TRL-style templates wrap the assistant's turns in `{% generation %}`, a tag HF's template
    environment knows; it once failed our start-up (an unknown tag)."""
    transformers = pytest.importorskip("transformers")
    template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n"
        "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}"
        "{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    checkpoint = _checkpoint_with_template(demo_model_dir, tmp_path / "trl", template)
    messages = [Message("user", "Hi"), Message("assistant", "Hello!"), Message("user", "Bye")]
    expected = transformers.AutoTokenizer.from_pretrained(checkpoint).apply_chat_template(
        [m.as_dict() for m in messages], tokenize=False, add_generation_prompt=True
    )
    assert ModelTokenizer(checkpoint).chat_template.render(messages, True, None) == expected
    assert "Hello!<|im_end|>" in expected
