"""Decode's overlapped steps (--overlap-steps on, CUDA's default) over real gRPC: a batch that
mixes every way a request ends and every sampling kind gives the single-process engine's
tokens, whether or not steps overlap, and every block comes back.

Runs once per decode_server mode (conftest.py): sync and overlap."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from pathlib import Path
from typing import Any

import pytest

from mili.engine.sampling_params import SamplingParams
from mili.engine.step.decode_inputs import DecodeInputs
from mili.pb.common.v1 import sampling_pb2
from mili.pb.decode.v1 import decode_pb2
from mili.rpc.client import insecure_channel
from services.decode.instance import DecodeInstance
from tests.decode.conftest import NUM_BLOCKS, tiny_decode_config
from tests.decode.harness import (
    Client,
    DecodeServerThread,
    Outcome,
    PrefillPlayer,
    blocks_back,
    eventually,
    sampling,
)
from tests.decode.test_generate import GREEDY, prompt_stopping_at

STOP = sampling_pb2.FINISH_REASON_STOP
LENGTH = sampling_pb2.FINISH_REASON_LENGTH


def test_a_mixed_batch_gives_the_single_process_tokens(
    decode_server: DecodeServerThread, player: PrefillPlayer
) -> None:
    prompt, reference, i = prompt_stopping_at(player, seed=300)
    requests = [
        (prompt, dataclasses.replace(GREEDY, stop_token_ids=(reference[i],))),  # stops mid-way
        (prompt, dataclasses.replace(GREEDY, max_tokens=2)),  # one decode step
        (prompt, dataclasses.replace(GREEDY, max_tokens=1)),  # prefill's token ends it
        (prompt, SamplingParams(temperature=1.3, top_p=0.9, max_tokens=25, seed=11)),
        (prompt, SamplingParams(temperature=0.8, top_k=9, max_tokens=17, seed=12, logprobs=2)),
        # penalties read each token: the step's sampling waits for them, not its forward
        (prompt, SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=6)),
        (prompt[:5], dataclasses.replace(GREEDY, max_tokens=30)),
        # min_tokens holds the stop id back past where it would stop; logit_bias, seeded
        (prompt, dataclasses.replace(GREEDY, stop_token_ids=(reference[i],), min_tokens=i + 2)),
        (
            prompt,
            SamplingParams(
                temperature=0.9,
                max_tokens=12,
                seed=13,
                logit_bias=((reference[1], 4.0), (reference[2], -100.0)),
            ),
        ),
    ]
    expected = [player.reference(p, params) for p, params in requests]
    batcher = decode_server.instance.batcher
    ahead_before = batcher.num_steps_ahead

    async def body() -> None:
        async with insecure_channel(decode_server.address) as channel:
            client = Client(channel)
            outcomes = await asyncio.gather(
                *(
                    client.run_request(player, f"mixed-{n}", p, params)
                    for n, (p, params) in enumerate(requests)
                )
            )
            assert [o.token_ids for o in outcomes] == expected
            assert outcomes[0].token_ids[-1] == reference[i]
            assert [o.finish_reason for o in outcomes[:7]] == [STOP] + [LENGTH] * 6
            assert reference[i] not in outcomes[7].token_ids[: i + 1]  # held back
            assert reference[2] not in outcomes[8].token_ids
            assert [len(o.logprobs) for o in outcomes][4] == 17
            await blocks_back(client, NUM_BLOCKS)

    decode_server.run(body())
    num_ahead = batcher.num_steps_ahead - ahead_before
    if decode_server.instance.config.overlaps_steps:
        assert num_ahead >= 20  # the longest runs 29 steps: all but the first go ahead
    else:
        assert num_ahead == 0


def test_cancelled_mid_flight_frees_its_blocks_and_spares_the_rest(
    decode_server: DecodeServerThread, player: PrefillPlayer
) -> None:
    prompt, _, _ = prompt_stopping_at(player, seed=400)
    long = dataclasses.replace(GREEDY, max_tokens=200)
    expected = player.reference(prompt, dataclasses.replace(GREEDY, max_tokens=30))

    async def body() -> None:
        async with insecure_channel(decode_server.address) as channel:
            client = Client(channel)
            doomed = asyncio.create_task(client.run_request(player, "doomed", prompt, long))
            kept = asyncio.create_task(
                client.run_request(
                    player, "kept", prompt, dataclasses.replace(GREEDY, max_tokens=30)
                )
            )
            steps = decode_server.instance.batcher.num_steps
            await eventually(lambda: decode_server.instance.batcher.num_steps > steps + 5)
            assert not doomed.done()
            doomed.cancel()
            outcome = await kept
            assert doomed.cancelled()
            assert outcome.token_ids == expected
            await blocks_back(client, NUM_BLOCKS)

    decode_server.run(body())


def test_prefill_token_streams_before_the_next_step_ends(
    decode_server: DecodeServerThread, player: PrefillPlayer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prefill's first token reaches the caller once its KV is committed, not after the decode
    step that follows (a whole step on every request's TTFT): here that step is held until the
    token is in, and the rest of the generation is the engine's."""
    prompt, _, _ = prompt_stopping_at(player, seed=500)
    params = dataclasses.replace(GREEDY, max_tokens=6)
    expected = player.reference(prompt, params)
    runner = decode_server.instance.runner
    forward = runner.decode_logits
    in_step, release = threading.Event(), threading.Event()

    def held(*args: Any, **kwargs: Any) -> Any:
        in_step.set()
        assert release.wait(10), "the test never let the step go on"
        return forward(*args, **kwargs)

    monkeypatch.setattr(runner, "decode_logits", held)

    async def body() -> None:
        async with insecure_channel(decode_server.address) as channel:
            client = Client(channel)
            request = decode_pb2.GenerateRequest(
                request_id="first-early", prompt_token_ids=prompt, sampling=sampling(params)
            )
            call, block_ids = await client.admit(request)
            prefilled = await asyncio.to_thread(player.prefill, prompt, params)
            transfer = client.kv.TransferKv(timeout=30)
            for message in player.messages("first-early", prompt, block_ids, prefilled):
                await transfer.write(message)
            await transfer.done_writing()
            await transfer
            try:
                assert await asyncio.to_thread(in_step.wait, 10)  # the next step is held
                first = await asyncio.wait_for(call.read(), 5)
            finally:
                release.set()
            assert list(first.tokens.token_ids) == expected[:1]
            outcome = await client.collect(call, Outcome(token_ids=list(expected[:1])))
            assert outcome.token_ids == expected
            assert outcome.finish_reason == LENGTH
            await blocks_back(client, NUM_BLOCKS)

    decode_server.run(body())


@pytest.mark.parametrize("gather", ["works", "broken"])
def test_steps_overlap_only_if_the_start_up_check_passes(
    tiny_model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    gather: str,
) -> None:
    """--overlap-steps on: the instance checks the overlapped step before serving; a forward
    not fed from the device (injected: the gather dropped) leaves its steps one at a time,
    with a warning that says why."""
    if gather == "broken":
        fill = DecodeInputs.fill

        def stale(self: DecodeInputs, seqs: Any, num_rows: int, *_: Any) -> int:
            return fill(self, seqs, num_rows)

        monkeypatch.setattr(DecodeInputs, "fill", stale)
    with caplog.at_level(logging.WARNING, logger="mili.decode"):
        instance = DecodeInstance.load(tiny_decode_config(tiny_model_dir, "on"))
    try:
        assert instance.batcher.overlap is (gather == "works")
        warned = [r.getMessage() for r in caplog.records if "will not overlap" in r.getMessage()]
        assert len(warned) == (gather == "broken"), warned
        assert ("steps overlapped" in instance.describe()) is (gather == "works")
    finally:
        instance.stop()
