"""The prefill service: runs prompts (batched under a token budget, chunked when long) and streams
each prompt's KV, layer by layer as the layers complete, straight to the decode instance that
reserved blocks for it.

    __main__.py   `mili serve-prefill`: flags -> PrefillConfig -> model -> PrefillServicer
    config.py     PrefillConfig (frozen, validated): pool size, token budget, queue bound
    scheduler.py  Scheduler: FIFO queue, token-budget batching, fixed chunk plans (pure Python)
    worker.py     PrefillWorker: the thread that owns the model and KV cache, ships each layer
    sender.py     KvSender: the TransferKv client stream (header, chunks, commit) to decode
    task.py       PrefillTask, FirstToken, KvSink: what the servicer, worker and sender exchange
    handoff.py    KvHandoff: one prompt, from the allow-list check to decode's ack
    server.py     PrefillService servicer (Prefill, Info): convert -> KvHandoff.prefill -> convert
    convert.py    proto <-> domain, with every bad field named
"""
