"""The decode service: admits requests by reserving KV blocks, receives each prompt's KV from a
prefill instance, and streams tokens from a continuously batched decode loop.

    __main__.py   `mili serve-decode`: flags -> DecodeConfig -> DecodeInstance -> RpcServer
    config.py     DecodeConfig (frozen, validated) and the decode-specific flags
    instance.py   DecodeInstance: model, KV cache, block pool, request table, batch loop
    requests.py   RequestTable: reservations, leases, pins, who frees which blocks (pure Python)
    batcher.py    Batcher: the thread that owns the model and runs every decode step
    kv_writer.py  KVWriter: landed prompt blocks written into the KV cache, off the step
    stream.py     TokenStream: token events handed from the batch thread to the event loop
    server.py     DecodeService servicer (Generate, Info), registration of both services
    transfer.py   KvTransferService servicer (TransferKv): checks and scatters prompt KV
    convert.py    proto <-> domain conversions
"""
