"""The decode step's forward pass as CUDA graphs, one per padded batch size.

Eagerly, a decode step of Qwen3-0.6B is ~1,600 kernel launches at ~20 µs of CPU each: the GPU
waits for Python. A graph replays all of them with one launch. What a graph needs:

- fixed addresses: inputs come from DecodeInputs' static buffers, logits go to one static
  [max_rows, vocab] float32 buffer (a copy at the end of each graph, so the graphs of every size
  share it instead of each holding its own output);
- fixed shapes: a batch of B runs at the smallest captured size >= B (buckets.py), its extra
  rows on the null block; the block tables keep their full width;
- kernels that allocate, validate or pick a launch grid from values only at capture: the
  attention backend says so with `is_graph_safe` (mili.engine.model.attention), else no graphs.

Sizes are captured largest first into one memory pool, so the smaller graphs reuse the
largest one's intermediate memory. Sampling is not in these graphs (its work depends on the
batch's sampling parameters): sampler_graphs.py keeps graphs of it per batch size and plan,
which read the logits from the static buffer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import torch

from mili.plural import plural

_LOG = logging.getLogger("mili.engine")


class DecodeGraphs:
    """Captured decode forwards by padded batch size; `replay(size)` -> logits [size, vocab]."""

    def __init__(
        self, graphs: dict[int, torch.cuda.CUDAGraph], logits: torch.Tensor, memory_bytes: int
    ) -> None:
        self._graphs = graphs
        self.logits = logits  # [max_rows, vocab] float32, written by every graph
        self.batch_sizes = tuple(sorted(graphs))
        self.memory_bytes = memory_bytes  # device memory the capture took (pool + logits)

    @classmethod
    def capture(
        cls,
        forward: Callable[[int], torch.Tensor],
        fill_padding: Callable[[int], None],
        batch_sizes: Sequence[int],
        vocab_size: int,
        device: torch.device,
    ) -> DecodeGraphs:
        """Capture `forward(size)` (the model over rows [0, size) of the static inputs,
        returning [size, vocab] logits) for every size, largest first.

        `fill_padding(size)` stages `size` padded rows, so the warm-up and capture run on
        inputs that touch only the null block.
        """
        started = time.perf_counter()
        graphs, logits, memory_bytes = capture_sizes(
            forward, fill_padding, batch_sizes, (max(batch_sizes), vocab_size), device
        )
        _LOG.info(
            "captured %s of the decode step (batch %s) in %.1f s, %.0f MiB",
            plural(len(graphs), "CUDA graph"),
            ", ".join(map(str, sorted(graphs))),
            time.perf_counter() - started,
            memory_bytes / 2**20,
        )
        return cls(graphs, logits, memory_bytes)

    def replay(self, size: int) -> torch.Tensor:
        """Run the graph of `size` on what the static inputs hold now: logits [size, vocab]."""
        self._graphs[size].replay()
        return self.logits[:size]


def capture_sizes(
    forward: Callable[[int], torch.Tensor],
    stage: Callable[[int], None],
    sizes: Sequence[int],
    output_shape: tuple[int, int],
    device: torch.device,
) -> tuple[dict[int, torch.cuda.CUDAGraph], torch.Tensor, int]:
    """`forward(size)` captured for every size, largest first, into one memory pool (the
    smaller graphs reuse the largest one's intermediates), its result copied into rows [0, n)
    of one static float32 `output_shape` buffer that every graph writes. Before each capture,
    `stage(size)` stages the inputs and one warm-up runs on a side stream (torch's advice:
    lazy initialisation, cuBLAS handles and kernel modules, must not happen inside a capture).
    -> (graphs by size, the output buffer, device memory the captures took: pool + buffer)."""
    # Cached blocks emptied on both sides of the count: entering a capture empties the
    # cache itself, which once made the count come out negative (-950 MiB).
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free_before = torch.cuda.mem_get_info(device)[0]
    output = torch.empty(output_shape, dtype=torch.float32, device=device)
    pool = torch.cuda.graph_pool_handle()
    graphs: dict[int, torch.cuda.CUDAGraph] = {}
    side = torch.cuda.Stream(device)
    for size in sorted(sizes, reverse=True):
        stage(size)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            forward(size)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            result = forward(size)
            output[: result.shape[0]].copy_(result)
        graphs[size] = graph
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return graphs, output, free_before - torch.cuda.mem_get_info(device)[0]
