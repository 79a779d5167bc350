"""How the prefill worker hands a step's KV to its sinks: a host sink (grpc, shm) gets each
layer as it is computed, a device sink (cuda-ipc) every layer at once after the forward, in
gathers of bounded size. Real runner, real scheduler, on the CPU; the sinks record."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch

from mili.engine.kv.block_pool import BlockPool
from mili.engine.sampling_params import SamplingParams
from mili.engine.step.runner import ModelRunner
from services.prefill import worker as worker_module
from services.prefill.scheduler import Scheduler
from services.prefill.task import FirstToken, PrefillTask
from services.prefill.worker import PrefillWorker
from tests.prefill.harness import BLOCK_SIZE, TinyModel, random_ids


class RecordingSink:
    def __init__(self, on_device: bool, layers_done: Callable[[], int]) -> None:
        self.on_device = on_device
        self._layers_done = layers_done
        self.sent: list[tuple[int, int, torch.Tensor, int]] = []  # layer, first, kv, done then
        self.done = threading.Event()
        self.error: BaseException | None = None

    @property
    def takes_device_tensors(self) -> bool:
        return self.on_device

    def send_blocks(
        self, layer: int, first_block: int, kv: torch.Tensor, ready: Callable[[], None] | None
    ) -> None:
        if ready is not None:
            ready()
        self.sent.append((layer, first_block, kv.clone(), self._layers_done()))

    def finish(self, first: FirstToken) -> None:
        self.done.set()

    def fail(self, exc: BaseException) -> None:
        self.error = exc
        self.done.set()


def new_worker(tiny: TinyModel) -> PrefillWorker:
    """A worker over the tiny model: 64 blocks, steps of up to 512 tokens."""
    runner = ModelRunner.create(tiny.model, 64, BLOCK_SIZE, vocab_size=tiny.model.config.vocab_size)
    scheduler = Scheduler(
        BlockPool(64, null_block=True),
        block_size=BLOCK_SIZE,
        max_batch_tokens=512,
        max_queued_tokens=4096,
    )
    return PrefillWorker(runner, scheduler)


@pytest.mark.parametrize("max_gather_layers", [None, 1])
def test_host_sinks_get_each_layer_as_computed_device_sinks_all_after_the_forward(
    tiny: TinyModel, monkeypatch: pytest.MonkeyPatch, max_gather_layers: int | None
) -> None:
    config = tiny.model.config
    num_layers = config.num_hidden_layers
    worker = new_worker(tiny)
    runner = worker.runner
    if max_gather_layers is not None:  # a gather bound of one layer: one send per layer
        layer_bytes = 3 * runner.kv_cache.layer_block_bytes
        monkeypatch.setattr(worker_module, "_MAX_GATHER_BYTES", layer_bytes)

    def layers_done() -> int:
        return len(worker.steps[-1].layer_done_at)

    prompt = random_ids(3 * BLOCK_SIZE - 5, config.vocab_size, seed=1)
    sinks = [RecordingSink(True, layers_done), RecordingSink(False, layers_done)]
    worker.start()
    try:
        for i, sink in enumerate(sinks):
            task = PrefillTask(f"r{i}", prompt, SamplingParams(), "decode:0", [7, 8, 9])
            worker.reserve(task)
            worker.submit(task, sink)
        for sink in sinks:
            assert sink.done.wait(30)
            assert sink.error is None
    finally:
        worker.stop()

    device, host = sinks
    # host: one layer per send, each while the forward is at that layer
    assert [(layer, first, kv.shape[0], done) for layer, first, kv, done in host.sent] == [
        (layer, 0, 1, layer) for layer in range(num_layers)
    ]
    # device: all layers once the forward is over, in one gather or (bounded) one per layer
    per_send = num_layers if max_gather_layers is None else 1
    assert [(layer, kv.shape[0], done) for layer, _, kv, done in device.sent] == [
        (layer, per_send, num_layers) for layer in range(0, num_layers, per_send)
    ]
    # the same prompt's KV both ways: the same bytes
    whole = [torch.cat([kv for _, _, kv, _ in sink.sent]) for sink in sinks]
    assert whole[0].shape == (num_layers, 2, 3, *runner.kv_cache.k[0].shape[1:])
    assert torch.equal(whole[0], whole[1])
    assert whole[0].abs().sum() > 0


def test_a_step_without_host_sinks_runs_without_a_layer_callback(tiny: TinyModel) -> None:
    """Device sinks alone (cuda-ipc) take every layer after the forward, so the worker asks
    for no layer callback: on CUDA such a step can replay a prefill graph."""
    config = tiny.model.config
    worker = new_worker(tiny)
    sink = RecordingSink(True, lambda: len(worker.steps[-1].layer_done_at))
    prompt = random_ids(2 * BLOCK_SIZE + 3, config.vocab_size, seed=2)
    worker.start()
    try:
        task = PrefillTask("r0", prompt, SamplingParams(), "decode:0", [7, 8, 9])
        worker.reserve(task)
        worker.submit(task, sink)
        assert sink.done.wait(30)
        assert sink.error is None
    finally:
        worker.stop()
    assert worker.steps[-1].layer_done_at == []  # no callback ran
    num_layers = config.num_hidden_layers
    assert [(layer, kv.shape[0]) for layer, _, kv, _ in sink.sent] == [(0, num_layers)]
