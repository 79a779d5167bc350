"""KV blocks as bookkeeping, pure Python: the block pool, the prefix cache and its block
hashes, block-table rows that changed, and the layout prefill and decode agree on."""
