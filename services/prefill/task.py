"""What the servicer hands the worker (a validated prompt and where its KV goes), and back.

Plain dataclasses: the worker never sees protobuf, and the KV transfer stays behind `KvSink`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch
from opentelemetry.trace import SpanContext

from mili.engine.logprobs import TokenLogprobs
from mili.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from mili.engine.constraint.compiler import CompiledConstraint


@dataclass(frozen=True)
class PrefillTask:
    """One validated prompt. Block j of the prompt goes to `prompt_block_ids[j]` on the decode
    instance (the blocks it reserved for this prompt)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    address: str  # host:port of the decode instance's KvTransferService
    prompt_block_ids: list[int]  # on the decode instance, in token order
    transfer_token: str = ""  # decode's secret for this request, sent back in the header
    # Leading prompt blocks decode already holds: computed here if need be, never sent.
    num_cached_blocks: int = 0
    client_request_id: str = ""  # the caller's own id: a label for logs and traces
    # The request's span on this instance, when traced: the batched step that computes the
    # prompt links to it (mili.telemetry.tracing). None when tracing is off.
    span_context: SpanContext | None = None
    # sampling.constraint compiled (by the servicer, off the event loop): the first token is
    # sampled under its start state's mask. None when unconstrained.
    constraint: CompiledConstraint | None = None

    @property
    def name(self) -> str:
        """How messages name it: the caller's id first (what they know), then ours."""
        if self.client_request_id and self.client_request_id != self.request_id:
            return f"{self.client_request_id!r} (id {self.request_id})"
        return repr(self.request_id)


class FirstToken(NamedTuple):
    """The token sampled from the prompt's last position, with the prompt's timings."""

    token_id: int
    logprob: float | None  # raw-model logprob of token_id, when logprobs were asked for
    top_logprobs: list[tuple[int, float]] | None  # most likely first
    queue_ms: float  # accepted -> first forward
    compute_ms: float  # first forward -> token sampled
    batch_size: int = 1  # prompts in the step that finished this one
    num_cached_tokens: int = 0  # prompt tokens taken from the prefix cache, not computed
    # SamplingParams.prompt_logprobs set: entry i - 1 for prompt token i (len(prompt) - 1).
    prompt_logprobs: list[TokenLogprobs] | None = None


class KvSink(Protocol):
    """Where the worker thread pushes one prompt's KV; every method is called from that thread
    and must return at once (hand off, never wait on the network)."""

    @property
    def takes_device_tensors(self) -> bool:
        """True: `send_blocks` gets K/V on the model's device, every layer at once after the
        forward (cuda-ipc copies them device to device: per layer, the hand-over's host work
        would cost more than the copies); False: on the CPU, each layer as it is computed."""
        ...

    def send_blocks(
        self, layer: int, first_block: int, kv: torch.Tensor, ready: Callable[[], None] | None
    ) -> None:
        """K/V of the prompt's blocks first_block, first_block + 1, ... of layers layer,
        layer + 1, ...

        kv: [num_layers, 2 (K, V), n, block_size, num_kv_heads, head_dim] on the CPU (on the
        model's device when `takes_device_tensors`), owned by the sink. `ready`, when given,
        must be called (from any thread) before reading it: it waits for the asynchronous
        gather or copy.
        """
        ...

    def finish(self, first: FirstToken) -> None:
        """Every layer of every chunk was sent; this is the first generated token."""
        ...

    def fail(self, exc: BaseException) -> None:
        """The prompt's compute failed; nothing more will be sent."""
        ...
