"""FrontendConfig: serve-frontend's flags default to what it says (and why: the two are written
apart, as the flags are parsed without importing the frontend), and it refuses what cannot
work."""

from __future__ import annotations

import argparse

import pytest

from services.frontend import __main__ as frontend_main
from services.frontend.config import FrontendConfig


def test_the_flags_defaults_are_the_configs() -> None:
    parser = argparse.ArgumentParser()
    frontend_main.add_arguments(parser)
    args = parser.parse_args([])
    config = FrontendConfig(
        tokenizer_address="t:1", prefill_addresses=("p:1",), decode_addresses=("d:1",)
    )
    for name in (
        "max_concurrent_requests",
        "max_queued_requests",
        "max_queued_tokens",
        "max_buffered_tokens",
        "stream_interval",
        "kv_lease_ms",
    ):
        assert getattr(args, name) == getattr(config, name), name
    assert args.hung_after == config.hung_after_s
    assert (args.sampling_defaults == "model") == config.model_sampling_defaults


@pytest.mark.parametrize("address", ["::::", "127.0.0.1:70000", "localhost"])
def test_a_tokenizer_address_that_cannot_be_dialled_is_refused(address: str) -> None:
    """Found by a flag review: unchecked, the frontend started and stayed NOT_SERVING for good
    (port 70000 was dialled as 4464)."""
    with pytest.raises(ValueError, match=r"--tokenizer: .*needs a port in 1\.\.65535"):
        FrontendConfig(
            tokenizer_address=address, prefill_addresses=("p:1",), decode_addresses=("d:1",)
        )


@pytest.mark.parametrize("value", [float("nan"), 1e-9, 0.0, float("inf")])
def test_an_interval_that_would_busy_loop_or_never_fire_is_refused(value: float) -> None:
    """Found by a flag review: --poll-interval nan (or 1e-9) polled every backend's Info in a
    busy loop, 4 CPU-seconds in 10."""
    with pytest.raises(ValueError, match=r"poll_interval_s must be in \[0\.01, inf\) s"):
        FrontendConfig(
            tokenizer_address="t:1",
            prefill_addresses=("p:1",),
            decode_addresses=("d:1",),
            poll_interval_s=value,
        )
