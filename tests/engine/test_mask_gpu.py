"""The constraint mask on a CUDA device: `apply_token_bitmask`'s torch path (what decode runs on
the GPU, the bitmask copied from the masker's pinned buffer) against the numpy path on the CPU
(what the CPU tests pin), and the sampler under a mask on the device.

Needs no grammar engine: the bitmasks are random words, so every bit pattern shows up. Marked
gpu; benchmarks/gpu_check.sh runs it with the MoE GPU tests.
"""

from __future__ import annotations

import pytest
import torch

from mili.engine.constraint import mask as mask_module
from mili.engine.constraint.mask import FilledMask, apply_token_bitmask, unpack_bitmask
from mili.engine.sampling_params import SamplingParams
from mili.engine.step.sampler import Sampler, SequenceSampling

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
QWEN3_ROWS = 151_936  # Qwen3's embedding rows: 4,748 words per mask row


def random_mask(num_rows: int, row_ids: list[int], words: int, seed: int) -> FilledMask:
    """Random words in a pinned buffer, as BatchMasker holds them when CUDA is there."""
    gen = torch.Generator().manual_seed(seed)
    bits = torch.randint(-(2**31), 2**31 - 1, (len(row_ids), words), generator=gen)
    pinned = torch.empty((len(row_ids), words), dtype=torch.int32, pin_memory=True)
    pinned.copy_(bits.to(torch.int32))
    assert num_rows > max(row_ids)
    return FilledMask(pinned, row_ids)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [QWEN3_ROWS, 151_669, 897])
@pytest.mark.parametrize("row_ids", [list(range(64)), [1, 5, 63], [0]])
def test_cuda_torch_path_equals_cpu_numpy_path(
    row_ids: list[int], width: int, dtype: torch.dtype
) -> None:
    """Same entries -inf, every other entry untouched, for all rows or some; a logits view
    narrower than the mask (the sampler passes logits[:, :vocab])."""
    words = (max(width, QWEN3_ROWS) + 31) // 32
    mask = random_mask(64, row_ids, words, seed=width + len(row_ids))
    gen = torch.Generator().manual_seed(len(row_ids))
    full = torch.randn(64, words * 32, generator=gen).to(dtype)
    on_cpu = full[:, :width].float().clone()  # numpy's path: float32 on the CPU
    mask_module._apply_numpy(on_cpu, mask)
    on_device = full.cuda()
    logits = on_device[:, :width]  # a view, as the sampler hands it over
    apply_token_bitmask(logits, mask)
    got = logits.float().cpu()
    assert torch.equal(got.isinf(), on_cpu.isinf())
    kept = ~on_cpu.isinf()
    assert torch.equal(got[kept], on_cpu[kept])
    assert torch.equal(on_device[:, width:].cpu(), full[:, width:])  # past the view: untouched


def test_unpack_on_cuda_equals_cpu() -> None:
    mask = random_mask(8, list(range(8)), (QWEN3_ROWS + 31) // 32, seed=3)
    on_cuda = unpack_bitmask(mask.bitmask.cuda(), QWEN3_ROWS).cpu()
    assert torch.equal(on_cuda, unpack_bitmask(mask.bitmask, QWEN3_ROWS))


def test_sampler_on_cuda_draws_only_allowed_tokens() -> None:
    """Greedy and temperature 1 rows, masked on the device: every token drawn is allowed by
    its row's mask; an unconstrained row is sampled as without a mask."""
    batch, vocab = 16, QWEN3_ROWS
    constrained = list(range(batch - 1))  # the last row is free
    mask = random_mask(batch, constrained, (vocab + 31) // 32, seed=7)
    allowed = unpack_bitmask(mask.bitmask, vocab)
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.0, seed=i) for i in range(batch)]
    seqs = [SequenceSampling(p, [1, 2, 3], vocab) for p in params]
    logits = torch.randn(batch, vocab, device="cuda")
    free_row = logits[-1:].clone()
    out = Sampler(vocab)(logits, seqs, mask)
    for i, token in enumerate(out.token_ids[:-1]):
        assert allowed[i, token], (i, token)
    free = Sampler(vocab)(free_row, seqs[-1:])
    assert out.token_ids[-1] == free.token_ids[0]
