"""The KV hand-off from prefill to decode: which transport a pair uses (`kv_transport`), the
transports behind one interface (`transport`), the chunks on the wire (`codec`, `checksums`),
and what the in-place transports map (`shm_segment`, `cuda_ipc`, `block_rows`).

Nothing is imported here: `kv_transport` stays torch-free for the flags every service shares.
"""
