"""Request validation: every bad field is an InvalidArgument naming it; defaults are resolved."""

from __future__ import annotations

import dataclasses
import math

import pytest

from mili.engine.constraint.spec import Constraint
from mili.engine.sampling_params import MAX_PROMPT_LOGPROBS_TOKENS
from mili.errors import InvalidArgument
from services.frontend.prompt import check_input_chars, check_token_ids, fit_context, with_eos
from services.frontend.tools import FunctionTool, ToolChoice
from services.frontend.validation import (
    MAX_CONTEXT_TOKENS,
    ChatTurn,
    Counts,
    Limits,
    RequestInput,
    SamplingInput,
    ValidRequest,
    check_counts,
    validate,
)

LIMITS = Limits(default_max_tokens=256, max_tokens_limit=1000)


def fields_of(err: InvalidArgument) -> list[str]:
    return [v.field for v in err.violations]


def sampled(**fields: object) -> RequestInput:
    return RequestInput(prompt="Hello", sampling=SamplingInput(**fields))  # type: ignore[arg-type]


def check(request: RequestInput, limits: Limits = LIMITS) -> ValidRequest:
    return validate(request, limits, new_seed=lambda: 1234, new_client_request_id=lambda: "rid")


@pytest.mark.parametrize(
    ("fields", "bad_field"),
    [
        ({"max_tokens": 0}, "sampling.max_tokens"),
        ({"max_tokens": -5}, "sampling.max_tokens"),
        ({"max_tokens": 1001}, "sampling.max_tokens"),
        ({"temperature": -0.1}, "sampling.temperature"),
        ({"temperature": math.nan}, "sampling.temperature"),
        ({"temperature": math.inf}, "sampling.temperature"),
        ({"top_p": 0.0}, "sampling.top_p"),
        ({"top_p": 1.5}, "sampling.top_p"),
        ({"top_p": -1.0}, "sampling.top_p"),
        ({"top_k": -1}, "sampling.top_k"),
        ({"min_p": -0.01}, "sampling.min_p"),
        ({"min_p": 1.01}, "sampling.min_p"),
        ({"repetition_penalty": 0.0}, "sampling.repetition_penalty"),
        ({"repetition_penalty": -1.0}, "sampling.repetition_penalty"),
        ({"presence_penalty": 2.5}, "sampling.presence_penalty"),
        ({"presence_penalty": -2.01}, "sampling.presence_penalty"),
        ({"frequency_penalty": 3.0}, "sampling.frequency_penalty"),
        ({"frequency_penalty": -3.0}, "sampling.frequency_penalty"),
        ({"logprobs": -1}, "sampling.logprobs"),
        ({"logprobs": 21}, "sampling.logprobs"),
        ({"prompt_logprobs": -1}, "sampling.prompt_logprobs"),
        ({"prompt_logprobs": 21}, "sampling.prompt_logprobs"),
        ({"stop": ("ok", "")}, "sampling.stop[1]"),
        ({"stop": ("x" * 257,)}, "sampling.stop[0]"),
        ({"logit_bias": ((5, 100.5),)}, "sampling.logit_bias"),
        ({"logit_bias": ((5, math.nan),)}, "sampling.logit_bias"),
        ({"logit_bias": ((5, 1.0), (5, 2.0))}, "sampling.logit_bias"),
        ({"logit_bias": ((-1, 1.0),)}, "sampling.logit_bias"),
        ({"min_tokens": -1}, "sampling.min_tokens"),
        ({"min_tokens": 11, "max_tokens": 10}, "sampling.min_tokens"),
        ({"min_tokens": 1001}, "sampling.min_tokens"),  # over the limit, max_tokens unset
        ({"min_tokens": 1, "constraint": Constraint.json_object()}, "sampling.min_tokens"),
    ],
)
def test_each_bad_sampling_field_is_named(fields: dict[str, object], bad_field: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        check(sampled(**fields))
    assert fields_of(info.value) == [bad_field]
    assert bad_field in str(info.value)


@pytest.mark.parametrize(
    "fields",
    [
        {"max_tokens": 1},
        {"max_tokens": 1000},
        {"temperature": 0.0},
        {"top_p": 1.0},
        {"top_p": 1e-6},
        {"top_k": 0},
        {"min_p": 0.0},
        {"min_p": 1.0},
        {"repetition_penalty": 1e-3},
        {"presence_penalty": -2.0},
        {"frequency_penalty": 2.0},
        {"logprobs": 0},
        {"logprobs": 20},
        {"prompt_logprobs": 0},
        {"prompt_logprobs": 20},
        {"min_tokens": 0, "constraint": Constraint.json_object()},
        {"min_tokens": 10, "max_tokens": 10},
        {"logit_bias": ((0, -100.0), (5, 100.0))},
    ],
)
def test_boundary_values_are_accepted(fields: dict[str, object]) -> None:
    check(sampled(**fields))


def test_all_violations_reported_at_once() -> None:
    with pytest.raises(InvalidArgument) as info:
        check(sampled(temperature=-1.0, top_p=2.0, top_k=-3))
    assert fields_of(info.value) == ["sampling.temperature", "sampling.top_p", "sampling.top_k"]


@pytest.mark.parametrize(
    ("request_input", "bad_fields"),
    [
        (RequestInput(), ["prompt"]),
        (RequestInput(prompt=""), ["prompt"]),
        (RequestInput(prompt="hi", token_ids=(1, 2)), ["token_ids"]),
        (
            RequestInput(prompt="hi", messages=(ChatTurn("user", "x"),), token_ids=(1,)),
            ["messages", "token_ids"],
        ),
        (RequestInput(messages=(ChatTurn("robot", "x"),)), ["messages[0].role"]),
        (RequestInput(prompt="hi", client_request_id="r" * 300), ["request_id"]),
    ],
)
def test_bad_input_names_the_field(request_input: RequestInput, bad_fields: list[str]) -> None:
    with pytest.raises(InvalidArgument) as info:
        check(request_input)
    assert fields_of(info.value) == bad_fields


def test_defaults_are_filled() -> None:
    valid = check(RequestInput(prompt="Hello"))
    s = valid.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.min_p) == (256, 1.0, 1.0, 0, 0.0)
    assert (s.repetition_penalty, s.presence_penalty, s.frequency_penalty) == (1.0, 0.0, 0.0)
    assert s.seed == 1234  # a fresh seed, so prefill and decode draw from the same one
    assert s.logprobs is None and valid.is_default_max_tokens
    assert valid.client_request_id == "rid" and valid.prompt_field == "prompt"


def test_given_values_and_request_id_are_kept() -> None:
    valid = check(
        RequestInput(
            client_request_id="mine",
            token_ids=(5, 6),
            sampling=SamplingInput(max_tokens=7, temperature=0.0, seed=99, logprobs=3),
        )
    )
    assert valid.client_request_id == "mine" and valid.prompt_field == "token_ids"
    s = valid.sampling
    assert (s.max_tokens, s.temperature, s.seed, s.logprobs) == (7, 0.0, 99, 3)
    assert not valid.is_default_max_tokens


def test_no_limit_means_only_the_context_bounds_max_tokens() -> None:
    check(sampled(max_tokens=10**6), Limits(default_max_tokens=16, max_tokens_limit=None))


def test_limits_reject_a_default_above_the_limit() -> None:
    with pytest.raises(ValueError, match="max_tokens_limit"):
        Limits(default_max_tokens=100, max_tokens_limit=50)


def test_limits_fit_the_uint32_fields_info_reports_them_in() -> None:
    """Found by a review: 2^32 or more overflowed InfoResponse, and every Info call failed."""
    with pytest.raises(ValueError, match=r"default_max_tokens must be in \[1, 2\^32\)"):
        Limits(default_max_tokens=2**32, max_tokens_limit=None)
    with pytest.raises(ValueError, match=r"max_tokens_limit must be below 2\^32"):
        Limits(default_max_tokens=16, max_tokens_limit=2**32)
    Limits(default_max_tokens=2**32 - 1, max_tokens_limit=2**32 - 1)  # the largest fit


def test_token_ids_outside_vocab_are_named_by_index() -> None:
    valid = check(RequestInput(token_ids=(1, 900, 2, 1000), sampling=SamplingInput()))
    with pytest.raises(InvalidArgument) as info:
        check_token_ids(valid, vocab_size=836)
    assert fields_of(info.value) == ["token_ids[1]", "token_ids[3]"]
    assert "835" in str(info.value)
    check_token_ids(check(RequestInput(token_ids=(0, 835))), vocab_size=836)


def test_logit_bias_ids_outside_vocab_are_named() -> None:
    biased = check(sampled(logit_bias=((5, 1.0), (836, -1.0))))
    with pytest.raises(InvalidArgument) as info:
        check_token_ids(biased, vocab_size=836)
    assert fields_of(info.value) == ["sampling.logit_bias"] and "836" in str(info.value)
    check_token_ids(check(sampled(logit_bias=((835, 1.0),))), vocab_size=836)


def test_stop_token_ids_outside_vocab_are_named() -> None:
    valid = check(sampled(stop_token_ids=(3, 5000)))
    with pytest.raises(InvalidArgument) as info:
        check_token_ids(valid, vocab_size=836)
    assert fields_of(info.value) == ["sampling.stop_token_ids[1]"]


def test_fit_context() -> None:
    explicit = check(sampled(max_tokens=100)).sampling
    assert fit_context(explicit, 50, 150, "prompt").max_tokens == 100
    with pytest.raises(InvalidArgument) as info:
        fit_context(explicit, 51, 150, "prompt")
    assert fields_of(info.value) == ["sampling.max_tokens"]
    assert all(n in str(info.value) for n in ("51", "100", "150", "99"))
    # The prompt alone fills the context: the prompt is what is wrong.
    with pytest.raises(InvalidArgument) as info:
        fit_context(explicit, 150, 150, "messages")
    assert fields_of(info.value) == ["messages"]
    with pytest.raises(InvalidArgument) as info:
        fit_context(explicit, 60, 4096, "token_ids", max_prompt_tokens=50)
    assert fields_of(info.value) == ["token_ids"]
    with pytest.raises(InvalidArgument):
        fit_context(explicit, 0, 150, "prompt")
    # An unset max_tokens shrinks to what the context leaves.
    default = check(RequestInput(prompt="x"))
    fitted = fit_context(
        default.sampling, 4000, 4096, "prompt", may_shrink=default.is_default_max_tokens
    )
    assert fitted.max_tokens == 96
    # ... but not below an explicit min_tokens, which cannot be honoured then.
    held = check(RequestInput(prompt="x", sampling=SamplingInput(min_tokens=97)))
    with pytest.raises(InvalidArgument) as info:
        fit_context(held.sampling, 4000, 4096, "prompt", may_shrink=held.is_default_max_tokens)
    assert fields_of(info.value) == ["sampling.min_tokens"]
    assert "at most 96 fits" in str(info.value)


def test_a_one_token_prompt_over_the_window_is_counted_in_the_singular() -> None:
    """The 400 for a one-token prompt whose max_tokens (or min_tokens) passes the window read
    'prompt (1 tokens)': these two messages were left out when counts took mili/plural.py."""
    explicit = check(sampled(max_tokens=100)).sampling
    with pytest.raises(InvalidArgument) as info:
        fit_context(explicit, 1, 50, "prompt")
    assert "prompt (1 token) + max_tokens (100) is over" in str(info.value)
    held = check(RequestInput(prompt="x", sampling=SamplingInput(min_tokens=100)))
    with pytest.raises(InvalidArgument) as info:
        fit_context(held.sampling, 1, 50, "prompt", may_shrink=held.is_default_max_tokens)
    assert "prompt (1 token) + min_tokens (100) is over" in str(info.value)


def test_prompt_logprobs_are_carried_and_bounded_by_the_prompt_length() -> None:
    sampling = check(sampled(prompt_logprobs=3, max_tokens=1)).sampling
    assert sampling.prompt_logprobs == 3
    assert check(sampled()).sampling.prompt_logprobs is None
    limit = MAX_PROMPT_LOGPROBS_TOKENS
    fit_context(sampling, limit, limit + 10, "prompt")  # at the limit: fine
    with pytest.raises(InvalidArgument) as info:
        fit_context(sampling, limit + 1, limit + 10, "prompt")
    assert fields_of(info.value) == ["sampling.prompt_logprobs"]
    assert str(limit) in str(info.value)
    fit_context(check(sampled(max_tokens=1)).sampling, limit + 1, limit + 10, "prompt")


def test_with_eos_adds_eos_ids_unless_ignore_eos() -> None:
    s = check(sampled(stop_token_ids=(7, 9))).sampling
    assert with_eos(s, [9, 11]).stop_token_ids == (7, 9, 11)
    ignoring = check(sampled(stop_token_ids=(7,), ignore_eos=True)).sampling
    assert with_eos(ignoring, [9, 11]).stop_token_ids == (7,)


def test_text_over_the_tokenizers_limit_is_refused_before_tokenizing() -> None:
    check_input_chars(check(RequestInput(prompt="x" * 10)), max_input_chars=10)
    with pytest.raises(InvalidArgument) as info:
        check_input_chars(check(RequestInput(prompt="x" * 11)), max_input_chars=10)
    # The count is quoted as a count, not as a string the caller never sent.
    assert str(info.value) == (
        "prompt: longer than the tokenizer's limit of 10 characters (got 11 characters)"
    )
    turns = (ChatTurn("user", "abcdef"), ChatTurn("assistant", "ghij", reasoning_content="k"))
    with pytest.raises(InvalidArgument) as info:
        check_input_chars(check(RequestInput(messages=turns)), max_input_chars=10)
    assert fields_of(info.value) == ["messages"] and "11 characters" in str(info.value)
    check_input_chars(check(RequestInput(prompt="x" * 11)), max_input_chars=0)  # unknown: sent
    check_input_chars(check(RequestInput(token_ids=(1,) * 50)), max_input_chars=10)  # no text


def test_a_long_request_id_and_stop_string_are_quoted_by_their_lengths() -> None:
    request = RequestInput(prompt="Hello", client_request_id="r" * 257)
    request = dataclasses.replace(request, sampling=SamplingInput(stop=("s" * 300,)))
    with pytest.raises(InvalidArgument) as info:
        check(request)
    assert [v.description for v in info.value.violations] == [
        "longer than 256 characters (got 257 characters)",
        "longer than 256 characters (got 300 characters)",
    ]


def test_lists_longer_than_any_valid_request_are_refused_by_their_counts() -> None:
    check_counts(Counts(40_960, 40_960, 16, 64, 1024), 40_960)  # each at its bound
    with pytest.raises(InvalidArgument) as caught:
        check_counts(Counts(1_500_000, 40_961, 17, 65, 1025), 40_960)
    assert fields_of(caught.value) == [
        "token_ids",
        "messages",
        "sampling.stop",
        "sampling.stop_token_ids",
        "sampling.logit_bias",
    ]
    descriptions = [v.description for v in caught.value.violations]
    assert descriptions[0] == (
        "more ids than the context window of 40960 tokens (got 1500000 items)"
    )
    assert "this server's limit of 16" in descriptions[2]
    # Before any decode instance reported its context: the largest Qwen3's.
    check_counts(Counts(MAX_CONTEXT_TOKENS, 0, 0, 0), None)
    with pytest.raises(InvalidArgument, match="262144 tokens"):
        check_counts(Counts(MAX_CONTEXT_TOKENS + 1, 0, 0, 0), None)


def test_min_tokens_with_a_forced_tool_call_is_refused_naming_it() -> None:
    """tool_choice required (or named) is enforced with a constraint, which must be able to end:
    min_tokens is refused there, named as the caller wrote it, the reason saying why."""
    chat = RequestInput(
        messages=(ChatTurn("user", "hi"),),
        sampling=SamplingInput(min_tokens=3, max_tokens=10),
        tools=(FunctionTool("f"),),
        tool_choice=ToolChoice("required"),
    )
    with pytest.raises(InvalidArgument) as info:
        check(chat)
    assert fields_of(info.value) == ["sampling.min_tokens"]
    assert "tool_choice required" in str(info.value)
    check(dataclasses.replace(chat, tool_choice=ToolChoice("auto")))  # nothing enforced


def test_an_unset_max_tokens_is_raised_to_min_tokens() -> None:
    """max_tokens unset means this server's default (256 here), or min_tokens if that is more:
    a caller asking for at least 300 tokens is not refused over a default it never set."""
    assert check(sampled(min_tokens=300)).sampling.max_tokens == 300
    assert check(sampled(min_tokens=10)).sampling.max_tokens == 256


def test_without_a_server_default_an_unset_max_tokens_is_the_room_the_context_leaves() -> None:
    """The frontend's default (no --default-max-tokens), as vLLM's: whatever the context
    window leaves after the prompt, or the server's limit when it has one."""
    unset = check(sampled(), Limits())
    assert unset.is_default_max_tokens
    fitted = fit_context(unset.sampling, 4000, 4096, "prompt", may_shrink=True)
    assert fitted.max_tokens == 96
    assert fit_context(unset.sampling, 10, 4096, "prompt", may_shrink=True).max_tokens == 4086
    limited = check(sampled(), Limits(max_tokens_limit=1000)).sampling
    assert fit_context(limited, 10, 4096, "prompt", may_shrink=True).max_tokens == 1000
    assert check(sampled(max_tokens=7), Limits()).sampling.max_tokens == 7
