"""readiness_of: the one rule behind gRPC health and HTTP /health, state by state."""

from __future__ import annotations

from services.frontend.readiness import NOT_POLLED, Readiness, readiness_of
from services.frontend.router import Router

P, D = "127.0.0.1:1", "127.0.0.1:2"


def up_router(*, is_prefill_up: bool = True, pair_error: str | None = None) -> Router:
    router = Router([P], [D])
    router.update_decode(D, num_free_blocks=8, num_total_blocks=8, max_context_tokens=64)
    if is_prefill_up:
        router.update_prefill(P, num_queued_tokens=0, max_prompt_tokens=64)
    router.set_pair_error(P, D, pair_error)
    return router


def readiness(router: Router, *, is_tokenizer_up: bool = True) -> Readiness:
    return readiness_of(router, is_tokenizer_up=is_tokenizer_up, tokenizer_address="tok:1")


def test_a_routable_pair_and_a_tokenizer_serve() -> None:
    assert readiness(up_router()) == Readiness(True, True, None)
    assert readiness(up_router()).is_serving


def test_nothing_polled_serves_nothing() -> None:
    assert not NOT_POLLED.is_serving
    got = readiness(Router([P], [D]), is_tokenizer_up=False)
    assert got == Readiness(False, False, "the tokenizer at tok:1 is down")


def test_a_tokenizer_down_is_no_model_though_a_route_exists() -> None:
    got = readiness(up_router(), is_tokenizer_up=False)
    assert (got.model_loaded, got.scheduler_ready, got.is_serving) == (False, True, False)


def test_a_decode_up_without_a_prefill_is_a_model_but_no_route() -> None:
    got = readiness(up_router(is_prefill_up=False))
    assert (got.model_loaded, got.scheduler_ready) == (True, False)
    assert got.problem is not None and "no prefill instance is up" in got.problem


def test_mismatched_layouts_are_no_route() -> None:
    got = readiness(up_router(pair_error="block size 16 != 32"))
    assert got == Readiness(
        True,
        False,
        "no up prefill/decode pair is compatible (see the frontend's REFUSING PAIR errors)",
    )


def test_a_draining_decode_is_loaded_but_not_routable() -> None:
    router = up_router()
    router.decodes[D].num_in_flight = 1  # a request of ours still runs there
    router.set_members([P], [])  # the decode left discovery: it drains that request
    assert router.decodes[D].is_draining
    got = readiness(router)
    assert (got.model_loaded, got.scheduler_ready) == (True, False)
