"""The frontend's configuration, built once from CLI flags in `__main__`."""

from __future__ import annotations

from dataclasses import dataclass, field

from mili.discovery import parse_target, parse_targets
from services.frontend.validation import Limits


@dataclass(frozen=True)
class FrontendConfig:
    tokenizer_address: str
    # Targets (mili.discovery): host:port, or dns:///NAME:PORT for every address NAME has.
    prefill_addresses: tuple[str, ...]
    decode_addresses: tuple[str, ...]
    limits: Limits = field(default_factory=Limits)
    # How often each instance's Info is polled: free blocks and queue lengths for routing, and
    # (re)discovery of instances that were down, whose KV layouts are then checked.
    poll_interval_s: float = 1.0
    # How often dns:/// targets are looked up again: instances that appeared join (once their
    # Info and layouts check out), vanished ones drain and are dropped.
    resolve_interval_s: float = 5.0
    # Timeout of one Info call; an instance slower than this counts as down until it answers.
    info_timeout_s: float = 2.0
    # How long an instance answers no Info before the calls out on it are cut (a hung one keeps
    # its connection, so they would wait for keepalive or the KV lease): several polls, so
    # one slow answer of a busy instance cuts nothing.
    hung_after_s: float = 10.0
    # How long a decode instance gets to admit or refuse a request (it answers at once unless
    # it is stuck); past it, the instance counts as down and the next one is tried.
    admit_timeout_s: float = 5.0
    # How long decode holds a reservation waiting for the KV (0 = decode's own default).
    kv_lease_ms: int = 0
    # Requests running through this frontend at once, waiting in its admission queue
    # included; more are RESOURCE_EXHAUSTED. A bound on the frontend's own memory, above what
    # the decode instances run plus the queue's 2048, so that the queue's bound is the one
    # load reaches (it was 512 too, so the queue never filled).
    max_concurrent_requests: int = 4096
    # The admission queue (admission.py): requests that found every decode instance full wait
    # for room, by priority then first come first served, up to these many requests and prompt
    # tokens (past them: RESOURCE_EXHAUSTED with RetryInfo). 0 requests: no waiting, refused at
    # once.
    # Sized for the load generators users measure with (vllm bench serve and SGLang's
    # bench_serving send 1000 requests at once by default, about 1M prompt tokens, and count
    # a 429 as a failure); 4M prompt tokens waiting are ~150 MB of ids at most.
    max_queued_requests: int = 2048
    max_queued_tokens: int = 1 << 22
    # RetryInfo sent with RESOURCE_EXHAUSTED when no decode instance had one of its own.
    retry_after_s: float = 0.5
    # After decode finished, how long to wait for prefill's reply (it only carries statistics).
    prefill_reply_grace_s: float = 1.0
    # Token ids a streamed request holds for a client that reads slower than they come, merged
    # into its next message (coalescer.py); past it, the request stops pulling from decode.
    max_buffered_tokens: int = 1024
    # Token ids a streamed request gathers before it sends a message (its first and last go out
    # at once): fewer, larger messages for less CPU per token, tokens waiting up to N-1 steps.
    stream_interval: int = 1
    # Ended requests whose status GET /status/{request_id} still reports (request_status.py),
    # the oldest forgotten first; requests in flight are always reported.
    status_history: int = 1024
    # The model names the public APIs answer to, the first the one they report (Info,
    # /v1/models, each response's `model`); empty: the tokenizer's, the model directory's name.
    served_model_names: tuple[str, ...] = ()
    # Requests' unset temperature, top_p, top_k, min_p and repetition_penalty take the model's
    # generation_config.json values (vLLM's and SGLang's default); False: SamplingParams' own.
    model_sampling_defaults: bool = True

    def __post_init__(self) -> None:
        if not self.tokenizer_address:
            raise ValueError("a tokenizer address is required")
        try:  # (unchecked, a bad one served NOT_SERVING for good; port 70000 dialled 4464)
            parse_target(self.tokenizer_address)
        except ValueError as e:
            raise ValueError(f"--tokenizer: {e}") from None
        if any(not name.strip() for name in self.served_model_names):
            raise ValueError(f"served model names must not be empty: {self.served_model_names}")
        for kind, addresses in (
            ("prefill", self.prefill_addresses),
            ("decode", self.decode_addresses),
        ):
            if not addresses or not all(addresses):
                raise ValueError(f"at least one {kind} address is required")
            if len(set(addresses)) != len(addresses):
                raise ValueError(f"{kind} addresses repeat: {', '.join(addresses)}")
            try:
                parse_targets(addresses)
            except ValueError as e:
                raise ValueError(f"--{kind}: {e}") from None
        shared = set(self.prefill_addresses) & set(self.decode_addresses)
        if shared:
            raise ValueError(f"addresses given as both prefill and decode: {sorted(shared)}")
        for name in (
            "poll_interval_s",
            "resolve_interval_s",
            "info_timeout_s",
            "hung_after_s",
            "admit_timeout_s",
        ):
            # NaN passed a `<= 0` check; a poll every nanosecond busy-looped on Info calls.
            if not 0.01 <= getattr(self, name) < float("inf"):
                raise ValueError(f"{name} must be in [0.01, inf) s, got {getattr(self, name)}")
        if not 0 <= self.kv_lease_ms < 2**32:
            raise ValueError(f"kv_lease_ms must be in [0, 2^32), got {self.kv_lease_ms}")
        if self.max_concurrent_requests < 1:
            raise ValueError("max_concurrent_requests must be >= 1")
        if self.max_queued_requests < 0 or self.max_queued_tokens < 0:
            raise ValueError("max_queued_requests and max_queued_tokens must be >= 0")
        if self.max_buffered_tokens < 1:
            raise ValueError("max_buffered_tokens must be >= 1")
        if not 1 <= self.stream_interval <= self.max_buffered_tokens:
            raise ValueError(
                f"stream_interval must be in [1, max_buffered_tokens={self.max_buffered_tokens}]"
                f", got {self.stream_interval}"
            )
        if self.status_history < 0:
            raise ValueError(f"status_history must be >= 0, got {self.status_history}")
        if self.retry_after_s < 0 or self.prefill_reply_grace_s < 0:
            raise ValueError("retry_after_s and prefill_reply_grace_s must be >= 0")
