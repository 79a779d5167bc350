"""The Qwen3 network: config, layers, rotary embeddings, the attention and fused-op
interfaces with their torch references, the KV cache tensors it reads and writes, and
checkpoint loading."""
