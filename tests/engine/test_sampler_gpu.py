"""The sampler's draw and filters on a CUDA device, on Qwen3-sized rows: the two-level inverse
CDF draws what it draws on the CPU, and the filters read off torch.topk's head keep what a sort
of the rows keeps (torch's CUDA topk and sort are other kernels than the CPU's).

Marked gpu; benchmarks/gpu_check.sh runs it with the other new paths (last: a device-side
fault would poison the process).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from mili.engine.sampling_params import SamplingParams
from mili.engine.step.distribution import filter_logits, inverse_cdf_in_blocks, sample_inverse_cdf
from mili.engine.step.sampler import Sampler, SequenceSampling

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
VOCAB = 151_669  # Qwen3's tokenizer ids


def rows(num_rows: int, seed: int) -> torch.Tensor:
    """[num_rows, VOCAB] probabilities: half dense, half a constraint's few allowed tokens."""
    g = torch.Generator().manual_seed(seed)
    probs = (torch.randn(num_rows, VOCAB, generator=g) * 3).softmax(-1)
    for row in probs[num_rows // 2 :]:
        allowed = torch.randperm(VOCAB, generator=g)[:5]
        row.zero_()[allowed] = torch.rand(5, generator=g) + 0.1
    return probs


@pytest.mark.parametrize("draw", [sample_inverse_cdf, inverse_cdf_in_blocks])  # 1 row: whole
@pytest.mark.parametrize("num_rows", [1, 64, 256])
def test_inverse_cdf_on_cuda_draws_by_the_rule(
    num_rows: int, draw: Callable[..., torch.Tensor]
) -> None:
    """Each draw is the token where u x total falls in the row's float64 CDF (taken on the CPU,
    in order), to a rounding of the block sums (float32, summed in another order on the
    device), and never one of probability 0."""
    probs = rows(num_rows, num_rows)
    u = torch.rand(num_rows, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    u[:2] = torch.tensor([0.0, 1 - 2**-53], dtype=torch.float64)[: min(2, num_rows)]
    drawn = draw(probs.cuda(), u.cuda()).cpu().unsqueeze(1)  # [B, 1]
    cdf = probs.double().cumsum(-1)
    target = (u * cdf[:, -1]).unsqueeze(1)
    before = torch.where(drawn > 0, cdf.gather(1, (drawn - 1).clamp(min=0)), 0.0)
    assert bool((before <= target + 1e-6).all() & (cdf.gather(1, drawn) > target - 1e-6).all())
    assert bool((probs.gather(1, drawn) > 0).all())
    exact = draw(probs, u).unsqueeze(1)
    assert (exact == drawn).float().mean() > 0.95  # mostly the very same token as the CPU's


def test_filters_from_the_topk_head_keep_what_the_sort_keeps_on_cuda() -> None:
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(64, VOCAB, generator=g) * 2).bfloat16().float()  # ties
    logits[:8, 40:] = float("-inf")  # fewer allowed than some top-k
    top_k = torch.randint(1, 61, (64, 1), generator=g)
    top_p = torch.rand(64, 1, generator=g) * 0.8 + 0.2
    min_p = torch.rand(64, 1, generator=g) * 0.1
    args = [t.cuda() for t in (logits, top_k, top_p, min_p)]
    whole = filter_logits(*args)
    head = filter_logits(*args, head_size=60)
    assert torch.equal(head.isinf(), whole.isinf())
    kept = (~head.isinf()).sum(-1).cpu()
    assert kept.min() >= 1 and kept.max() > 1  # the filters worked, and kept something


def test_qwen3_sampling_draws_inside_each_rows_top_k_on_cuda() -> None:
    params = SamplingParams(temperature=0.6, top_k=20, top_p=0.95)
    seqs = [SequenceSampling(params, [1, 2], VOCAB) for _ in range(64)]
    logits = torch.randn(64, 151_936, device="cuda") * 3
    drawn = torch.tensor(Sampler(VOCAB)(logits, seqs).token_ids)
    kth = logits[:, :VOCAB].topk(20, dim=-1).values[:, -1:].cpu()
    assert bool((logits.cpu().gather(1, drawn.unsqueeze(1)) >= kth).all())
    assert len(set(drawn.tolist())) > 1


def test_a_nan_row_draws_in_range_without_a_device_fault() -> None:
    probs = torch.full((2, VOCAB), float("nan"), device="cuda")
    probs[1] = 0
    drawn = sample_inverse_cdf(probs, torch.full((2,), 0.5, dtype=torch.float64, device="cuda"))
    torch.cuda.synchronize()
    assert all(0 <= t < VOCAB for t in drawn.tolist())


def test_sampler_graphs_replay_what_the_eager_launch_draws() -> None:
    """SamplerGraphs over a static logits buffer, as the decode graphs hand it over: a key's
    first batch eager, its second captured (and checked), the rest replayed; each batch's
    tokens the eager launch's on the same logits, with the parameters (seeds, positions) and
    the mask rows of that batch, whatever the padded rows hold (NaN here)."""
    from mili.engine.constraint.mask import FilledMask
    from mili.engine.step.sampler_graphs import SamplerGraphs

    model_rows = 151_936
    sizes = (1, 2, 4, 8, 16, 24)
    static = torch.full((24, model_rows), float("nan"), device="cuda")
    sampler = Sampler(VOCAB)
    graphs = SamplerGraphs(sampler, static, sizes)
    words = (model_rows + 31) // 32
    buffer = torch.zeros((24, words), dtype=torch.int32, pin_memory=True)  # the masker's
    g = torch.Generator().manual_seed(0)
    kinds = {
        "random": SamplingParams(temperature=1.0, seed=1),
        "qwen3": SamplingParams(temperature=0.6, top_k=20, top_p=0.95, seed=2),
        "top-p": SamplingParams(temperature=0.8, top_p=0.9, seed=3),
        "greedy": SamplingParams(temperature=0.0),
    }
    cases = [("random", 1, False), ("random", 5, True), ("qwen3", 17, False),
             ("top-p", 3, True), ("greedy", 2, True)]  # fmt: skip
    for kind, n, masked in cases:
        seqs = [SequenceSampling(kinds[kind], [1, 2], VOCAB) for _ in range(n)]
        for _ in range(4):  # eager, capture, replay, replay
            static[:n] = torch.randn(n, model_rows, generator=g).mul_(3).cuda()
            mask = None
            if masked:  # a random quarter of the ids allowed, in every row
                bits = torch.randint(-(2**31), 2**31, (n, words), generator=g, dtype=torch.int64)
                buffer[:n] = (bits & torch.randint(-(2**31), 2**31, bits.shape, generator=g)).int()
                mask = FilledMask(buffer[:n], list(range(n)))
            eager = sampler.launch(static[:n].clone(), seqs, mask).result().token_ids
            got = graphs.launch(static[:n], seqs, mask).result().token_ids
            assert got == eager, (kind, n, masked)
            for s, t in zip(seqs, got, strict=True):
                s.append(t)
    assert graphs.num_graphs == len(cases)
    assert graphs.num_replays == 2 * len(cases)
