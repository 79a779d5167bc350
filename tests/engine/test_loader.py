"""Checkpoint writing and loading: sharding, determinism, and errors that name what is wrong."""

from __future__ import annotations

import hashlib
import json
import multiprocessing
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from mili.engine.model.checkpoint import (
    INDEX_FILE,
    SINGLE_FILE,
    cached_random_checkpoint,
    write_random_checkpoint,
)
from mili.engine.model.config import PRESETS, ConfigError, Qwen3Config
from mili.engine.model.kv_cache import KVCache
from mili.engine.model.loader import CheckpointError, CheckpointWarning, load_model, tensor_files
from mili.engine.model.qwen3 import PrefillBatch, Qwen3ForCausalLM
from mili.engine.model.weight_map import hf_tensor

CONFIG = Qwen3Config(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    torch_dtype="float32",
)
PROMPT = [5, 17, 99, 3, 64, 20, 21, 8, 100, 42, 7]


def prompt_logits(model: Qwen3ForCausalLM) -> torch.Tensor:
    cache = KVCache(model.config, 4, 16, dtype=model.dtype)
    batch = PrefillBatch.build([PROMPT], [[2]], 16)
    return model.prefill(batch, cache, all_logits=True)  # [11, vocab] float32


def files_of(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def test_same_seed_gives_byte_identical_files(tmp_path: Path) -> None:
    a = write_random_checkpoint(tmp_path / "a", CONFIG, seed=3)
    b = write_random_checkpoint(tmp_path / "b", CONFIG, seed=3)
    c = write_random_checkpoint(tmp_path / "c", CONFIG, seed=4)
    assert files_of(a) == files_of(b)
    assert files_of(a)[SINGLE_FILE] != files_of(c)[SINGLE_FILE]


def test_written_checkpoint_has_hf_names_and_unit_norms(tmp_path: Path) -> None:
    path = write_random_checkpoint(tmp_path, CONFIG, seed=0)
    tensors = load_file(path / SINGLE_FILE)
    assert "lm_head.weight" in tensors and tensors["lm_head.weight"].shape == (128, 32)
    assert tensors["model.layers.1.self_attn.k_norm.weight"].shape == (16,)
    assert tensors["model.layers.0.mlp.gate_proj.weight"].shape == (64, 32)
    norm = tensors["model.norm.weight"]
    assert (norm - 1).abs().max() < 0.2 and (norm != 1).any()
    assert tensors["model.embed_tokens.weight"].std().item() == pytest.approx(0.02, rel=0.1)
    assert json.loads((path / "config.json").read_text())["model_type"] == "qwen3"

    tied = write_random_checkpoint(tmp_path / "tied", _tied(CONFIG), seed=0)
    assert "lm_head.weight" not in load_file(tied / SINGLE_FILE)


def _tied(config: Qwen3Config) -> Qwen3Config:
    return Qwen3Config(**{**config.__dict__, "tie_word_embeddings": True})


def test_sharded_checkpoint_loads_same_logits(tmp_path: Path) -> None:
    single = write_random_checkpoint(tmp_path / "single", CONFIG, seed=5)
    sharded = write_random_checkpoint(tmp_path / "sharded", CONFIG, seed=5, max_shard_bytes=20_000)
    shards = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((sharded / INDEX_FILE).read_text())
    assert set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == (single / SINGLE_FILE).stat().st_size - (
        8 + int.from_bytes((single / SINGLE_FILE).read_bytes()[:8], "little")
    )
    assert torch.equal(prompt_logits(load_model(single)), prompt_logits(load_model(sharded)))


def test_missing_tensor_is_named(tmp_path: Path) -> None:
    path = write_random_checkpoint(tmp_path, CONFIG)
    tensors = load_file(path / SINGLE_FILE)
    del tensors["model.layers.1.self_attn.q_norm.weight"]
    save_file(tensors, path / SINGLE_FILE)
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.self_attn\.q_norm\.weight"):
        load_model(path)


def test_wrong_shape_names_tensor_and_file(tmp_path: Path) -> None:
    path = write_random_checkpoint(tmp_path, CONFIG, max_shard_bytes=20_000)
    files = tensor_files(path)
    name = "model.layers.0.mlp.up_proj.weight"
    shard = files[name]
    tensors = load_file(shard)
    tensors[name] = torch.zeros(63, 32)
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as err:
        load_model(path)
    assert name in str(err.value) and shard.name in str(err.value)
    assert "[63, 32]" in str(err.value) and "[64, 32]" in str(err.value)


def test_tensor_missing_from_its_indexed_shard_is_named(tmp_path: Path) -> None:
    path = write_random_checkpoint(tmp_path, CONFIG, max_shard_bytes=20_000)
    name = "model.norm.weight"
    shard = tensor_files(path)[name]
    tensors = load_file(shard)
    del tensors[name]
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"{name}.*{shard.name}"):
        load_model(path)


def test_missing_shard_file_is_named(tmp_path: Path) -> None:
    path = write_random_checkpoint(tmp_path, CONFIG, max_shard_bytes=20_000)
    shard = sorted(path.glob("model-00002-of-*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(CheckpointError, match=shard.name):
        load_model(path)


def test_missing_config_field_is_named(tmp_path: Path) -> None:
    path = write_random_checkpoint(tmp_path, CONFIG)
    config = json.loads((path / "config.json").read_text())
    del config["num_key_value_heads"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        load_model(path)


def test_quantized_weights_are_refused_not_loaded_without_their_scales(tmp_path: Path) -> None:
    """An FP8 checkpoint (Qwen's -FP8 releases) has the bf16 shapes: loaded, its raw values
    upcast without their scales, it served garbage. Its stored dtype and its config's
    quantization_config each refuse it."""
    path = write_random_checkpoint(tmp_path, CONFIG)
    (shard,) = set(tensor_files(path).values())
    tensors = load_file(shard)
    name = "model.layers.0.mlp.up_proj.weight"
    tensors[name] = tensors[name].to(torch.float8_e4m3fn)
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=f"{name} in {shard.name} is stored as F8_E4M3"):
        load_model(path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="quant_method 'fp8'"):
        load_model(path)


def test_config_json_is_read_as_transformers_reads_it() -> None:
    """Sliding-window attention would be ignored: refused. rope_theta and
    max_position_embeddings left out take transformers' defaults (they change the math)."""
    transformers = pytest.importorskip("transformers")
    data = {k: v for k, v in CONFIG.to_hf_dict().items() if k != "rope_theta"}
    del data["max_position_embeddings"]
    ours = Qwen3Config.from_hf_dict(data)
    hf = transformers.Qwen3Config(**data)
    hf_theta = getattr(hf, "rope_theta", None) or hf.rope_parameters["rope_theta"]
    assert (ours.rope_theta, ours.max_position_embeddings) == (
        hf_theta,
        hf.max_position_embeddings,
    )
    with pytest.raises(ConfigError, match="use_sliding_window"):
        Qwen3Config.from_hf_dict({**data, "use_sliding_window": True, "sliding_window": 8})


def test_left_out_shapes_are_read_as_transformers_reads_them() -> None:
    """num_key_value_heads null is multi-head attention; a dense config without head_dim has
    transformers' 128 (not hidden / heads: the loader would then refuse the real weights)."""
    transformers = pytest.importorskip("transformers")
    data = {**CONFIG.to_hf_dict(), "num_key_value_heads": None}
    del data["head_dim"]
    ours = Qwen3Config.from_hf_dict(data)
    hf = transformers.Qwen3Config(**data)
    assert CONFIG.hidden_size // CONFIG.num_attention_heads != 128  # the two rules differ here
    assert (ours.num_key_value_heads, ours.head_dim) == (hf.num_key_value_heads, hf.head_dim)
    assert (ours.num_key_value_heads, ours.head_dim) == (CONFIG.num_attention_heads, 128)


def test_yarn_context_is_the_original_times_the_factor() -> None:
    """Qwen3's long-context recipe: max_position_embeddings stays 40960 beside YaRN 4 x 32768;
    the model serves 131072 tokens (what vLLM derives), not 40960."""
    data = PRESETS["qwen3-0.6b"].to_hf_dict()
    assert Qwen3Config.from_hf_dict(data).max_context_tokens == 40960
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    assert Qwen3Config.from_hf_dict({**data, "rope_scaling": yarn}).max_context_tokens == 131072
    nested = {**data, "rope_parameters": {**yarn, "rope_theta": 1e6}}
    del nested["rope_theta"]
    assert Qwen3Config.from_hf_dict(nested).max_context_tokens == 131072
    # The factor derived from the two lengths stretches nothing past max_position_embeddings.
    derived = {"rope_type": "yarn", "original_max_position_embeddings": 32768}
    assert Qwen3Config.from_hf_dict({**data, "rope_scaling": derived}).max_context_tokens == 40960


def test_no_weights_is_an_error(tmp_path: Path) -> None:
    path = write_random_checkpoint(tmp_path, CONFIG)
    (path / SINGLE_FILE).unlink()
    with pytest.raises(CheckpointError, match=SINGLE_FILE):
        load_model(path)


def test_unexpected_tensor_warns_with_its_name(tmp_path: Path) -> None:
    path = write_random_checkpoint(tmp_path, CONFIG)
    tensors = load_file(path / SINGLE_FILE)
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(tensors, path / SINGLE_FILE)
    with pytest.warns(
        CheckpointWarning, match=r"model\.layers\.0\.self_attn\.rotary_emb\.inv_freq"
    ):
        model = load_model(path)
    assert not any(p.is_meta for p in model.parameters())


def test_bf16_checkpoint_and_bf16_load(tmp_path: Path) -> None:
    fp32 = write_random_checkpoint(tmp_path / "fp32", CONFIG, seed=9, std=0.1)
    bf16 = write_random_checkpoint(tmp_path / "bf16", CONFIG, seed=9, std=0.1, dtype=torch.bfloat16)
    assert (bf16 / SINGLE_FILE).stat().st_size < (fp32 / SINGLE_FILE).stat().st_size
    reference = prompt_logits(load_model(fp32))
    for path, dtype in ((bf16, None), (fp32, torch.bfloat16)):
        model = load_model(path, dtype=dtype)
        assert all(p.dtype == torch.bfloat16 for p in model.parameters())
        logits = prompt_logits(model)
        assert logits.dtype == torch.float32
        assert (logits - reference).abs().max() < 0.1 * reference.abs().max()
    # An fp32 model from bf16 files holds exactly the rounded weights.
    up = hf_tensor(load_model(bf16, dtype=torch.float32), "model.layers.0.mlp.up_proj.weight")
    assert up.dtype == torch.float32
    exact = hf_tensor(load_model(fp32), "model.layers.0.mlp.up_proj.weight")
    assert torch.equal(up, exact.bfloat16().float())


def test_cached_random_checkpoint_is_written_once(tmp_path: Path) -> None:
    first = cached_random_checkpoint(CONFIG, "tiny", tmp_path, seed=7)
    assert first == tmp_path / "tiny-bf16-seed7"
    stamp = (first / SINGLE_FILE).stat().st_mtime_ns
    assert cached_random_checkpoint(CONFIG, "tiny", tmp_path, seed=7) == first
    assert (first / SINGLE_FILE).stat().st_mtime_ns == stamp  # reused, not rewritten
    assert [p.name for p in tmp_path.iterdir()] == ["tiny-bf16-seed7"]  # no staging left
    reference = write_random_checkpoint(tmp_path / "direct", CONFIG, seed=7, dtype=torch.bfloat16)
    assert (first / SINGLE_FILE).read_bytes() == (reference / SINGLE_FILE).read_bytes()


# Big enough that writing takes tens of milliseconds: the racers are all past the "is it
# there?" check before the first rename.
RACE_CONFIG = Qwen3Config(
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    torch_dtype="bfloat16",
)


def _race_for_the_cache(cache_dir: Path, start: Any, results: Any) -> None:
    """One process of the race below: wait for the others, ask for the checkpoint, load it, and
    report its files' digests (or the error)."""
    try:
        start.wait()
        path = cached_random_checkpoint(RACE_CONFIG, "race", cache_dir, seed=5)
        load_model(path)  # complete: every tensor there, every shape right
        digests = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in path.iterdir()}
        results.put((str(path), digests))
    except BaseException as e:
        results.put(("error", repr(e)))
        raise


@pytest.mark.slow  # four fresh interpreters import torch
def test_concurrent_processes_all_get_the_one_complete_checkpoint(tmp_path: Path) -> None:
    """Processes that ask for the same missing checkpoint at once all write one; the first
    rename wins and every process, winner or not, returns the complete checkpoint."""
    num_processes = 4
    context = multiprocessing.get_context("spawn")  # no fork of a process that ran torch
    start = context.Barrier(num_processes, timeout=120)
    results = context.Queue()
    processes = [
        context.Process(target=_race_for_the_cache, args=(tmp_path, start, results))
        for _ in range(num_processes)
    ]
    for process in processes:
        process.start()
    reports = [results.get(timeout=180) for _ in processes]
    for process in processes:
        process.join(timeout=60)
    assert [r for r in reports if r[0] == "error"] == []
    assert [p.exitcode for p in processes] == [0] * num_processes
    target = tmp_path / "race-bf16-seed5"
    assert {path for path, _ in reports} == {str(target)}
    reference = write_random_checkpoint(
        tmp_path / "direct", RACE_CONFIG, seed=5, dtype=torch.bfloat16
    )
    expected = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in reference.iterdir()}
    assert all(digests == expected for _, digests in reports)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["direct", "race-bf16-seed5"]
