"""Qwen3-MoE against HF transformers' Qwen3MoeForCausalLM, on checkpoints HF itself wrote.

Each checkpoint is `Qwen3MoeForCausalLM(config).save_pretrained(...)` of transformers 5: the
published layout (one tensor per expert and projection, `num_local_experts` and
`rope_parameters` in config.json), sharded where `max_shard_size` says so. One more is the
same model's fused layout (`mlp.experts.gate_up_proj` stacked, as transformers 5 holds it in
memory). Our logits must equal HF's within the dense model's tolerance, and greedy tokens over
prefill and 48 decode steps must be HF's.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kernels.choice import load_family
from kernels.self_check import FUSED
from mili.engine.generate import generate
from mili.engine.kv.block_pool import BlockPool
from mili.engine.model.fused_ops import TorchFusedOps
from mili.engine.model.loader import load_model
from mili.engine.model.moe import SparseMoeBlock
from mili.engine.model.qwen3 import Qwen3ForCausalLM
from mili.engine.model.weight_map import weight_map
from mili.engine.sampling_params import SamplingParams
from mili.engine.step.runner import ModelRunner
from tests.engine.test_model_hf import TOL, Runner, hf_logits, max_diff, random_ids
from tests.engine.test_runner import BLOCK_SIZE, start
from tests.engine.test_weight_map import assert_parts_tile

transformers = pytest.importorskip("transformers")

_BASE: dict[str, Any] = dict(
    vocab_size=192,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,  # != hidden / heads
    max_position_embeddings=512,
    initializer_range=0.1,  # peaked logits: no greedy near-ties (tests/engine/conftest.py)
    rms_norm_eps=1e-6,
)
# name -> (Qwen3MoeConfig overrides, save_pretrained's max_shard_size or None)
MOE_CONFIGS: dict[str, tuple[dict[str, Any], str | None]] = {
    # 4 experts, 2 active, renormalised, untied
    "e4k2_norm": (
        dict(num_hidden_layers=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
             norm_topk_prob=True, tie_word_embeddings=False),
        None,
    ),
    # 8 experts, 3 active, not renormalised, tied, layer 1 dense (mlp_only_layers), sharded
    "e8k3_tied_dense1": (
        dict(num_hidden_layers=3, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=24,
             norm_topk_prob=False, tie_word_embeddings=True, mlp_only_layers=[1],
             rope_theta=1_000_000.0),
        "100KB",
    ),
    # 6 experts, top-1, every second layer sparse (decoder_sparse_step 2), GQA 4, sharded
    "e6k1_step2": (
        dict(num_hidden_layers=4, num_experts=6, num_experts_per_tok=1, moe_intermediate_size=48,
             norm_topk_prob=True, tie_word_embeddings=False, decoder_sparse_step=2,
             num_attention_heads=8, num_key_value_heads=2, head_dim=16),
        "60KB",
    ),
    # 16 experts, 4 active, not renormalised, untied
    "e16k4": (
        dict(num_hidden_layers=2, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=16,
             norm_topk_prob=False, tie_word_embeddings=False),
        None,
    ),
}  # fmt: skip


def hf_greedy(hf: Any, prompt: list[int], max_new_tokens: int) -> list[int]:
    """HF's own greedy continuation of `prompt`."""
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = hf.generate(
            torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0
        )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def hf_moe(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    """name -> (checkpoint directory HF wrote, HF's model in fp32 with eager attention)."""
    root = tmp_path_factory.mktemp("moe")
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformers.logging.set_verbosity_error()
        for i, (name, (overrides, shard)) in enumerate(MOE_CONFIGS.items()):
            torch.manual_seed(10 + i)
            config = transformers.Qwen3MoeConfig(**{**_BASE, **overrides})
            model = transformers.Qwen3MoeForCausalLM(config).eval()
            kwargs = {"max_shard_size": shard} if shard else {}
            model.save_pretrained(root / name, **kwargs)
            hf = transformers.Qwen3MoeForCausalLM.from_pretrained(
                root / name, dtype=torch.float32, attn_implementation="eager"
            )
            out[name] = (root / name, hf.eval())
    return out


@pytest.fixture(scope="module")
def ours(hf_moe: dict[str, tuple[Path, Any]]) -> dict[str, Qwen3ForCausalLM]:
    return {name: load_model(path) for name, (path, _) in hf_moe.items()}


def test_checkpoints_are_in_the_published_layout(hf_moe: dict[str, tuple[Path, Any]]) -> None:
    path, _ = hf_moe["e8k3_tied_dense1"]
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe" and config["num_local_experts"] == 8
    assert "rope_parameters" in config
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) > 2  # sharded
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in index
    assert "model.layers.1.mlp.gate_proj.weight" in index  # the dense layer
    assert not any(name.endswith("experts.gate_up_proj") for name in index)


@pytest.mark.parametrize("name", sorted(MOE_CONFIGS))
def test_config_and_layers_follow_hf(
    name: str, hf_moe: dict[str, tuple[Path, Any]], ours: dict[str, Qwen3ForCausalLM]
) -> None:
    _, hf = hf_moe[name]
    model = ours[name]
    assert model.config.rope_theta == hf.config.rope_parameters["rope_theta"]
    for ours_layer, hf_layer in zip(model.model.layers, hf.model.layers, strict=True):
        is_sparse = isinstance(hf_layer.mlp, transformers.models.qwen3_moe.modeling_qwen3_moe.
                               Qwen3MoeSparseMoeBlock)  # fmt: skip
        assert isinstance(ours_layer.mlp, SparseMoeBlock) == is_sparse
        if is_sparse:  # stacking at load = transformers' own merge of the per-expert tensors
            torch.testing.assert_close(
                ours_layer.mlp.experts.gate_up_proj, hf_layer.mlp.experts.gate_up_proj,
                rtol=0, atol=0,
            )  # fmt: skip
            torch.testing.assert_close(
                ours_layer.mlp.experts.down_proj, hf_layer.mlp.experts.down_proj, rtol=0, atol=0
            )
            assert ours_layer.mlp.gate.weight.std() > 0.05  # routing is not a tie
    assert_parts_tile(model, weight_map(model))


@pytest.mark.parametrize("name", sorted(MOE_CONFIGS))
def test_prefill_and_decode_logits_match_hf(
    name: str, hf_moe: dict[str, tuple[Path, Any]], ours: dict[str, Qwen3ForCausalLM]
) -> None:
    """Three sequences: packed prefill, then 24 teacher-forced decode steps together."""
    _, hf = hf_moe[name]
    model = ours[name]
    vocab = model.config.vocab_size
    prompt_lens, num_steps = [1, 13, 40], 24
    full = [random_ids(n + num_steps, vocab, seed=900 + n) for n in prompt_lens]
    refs = [hf_logits(hf, ids) for ids in full]
    runner = Runner(model, block_size=16)
    tables = [runner.table(n) for n in prompt_lens]
    prompts = [ids[:n] for ids, n in zip(full, prompt_lens, strict=True)]
    logits = runner.prefill(prompts, tables)
    start = 0
    for i, n in enumerate(prompt_lens):
        assert max_diff(logits[start : start + n], refs[i][:n]) < TOL
        start += n
    for step in range(num_steps):
        positions = [n + step for n in prompt_lens]
        tokens = [ids[p] for ids, p in zip(full, positions, strict=True)]
        logits = runner.decode(tokens, positions, tables)
        for i, p in enumerate(positions):
            assert max_diff(logits[i], refs[i][p]) < TOL, (step, i)


@pytest.mark.parametrize("name", ["e4k2_norm", "e8k3_tied_dense1", "e6k1_step2"])
def test_greedy_equals_hf_generate(
    name: str, hf_moe: dict[str, tuple[Path, Any]], ours: dict[str, Qwen3ForCausalLM]
) -> None:
    """Our paged engine (prefill in chunks of 7, then 48 batched decode steps) = HF's greedy."""
    _, hf = hf_moe[name]
    model = ours[name]
    prompts = [random_ids(n, model.config.vocab_size, seed=950 + n) for n in (3, 17, 30)]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    results = generate(model, prompts, params, prefill_chunk_size=7)
    for prompt, result in zip(prompts, results, strict=True):
        assert result.token_ids == hf_greedy(hf, prompt, 48)


def test_fused_layout_loads_the_same_model(
    tmp_path: Path, hf_moe: dict[str, tuple[Path, Any]], ours: dict[str, Qwen3ForCausalLM]
) -> None:
    """transformers 5's stacked `experts.gate_up_proj` / `experts.down_proj` tensors."""
    path, hf = hf_moe["e16k4"]
    fused = tmp_path / "fused"
    fused.mkdir()
    (fused / "config.json").write_text((path / "config.json").read_text())
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    save_file(state, str(fused / "model.safetensors"), metadata={"format": "pt"})
    with safe_open(str(fused / "model.safetensors"), "pt") as f:
        assert not any(".experts.0." in k for k in f.keys())  # noqa: SIM118 (safe_open: no __iter__)
    model = load_model(fused)
    prompt = random_ids(30, model.config.vocab_size, seed=990)
    runner, reference = Runner(model, block_size=16), Runner(ours["e16k4"], block_size=16)
    table = runner.table(30)
    logits = runner.prefill([prompt], [table])
    assert torch.equal(logits, reference.prefill([prompt], [table]))
    assert max_diff(logits, hf_logits(hf, prompt)) < TOL


class _MojoExperts(TorchFusedOps):
    """Torch's ops but the CPU's Mojo grouped GEMM on every call (these tiny experts are far
    below the size where `grouped_gemm` chooses it; their head_dim, 16 or 32, is below the Mojo
    RoPE kernel's smallest, 64)."""

    def __init__(self) -> None:
        self.kernels = load_family(FUSED, "cpu", head_dim=64)

    def grouped_gemm(
        self, rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor
    ) -> torch.Tensor:
        return self.kernels.grouped_gemm_kernel(rows, weight, offsets)


@pytest.mark.parametrize("name", ["e16k4", "e8k3_tied_dense1"])
def test_greedy_with_the_cpu_kernel_equals_hf_generate(
    name: str, hf_moe: dict[str, tuple[Path, Any]]
) -> None:
    """The experts through the CPU's Mojo grouped GEMM (what `mili serve` runs on CPU for
    real-sized experts): chunked prefill and batched decode = HF's greedy."""
    path, hf = hf_moe[name]
    ops = _MojoExperts()
    model = load_model(path, fused_ops=ops)
    prompts = [random_ids(n, model.config.vocab_size, seed=960 + n) for n in (5, 26)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    results = generate(model, prompts, params, prefill_chunk_size=9)
    assert ops.kernels.num_calls >= 2 * 24  # two GEMMs per sparse layer and step, at least
    for prompt, result in zip(prompts, results, strict=True):
        assert result.token_ids == hf_greedy(hf, prompt, 24)


@pytest.mark.parametrize("grouped_gemm", ["loop", "grouped_mm"])
def test_both_grouped_gemms_match_hf(
    grouped_gemm: str, hf_moe: dict[str, tuple[Path, Any]], ours: dict[str, Qwen3ForCausalLM]
) -> None:
    """The CUDA formulation (torch._grouped_mm, torch's CPU fallback here) = the CPU one."""
    _, hf = hf_moe["e16k4"]
    model = ours["e16k4"]
    blocks = [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, SparseMoeBlock)]
    prompt = random_ids(45, model.config.vocab_size, seed=991)
    try:
        for block in blocks:
            block.grouped_gemm = grouped_gemm  # type: ignore[assignment]
        runner = Runner(model, block_size=16)
        logits = runner.prefill([prompt], [runner.table(45)])
    finally:
        for block in blocks:
            block.grouped_gemm = None
    assert max_diff(logits, hf_logits(hf, prompt)) < TOL


def test_runner_greedy_with_padded_batches_equals_hf(
    hf_moe: dict[str, tuple[Path, Any]], ours: dict[str, Qwen3ForCausalLM]
) -> None:
    """The services' ModelRunner: padded decode batches (the CUDA-graph shapes, run eagerly:
    padding rows route to experts too, and must change nothing) give HF's greedy tokens."""
    _, hf = hf_moe["e8k3_tied_dense1"]
    model = ours["e8k3_tied_dense1"]
    runner = ModelRunner.create(model, 60, BLOCK_SIZE, max_decode_batch=8)
    pool = BlockPool(runner.num_blocks, null_block=True)
    prompt_ids = [random_ids(n, model.config.vocab_size, seed=970 + n) for n in (2, 9, 21)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    seqs = start(runner, pool, prompt_ids, [params] * 3)
    with torch.inference_mode():
        while active := [s for s in seqs if not s.is_finished]:
            logits = runner.decode_logits(active, num_rows=8)  # 8 - len(active) padding rows
            torch.testing.assert_close(logits, runner.decode_logits(active), rtol=0, atol=1e-5)
            out = runner.sample(logits, [s.sampling for s in active]).result()
            for s, token_id in zip(active, out.token_ids, strict=True):
                s.append(token_id)
    for prompt, seq in zip(prompt_ids, seqs, strict=True):
        assert seq.output_token_ids == hf_greedy(hf, prompt, 24)
