"""Structured output: constraints (JSON schema, regex, grammar, choice) compiled to token masks.

    spec.py      Constraint and its size limits (pure Python)
    vocab.py     GrammarTokenizer: tokenizer.json + the model's rows + EOS ids, fingerprinted
    schema.py    JSON Schema closed (no extra keys) before compiling; refusals worded
    compiler.py  ConstraintCompiler: LRU-cached, off the event loop, time-limited compiles
    trial.py     each first compile tried in a child process, killed past the time or memory limit
    matcher.py   ConstraintMatcher per request (torch-free)
    mask.py      BatchMasker (filled on a thread while the step runs) and apply_token_bitmask

The grammar engine is llguidance (docs/benchmarks.md, "Structured output (CPU)": why not
xgrammar). Only compiler.py, matcher.py, mask.py and vocab.py import it (trial.py's child
through compiler.py); only mask.py imports torch.
"""
