"""`mili demo-model DIR --moe`: a Qwen3-MoE checkpoint in the published layout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def test_demo_model_moe_writes_the_published_layout(tmp_path: Path) -> None:
    out = tmp_path / "moe"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run(
        [sys.executable, "-m", "mili", "demo-model", str(out), "--moe"],
        capture_output=True, text=True, env=env, timeout=300, check=True,
    )  # fmt: skip
    assert "Qwen3-MoE demo model" in done.stdout and "8 experts (2 active)" in done.stdout
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe"
    assert config["architectures"] == ["Qwen3MoeForCausalLM"]
    assert (config["num_experts"], config["num_experts_per_tok"]) == (8, 2)
    assert config["mlp_only_layers"] == [0]
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) > 1  # sharded
    assert "model.layers.3.mlp.experts.7.up_proj.weight" in index
    assert "model.layers.2.mlp.gate.weight" in index  # the router
    assert "model.layers.0.mlp.gate_proj.weight" in index  # layer 0 is dense
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" not in index
    assert (out / "tokenizer.json").exists()
