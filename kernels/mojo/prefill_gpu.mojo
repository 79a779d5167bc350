# Paged causal GQA prefill attention for NVIDIA GPUs (sm_90), compiled ahead of time to PTX.
#
# Semantics (same as prefill_cpu.mojo and mili.engine.attention.TorchAttention.prefill):
#   q, out       [T, H, D]          packed new tokens of B sequences
#   k/v_cache    [N, S, KVH, D]     paged cache; the new tokens are already written there
#   cu_seqlens   [B + 1] int32      sequence i's tokens are rows cu[i] .. cu[i+1]-1 of q
#   start_positions [B] int32       position of sequence i's first new token
#   block_tables [B, max_blocks] int32
# Token j of sequence i sits at position p = start_i + j and attends to positions 0..p of its
# sequence, all read from the cache (position p is k_cache[bt[i, p // S], p % S, kvh, :]).
# Query head h reads kv head h // (H // KVH).
#
# Launch (kernels/gpu.py): grid (ceil(T / BM), H, B), block 128 threads, static shared memory.
# A CTA handles BM consecutive new tokens of one sequence for one query head; the tiles past
# its sequence's length exit at once (T bounds every length, so no host sync is needed).
#
# Algorithm (a simple flash-attention on CUDA cores, fp32 throughout):
#   Qs[BM, D]      the CTA's queries, pre-multiplied by scale * log2(e) (softmax in base 2)
#   Ks[BN, D + 4]  key tile (rows padded by 4 floats so lane j reading row j is conflict-free)
#   Vs[BN, D]      value tile
#   Ps[BM, BN]     probabilities of the current tile
# Warp w owns query rows w, w + 4, ... (RPW = BM / 4 rows); in the score phase lane j owns key
# j of the tile, in the PV phase lane l owns output dims l, l + 32, ... Online softmax keeps the
# row max m and the row sum l in registers (identical in every lane of the owning warp).

from std.math import exp2, inf
from std.memory import stack_allocation
from std.sys import size_of
from max.gpu import thread_idx, block_idx, barrier, lane_id
from max.gpu.memory import AddressSpace
from max.gpu.primitives import warp
from grid_order_gpu import grid_order_start

comptime PREFILL_THREADS = 128
comptime NUM_WARPS = 4


def prefill_block_m(head_dim: Int) -> Int:
    """Query rows per CTA (grid.x = ceil(T / BM)); the loader reads it from the manifest."""
    return 16 if head_dim <= 128 else 8


def prefill_block_n(head_dim: Int) -> Int:
    return 32 if head_dim <= 128 else 16


def prefill_kernel[
    dtype: DType, D: Int
](
    out_ptr: Pointer[Scalar[dtype], MutAnyOrigin],
    q: Pointer[Scalar[dtype], MutAnyOrigin],
    k_cache: Pointer[Scalar[dtype], MutAnyOrigin],
    v_cache: Pointer[Scalar[dtype], MutAnyOrigin],
    cu_seqlens: Pointer[Int32, MutAnyOrigin],
    start_positions: Pointer[Int32, MutAnyOrigin],
    block_tables: Pointer[Int32, MutAnyOrigin],
    num_q_heads: Int32,
    num_kv_heads: Int32,
    block_size: Int32,
    max_blocks: Int32,
    scale_log2: Float32,
):
    grid_order_start()  # grid_order_gpu.mojo: nothing is read before it
    comptime assert D % 64 == 0, "head_dim must be a multiple of 64"
    comptime BM = prefill_block_m(D)
    comptime BN = prefill_block_n(D)
    comptime RPW = BM // NUM_WARPS  # query rows per warp
    comptime KP = D + 4  # padded K row stride (floats)
    comptime DPL = D // 32  # output dims per lane
    comptime VEC = 16 // size_of[dtype]()  # elements per 16-byte global load
    comptime CPR = D // VEC  # 16-byte chunks per row
    comptime NEG_INF = -inf[DType.float32]()

    var tile = Int(block_idx.x)
    var h = Int(block_idx.y)
    var b = Int(block_idx.z)
    var tid = Int(thread_idx.x)
    var w = tid // 32
    var lane = Int(lane_id())

    var seq_lo = Int(cu_seqlens[unsafe_offset=b])
    var n = Int(cu_seqlens[unsafe_offset=b + 1]) - seq_lo
    var m0 = tile * BM
    if m0 >= n:
        return  # CTA-uniform: past this sequence's new tokens
    var start = Int(start_positions[unsafe_offset=b])
    var rows = min(BM, n - m0)
    var H = Int(num_q_heads)
    var KVH = Int(num_kv_heads)
    var S = Int(block_size)
    var kvh = h // (H // KVH)
    var kv_end = start + m0 + rows  # keys [0, kv_end) cover every row of the tile
    var bt_row = b * Int(max_blocks)

    var Qs = stack_allocation[BM * D, Float32, address_space=AddressSpace.SHARED, alignment=16]()
    var Ks = stack_allocation[BN * KP, Float32, address_space=AddressSpace.SHARED, alignment=16]()
    var Vs = stack_allocation[BN * D, Float32, address_space=AddressSpace.SHARED, alignment=16]()
    var Ps = stack_allocation[BM * BN, Float32, address_space=AddressSpace.SHARED, alignment=16]()
    var Rb = stack_allocation[BN, Int64, address_space=AddressSpace.SHARED, alignment=16]()

    # Queries of the tile (rows past the sequence are zero; their outputs are never written).
    for idx in range(tid, BM * CPR, PREFILL_THREADS):
        var r = idx // CPR
        var c = idx % CPR
        var v = SIMD[DType.float32, VEC](0)
        if r < rows:
            var off = ((seq_lo + m0 + r) * H + h) * D + c * VEC
            v = q.unsafe_load[width=VEC, alignment=16](off).cast[DType.float32]() * scale_log2
        comptime for e in range(0, VEC, 4):
            Qs.unsafe_store[alignment=16](r * D + c * VEC + e, v.slice[4, offset=e]())

    # Per-row state of the RPW rows this warp owns (rows w + NUM_WARPS * k).
    var m_i = SIMD[DType.float32, RPW](NEG_INF)
    var l_i = SIMD[DType.float32, RPW](0)
    var acc = SIMD[DType.float32, RPW * DPL](0)
    # Last key each row may see: its own position, clamped for rows past the sequence.
    var limit = SIMD[DType.int64, RPW](0)
    comptime for k in range(RPW):
        var i = w + NUM_WARPS * k
        limit[k] = Int64(min(start + m0 + i, kv_end - 1))

    for k0 in range(0, kv_end, BN):
        barrier()  # the previous tile's Ks/Vs/Ps/Rb reads are done (and Qs is written)
        if tid < BN:
            var kp = k0 + tid
            var base = Int64(-1)
            if kp < kv_end:
                var blk = Int(block_tables[unsafe_offset=bt_row + kp // S])
                base = Int64(((blk * S + kp % S) * KVH + kvh) * D)
            Rb[unsafe_offset=tid] = base
        barrier()
        for idx in range(tid, BN * CPR, PREFILL_THREADS):
            var r = idx // CPR
            var c = idx % CPR
            var base = Int(Rb[unsafe_offset=r])
            var kv = SIMD[DType.float32, VEC](0)
            var vv = SIMD[DType.float32, VEC](0)
            if base >= 0:
                kv = k_cache.unsafe_load[width=VEC, alignment=16](base + c * VEC).cast[
                    DType.float32
                ]()
                vv = v_cache.unsafe_load[width=VEC, alignment=16](base + c * VEC).cast[
                    DType.float32
                ]()
            comptime for e in range(0, VEC, 4):
                Ks.unsafe_store[alignment=16](r * KP + c * VEC + e, kv.slice[4, offset=e]())
                Vs.unsafe_store[alignment=16](r * D + c * VEC + e, vv.slice[4, offset=e]())
        barrier()

        # Scores: lane j <-> key k0 + j (lanes >= BN idle for D = 256), all RPW rows at once.
        var kj = min(lane, BN - 1)
        var s4 = SIMD[DType.float32, RPW * 4](0)
        comptime for d in range(0, D, 4):
            var kvec = Ks.unsafe_load[width=4, alignment=16](kj * KP + d)
            comptime for k in range(RPW):
                var qvec = Qs.unsafe_load[width=4, alignment=16]((w + NUM_WARPS * k) * D + d)
                s4 = s4.insert[offset=k * 4](
                    qvec.fma(kvec, s4.slice[4, offset=k * 4]())
                )
        var kp = Int64(k0 + lane)
        comptime for k in range(RPW):
            var s = s4.slice[4, offset=k * 4]().reduce_add()
            var valid = lane < BN and kp <= limit[k]
            if not valid:
                s = NEG_INF
            var m_new = max(m_i[k], warp.max(s))
            # Key 0 is in the first tile and visible to every row, so m_new is finite; the
            # guard only keeps a hypothetical all-masked row from producing NaN.
            var m_use = m_new if m_new != NEG_INF else Float32(0)
            var p = exp2(s - m_use) if valid else Float32(0)
            var alpha = exp2(m_i[k] - m_use)
            l_i[k] = l_i[k] * alpha + warp.sum(p)
            m_i[k] = m_new
            comptime for c in range(DPL):
                acc[k * DPL + c] = acc[k * DPL + c] * alpha
            if lane < BN:
                Ps[unsafe_offset=(w + NUM_WARPS * k) * BN + lane] = p
        barrier()  # Ps complete (a warp only reads its own rows, but keep it simple)

        # acc[row, dim] += sum_j P[row, j] * V[j, dim]; lane owns dims lane + 32 c.
        comptime for j in range(BN):
            var vcol = SIMD[DType.float32, DPL](0)
            comptime for c in range(DPL):
                vcol[c] = Vs[unsafe_offset=j * D + lane + 32 * c]
            comptime for k in range(RPW):
                var p = Ps[unsafe_offset=(w + NUM_WARPS * k) * BN + j]
                comptime for c in range(DPL):
                    acc[k * DPL + c] = p.fma(vcol[c], acc[k * DPL + c])

    comptime for k in range(RPW):
        var i = w + NUM_WARPS * k
        if i < rows:
            var inv = Float32(1) / l_i[k]
            var base = ((seq_lo + m0 + i) * H + h) * D
            comptime for c in range(DPL):
                out_ptr[unsafe_offset=base + lane + 32 * c] = (acc[k * DPL + c] * inv).cast[dtype]()
