"""The MoE block's parts: routing as HF routes, grouped experts = the naive loop on any routing,
and the config read from both spellings of config.json."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch

from mili.engine.model.checkpoint import write_random_checkpoint
from mili.engine.model.config import PRESETS, ConfigError, Qwen3Config
from mili.engine.model.fingerprint import model_fingerprint
from mili.engine.model.fused_ops import TorchFusedOps
from mili.engine.model.kv_cache import KVCache
from mili.engine.model.moe import Routing, grouped_experts, reference_experts, route

GROUPED_GEMMS = ["loop", "grouped_mm"]
OPS = TorchFusedOps()


def weights(num_experts: int, hidden: int, inter: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=g) * 0.1
    down = torch.randn(num_experts, hidden, inter, generator=g) * 0.1
    return gate_up, down


def routing_of(expert_ids: torch.Tensor, seed: int) -> Routing:
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(expert_ids.shape, generator=g)
    return Routing(w / w.sum(-1, keepdim=True), expert_ids)


def random_routing(num_tokens: int, num_experts: int, top_k: int, seed: int) -> Routing:
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(num_tokens)])
    return routing_of(ids, seed)


@pytest.mark.parametrize("grouped_gemm", GROUPED_GEMMS)
@pytest.mark.parametrize(
    ("num_tokens", "num_experts", "top_k"), [(1, 8, 2), (5, 4, 1), (37, 16, 4), (64, 128, 8)]
)
def test_grouped_equals_naive_on_random_routings(
    grouped_gemm: str, num_tokens: int, num_experts: int, top_k: int
) -> None:
    hidden, inter = 32, 24
    gate_up, down = weights(num_experts, hidden, inter, seed=num_tokens)
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(1))
    routing = random_routing(num_tokens, num_experts, top_k, seed=num_tokens)
    got = grouped_experts(x, gate_up, down, routing, OPS, grouped_gemm)  # type: ignore[arg-type]
    torch.testing.assert_close(got, reference_experts(x, gate_up, down, routing))


@pytest.mark.parametrize("grouped_gemm", GROUPED_GEMMS)
def test_experts_with_no_token_and_one_with_all(grouped_gemm: str) -> None:
    """Expert 3 gets every token, experts 0, 2, 5 (first, middle, last) get none."""
    num_tokens, num_experts, hidden, inter = 9, 6, 16, 8
    gate_up, down = weights(num_experts, hidden, inter, seed=2)
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(3))
    others = torch.tensor([1, 4] * 5)[:num_tokens]
    ids = torch.stack([torch.full((num_tokens,), 3), others], dim=1)  # [T, 2]
    routing = routing_of(ids, seed=4)
    got = grouped_experts(x, gate_up, down, routing, OPS, grouped_gemm)  # type: ignore[arg-type]
    torch.testing.assert_close(got, reference_experts(x, gate_up, down, routing))
    # every token to expert 3 alone (top-1): one expert holds all the rows
    alone = routing_of(torch.full((num_tokens, 1), 3), seed=5)
    got = grouped_experts(x, gate_up, down, alone, OPS, grouped_gemm)  # type: ignore[arg-type]
    torch.testing.assert_close(got, reference_experts(x, gate_up, down, alone))


@pytest.mark.parametrize(("dtype", "inter"), [(torch.bfloat16, 20), (torch.float32, 15)])
def test_widths_torch_grouped_mm_cannot_take_run_the_loop(dtype: torch.dtype, inter: int) -> None:
    """torch._grouped_mm wants rows of whole 16-byte units, on the CPU too (found by a
    read-only review: an expert width of 20 in bf16 loaded, then failed its first forward with
    'strides should be multiple of 16 bytes'). The ops' default takes the loop there."""
    from mili.engine.model.grouped_gemm import default_grouped_gemm

    cpu = torch.device("cpu")
    assert default_grouped_gemm(cpu, dtype, (32, inter)) == "loop"
    assert default_grouped_gemm(cpu, dtype, (32, 16)) == "grouped_mm"
    gate_up, down = (w.to(dtype) for w in weights(4, 32, inter, seed=21))
    x = torch.randn(9, 32, generator=torch.Generator().manual_seed(22)).to(dtype)
    routing = random_routing(9, 4, 2, seed=23)
    got = grouped_experts(x, gate_up, down, routing, OPS, None)  # the ops' default
    want = reference_experts(x.float(), gate_up.float(), down.float(), routing)
    torch.testing.assert_close(got.float(), want, rtol=0.05, atol=0.02)


def test_a_tokens_output_does_not_depend_on_its_batch() -> None:
    """Each token's k results are summed in its own top-k order: no cross-row reduction, so a
    row is the same alone and in a batch, whatever the other rows routed to."""
    gate_up, down = weights(8, 32, 16, seed=6)
    x = torch.randn(20, 32, generator=torch.Generator().manual_seed(7))
    routing = random_routing(20, 8, 3, seed=8)
    batched = grouped_experts(x, gate_up, down, routing, OPS, "grouped_mm")
    for t in (0, 7, 19):
        alone = Routing(routing.weights[t : t + 1], routing.expert_ids[t : t + 1])
        row = grouped_experts(x[t : t + 1], gate_up, down, alone, OPS, "grouped_mm")
        torch.testing.assert_close(row, batched[t : t + 1], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_route_is_hfs_router(norm_topk_prob: bool) -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    config = transformers.Qwen3MoeConfig(
        hidden_size=32, num_experts=10, num_experts_per_tok=3, norm_topk_prob=norm_topk_prob
    )
    hf = Qwen3MoeTopKRouter(config)
    torch.nn.init.normal_(hf.weight, std=0.5)
    x = torch.randn(17, 32, generator=torch.Generator().manual_seed(9))
    _, hf_weights, hf_ids = hf(x)
    ours = route(torch.nn.functional.linear(x, hf.weight), 3, norm_topk_prob=norm_topk_prob)
    assert torch.equal(ours.expert_ids, hf_ids)
    assert torch.equal(ours.weights, hf_weights)
    sums = ours.weights.sum(-1)
    assert torch.allclose(sums, torch.ones(17)) == norm_topk_prob


# The published config.json of Qwen/Qwen3-30B-A3B (transformers 4.51 wrote it).
PUBLISHED_30B = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
    "intermediate_size": 6144, "max_position_embeddings": 40960, "max_window_layers": 48,
    "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768,
    "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4,
    "output_router_logits": False, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.51.0",
    "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}  # fmt: skip


def test_published_config_is_the_preset() -> None:
    config = Qwen3Config.from_hf_dict(PUBLISHED_30B)
    assert config == PRESETS["qwen3-30b-a3b"]
    assert config.is_moe and config.architecture == "Qwen3MoeForCausalLM"
    assert config.num_sparse_layers == 48
    big = PRESETS["qwen3-235b-a22b"]
    assert (big.num_hidden_layers, big.hidden_size, big.num_attention_heads) == (94, 4096, 64)
    assert (big.num_key_value_heads, big.num_experts, big.moe_intermediate_size) == (4, 128, 1536)


def test_transformers_5_keys() -> None:
    """num_local_experts, rope_parameters (with YaRN's keys beside rope_theta), dtype."""
    data = {k: v for k, v in PUBLISHED_30B.items() if k not in ("num_experts", "rope_theta")}
    del data["torch_dtype"]
    data.update(
        num_local_experts=64,
        dtype="float32",
        mlp_only_layers=[0, 5],
        decoder_sparse_step=2,
        rope_parameters={
            "rope_type": "yarn", "rope_theta": 5e5, "factor": 4.0,
            "original_max_position_embeddings": 32768,
        },
    )  # fmt: skip
    config = Qwen3Config.from_hf_dict(data)
    assert (config.num_experts, config.rope_theta, config.torch_dtype) == (64, 5e5, "float32")
    assert config.rope_scaling == {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768,
    }  # fmt: skip
    assert config.mlp_only_layers == (0, 5)
    # HF's rule: (i + 1) % step == 0 and i not in mlp_only_layers
    assert [i for i in range(8) if config.is_sparse_layer(i)] == [1, 3, 7]
    plain = dict(data, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    assert Qwen3Config.from_hf_dict(plain).rope_scaling is None
    assert Qwen3Config.from_hf_dict(plain).rope_theta == 10000.0


def test_round_trip_and_errors() -> None:
    config = dataclasses.replace(PRESETS["qwen3-30b-a3b"], mlp_only_layers=(3,))
    data = config.to_hf_dict()
    assert data["model_type"] == "qwen3_moe" and data["mlp_only_layers"] == [3]
    assert Qwen3Config.from_hf_dict(json.loads(json.dumps(data))) == config
    dense = PRESETS["qwen3-0.6b"].to_hf_dict()
    assert "num_experts" not in dense and dense["model_type"] == "qwen3"
    with pytest.raises(ConfigError, match="moe_intermediate_size"):
        Qwen3Config.from_hf_dict(
            {k: v for k, v in PUBLISHED_30B.items() if k != "moe_intermediate_size"}
        )
    with pytest.raises(ConfigError, match="exceeds num_experts"):
        Qwen3Config.from_hf_dict(dict(PUBLISHED_30B, num_experts_per_tok=200))
    with pytest.raises(ConfigError, match="mlp_only_layers"):
        Qwen3Config.from_hf_dict(dict(PUBLISHED_30B, mlp_only_layers=[48]))
    with pytest.raises(ConfigError, match="model_type"):
        Qwen3Config.from_hf_dict(dict(PUBLISHED_30B, model_type="mixtral"))


TINY_MOE = Qwen3Config(
    vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
    torch_dtype="float32", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
)  # fmt: skip


def test_fingerprint_and_kv_layout_cover_moe(tmp_path: Path) -> None:
    """Same attention shapes: same KV layout (the pipeline carries over); another routing or
    expert count: another fingerprint (prefill and decode refuse to pair)."""
    a = write_random_checkpoint(tmp_path / "a", TINY_MOE)
    b = write_random_checkpoint(
        tmp_path / "b", dataclasses.replace(TINY_MOE, num_experts_per_tok=1)
    )
    c = write_random_checkpoint(tmp_path / "c", dataclasses.replace(TINY_MOE, num_experts=0))
    prints = {model_fingerprint(p) for p in (a, b, c)}
    assert len(prints) == 3
    dense = dataclasses.replace(TINY_MOE, num_experts=0)
    assert KVCache.layout_of(TINY_MOE, 16, torch.float32) == KVCache.layout_of(
        dense, 16, torch.float32
    )


def test_grouped_mm_path_traces_as_one_graph() -> None:
    """No data-dependent Python control flow or host read: dynamo traces it without a break
    (what CUDA-graph capture and torch.compile of the decode step need). bf16: the dtype the
    CUDA kernel (and so torch's shape rule for compile) takes."""
    gate_up, down = (w.bfloat16() for w in weights(8, 32, 16, seed=10))
    x = torch.randn(6, 32, generator=torch.Generator().manual_seed(11)).bfloat16()
    router = torch.randn(8, 32, generator=torch.Generator().manual_seed(12)).bfloat16()

    def block(x: torch.Tensor) -> torch.Tensor:
        routing = route(x @ router.T, 2, norm_topk_prob=True)
        return grouped_experts(x, gate_up, down, routing, OPS, "grouped_mm")

    compiled = torch.compile(block, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(x), block(x))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_grouped_mm_matches_reference_and_captures() -> None:
    """bf16 on the GPU: the grouped GEMM the device runs = the naive loop (in float32 on the
    same bf16 weights), and a CUDA graph of the block replays to the eager result on new
    inputs (another routing: the offsets stay on the device)."""
    from mili.engine.model.grouped_gemm import default_grouped_gemm, is_graph_safe

    device, dtype = torch.device("cuda"), torch.bfloat16
    gate_up, down = (w.to(device, dtype) for w in weights(16, 128, 64, seed=13))
    router = torch.randn(16, 128, device=device, dtype=dtype)
    mode = default_grouped_gemm(device, dtype, (128, 64))

    def block(x: torch.Tensor) -> torch.Tensor:
        routing = route(x @ router.T, 4, norm_topk_prob=True)
        return grouped_experts(x, gate_up, down, routing, OPS, mode)

    x = torch.randn(24, 128, device=device, dtype=dtype)
    routing = route(x @ router.T, 4, norm_topk_prob=True)
    want = reference_experts(x.float(), gate_up.float(), down.float(), routing)
    torch.testing.assert_close(block(x).float(), want, rtol=0.05, atol=0.02)
    if not is_graph_safe(device, dtype, (128, 64)):
        pytest.skip(f"grouped_mm has no graph-safe kernel here ({mode})")
    static_x = x.clone()
    block(static_x)  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = block(static_x)
    new_x = torch.randn(24, 128, device=device, dtype=dtype)
    static_x.copy_(new_x)
    graph.replay()
    torch.testing.assert_close(static_out, block(new_x), rtol=0, atol=0)


_LOAD_AND_REPORT_RSS = """
import resource, sys
import torch
from mili.engine.model.loader import load_model
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
model = load_model(sys.argv[1])
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print((after - before) * 1024)
"""


def test_loading_streams_experts_shard_by_shard(tmp_path: Path) -> None:
    """Peak host memory while loading a sharded per-expert checkpoint: the model's stacked
    parameters plus about a shard, never a second copy of the experts (ru_maxrss, in a child
    process so that nothing else of this session counts)."""
    import subprocess
    import sys

    config = dataclasses.replace(
        TINY_MOE, hidden_size=256, num_hidden_layers=4, num_experts=32, moe_intermediate_size=256
    )
    path = write_random_checkpoint(tmp_path, config, max_shard_bytes=8 << 20)
    model_bytes = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    assert model_bytes > 90 << 20 and len(list(path.glob("*.safetensors"))) > 8
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", _LOAD_AND_REPORT_RSS, str(path)],
        capture_output=True, text=True, timeout=300, check=True,
        env={**os.environ, "PYTHONPATH": str(root)},
    )  # fmt: skip
    growth = int(done.stdout.split()[-1])
    # measured 127 MB for 102 MB of weights in 8 MB shards: the parameters, the mapped pages of
    # the shard being read and a tensor on its way; a second copy would be >= 204 MB
    assert growth < model_bytes + 5 * (8 << 20), (growth, model_bytes)
