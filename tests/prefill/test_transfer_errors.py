"""Every way a prefill can fail ends with the right status at the caller, fast, and with the
prefill's blocks freed (`prefill_service` asserts the free count on exit of every test)."""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry import trace

from mili.engine.sampling_params import SamplingParams
from mili.errors import DataLoss
from mili.pb.common.v1 import sampling_pb2
from mili.pb.prefill.v1 import prefill_pb2
from mili.rpc.client import insecure_channel
from mili.rpc.status import bad_request_of, retry_info_of
from mili.telemetry.tracing import client_interceptors
from mili.watchdog import Watchdog
from services.prefill import sender as sender_module
from services.prefill.sender import KvSender
from services.prefill.task import FirstToken, PrefillTask
from tests.prefill.harness import (
    BLOCK_SIZE,
    TinyModel,
    prefill_request,
    prefill_service,
    random_ids,
    receiver_for,
    until,
)

ROOT = Path(__file__).resolve().parents[2]


def prompt(tiny: TinyModel, n: int = 40, seed: int = 1) -> list[int]:
    return random_ids(n, tiny.model.config.vocab_size, seed=seed)


async def failed(call: object) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call  # type: ignore[misc]
    return info.value


def test_layout_mismatch_is_failed_precondition_naming_both_layouts(tiny: TinyModel) -> None:
    async def main() -> None:
        async with prefill_service(tiny) as h:
            other = type(h.servicer.layout)()
            other.CopyFrom(h.servicer.layout)
            other.block_size = 32
            async with receiver_for(h, layout=other) as (receiver, server):
                receiver.reserve("r", [0, 1, 2])
                request = prefill_request("r", prompt(tiny), server.address, [0, 1, 2])
                err = await failed(h.stub.Prefill(request))
        assert err.code() is grpc.StatusCode.FAILED_PRECONDITION, err.details()
        assert server.address in err.details()
        assert "block_size=16" in err.details() and "block_size=32" in err.details()
        assert receiver.transfers["r"].chunks == []  # refused at the header

    asyncio.run(main())


def test_missing_reservation_is_not_found(tiny: TinyModel) -> None:
    async def main() -> None:
        async with prefill_service(tiny) as h, receiver_for(h) as (_, server):
            request = prefill_request("ghost", prompt(tiny), server.address, [0, 1, 2])
            err = await failed(h.stub.Prefill(request))
        assert err.code() is grpc.StatusCode.NOT_FOUND, err.details()
        assert server.address in err.details() and "ghost" in err.details()

    asyncio.run(main())


def test_corrupt_chunk_is_data_loss(tiny: TinyModel) -> None:
    async def main() -> None:
        async with prefill_service(tiny) as h, receiver_for(h) as (receiver, server):
            receiver.reserve("r", [0, 1, 2])
            receiver.corrupt_seq = 3
            request = prefill_request("r", prompt(tiny), server.address, [0, 1, 2])
            err = await failed(h.stub.Prefill(request))
        assert err.code() is grpc.StatusCode.DATA_LOSS, err.details()
        assert server.address in err.details() and "checksum" in err.details()

    asyncio.run(main())


def test_decode_refusing_the_transfer_as_malformed_is_data_loss(tiny: TinyModel) -> None:
    """Decode answers a malformed transfer (here its commit) INVALID_ARGUMENT: that is our
    message's fault, not our caller's, whose request had no such field: DATA_LOSS, carrying
    decode's words, never INVALID_ARGUMENT naming a field of the Prefill request."""

    async def main() -> None:
        async with prefill_service(tiny) as h, receiver_for(h) as (receiver, server):
            receiver.reserve("r", [0, 1, 2])
            receiver.refuse_commit = (grpc.StatusCode.INVALID_ARGUMENT, "first_token_id 9999")
            request = prefill_request("r", prompt(tiny), server.address, [0, 1, 2])
            err = await failed(h.stub.Prefill(request))
        assert err.code() is grpc.StatusCode.DATA_LOSS, err.details()
        assert server.address in err.details() and "first_token_id 9999" in err.details()
        assert bad_request_of(err) is None

    asyncio.run(main())


@pytest.mark.parametrize("traced", [False, True], ids=["plain", "traced"])
@pytest.mark.parametrize("corrupt_seq", [0, 5])
def test_decode_error_racing_our_writes_keeps_its_code(
    tiny: TinyModel, corrupt_seq: int, traced: bool
) -> None:
    """Chunks written back to back while decode aborts the stream: grpc turns such a write into
    INTERNAL "Internal error from Core" and may overwrite decode's status with it; the caller
    must still get decode's DATA_LOSS, every time — also through tracing's client interceptors,
    which wrap the call."""
    interceptors = client_interceptors(trace.get_tracer(__name__)) if traced else ()
    num_layers = tiny.model.config.num_hidden_layers

    async def main() -> None:
        async with prefill_service(tiny) as h:
            kv_cache = h.servicer.worker.kv_cache
            index = kv_cache.block_index([0, 1, 2])
            layers = [kv_cache.gather_layers(i, i + 1, index) for i in range(num_layers)]
            async with receiver_for(h) as (receiver, server):
                receiver.corrupt_seq = corrupt_seq
                channel = insecure_channel(server.address, interceptors=interceptors)
                with ThreadPoolExecutor(2) as encoder:
                    for i in range(15):
                        rid = f"race-{i}"
                        receiver.reserve(rid, [0, 1, 2])
                        sender = KvSender(
                            PrefillTask(
                                rid, prompt(tiny), SamplingParams(), server.address, [0, 1, 2]
                            ),
                            channel=channel,
                            encoder=encoder,
                            layout=h.servicer.layout,
                            num_chunks=num_layers,
                            timeout_s=10,
                        )

                        def push(sender: KvSender = sender) -> None:
                            for layer, kv in enumerate(layers):
                                sender.send_blocks(layer, 0, kv, None)
                            sender.finish(FirstToken(0, None, None, 0.0, 0.0))

                        with pytest.raises(DataLoss, match="checksum"):
                            await sender.run(push, lambda: None)
                await channel.close()

    asyncio.run(main())


def test_unreachable_decode_is_unavailable(tiny: TinyModel) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"

    async def main() -> None:
        async with prefill_service(tiny) as h:
            started = time.monotonic()
            err = await failed(
                h.stub.Prefill(prefill_request("r", prompt(tiny), address, [0, 1, 2]))
            )
            assert err.code() is grpc.StatusCode.UNAVAILABLE, err.details()
            assert address in err.details()
            assert time.monotonic() - started < 5

    asyncio.run(main())


def test_decode_stopped_mid_transfer_is_unavailable(tiny: TinyModel) -> None:
    async def main() -> None:
        async with prefill_service(tiny) as h, receiver_for(h) as (receiver, server):
            receiver.reserve("r", [0, 1, 2])
            receiver.stall_after = 2
            request = prefill_request("r", prompt(tiny), server.address, [0, 1, 2])
            call = asyncio.ensure_future(h.stub.Prefill(request))
            await asyncio.wait_for(receiver.got_chunk.wait(), 5)
            started = time.monotonic()
            await server.stop(None)  # decode goes away with the transfer half done
            err = await failed(call)
            assert time.monotonic() - started < 5
        assert err.code() is grpc.StatusCode.UNAVAILABLE, err.details()
        assert server.address in err.details()

    asyncio.run(main())


def test_decode_process_killed_mid_transfer_is_unavailable(tiny: TinyModel) -> None:
    async def main() -> None:
        async with prefill_service(tiny) as h:
            layout_hex = h.servicer.layout.SerializeToString().hex()
            proc = subprocess.Popen(
                [sys.executable, "-m", "tests.prefill.receiver", layout_hex],
                stdout=subprocess.PIPE,
                text=True,
                cwd=ROOT,
            )
            try:
                assert proc.stdout is not None
                line = await asyncio.to_thread(proc.stdout.readline)
                address = line.split()[-1]
                request = prefill_request("r", prompt(tiny), address, [0, 1, 2])
                call = asyncio.ensure_future(h.stub.Prefill(request))
                assert (await asyncio.to_thread(proc.stdout.readline)).startswith("chunk 0")
                started = time.monotonic()
                proc.send_signal(signal.SIGKILL)
                err = await failed(call)
                assert time.monotonic() - started < 5
            finally:
                proc.kill()
                proc.wait()
        assert err.code() is grpc.StatusCode.UNAVAILABLE, err.details()
        assert address in err.details()

    asyncio.run(main())


def test_caller_deadline_ends_the_transfer_and_frees_blocks(tiny: TinyModel) -> None:
    async def main() -> None:
        async with prefill_service(tiny) as h, receiver_for(h) as (receiver, server):
            receiver.reserve("r", [0, 1, 2])
            receiver.stall_after = 1  # decode hangs: no ack ever comes
            request = prefill_request("r", prompt(tiny), server.address, [0, 1, 2])
            started = time.monotonic()
            err = await failed(h.stub.Prefill(request, timeout=1.0))
            assert err.code() is grpc.StatusCode.DEADLINE_EXCEEDED, err.details()
            assert time.monotonic() - started < 3
            # The transfer carried the deadline: decode's side of it ends too.
            await until(lambda: receiver.transfers["r"].status != "open")
            assert "r" not in receiver.reservations

    asyncio.run(main())


def test_caller_cancel_cancels_the_transfer_and_frees_blocks(tiny: TinyModel) -> None:
    async def main() -> None:
        async with prefill_service(tiny) as h, receiver_for(h) as (receiver, server):
            receiver.reserve("r", [0, 1, 2])
            receiver.stall_after = 1
            call = h.stub.Prefill(prefill_request("r", prompt(tiny), server.address, [0, 1, 2]))
            await asyncio.wait_for(receiver.got_chunk.wait(), 5)
            assert h.num_free_blocks < h.num_total_blocks  # held while in flight
            call.cancel()
            await until(lambda: receiver.transfers["r"].status == "cancelled")
            await until(lambda: h.num_free_blocks == h.num_total_blocks)

    asyncio.run(main())


def test_a_cancelled_prompt_leaves_the_worker_before_decode_answers_the_abort(
    tiny: TinyModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a review: the prompt stayed on the worker (its chunks computed, its blocks
    held) until decode answered the abort, up to _ABORT_ANSWER_S: many steps on a GPU."""
    monkeypatch.setattr(sender_module, "_ABORT_ANSWER_S", 30.0)  # a decode slow to answer

    async def main() -> None:
        async with prefill_service(tiny) as h, receiver_for(h) as (receiver, server):
            receiver.reserve("r", [0, 1, 2])
            receiver.stall_after = 1  # reads nothing more, the abort included, until resumed
            call = h.stub.Prefill(prefill_request("r", prompt(tiny), server.address, [0, 1, 2]))
            await asyncio.wait_for(receiver.got_chunk.wait(), 5)
            worker = h.servicer.worker
            assert worker.num_queued_requests == 1
            call.cancel()
            await until(lambda: worker.num_queued_requests == 0, timeout_s=10)
            assert receiver.transfers["r"].status == "open"  # the abort is still unanswered
            receiver.resume.set()
            await until(lambda: receiver.transfers["r"].status != "open")

    asyncio.run(main())


def test_a_cancel_during_a_blocked_write_still_sends_the_abort(
    tiny: TinyModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a flaky CI run: grpc.aio cancels a call whose write is interrupted by a cancel,
    so a caller's cancel landing while a chunk waited for decode to read (flow control)
    ended the transfer as CANCELLED without our abort, and decode kept in-place blocks for its
    grace period. The stream now runs on a task of its own, stopped between writes."""
    monkeypatch.setattr(sender_module, "_ABORT_ANSWER_S", 30.0)

    async def main() -> None:
        async with prefill_service(tiny) as h, receiver_for(h) as (receiver, server):
            blocks = list(range(60))  # 60 blocks x 8 layers of 16 KB: past the stream's window
            receiver.reserve("r", blocks)
            receiver.stall_after = 1
            call = h.stub.Prefill(
                prefill_request("r", prompt(tiny, n=60 * BLOCK_SIZE - 3), server.address, blocks)
            )
            await asyncio.wait_for(receiver.got_chunk.wait(), 5)
            await asyncio.sleep(0.5)  # the forward ends and the sender blocks in a write
            call.cancel()
            await asyncio.sleep(0.5)
            assert receiver.transfers["r"].status == "open"  # the abort waits for the write
            receiver.resume.set()
            await until(lambda: receiver.transfers["r"].status != "open")
            assert receiver.transfers["r"].status == "aborted: CANCELLED"
            await until(lambda: h.num_free_blocks == h.num_total_blocks)

    asyncio.run(main())


def test_a_failed_compute_aborts_the_transfer_with_our_status(
    tiny: TinyModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 29: a transfer prefill gives up on ends with an abort message carrying its status,
    so decode tells it from a sender that died (a stream broken off without one)."""

    def boom(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("the forward failed")

    async def main() -> None:
        async with prefill_service(tiny) as h, receiver_for(h) as (receiver, server):
            monkeypatch.setattr(h.servicer.worker.runner, "prefill_step", boom)
            receiver.reserve("r", [0, 1, 2])
            request = prefill_request("r", prompt(tiny), server.address, [0, 1, 2])
            err = await failed(h.stub.Prefill(request, timeout=10))
            assert err.code() is grpc.StatusCode.INTERNAL, err.details()
            assert "the forward failed" in err.details()
            await until(lambda: receiver.transfers["r"].status != "open")
            assert receiver.transfers["r"].status == "aborted: INTERNAL"
            assert "r" not in receiver.reservations

    asyncio.run(main())


def test_a_failed_step_leaves_a_newer_request_of_the_same_id_alone(
    tiny: TinyModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request removed (its caller cancelled) while its step computes, then an id reused by a
    new call before that step fails: the failure is the old request's only; the new one is
    computed, not dropped to wait out its transfer deadline."""
    entered, release = threading.Event(), threading.Event()

    async def main() -> None:
        async with prefill_service(tiny) as h, receiver_for(h) as (receiver, server):
            real = h.servicer.worker.runner.prefill_step
            calls = 0

            def first_fails(*args: Any, **kwargs: Any) -> Any:
                nonlocal calls
                calls += 1
                if calls > 1:
                    return real(*args, **kwargs)
                entered.set()
                release.wait(10)
                raise RuntimeError("the forward failed")

            monkeypatch.setattr(h.servicer.worker.runner, "prefill_step", first_fails)
            receiver.reserve("x", [0, 1, 2])
            old = h.stub.Prefill(prefill_request("x", prompt(tiny), server.address, [0, 1, 2]))
            assert await asyncio.to_thread(entered.wait, 5)
            old.cancel()
            await until(lambda: h.servicer.worker.num_queued_requests == 0)
            receiver.reserve("x", [3, 4, 5])
            new = h.stub.Prefill(
                prefill_request("x", prompt(tiny), server.address, [3, 4, 5]), timeout=20
            )
            await until(lambda: h.servicer.worker.num_queued_requests == 1)
            release.set()
            reply = await new
            assert reply.num_prompt_tokens == len(prompt(tiny)) and calls == 2
            await until(lambda: h.num_free_blocks == h.num_total_blocks)

    asyncio.run(main())


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dead_worker_thread_fails_its_prompts_and_says_so(tiny: TinyModel) -> None:
    """A bug that kills the worker thread outside a step (here the scheduler raising): its
    prompts fail UNAVAILABLE at once, not at their deadlines, new ones are refused, and
    `on_death` hears of it (the process then drains and exits 1: __main__)."""
    deaths: list[BaseException] = []

    def broken() -> None:
        raise RuntimeError("injected scheduler bug")

    async def main() -> None:
        async with (
            prefill_service(tiny, on_death=deaths.append) as h,
            receiver_for(h) as (receiver, server),
        ):
            h.servicer.scheduler.schedule = broken  # type: ignore[method-assign]
            for rid in ("a", "b"):
                receiver.reserve(rid, [0, 1, 2])
                request = prefill_request(rid, prompt(tiny), server.address, [0, 1, 2])
                err = await failed(h.stub.Prefill(request))
                assert err.code() is grpc.StatusCode.UNAVAILABLE, err.details()
        assert [str(d) for d in deaths] == ["injected scheduler bug"]

    asyncio.run(main())


def test_full_queue_is_resource_exhausted_with_retry_info(tiny: TinyModel) -> None:
    async def main() -> None:
        async with (
            prefill_service(tiny, max_queued_tokens=64) as h,
            receiver_for(h) as (receiver, server),
        ):
            receiver.reserve("a", [0, 1, 2])
            receiver.reserve("b", [3, 4, 5])
            receiver.hold_ack.clear()  # a's tokens stay in flight until decode acks
            first = asyncio.ensure_future(
                h.stub.Prefill(prefill_request("a", prompt(tiny), server.address, [0, 1, 2]))
            )
            await until(lambda: receiver.transfers.get("a") and receiver.transfers["a"].commit)
            info = await h.stub.Info(prefill_pb2.InfoRequest())
            assert info.num_queued_tokens == 40
            assert info.num_free_blocks == info.num_total_blocks - 3
            second = prefill_request("b", prompt(tiny, seed=2), server.address, [3, 4, 5])
            err = await failed(h.stub.Prefill(second))
            assert err.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, err.details()
            assert "64" in err.details()
            retry = retry_info_of(err)
            assert retry is not None and retry.retry_delay.ToNanoseconds() > 0
            assert "b" not in receiver.transfers  # refused before opening a transfer
            receiver.hold_ack.set()
            await first
            await h.stub.Prefill(second)  # room again

    asyncio.run(main())


def test_prompts_racing_for_the_last_room_are_refused_before_any_header(
    tiny: TinyModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 29: two prompts at once against a bound just above one of them. The one refused
    is refused before its transfer opens (queue room is reserved with the check), never by a
    submit after decode got its header (decode would report a sender that broke off)."""

    async def main() -> None:
        async with (
            prefill_service(tiny, max_queued_tokens=64) as h,
            receiver_for(h) as (receiver, server),
        ):
            receiver.reserve("a", [0, 1, 2])
            receiver.reserve("b", [3, 4, 5])
            receiver.hold_ack.clear()  # the winner's room stays held until decode acks
            # Both calls past pairing together, so both reach the queue bound before either
            # has submitted (before the fix both passed the check and sent their header).
            peers = h.servicer.peers
            pair, arrived = peers.pair, asyncio.Barrier(2)

            async def pair_together(address: str) -> Any:
                await arrived.wait()
                return await pair(address)

            peers.pair = pair_together  # type: ignore[method-assign]
            opened: list[str] = []  # the transfers started (each sends its header first)
            run = KvSender.run

            async def run_recorded(sender: KvSender, start_compute: Any, stop: Any) -> Any:
                opened.append(sender._task.request_id)
                return await run(sender, start_compute, stop)

            monkeypatch.setattr(KvSender, "run", run_recorded)
            calls = {
                rid: asyncio.ensure_future(
                    h.stub.Prefill(
                        prefill_request(rid, prompt(tiny, seed=seed), server.address, ids)
                    )
                )
                for rid, seed, ids in (("a", 1, [0, 1, 2]), ("b", 2, [3, 4, 5]))
            }
            done, _ = await asyncio.wait(calls.values(), return_when=asyncio.FIRST_COMPLETED)
            (refused,) = [rid for rid, call in calls.items() if call in done]
            err = await failed(calls[refused])
            assert err.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, err.details()
            assert refused not in opened  # decode never heard of it
            (winner,) = set(calls) - {refused}
            receiver.hold_ack.set()
            assert (await calls[winner]).num_prompt_tokens == 40
            assert opened == [winner] and list(receiver.transfers) == [winner]

    asyncio.run(main())


def test_duplicate_request_id_is_refused_without_touching_the_first(tiny: TinyModel) -> None:
    async def main() -> None:
        async with (
            prefill_service(tiny) as h,
            receiver_for(h) as (receiver, server),
        ):
            receiver.reserve("dup", [0, 1, 2])
            receiver.hold_ack.clear()
            request = prefill_request("dup", prompt(tiny), server.address, [0, 1, 2])
            first = asyncio.ensure_future(h.stub.Prefill(request))
            await until(lambda: receiver.transfers.get("dup") and receiver.transfers["dup"].commit)
            err = await failed(h.stub.Prefill(request))
            assert err.code() is grpc.StatusCode.INVALID_ARGUMENT, err.details()
            assert "already being prefilled" in err.details()
            assert h.num_free_blocks == h.num_total_blocks - 3  # the first still holds its own
            receiver.hold_ack.set()
            assert (await first).num_prompt_tokens == 40

    asyncio.run(main())


def _bad(tiny: TinyModel, **changes: object) -> prefill_pb2.PrefillRequest:
    """A valid 20-token request with `changes` applied."""
    fields: dict[str, object] = {
        "request_id": "r",
        "prompt_token_ids": prompt(tiny, n=20),
        "address": "127.0.0.1:1",
        "prompt_block_ids": [0, 1],
        "sampling": sampling_pb2.SamplingParams(temperature=0.0),
        **changes,
    }
    return prefill_pb2.PrefillRequest(
        request_id=fields["request_id"],
        prompt_token_ids=fields["prompt_token_ids"],
        sampling=fields["sampling"],
        destination=prefill_pb2.KvDestination(
            address=fields["address"], prompt_block_ids=fields["prompt_block_ids"]
        ),
    )


@pytest.mark.parametrize(
    ("changes", "fields"),
    [
        ({"request_id": ""}, ["request_id"]),
        ({"prompt_token_ids": []}, ["prompt_token_ids"]),
        ({"prompt_token_ids": [5, 6, 512, 7]}, ["prompt_token_ids[2]"]),
        ({"prompt_token_ids": [5] * 1025}, ["prompt_token_ids"]),
        ({"address": ""}, ["destination.address"]),
        ({"prompt_block_ids": [0]}, ["destination.prompt_block_ids"]),
        ({"prompt_block_ids": [0, 1, 2]}, ["destination.prompt_block_ids"]),
        (
            {"sampling": sampling_pb2.SamplingParams(stop_token_ids=[7, 2**32 - 1])},
            ["sampling.stop_token_ids[1]"],
        ),
        (
            {"sampling": sampling_pb2.SamplingParams(logit_bias={5000: 1.0})},
            ["sampling.logit_bias"],
        ),
        (
            {"sampling": sampling_pb2.SamplingParams(logit_bias={i: 1.0 for i in range(1025)})},
            ["sampling.logit_bias"],
        ),
        (
            {"sampling": sampling_pb2.SamplingParams(top_p=2.0, temperature=-1.0)},
            ["sampling.temperature", "sampling.top_p"],
        ),
        ({"request_id": "", "address": ""}, ["request_id", "destination.address"]),
    ],
)
def test_bad_requests_are_invalid_argument_naming_the_field(
    tiny: TinyModel, changes: dict[str, object], fields: list[str]
) -> None:
    async def main() -> None:
        async with prefill_service(tiny, num_blocks=128, max_queued_tokens=2048) as h:
            err = await failed(h.stub.Prefill(_bad(tiny, **changes)))
        assert err.code() is grpc.StatusCode.INVALID_ARGUMENT, err.details()
        bad_request = bad_request_of(err)
        assert bad_request is not None
        assert [v.field for v in bad_request.field_violations] == fields

    asyncio.run(main())


def test_ids_past_the_tokenizers_vocabulary_are_refused_where_the_model_has_rows(
    tiny: TinyModel,
) -> None:
    # A padded embedding table: the model has 512 rows, the tokenizer 500 ids.
    async def main() -> None:
        async with prefill_service(tiny, vocab_size=500) as h:
            err = await failed(h.stub.Prefill(_bad(tiny, prompt_token_ids=[5] * 19 + [500])))
        assert err.code() is grpc.StatusCode.INVALID_ARGUMENT, err.details()
        assert "[0, 500)" in err.details()
        bad_request = bad_request_of(err)
        assert bad_request is not None
        assert [v.field for v in bad_request.field_violations] == ["prompt_token_ids[19]"]

    asyncio.run(main())


def test_prompt_longer_than_the_pool_is_invalid_argument(tiny: TinyModel) -> None:
    async def main() -> None:
        async with prefill_service(tiny, num_blocks=4, max_queued_tokens=1000) as h:
            ids = prompt(tiny, n=65)  # the pool holds 4 x 16 = 64 tokens
            err = await failed(h.stub.Prefill(prefill_request("r", ids, "x:1", list(range(5)))))
        assert err.code() is grpc.StatusCode.INVALID_ARGUMENT, err.details()
        assert "max_prompt_tokens 64" in err.details()

    asyncio.run(main())


def test_a_stuck_step_is_seen_by_the_watchdog(
    tiny: TinyModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prefill step whose forward never returns (injected): the worker's progress stops
    moving and the watchdog the process runs over it reports it, naming the step's tokens;
    while the worker waits for work (before the prompt came) it reports nothing."""
    release = threading.Event()
    stalls: list[str] = []

    async def main() -> None:
        async with prefill_service(tiny) as h, receiver_for(h) as (receiver, server):
            worker = h.servicer.worker
            real = worker.runner.prefill_step

            def stuck(*args: Any, **kwargs: Any) -> Any:
                release.wait(30)
                return real(*args, **kwargs)

            monkeypatch.setattr(worker.runner, "prefill_step", stuck)
            watchdog = Watchdog(worker.progress, 0.5, stalls.append, "prefill")
            watchdog.start()
            try:
                await asyncio.sleep(1.0)  # idle, twice the timeout
                assert stalls == []
                receiver.reserve("r", [0, 1, 2])
                call = h.stub.Prefill(prefill_request("r", prompt(tiny), server.address, [0, 1, 2]))
                await until(lambda: bool(stalls))
                n = len(prompt(tiny))
                assert stalls[0].startswith(f"prefill: a prefill step of {n} tokens has made no")
                release.set()
                reply = await call  # the step returned after all
                assert reply.num_prompt_tokens == n
            finally:
                release.set()
                watchdog.stop()

    asyncio.run(main())
