"""serve-frontend's flags default to what FrontendConfig says (and why): the two are written
apart, as the flags are parsed without importing the frontend."""

from __future__ import annotations

import argparse

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
