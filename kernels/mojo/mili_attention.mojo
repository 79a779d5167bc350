# The CPU extension module `mili_attention`: Python calls these with tensors' data pointers after
# kernels/checks.py has validated every shape, dtype and index (a bad pointer here is a crash).
#
#   prefill(ptrs, dims, scale)  ptrs = (out, q, k_cache, v_cache, cu_seqlens, start_positions,
#                                       block_tables)
#                               dims = (dtype_code, num_seqs, num_tokens, num_q_heads,
#                                       num_kv_heads, head_dim, num_blocks, block_size,
#                                       max_blocks, num_threads)
#   decode(ptrs, dims, scale)   ptrs = (out, q, k_cache, v_cache, block_tables, seq_lens)
#                               dims = prefill's dims + (num_splits,)  (0: the kernel chooses)
#
# dtype_code: 0 float32, 1 bfloat16, 2 float16 (kernels/checks.py DTYPE_CODES).
#
# It also carries the fused elementwise kernels of a layer (fused_cpu.mojo; kernels/fused/cpu.py
# binds them): add_rms_norm, qk_norm_rope, silu_mul; and a MoE layer's expert GEMM
# (experts_cpu.mojo): grouped_gemm.
from std.os import abort
from std.python import PythonObject
from std.python.bindings import PythonModuleBuilder

from prefill_cpu import prefill_cpu
from decode_cpu import decode_cpu
from fused_cpu import add_rms_norm_cpu, qk_norm_rope_cpu, silu_mul_cpu
from experts_cpu import grouped_gemm_cpu


@export
def PyInit_mili_attention() abi("C") -> PythonObject:
    try:
        var m = PythonModuleBuilder("mili_attention")
        m.def_function[prefill_cpu](
            "prefill", docstring="Causal GQA FlashAttention over packed prompts and the paged cache"
        )
        m.def_function[decode_cpu](
            "decode", docstring="Paged decode attention: one query per sequence over its blocks"
        )
        m.def_function[add_rms_norm_cpu](
            "add_rms_norm", docstring="residual += x; out = RMSNorm(residual) (or RMSNorm(x))"
        )
        m.def_function[qk_norm_rope_cpu](
            "qk_norm_rope", docstring="Per-head RMSNorm of q and k, RoPE, K/V into the paged cache"
        )
        m.def_function[silu_mul_cpu]("silu_mul", docstring="out = silu(gate) * up")
        m.def_function[grouped_gemm_cpu](
            "grouped_gemm", docstring="out[r] = x[r] . weight[expert of r]^T, rows sorted by expert"
        )
        return m.finalize()
    except e:
        abort(String("failed to create module mili_attention: ", e))
