"""Start-up check of the overlapped decode step on the device that will serve it.

Decode overlaps its steps on CUDA (services/decode/batcher.py): each forward is fed from the
previous step's sampled ids on the device (ModelRunner.decode_logits' `ahead`: a gather into
the static inputs, then the CUDA graph). A wrong gather would not fail loudly, it would serve
wrong tokens, so before the first request the decode service runs one step both ways and
overlaps only if the logits agree (as the kernels' self-check guards the Mojo kernels):

    step 1         decode([s])                          s feeds its last token at position 1
    ahead          decode_logits([s], ahead=step 1)     fed step 1's id on the device, position 2
    waited         decode_logits([s]) after appending   the same input, fed from the host

Everything runs on the null block (never handed out; padding rows write there anyway), so it
leaves the pool as it found it.
"""

from __future__ import annotations

import torch

from mili.engine.kv.block_pool import blocks_needed
from mili.engine.sampling_params import SamplingParams
from mili.engine.step.runner import Launched, ModelRunner
from mili.engine.step.sequence import Sequence

# Relative to the largest logit: the two forwards run the same kernels on the same inputs, so
# they agree to the bit unless a kernel is nondeterministic; a wrong input id is off by units.
_TOLERANCE = 1e-3


def check_ahead(runner: ModelRunner) -> str | None:
    """None when a forward fed from a pending step's ids gives the logits a forward fed from
    the host gives; else what went wrong."""
    null = runner.null_block_id
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    table = [null] * blocks_needed(3, runner.block_size)
    seq = Sequence.new(
        [1], params, vocab_size=runner.vocab_size, eos_token_ids=(), block_table=table
    )
    seq.append(2)
    try:
        with torch.inference_mode():
            pending = Launched([seq], runner.decode([seq]))
            ahead = runner.decode_logits([seq], ahead=pending).clone()  # [1, vocab]
            seq.append(pending.sample.result().token_ids[0])
            waited = runner.decode_logits([seq]).clone()
            diff = (ahead - waited).abs().max().item()
            scale = waited.abs().max().item()
    except Exception as e:  # whatever broke, the synchronous steps still serve
        return f"{type(e).__name__}: {e}"
    if not diff <= _TOLERANCE * max(scale, 1.0):  # NaN fails too
        return f"its logits differ from the waited step's by {diff:.3g} (largest {scale:.3g})"
    return None
