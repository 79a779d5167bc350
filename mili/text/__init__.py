"""Token ids -> text, shared by the tokenizer service and the frontend (which detokenizes in
process with the tokenizer's file): incremental detokenization, and byte-level decoding from a
table of each token's bytes."""
