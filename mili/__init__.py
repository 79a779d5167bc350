"""MILI: Qwen3 serving over gRPC with disaggregated prefill and decode."""
