"""gRPC edge of the prefill service, thin: PrefillRequest -> PrefillTask (convert.py) ->
KvHandoff.prefill (handoff.py: the prompt's compute and its KV's way to decode) ->
PrefillResponse (convert.py). Domain errors become statuses in the server interceptor (mili.rpc).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

import grpc

from mili.discovery import Callers
from mili.engine.kv.block_pool import blocks_needed
from mili.pb.prefill.v1 import prefill_pb2, prefill_pb2_grpc
from mili.rpc.policy import REQUEST_FIELDS_BYTES, Policy, uint32s_bytes
from mili.rpc.prefix_cache import prefix_cache_to_proto
from mili.rpc.server import RpcServer
from mili.rpc.tls import Tls
from services.prefill import convert
from services.prefill.handoff import KvHandoff
from services.prefill.instance import PrefillInstance

SERVICE_NAME = prefill_pb2.DESCRIPTOR.services_by_name["PrefillService"].full_name


class PrefillServicer(prefill_pb2_grpc.PrefillServiceServicer):
    """The gRPC edge over a PrefillInstance (which owns the model, the KV pool and the worker)
    and its KvHandoff (the decode channels and the KV encoder threads)."""

    def __init__(
        self,
        instance: PrefillInstance,
        *,
        max_message_bytes: int,
        client_interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
        tls: Tls | None = None,
        on_death: Callable[[BaseException], None] | None = None,
    ) -> None:
        """`tls`: KV goes to decode over TLS with these certificates. `on_death`: the
        worker's (PrefillWorker.start)."""
        self.instance = instance
        self.config = instance.config
        self.worker = instance.worker
        self.scheduler = instance.scheduler
        self.handoff = KvHandoff(instance, max_message_bytes, client_interceptors, tls)
        self.layout = self.handoff.layout
        self.peers = self.handoff.peers
        self.max_prompt_tokens = instance.max_prompt_tokens
        instance.start(on_death)

    async def close(self) -> None:
        """Stop the worker (failing what is left), close channels and the encoder threads."""
        await asyncio.to_thread(self.instance.stop)
        await self.handoff.close()

    async def Prefill(
        self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> prefill_pb2.PrefillResponse:
        task = convert.prefill_task(
            request,
            vocab_size=self.instance.vocab_size,
            max_prompt_tokens=self.max_prompt_tokens,
            block_size=self.config.engine.block_size,
        )
        result = await self.handoff.prefill(task, context.time_remaining())
        return convert.prefill_response(task, result)

    async def Info(
        self, request: prefill_pb2.InfoRequest, context: grpc.aio.ServicerContext
    ) -> prefill_pb2.InfoResponse:
        instance = self.instance
        return prefill_pb2.InfoResponse(
            model=instance.model_name,
            dtype=instance.dtype,
            device=instance.device,
            kv_layout=self.layout,
            attention_backend=instance.attention_backend,
            fused_ops=instance.fused_ops,
            architecture=instance.architecture,
            num_experts=instance.num_experts,
            num_active_experts=instance.num_active_experts,
            num_cuda_graphs=instance.num_cuda_graphs,
            tokenizer_file_sha256=instance.tokenizer_file_sha256,
            max_prompt_tokens=self.max_prompt_tokens,
            max_batch_tokens=self.config.max_batch_tokens,
            num_queued_tokens=self.worker.num_queued_tokens,
            num_total_blocks=self.worker.num_total_blocks,
            num_free_blocks=self.worker.num_free_blocks,
            kv_cache_bytes=instance.runner.kv_cache_bytes,
            prefix_cache=prefix_cache_to_proto(instance.worker.prefix_cache_reading()),
            kv_transports=self.peers.transports(),
        )


def add_to_server(
    server: RpcServer, servicer: PrefillServicer, *, frontends: Callers | None = None
) -> None:
    """Register PrefillService. Prefill takes calls only from `frontends` (checked by the server
    before the servicer runs; default: this machine) and requests up to a prompt of
    max_prompt_tokens with its block ids; Info is open."""
    frontends = frontends or Callers("--frontend")
    num_blocks = blocks_needed(servicer.max_prompt_tokens, servicer.config.engine.block_size)
    prefill = uint32s_bytes(servicer.max_prompt_tokens) + uint32s_bytes(num_blocks)
    policy = Policy(
        max_request_bytes={"Prefill": prefill + REQUEST_FIELDS_BYTES},
        callers={"Prefill": frontends},
    )
    server.add_service(
        SERVICE_NAME,
        lambda s: prefill_pb2_grpc.add_PrefillServiceServicer_to_server(servicer, s),
        policy,
    )
