"""Shared Qwen3 engine used by the prefill and decode services: model, loader, KV cache, sampler."""
