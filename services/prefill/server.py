"""gRPC edge of the prefill service: PrefillRequest -> PrefillTask -> worker + KV sender -> reply.

Life of one Prefill call (all awaits; the model runs only in the worker thread):

    validate ─▶ queue bound (RESOURCE_EXHAUSTED when full)
             ─▶ KvSender.run: header, then worker.submit, chunks as layers complete, commit,
                decode's ack
             ─▶ finally worker.remove: the prompt's blocks are freed on every path
                (ack, decode's error, compute error, caller cancelled or deadline passed)
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import grpc

from mili.engine.block_pool import BlockPool
from mili.engine.kv_cache import KVCache, dtype_name
from mili.engine.model import Qwen3ForCausalLM
from mili.prefill.v1 import prefill_pb2, prefill_pb2_grpc
from mili.rpc.kv_codec import block_bytes, layout_to_proto
from mili.rpc.server import RpcServer
from services.prefill import convert
from services.prefill.config import PrefillConfig
from services.prefill.scheduler import Scheduler
from services.prefill.sender import ChannelPool, KvSender, logprobs
from services.prefill.worker import PrefillWorker

SERVICE_NAME = prefill_pb2.DESCRIPTOR.services_by_name["PrefillService"].full_name


class PrefillServicer(prefill_pb2_grpc.PrefillServiceServicer):
    """Owns the worker (and through it the model and KV pool) and the decode channels."""

    def __init__(
        self,
        model: Qwen3ForCausalLM,
        config: PrefillConfig,
        *,
        model_name: str,
        fingerprint: str,
        max_message_bytes: int,
        num_encoder_threads: int = 2,
    ) -> None:
        self.config = config
        self.model = model
        self._model_name = model_name
        kv_cache = KVCache(
            model.config,
            config.num_blocks,
            config.block_size,
            dtype=model.dtype,
            device=model.device,
        )
        self.scheduler = Scheduler(
            BlockPool(config.num_blocks),
            block_size=config.block_size,
            max_batch_tokens=config.max_batch_tokens,
            max_queued_tokens=config.max_queued_tokens,
        )
        self.worker = PrefillWorker(model, kv_cache, self.scheduler)
        self.layout = layout_to_proto(kv_cache.layout, fingerprint)
        self.max_prompt_tokens = min(
            model.config.max_position_embeddings, self.scheduler.max_prompt_tokens()
        )
        # One message carries one layer of one chunk: it must fit the gRPC message limit.
        largest = 2 * block_bytes(self.layout) * (self.scheduler.chunk_tokens // config.block_size)
        if largest + 4096 > max_message_bytes:
            raise ValueError(
                f"a KV chunk of max_batch_tokens {config.max_batch_tokens} is {largest} bytes, "
                f"more than max_message_bytes {max_message_bytes}; lower --max-batch-tokens"
            )
        self._channels = ChannelPool(max_message_bytes)
        self._encoder = ThreadPoolExecutor(num_encoder_threads, thread_name_prefix="kv-encode")
        self.worker.start()

    async def close(self) -> None:
        """Stop the worker (failing what is left), close channels and the encoder threads."""
        await asyncio.to_thread(self.worker.stop)
        await self._channels.close()
        self._encoder.shutdown(wait=False, cancel_futures=True)

    async def Prefill(
        self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> prefill_pb2.PrefillResponse:
        task = convert.prefill_task(
            request,
            vocab_size=self.model.config.vocab_size,
            max_prompt_tokens=self.max_prompt_tokens,
            block_size=self.config.block_size,
        )
        timeout_s = self.config.transfer_timeout_s
        remaining = context.time_remaining()
        if remaining is not None:  # end the transfer with the caller's deadline
            timeout_s = min(timeout_s, max(remaining, 0.001))
        sender = KvSender(
            task,
            channel=self._channels.get(task.address),
            encoder=self._encoder,
            layout=self.layout,
            num_chunks=self.layout.num_layers * self.scheduler.num_chunks(len(task.token_ids)),
            timeout_s=timeout_s,
        )
        # Refuse a full queue (or a request id already here) before opening a stream to
        # decode; `submit` checks again.
        self.worker.check_capacity(task)
        is_submitted = False

        def submit() -> None:
            nonlocal is_submitted
            self.worker.submit(task, sender)
            is_submitted = True

        try:
            result = await sender.run(submit)
        finally:
            if is_submitted:  # never remove another call's prompt that has the same id
                self.worker.remove(task.request_id)
        first = result.first
        return prefill_pb2.PrefillResponse(
            first_token_id=first.token_id,
            first_logprobs=logprobs(first),
            num_prompt_tokens=len(task.token_ids),
            queue_ms=first.queue_ms,
            compute_ms=first.compute_ms,
            transfer_ms=result.transfer_ms,
            kv_bytes=result.kv_bytes,
        )

    async def Info(
        self, request: prefill_pb2.InfoRequest, context: grpc.aio.ServicerContext
    ) -> prefill_pb2.InfoResponse:
        return prefill_pb2.InfoResponse(
            model=self._model_name,
            dtype=dtype_name(self.model.dtype),
            device=str(self.model.device),
            kv_layout=self.layout,
            attention_backend=self.model.attention.name,
            max_prompt_tokens=self.max_prompt_tokens,
            max_batch_tokens=self.config.max_batch_tokens,
            num_queued_tokens=self.worker.num_queued_tokens,
            num_total_blocks=self.worker.num_total_blocks,
            num_free_blocks=self.worker.num_free_blocks,
        )


def add_to_server(server: RpcServer, servicer: PrefillServicer) -> None:
    server.add_service(
        SERVICE_NAME, lambda s: prefill_pb2_grpc.add_PrefillServiceServicer_to_server(servicer, s)
    )
