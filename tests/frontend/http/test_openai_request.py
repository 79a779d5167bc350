"""OpenAI request bodies -> RequestInput, and their errors naming the parameter as the caller
wrote it, through the same validation the gRPC API runs. No server: the parsing is plain
Python."""

from __future__ import annotations

import json
from typing import Any

import pytest

from mili.engine.sampling_params import MAX_LOGIT_BIAS
from mili.errors import InvalidArgument
from services.frontend.http_api.body import parse
from services.frontend.http_api.errors import response_of
from services.frontend.http_api.openai_request import (
    MAX_N,
    OpenAIRequest,
    chat_request,
    completion_request,
    nth_seed,
)
from services.frontend.validation import Limits, validate

LIMITS = Limits(max_tokens_limit=1000)
WINDOW = 4096


def completion(**fields: Any) -> OpenAIRequest:
    return completion_request(parse(json.dumps(fields).encode()), WINDOW, "rid")


def chat(**fields: Any) -> OpenAIRequest:
    fields.setdefault("messages", [{"role": "user", "content": "hi"}])
    return chat_request(parse(json.dumps(fields).encode()), WINDOW, "rid")


def error_of(
    exc: BaseException, request: OpenAIRequest | None = None
) -> tuple[int, dict[str, Any]]:
    response = response_of(exc, request.param_of) if request else response_of(exc)
    assert response.text is not None
    return response.status, json.loads(response.text)["error"]


def param_of_failure(fn: Any, **fields: Any) -> str | None:
    with pytest.raises(InvalidArgument) as caught:
        fn(**fields)
    status, error = error_of(caught.value)
    assert status == 400 and error["type"] == "invalid_request_error"
    return error["param"]  # type: ignore[no-any-return]


def validation_param(request: OpenAIRequest) -> str | None:
    """The parameter validation's first complaint names, mapped as the handlers map it."""
    with pytest.raises(InvalidArgument) as caught:
        validate(request.inputs[0], LIMITS)
    status, error = error_of(caught.value, request)
    assert status == 400
    return error["param"]  # type: ignore[no-any-return]


def test_prompt_forms() -> None:
    assert [i.prompt for i in completion(prompt="a").inputs] == ["a"]
    assert [i.prompt for i in completion(prompt=["a", "b"]).inputs] == ["a", "b"]
    assert [i.token_ids for i in completion(prompt=[1, 2, 3]).inputs] == [(1, 2, 3)]
    assert [i.token_ids for i in completion(prompt=[[1], [2, 3]]).inputs] == [(1,), (2, 3)]
    for bad in ([], [1, "a"], [[1], "a"], 5, None, [[1, 1.5]], [True]):
        assert param_of_failure(completion, prompt=bad) == "prompt", bad


def test_sampling_fields_map_to_sampling_input() -> None:
    request = completion(
        prompt="a",
        max_tokens=7,
        temperature=0,
        top_p=0.5,
        top_k=-1,
        min_p=0.1,
        presence_penalty=0.2,
        frequency_penalty=0.3,
        repetition_penalty=1.1,
        seed=5,
        stop="x",
        stop_token_ids=[9],
        ignore_eos=True,
        logprobs=3,
        user="u",
        some_unknown_field={"ignored": True},
    )
    s = request.inputs[0].sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.min_p) == (7, 0.0, 0.5, 0, 0.1)
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (0.2, 0.3, 1.1)
    assert (s.seed, s.stop, s.stop_token_ids, s.ignore_eos, s.logprobs) == (
        5,
        ("x",),
        (9,),
        True,
        3,
    )
    assert completion(prompt="a", stop=["x", "y"]).inputs[0].sampling.stop == ("x", "y")
    assert request.inputs[0].client_request_id == "rid" and request.user == "u"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", "7"),
        ("max_tokens", 1.5),
        ("temperature", "hot"),
        ("temperature", True),
        ("top_p", [1]),
        ("seed", 2**70),
        ("stop", 3),
        ("stop", ["a", 1]),
        ("stop_token_ids", [1.5]),
        ("ignore_eos", 1),
        ("n", "2"),
        ("stream", "yes"),
        ("echo", 0),
    ],
)
def test_wrong_types_name_their_parameter(field: str, value: Any) -> None:
    assert param_of_failure(completion, prompt="a", **{field: value}) == field


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("top_p", 5),
        ("temperature", -1),
        ("top_k", -2),
        ("min_p", 2),
        ("repetition_penalty", 0),
        ("max_tokens", 1001),  # over this server's limit
        ("logprobs", 21),
        ("stop", ["ok", ""]),
    ],
)
def test_validation_names_the_openai_parameter(field: str, value: Any) -> None:
    expected = "stop[1]" if field == "stop" else field  # an item is named by its index
    assert validation_param(completion(prompt="a", **{field: value})) == expected


def test_max_tokens_zero_only_with_echo_and_then_the_prompt_alone() -> None:
    """lm-eval's older loglikelihood request: echo with max_tokens 0 runs one token (prefill's)
    and returns none of it; without echo, or with min_tokens, max_tokens 0 means nothing."""
    request = completion(prompt="a", echo=True, logprobs=1, max_tokens=0)
    assert request.is_prompt_only and request.inputs[0].sampling.max_tokens == 1
    assert not completion(prompt="a", echo=True, max_tokens=1).is_prompt_only
    assert param_of_failure(completion, prompt="a", max_tokens=0) == "max_tokens"
    assert param_of_failure(completion, prompt="a", echo=True, max_tokens=0, min_tokens=1) == (
        "min_tokens"
    )


def test_a_completions_boolean_logprobs_reads_as_vllm_reads_it() -> None:
    """evalscope perf --logprobs sends `"logprobs": true` to /v1/completions too; vLLM's
    pydantic takes it as 1, so it asks for the sampled token's logprob and the top one; false
    asks for none. Any other non-integer is still the caller's error."""
    assert completion(prompt="a", logprobs=True).inputs[0].sampling.logprobs == 1
    assert completion(prompt="a", logprobs=False).inputs[0].sampling.logprobs is None
    assert param_of_failure(completion, prompt="a", logprobs="1") == "logprobs"


def test_chat_names_its_own_parameters() -> None:
    assert validation_param(chat(logprobs=True, top_logprobs=25)) == "top_logprobs"
    assert validation_param(chat(max_tokens=5000)) == "max_tokens"
    assert validation_param(chat(max_completion_tokens=5000)) == "max_completion_tokens"
    assert validation_param(chat(messages=[{"role": "robot", "content": "x"}])) == (
        "messages[0].role"
    )
    assert param_of_failure(chat, top_logprobs=2) == "top_logprobs"  # without logprobs
    assert param_of_failure(chat, messages=[]) == "messages"
    assert param_of_failure(chat, messages=[{"content": "x"}]) == "messages[0].role"
    assert param_of_failure(chat, messages=["x"]) == "messages[0]"
    assert param_of_failure(chat, messages=[{"role": "user", "content": 5}]) == (
        "messages[0].content"
    )
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]
    assert param_of_failure(chat, messages=image) == "messages[0].content[0]"


def test_completion_prompt_ids_errors_name_prompt() -> None:
    request = completion(prompt=[1, 2])
    with pytest.raises(InvalidArgument) as caught:
        raise InvalidArgument("token_ids[1]", 99999999, "outside the vocabulary")
    assert error_of(caught.value, request)[1]["param"] == "prompt"
    assert param_of_failure(completion, prompt=list(range(WINDOW + 1))) == "prompt"


def test_chat_fields() -> None:
    request = chat(
        messages=[
            {"role": "developer", "content": "be brief"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
            {"role": "assistant", "content": None, "reasoning_content": "hmm"},
        ],
        max_completion_tokens=9,
        max_tokens=3,
        logprobs=True,
        chat_template_kwargs={"enable_thinking": False},
    )
    (turns,) = [i.messages for i in request.inputs]
    assert [(t.role, t.content, t.reasoning_content) for t in turns] == [
        ("system", "be brief", None),
        ("user", "a\nb", None),
        ("assistant", "", "hmm"),
    ]
    one = request.inputs[0]
    assert one.sampling.max_tokens == 9 and one.sampling.logprobs == 0
    assert one.enable_thinking is False and request.is_chat_logprobs
    assert chat().inputs[0].sampling.logprobs is None and chat().inputs[0].enable_thinking is None
    assert chat(logprobs=True, top_logprobs=4).inputs[0].sampling.logprobs == 4


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("suffix", "x"),
        ("skip_special_tokens", False),
        ("functions", [{"name": "f"}]),
        ("tools", [{"type": "function", "function": {"name": "f"}}]),  # completions: no chat
    ],
)
def test_known_unsupported_fields_are_refused(field: str, value: Any) -> None:
    assert param_of_failure(completion, prompt="a", **{field: value}) == field


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("continue_final_message", True),
        ("add_generation_prompt", False),
        ("chat_template", "{{ messages }}"),
        ("documents", [{"text": "x"}]),
        ("echo", True),
    ],
)
def test_vllms_chat_extras_that_would_change_the_answer_are_refused(field: str, value: Any) -> None:
    """Ignored, each would give a plausible but wrong answer (a new turn instead of the
    continuation asked for, the model's template instead of the one sent)."""
    assert param_of_failure(chat, **{field: value}) == field


def test_harmless_values_of_unsupported_fields_pass() -> None:
    completion(prompt="a", suffix="", logit_bias={}, skip_special_tokens=True)
    chat(tools=[], response_format={"type": "text"}, best_of=None)
    chat(add_generation_prompt=True, continue_final_message=False, echo=False, top_logprobs=0)


def test_logit_bias_is_read_with_its_keys_as_ids() -> None:
    biased = completion(prompt="a", logit_bias={"50": -100, "7": 2.5})
    assert biased.inputs[0].sampling.logit_bias == ((7, 2.5), (50, -100))
    assert chat(logit_bias={}).inputs[0].sampling.logit_bias == ()
    assert param_of_failure(completion, prompt="a", logit_bias={"x": 1}) == "logit_bias.x"
    assert param_of_failure(completion, prompt="a", logit_bias={"5": "high"}) == "logit_bias.5"
    assert param_of_failure(completion, prompt="a", logit_bias={"5": None}) == "logit_bias.5"
    assert param_of_failure(completion, prompt="a", logit_bias=[1]) == "logit_bias"
    # counted before any entry is read: a bad key past the limit is not what is reported
    many = {str(i): 1 for i in range(MAX_LOGIT_BIAS)} | {"x": 1}
    with pytest.raises(InvalidArgument) as caught:
        chat(logit_bias=many)
    assert caught.value.violations[0].description == (
        "more entries than this server's limit of 1024 (got 1025 items)"
    )


def test_min_tokens_is_read_and_typed() -> None:
    assert completion(prompt="a", min_tokens=3).inputs[0].sampling.min_tokens == 3
    assert chat().inputs[0].sampling.min_tokens == 0
    assert param_of_failure(completion, prompt="a", min_tokens="3") == "min_tokens"


def test_n_best_of_echo_stream_options() -> None:
    assert completion(prompt="a", n=3, best_of=3).n == 3
    assert param_of_failure(completion, prompt="a", n=0) == "n"
    assert param_of_failure(completion, prompt="a", n=MAX_N + 1) == "n"
    assert completion(prompt="a", n=MAX_N).n == 128  # OpenAI's largest
    assert len(completion(prompt=["a"] * 128, n=2).inputs) == 128  # 256 choices: lm-eval's
    assert param_of_failure(completion, prompt=["a"] * 129, n=2) == "n"  # 258 choices
    # The prompts alone too many: not an n the client never sent (found by an exploratory test)
    assert param_of_failure(completion, prompt=["a"] * 5000) == "prompt"
    assert param_of_failure(completion, prompt="a", n=2, best_of=3) == "best_of"
    echoed = completion(prompt="a", echo=True, logprobs=1)
    assert echoed.inputs[0].sampling.prompt_logprobs == 1  # the prompt's logprobs, from prefill
    assert completion(prompt="a", echo=True).echo
    assert param_of_failure(completion, prompt="a", stream_options={"include_usage": True}) == (
        "stream_options"
    )
    streamed = completion(prompt="a", stream=True, stream_options={"include_usage": True})
    assert streamed.is_stream and streamed.include_usage and not streamed.is_continuous_usage
    # As vLLM reads stream_options: include_usage on unless set false; continuous_usage_stats
    # (usage on every chunk) only with it
    for endpoint, args in ((completion, {"prompt": "a"}), (chat, {})):
        usage = {"continuous_usage_stats": True}
        given = endpoint(**args, stream=True, stream_options=usage)
        assert given.include_usage and given.is_continuous_usage
        assert endpoint(**args, stream=True, stream_options={}).include_usage
        off = endpoint(**args, stream=True, stream_options={**usage, "include_usage": False})
        assert not off.include_usage and not off.is_continuous_usage


def test_prompt_logprobs_as_vllm_takes_them() -> None:
    """vLLM's prompt_logprobs k on both endpoints: asked of prefill, never streamed (k > 0 with
    stream is a 400, 0 answers nothing), -1 (the whole vocabulary) over the limit of 20."""
    for endpoint, args in ((completion, {"prompt": "a"}), (chat, {})):
        asked = endpoint(**args, prompt_logprobs=3)
        assert asked.prompt_logprobs == 3 and asked.inputs[0].sampling.prompt_logprobs == 3
        assert endpoint(**args, prompt_logprobs=0).inputs[0].sampling.prompt_logprobs == 0
        assert endpoint(**args, prompt_logprobs=20).prompt_logprobs == 20
        streamed = endpoint(**args, prompt_logprobs=0, stream=True)
        assert streamed.prompt_logprobs is None
        assert streamed.inputs[0].sampling.prompt_logprobs is None
        for bad, says in ((-1, "whole vocabulary"), (-2, r"\[0, 20\]"), (21, r"\[0, 20\]")):
            with pytest.raises(InvalidArgument, match=says) as caught:
                endpoint(**args, prompt_logprobs=bad)
            assert error_of(caught.value)[1]["param"] == "prompt_logprobs"
        for bad_value in (1.5, "2", True):
            assert param_of_failure(endpoint, **args, prompt_logprobs=bad_value) == (
                "prompt_logprobs"
            )
        with pytest.raises(InvalidArgument, match="stream: true"):
            endpoint(**args, prompt_logprobs=1, stream=True)
    # echo with logprobs: the prompt's logprobs in vLLM's format too (k = logprobs), prefill
    # asked for the larger top of the two; a stream has the echoed ones only
    echoed = completion(prompt="a", echo=True, logprobs=2)
    assert echoed.prompt_logprobs == 2
    both = completion(prompt="a", echo=True, logprobs=2, prompt_logprobs=5)
    assert both.prompt_logprobs == 5 and both.inputs[0].sampling.prompt_logprobs == 5
    assert both.inputs[0].sampling.logprobs == 2
    fewer = completion(prompt="a", echo=True, logprobs=4, prompt_logprobs=1)
    assert fewer.prompt_logprobs == 1 and fewer.inputs[0].sampling.prompt_logprobs == 4
    echo_streamed = completion(prompt="a", echo=True, logprobs=2, stream=True)
    assert echo_streamed.prompt_logprobs is None
    assert echo_streamed.inputs[0].sampling.prompt_logprobs == 2
    assert completion(prompt="a", logprobs=2).prompt_logprobs is None


def test_bodies_that_are_not_json_objects() -> None:
    for raw in (b"{", b"[1]", b"\xff", b'"x"'):
        with pytest.raises(InvalidArgument) as caught:
            parse(raw)
        status, error = error_of(caught.value)
        assert status == 400 and error["param"] is None, raw
    with pytest.raises(InvalidArgument, match=r"\(got 2 bytes\)$"):  # not a quoted '2 bytes'
        parse(b"{]")


def test_a_body_nested_too_deeply_is_a_400_not_a_500() -> None:
    with pytest.raises(InvalidArgument, match="nests too deeply") as caught:
        parse(b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
    assert error_of(caught.value)[0] == 400


def test_vllms_structural_tag_is_refused_not_ignored() -> None:
    assert param_of_failure(chat, structured_outputs={"structural_tag": "{}"}) == (
        "structured_outputs.structural_tag"
    )


def test_a_lone_surrogate_escape_is_a_400_naming_where_it_is() -> None:
    """A client that cut a string inside an emoji: not a 500 when it is encoded later."""
    raw = b'{"messages": [{"role": "user", "content": "hi \\ud83d"}]}'
    with pytest.raises(InvalidArgument) as caught:
        parse(raw)
    status, error = error_of(caught.value)
    assert status == 400 and error["param"] == "messages[0].content"
    whole = parse(b'{"messages": [{"role": "user", "content": "\\ud83d\\ude00"}]}')
    assert whole.data["messages"][0]["content"] == "\U0001f600"  # a pair is one character


def test_nth_seed() -> None:
    assert [nth_seed(7, i) for i in range(3)] == [7, 8, 9]
    assert nth_seed(2**64 - 1, 1) == 0  # stays in 64 bits
    assert nth_seed(None, 2) is None
    # outside 64 bits: left for validation to name (it was wrapped into a valid seed)
    assert nth_seed(-(2**63) - 1, 0) == -(2**63) - 1 and nth_seed(2**64, 1) == 2**64


def test_a_negative_seed_is_its_64_bit_twos_complement() -> None:
    """vLLM takes any 64-bit seed; the gRPC seed is a uint64."""
    assert completion(prompt="a", seed=-1).inputs[0].sampling.seed == 2**64 - 1
    assert chat(seed=-(2**63)).inputs[0].sampling.seed == 2**63
    assert completion(prompt="a", seed=5).inputs[0].sampling.seed == 5
    assert validation_param(completion(prompt="a", seed=-(2**63) - 1)) == "seed"
    assert param_of_failure(completion, prompt="a", seed=2**64) == "seed"  # not even 64 bits
    assert validation_param(completion(prompt="a", top_k=2**31)) == "top_k"


def test_only_an_assistant_message_may_leave_its_content_out() -> None:
    """As OpenAI: a user message without content was taken as "" (OpenAI says "Missing
    required parameter"); an assistant turn that only calls tools has none."""
    for role in ("user", "system", "developer", "tool"):
        for message in ({"role": role}, {"role": role, "content": None}):
            with pytest.raises(InvalidArgument) as info:
                chat(messages=[message])
            assert [v.field for v in info.value.violations] == ["messages[0].content"]
            assert f"required in a {role} message" in str(info.value)
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    turns = (
        chat(
            messages=[
                {"role": "user", "content": "hi"},
                {"role": "assistant", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "ok"},
            ]
        )
        .inputs[0]
        .messages
    )
    assert [(t.role, t.content) for t in turns] == [
        ("user", "hi"),
        ("assistant", ""),
        ("tool", "ok"),
    ]


def test_an_unset_max_tokens_is_16_for_a_completion_and_the_servers_default_for_a_chat() -> None:
    """OpenAI's documented default for /v1/completions, as vLLM and SGLang keep it, within the
    server's limit (found by test_http_fuzz: under --max-tokens-limit 8, every completion and
    /tokenize of a prompt without max_tokens was a 400 naming the max_tokens it never sent); a
    chat leaves it to the server (the room the context leaves, fitted once tokenized)."""
    unset = completion(prompt="hi").inputs[0]
    assert validate(unset, Limits()).sampling.max_tokens == 16
    assert validate(unset, Limits(max_tokens_limit=8)).sampling.max_tokens == 8
    assert validate(unset, Limits(default_max_tokens=4)).sampling.max_tokens == 16
    assert validate(unset, Limits()).is_default_max_tokens  # the prompt's room may lower it
    assert completion(prompt="hi", max_tokens=300).inputs[0].sampling.max_tokens == 300
    assert chat().inputs[0].sampling.max_tokens is None
    assert validate(chat().inputs[0], Limits()).is_default_max_tokens
