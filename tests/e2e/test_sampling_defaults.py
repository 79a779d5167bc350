"""The model's sampling defaults (generation_config.json; the demo's are Qwen3-0.6B's:
temperature 0.6, top_p 0.95, top_k 20) fill what a request leaves unset, on gRPC and on HTTP;
`--sampling-defaults none` leaves SamplingParams' own. Checked on real outputs: with one seed,
a request leaving the fields unset draws exactly the tokens of one setting the defaults
explicitly, and not those of one setting SamplingParams' own."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest

from mili.pb.common.v1 import sampling_pb2
from mili.pb.frontend.v1 import generation_pb2, generation_pb2_grpc
from tests.e2e.conftest import Deployment
from tests.service_process import ServiceProcess

pytestmark = pytest.mark.slow

QWEN3 = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}  # the demo's generation_config.json
BUILTIN = {"temperature": 1.0, "top_p": 1.0, "top_k": 0}
PROMPT = "The quick brown fox"


def _tokens(stub: Any, seed: int, **sampling: Any) -> list[int]:
    request = generation_pb2.CompleteRequest(
        prompt=PROMPT,
        sampling=sampling_pb2.SamplingParams(max_tokens=24, ignore_eos=True, seed=seed, **sampling),
    )
    return list(stub.Complete(request, timeout=60).token_ids)


@pytest.fixture(scope="module")
def plain_frontend(pipeline: Deployment) -> Iterator[ServiceProcess]:
    """A second frontend over the same instances, with --sampling-defaults none."""
    frontend = ServiceProcess(
        "serve-frontend",
        *("--port", "0", "--tokenizer", pipeline.tokenizer.address),
        *("--prefill", ",".join(p.address for p in pipeline.prefills)),
        *("--decode", ",".join(d.address for d in pipeline.decodes)),
        *("--sampling-defaults", "none", "--poll-interval", "0.5"),
    )
    yield frontend
    assert frontend.terminate() == 0, frontend.stderr


def test_info_lists_the_models_defaults(pipeline: Deployment) -> None:
    stub = pipeline.stub()
    _tokens(stub, seed=1)  # the tokenizer has answered
    defaults = stub.Info(generation_pb2.InfoRequest()).sampling_defaults
    given = {f: getattr(defaults, f) for f in BUILTIN if defaults.HasField(f)}
    assert given == pytest.approx(QWEN3)
    assert not defaults.HasField("min_p") and not defaults.HasField("repetition_penalty")


@pytest.mark.parametrize("seed", [3, 4])
def test_unset_fields_take_the_models_defaults(pipeline: Deployment, seed: int) -> None:
    stub = pipeline.stub()
    unset = _tokens(stub, seed)
    assert unset == _tokens(stub, seed, **QWEN3)
    assert unset != _tokens(stub, seed, **BUILTIN)
    # a field the caller sets is its own; the others still default
    assert _tokens(stub, seed, temperature=1.0) == _tokens(
        stub, seed, **{**QWEN3, "temperature": 1.0}
    )


def test_sampling_defaults_none_keeps_sampling_params_own(
    pipeline: Deployment, plain_frontend: ServiceProcess
) -> None:
    stub = generation_pb2_grpc.GenerationServiceStub(pipeline.channel(plain_frontend.address))
    unset = _tokens(stub, seed=5)
    assert unset == _tokens(stub, 5, **BUILTIN)
    assert unset != _tokens(pipeline.stub(), 5)
    defaults = stub.Info(generation_pb2.InfoRequest()).sampling_defaults
    assert not any(defaults.HasField(f) for f in BUILTIN)
    # The operator's log says the model has defaults and whether this frontend applies them.
    said = "the model's sampling defaults temperature=0.6 top_p=0.95 top_k=20"
    # (Once per time the tokenizer comes up: the shared pipeline's may have been restarted.)
    for frontend, end in (
        (plain_frontend, " (not applied: --sampling-defaults none)"),
        (pipeline.frontend, ""),
    ):
        lines = [line.rstrip() for line in frontend.stderr_lines if said in line]
        assert lines and all(line.endswith(said + end) for line in lines), lines


def test_http_requests_take_them_too(pipeline: Deployment) -> None:
    client = openai.OpenAI(
        base_url=f"{pipeline.frontend.http_url}/v1", api_key="unused", max_retries=0, timeout=60
    )

    model = client.models.list().data[0].id

    def text(**sampling: Any) -> str:
        extra = {"ignore_eos": True}
        if "top_k" in sampling:  # not an OpenAI parameter: the SDK sends it as an extra
            extra["top_k"] = sampling.pop("top_k")
        reply = client.completions.create(
            model=model, prompt=PROMPT, max_tokens=24, seed=7, extra_body=extra, **sampling
        )
        return reply.choices[0].text

    unset = text()
    assert unset == text(**QWEN3)
    assert unset != text(**BUILTIN)
